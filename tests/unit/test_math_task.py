"""task=math (SPEC 12): the built-in set, the user's files in each preset layout (written here, loaded
through `datasets`), the held-out split, the prompt, the failure categories and the config's checks."""

from __future__ import annotations

import json

import pandas as pd
import pytest

from src.command.config import ConfigError, validate
from src.task.base import TaskDataError, build_task
from src.task.math import failures
from src.task.math.data import MathProblem, normalise_question
from src.task.math.generate import generate_problems
from src.task.math.task import MathTask
from src.task.math.verify import MathVerdict, last_boxed


def rows(count: int, offset: int = 0) -> list[dict]:
    return [{"n": i, "q": f"What is {i} plus {i}?", "a": str(2 * i)} for i in range(offset, offset + count)]


def write_layouts(folder) -> dict[str, tuple[str, dict]]:
    """One small copy per public layout; value: (path, the task settings that read it)."""
    base = rows(30)
    openr1 = pd.DataFrame({"problem": [r["q"] for r in base], "solution": ["..."] * 30,
                           "answer": [r["a"] for r in base], "uuid": [str(r["n"]) for r in base]})
    (folder / "openr1" / "data").mkdir(parents=True)
    openr1.iloc[:15].to_parquet(folder / "openr1" / "data" / "train-00000-of-00002.parquet")
    openr1.iloc[15:].to_parquet(folder / "openr1" / "data" / "train-00001-of-00002.parquet")
    deepscaler = [{"problem": r["q"], "answer": r["a"], "solution": "..."} for r in base]
    (folder / "deepscaler.json").write_text(json.dumps(deepscaler))
    with open(folder / "math500.jsonl", "w") as handle:
        for r in base:
            handle.write(json.dumps({"problem": r["q"], "solution": "...", "answer": r["a"], "subject": "Algebra",
                                     "level": 1, "unique_id": f"test/{r['n']}.json"}) + "\n")
    hendrycks = pd.DataFrame({"problem": [r["q"] for r in base], "level": ["Level 1"] * 30,
                              "solution": [f"Twice is \\boxed{{{r['a']}}}." for r in base]})
    hendrycks.to_parquet(folder / "math.parquet")
    gsm8k = pd.DataFrame({"question": [r["q"] for r in base],
                          "answer": [f"{r['n']} + {r['n']} = <<{r['n']}+{r['n']}={r['a']}>>\n#### {r['a']}" for r in base]})
    (folder / "gsm8k" / "main").mkdir(parents=True)
    gsm8k.to_parquet(folder / "gsm8k" / "main" / "train-00000-of-00001.parquet")
    import datasets

    datasets.Dataset.from_pandas(openr1).save_to_disk(str(folder / "arrow"))
    return {
        "openr1": (str(folder / "openr1"), {}),
        "deepscaler": (str(folder / "deepscaler.json"), {"preset": "deepscaler"}),
        "math500": (str(folder / "math500.jsonl"), {"preset": "math500"}),
        "math": (str(folder / "math.parquet"), {"preset": "math"}),
        "gsm8k": (str(folder / "gsm8k"), {"preset": "gsm8k"}),
        "arrow": (str(folder / "arrow"), {}),
    }


@pytest.fixture(scope="module")
def layouts(tmp_path_factory):
    return write_layouts(tmp_path_factory.mktemp("math-data"))


@pytest.mark.parametrize("layout", ["openr1", "deepscaler", "math500", "math", "gsm8k", "arrow"])
def test_each_preset_layout_loads_from_local_files(layouts, layout):
    path, settings = layouts[layout]
    task = MathTask(data=path, train_size=100, heldout_size=5, **settings)
    train, heldout = task.splits()
    assert (len(train), len(heldout)) == (25, 5)  # 30 distinct problems: 5 held out, the rest trained on
    assert {p.key for p in train}.isdisjoint({p.key for p in heldout})
    for problem in train + heldout:  # the reference answer is the plain number, whatever the layout
        number = int(problem.question.split()[2])
        assert problem.answer == str(2 * number)


def test_heldout_from_its_own_file_and_disjoint_by_normalised_text(tmp_path):
    train = pd.DataFrame({"problem": [r["q"] for r in rows(20)], "answer": [r["a"] for r in rows(20)]})
    train.to_parquet(tmp_path / "train.parquet")
    # The held-out file repeats training problem 3 with other case and spacing: it must leave the training set.
    test = pd.DataFrame({"problem": ["  WHAT is 3  plus 3? ", *[r["q"] for r in rows(5, offset=100)]],
                         "answer": ["6"] + [r["a"] for r in rows(5, offset=100)]})
    test.to_parquet(tmp_path / "test.parquet")
    task = MathTask(data=str(tmp_path / "train.parquet"), heldout_data=str(tmp_path / "test.parquet"),
                    heldout_size=6, train_size=100)
    train_set, heldout = task.splits()
    assert len(heldout) == 6 and len(train_set) == 19
    assert normalise_question("What is 3 plus 3?") not in {p.key for p in train_set}
    assert task.splits() == (train_set, heldout)  # seeded


def test_missing_column_names_the_preset_that_fits(layouts):
    path, _ = layouts["gsm8k"]
    with pytest.raises(ValueError, match=r"no column \['problem'\].*set task.preset=gsm8k"):
        MathTask(data=path)


def test_too_few_problems_for_the_heldout_set_is_one_line(layouts):
    path, settings = layouts["math500"]
    with pytest.raises(TaskDataError, match="task.heldout_size=50: the held-out data has only 30"):
        MathTask(data=path, heldout_size=50, **settings).splits()


def test_data_that_is_not_there_is_refused(tmp_path):
    with pytest.raises(ValueError, match="no .parquet, .jsonl, .json or .arrow file"):
        MathTask(data=str(tmp_path / "nowhere"))


def test_builtin_set_is_seeded_disjoint_and_exact():
    task = MathTask(train_size=300, heldout_size=40)
    train, heldout = task.splits()
    assert task.splits() == (train, heldout)
    assert len({p.key for p in train}) == 300 and {p.key for p in train}.isdisjoint({p.key for p in heldout})
    problems = generate_problems(200, seed=5)
    assert {p.question.split()[0] for p in problems} >= {"Compute", "What", "Solve"}
    for problem in problems:  # each worked solution boxes the reference answer
        assert last_boxed(problem.solution) == problem.answer
    linear = [p for p in problems if p.question.startswith("Solve for x")]
    for problem in linear:  # a x + b = c holds at x = the answer
        a, rest = problem.question[len("Solve for x: "):].rstrip(".").split("x + ")
        b, c = rest.split(" = ")
        assert int(a) * int(problem.answer) + int(b) == int(c)


def test_builtin_fraction_and_percent_answers_are_exact():
    from fractions import Fraction

    for problem in generate_problems(300, seed=9, kinds=["fractions", "percent"]):
        if problem.question.startswith("Compute"):
            left, right = problem.question[len("Compute "):].rstrip(".").split(" + ")
            total = Fraction(left) + Fraction(right)
        else:
            share, base = problem.question[len("What is "):].rstrip("?").split("% of ")
            total = Fraction(int(share) * int(base), 100)
        expected = str(total.numerator) if total.denominator == 1 else f"\\frac{{{total.numerator}}}{{{total.denominator}}}"
        assert problem.answer == expected


def test_prompt_is_seed_003s_and_the_truth_is_the_answer():
    task = MathTask()
    problem = MathProblem("What is 1 + 1?", "2")
    assert task.prompt(problem) == ("What is 1 + 1? Let's think step by step and output the final answer within "
                                    "\\boxed{}.\n")
    assert task.truth(problem) == "2"
    assert task.extract("so \\boxed{2}.") == "2"


@pytest.mark.parametrize("response, verdict, truncated, category", [
    ("one two three four five six seven eight " * 3, MathVerdict(0.0, "no_boxed"), True, failures.REPETITIVE),
    ("I keep thinking", MathVerdict(0.0, "no_boxed"), True, failures.TRUNCATED),
    ("I keep thinking", MathVerdict(0.0, "no_boxed"), False, failures.NO_BOXED),
    ("\\boxed{}", MathVerdict(0.0, "empty_answer", ""), False, failures.NO_BOXED),
    ("\\boxed{?}", MathVerdict(0.0, "unparseable", "?"), False, failures.UNPARSEABLE),
    ("\\boxed{3}", MathVerdict(0.0, "wrong", "3"), True, failures.WRONG),
    ("\\boxed{9^9^9}", MathVerdict(0.0, "timeout", "9^9^9"), False, failures.OTHER),
])
def test_failure_categories(response, verdict, truncated, category):
    assert failures.classify_failure(response, verdict, truncated) == category
    assert category in MathTask.failure_categories


def test_math_config_selects_its_tiny_policy_and_validates(compose_config):
    cfg = compose_config("task=math")
    assert cfg.policy.name_or_path == "checkpoints/tiny-math"
    validate(cfg)
    assert isinstance(build_task(cfg.task), MathTask)
    assert compose_config("task=math", "policy=qwen2.5-0.5b").policy.name_or_path == "Qwen/Qwen2.5-0.5B"


@pytest.mark.parametrize("overrides, message", [
    (["curriculum=frontier"], "curriculum=frontier retrieves prompts by a task-specific embedding"),
    (["task.preset=aime"], "task.preset='aime': choose one of"),
    (["task.data=/nonexistent/folder"], "task.data='/nonexistent/folder': no .parquet"),
    (["task.verifier.timeout_s=0"], "task.verifier.timeout_s=0"),
    (["task.builtin.kinds=[algebra]"], "task.builtin.kinds=\\['algebra'\\]"),
    (["task.prompt_template=no slot"], "has no {problem} slot"),
])
def test_math_config_mistakes_are_one_line(compose_config, overrides, message):
    with pytest.raises(ConfigError, match=message):
        validate(compose_config("task=math", *overrides))



def test_a_math_cell_says_its_task_in_its_name_and_still_counts_as_a_grid_run(compose_config):
    import pandas as pd

    from analysis.runs import is_plain
    from src.study.sweep import cell_name, variant_label
    from src.runs.naming import run_tags

    countdown, math = compose_config("buffer=age2", "clip=tight"), compose_config("task=math", "buffer=age2", "clip=tight")
    assert (cell_name(countdown), cell_name(math)) == ("rho1-L2-c1", "rho1-L2-c1-math")
    assert variant_label(math) == "Replay-RLOO + math task"
    for cfg in (countdown, math):
        tags = run_tags(cfg, cell=cell_name(cfg), cell_id="x", cell_key="y", variant=variant_label(cfg))
        assert is_plain(pd.Series({f"tags.{key}": value for key, value in tags.items()}))
    other = run_tags(math, cell="rho1-L2-c1", cell_id="x", cell_key="y", variant="")  # a name without its task
    assert not is_plain(pd.Series({f"tags.{key}": value for key, value in other.items()}))
