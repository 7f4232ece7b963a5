"""Tests for the Countdown task: verifier, solver, generator, hub loader, prompts, splits."""

import json
import time
from fractions import Fraction

import pytest

from src.task.countdown import (
    DEFAULT_PROMPT_TEMPLATE,
    MAX_EXPRESSION_CHARS,
    Instance,
    Solution,
    demonstration,
    evaluate_expression,
    extract_answer,
    format_prompt,
    generate_instances,
    load_hub_instances,
    score,
    solve,
    train_and_heldout,
)


def answer(expression: str) -> str:
    return f"<answer> {expression} </answer>"


# --------------------------------------------------------------------------- verifier: values


@pytest.mark.parametrize(
    "response, numbers, target",
    [
        (answer("44 + 19 + 35"), [44, 19, 35], 98),
        (answer("(44 + 19) + 35"), [44, 19, 35], 98),
        (answer("(1 + 2) / 3"), [1, 2, 3], 1),
        (answer("6 / (1 - 3 / 4)"), [1, 3, 4, 6], 24),  # rational intermediate, integer target
        (answer("(5 - 1 / 5) * 5"), [5, 1, 5, 5], 24),  # repeated given numbers
        ("<answer>95-(78-62)</answer>", [95, 78, 62], 79),  # no spaces
        ("<answer>\n\t(95 - 78)\n+ 62\t</answer>", [95, 78, 62], 79),  # tabs and newlines
        (answer("007 * 3"), [7, 3], 21),  # leading zeros are still the number 7
        (answer("((((2)) * (3)))"), [2, 3], 6),  # redundant parentheses
    ],
)
def test_correct_answers_score_one(response, numbers, target):
    assert score(response, numbers, target) == 1.0


def test_think_text_and_last_complete_answer_counts():
    numbers, target = [44, 19, 35], 98
    response = (
        " 44 + 19 = 63, 63 + 35 = 98 </think>\n"
        "<answer> 44 * 19 </answer> wait, try again <answer> 44 + 19 + 35 </answer>"
    )
    assert score(response, numbers, target) == 1.0
    # The last complete span is wrong, an earlier one right: the last one counts.
    flipped = "<answer> 44 + 19 + 35 </answer> no: <answer> 44 - 19 + 35 </answer>"
    assert score(flipped, numbers, target) == 0.1
    # A trailing unclosed <answer> does not hide the last complete span.
    assert score(response + " <answer> 1 +", numbers, target) == 1.0
    # An <answer> opened inside the span: the last <answer> before the close starts it.
    assert score("<answer> junk <answer> 44 + 19 + 35 </answer>", numbers, target) == 1.0


def test_extract_answer():
    assert extract_answer("x <answer> 1 + 2 </answer> y") == "1 + 2"
    assert extract_answer("<answer>a</answer><answer>b</answer>") == "b"
    assert extract_answer("<answer> 1 + 2") is None
    assert extract_answer("1 + 2 </answer>") is None
    assert extract_answer("</answer> <answer> 1") is None
    assert extract_answer("no tags") is None


@pytest.mark.parametrize(
    "expression, numbers, target",
    [
        ("44 + 19 + 35", [44, 19, 35], 97),  # wrong target
        ("44 + 19", [44, 19, 35], 63),  # missing number
        ("44 + 44 + 35", [44, 19, 35], 123),  # reused number
        ("44 + 19 + 35 + 1", [44, 19, 35], 99),  # extra number
        ("4 + 19 + 35", [44, 19, 35], 58),  # different number
        ("(44 - 44) + 19 / (35 - 35)", [44, 44, 35, 35, 19], 1),  # division by zero
        ("1 / (2 - 2)", [1, 2, 2], 0),  # division by zero even "equal" to 0
        ("3 / 2", [3, 2], 1),  # non-integer value never equals the target
        ("1" + "0" * 200 + " + 1", [1, 1], 2),  # giant literal: wrong numbers, no int()
    ],
)
def test_well_formed_but_wrong_scores_point_one(expression, numbers, target):
    assert score(answer(expression), numbers, target) == 0.1


@pytest.mark.parametrize(
    "response",
    [
        "44 + 19 + 35",  # no tags
        "<answer> 44 + 19 + 35",  # unclosed
        "44 + 19 + 35 </answer>",  # close without open
        "<answer></answer>",  # empty
        "<answer>   </answer>",  # whitespace only
        answer("()"),
        answer("(44 + 19) + 35)"),  # unbalanced
        answer("((44 + 19) + 35"),  # unbalanced
        answer("44 19 + 35"),  # two operands in a row
        answer("44 + + 19 + 35"),  # two operators in a row
        answer("44 + 19 + 35 +"),  # trailing operator
        answer("-44 + 19 + 35"),  # unary minus
        answer("+44 + 19 + 35"),  # unary plus
        answer("44 + (-19) + 35"),
        answer("44 ** 19 + 35"),
        answer("44 // 19 + 35"),
        answer("44.0 + 19 + 35"),
        answer("1.5 + 2"),
        answer("x + 19 + 35"),  # names
        answer("abs(44) + 19 + 35"),  # calls
        answer("__import__('os')"),
        answer("44 + 19 + 35 = 98"),  # equation, not expression
        answer("(44)(19) + 35"),  # implicit multiplication
        answer("44 × 19 + 35"),  # unicode operator
        answer("4² + 19 + 35"),  # unicode digit (str.isdigit would accept it)
        answer("44 + 19 + 35 </think>"),
        "<answer> 44 + 19 + 35 </answer> junk </answer>",  # last close wins, content malformed
    ],
)
def test_malformed_scores_zero(response):
    assert score(response, [44, 19, 35], 98) == 0.0


def test_length_bound():
    padded = "(" * 40 + "44 + 19 + 35" + ")" * 40
    assert score(answer(padded), [44, 19, 35], 98) == 1.0
    too_long = "(" * 130 + "44 + 19 + 35" + ")" * 130
    assert len(too_long) > MAX_EXPRESSION_CHARS
    assert score(answer(too_long), [44, 19, 35], 98) == 0.0


def test_evaluate_expression():
    assert evaluate_expression("6 / (1 - 3 / 4)") == (True, ["6", "1", "3", "4"], Fraction(24))
    assert evaluate_expression("2 - 3 - 4") == (True, ["2", "3", "4"], Fraction(-5))  # left-assoc
    assert evaluate_expression("8 / 4 / 2") == (True, ["8", "4", "2"], Fraction(1))
    assert evaluate_expression("2 + 3 * 4") == (True, ["2", "3", "4"], Fraction(14))
    assert evaluate_expression("1 / 0") == (True, ["1", "0"], None)
    assert evaluate_expression("1 +") == (False, [], None)


# --------------------------------------------------------------------------- verifier: adversarial

MB = 1 << 20
ADVERSARIAL = {
    "1MB of (": "(" * MB,
    "1MB of ( in tags": answer("(" * MB),
    "1MB of digits in tags": answer("9" * MB),
    "1MB of digits, no tags": "9" * MB,
    "100k unclosed <answer>": "<answer>" * 100_000,
    "100k <answer> then one close": "<answer>" * 100_000 + "1 + 2 </answer>",
    "100k </answer>": "</answer>" * 100_000,
    "1MB body in tags": "<answer>" + "1 + " * (MB // 4) + "1</answer>",
    "deep nesting at bound": answer("(" * 127 + "1" + ")" * 127),
    "power tower": answer("9**9**9"),
    "huge product at bound": answer(" * ".join(["9" * 40] * 6)),
    "import": answer("__import__('os').system('true')"),
    "floor division": answer("1//1"),
    "decimal": answer("1.5+2"),
    "unary minus": answer("-3+5"),
    "null bytes": answer("\x00" * MB),
}


@pytest.mark.parametrize("name", list(ADVERSARIAL))
def test_adversarial_inputs_are_fast_and_safe(name):
    response = ADVERSARIAL[name]
    # CPU time of this process, not wall time: the bound is on the verifier's work, and a suite running beside
    # other processes (parallel workers) would otherwise charge it for time it spent descheduled.
    start = time.process_time()
    value = score(response, [1, 2, 3], 6)
    elapsed = time.process_time() - start
    assert value in (0.0, 0.1)
    assert elapsed < 0.05, f"{name}: {elapsed * 1000:.1f} ms"


# --------------------------------------------------------------------------- solver


@pytest.mark.parametrize(
    "numbers, target",
    [
        ([44, 19, 35], 98),
        ([1, 3, 4, 6], 24),  # needs a rational intermediate: 6 / (1 - 3 / 4)
        ([5, 5, 5, 1], 24),  # (5 - 1 / 5) * 5
        ([3, 3, 8, 8], 24),  # 8 / (3 - 8 / 3)
        ([10, 2, 5], 1),
        ([7, 7, 7], 7),
        ([2, 3], 6),
    ],
)
def test_solver_hand_cases(numbers, target):
    solution = solve(numbers, target)
    assert isinstance(solution, Solution)
    assert score(answer(solution.expression), numbers, target) == 1.0
    assert len(solution.steps) == len(numbers) - 1
    assert solution.steps[-1][3] == target


@pytest.mark.parametrize("numbers, target", [([1, 1, 1], 99), ([2, 2], 5), ([97, 89, 83, 79], 1)])
def test_solver_unsolvable(numbers, target):
    assert solve(numbers, target) is None


def test_solver_prefers_integer_steps():
    solution = solve([44, 19, 35], 98)
    assert all(isinstance(x, int) and x >= 0 for step in solution.steps for x in (step[0], step[2], step[3]))


def test_solver_steps_are_consistent():
    for numbers, target in [([1, 3, 4, 6], 24), ([98, 54, 6, 34], 72)]:
        solution = solve(numbers, target)
        ops = {"+": lambda a, b: a + b, "-": lambda a, b: a - b, "*": lambda a, b: a * b,
               "/": lambda a, b: Fraction(a) / b}
        for a, op, b, result in solution.steps:
            assert ops[op](a, b) == result


def test_solver_on_generated_instances():
    for instance in generate_instances(200, seed=123):
        solution = solve(instance.numbers, instance.target)
        assert solution is not None
        assert score(answer(solution.expression), list(instance.numbers), instance.target) == 1.0


# --------------------------------------------------------------------------- generator


def test_generator_deterministic_and_seeded():
    a = generate_instances(100, seed=7)
    assert a == generate_instances(100, seed=7)
    assert a != generate_instances(100, seed=8)
    assert all(isinstance(x, Instance) for x in a)


def test_generator_ranges_and_uniqueness():
    kwargs = dict(number_counts=(3, 4), min_number=2, max_number=30, min_target=10, max_target=50)
    instances = generate_instances(500, seed=0, **kwargs)
    assert len(instances) == 500
    assert len({x.key for x in instances}) == 500
    assert {len(x.numbers) for x in instances} == {3, 4}
    for x in instances:
        assert all(2 <= n <= 30 for n in x.numbers)
        assert 10 <= x.target <= 50
    only_three = generate_instances(50, seed=0, number_counts=(3,))
    assert {len(x.numbers) for x in only_three} == {3}


def test_generator_exclude():
    first = generate_instances(100, seed=5)
    excluded = {x.key for x in first[:50]}
    second = generate_instances(100, seed=5, exclude=excluded)
    assert not excluded & {x.key for x in second}


def test_generator_refuses_impossible_ranges():
    with pytest.raises(ValueError):
        generate_instances(5, seed=0, number_counts=(3,), min_number=1, max_number=1, min_target=50)


def test_generator_speed():
    start = time.perf_counter()
    generate_instances(2000, seed=0)
    assert time.perf_counter() - start < 5.0


def test_instance_key_is_order_free():
    assert Instance((3, 1, 2), 6).key == Instance((1, 2, 3), 6).key == (6, (1, 2, 3))
    assert Instance((3, 1, 2), 6).key != Instance((1, 2, 3), 7).key


# --------------------------------------------------------------------------- hub loader

HUB_ROWS = [
    {"target": 98, "nums": [44, 19, 35]},
    {"target": 24, "nums": [1, 3, 4, 6]},
    {"target": 79, "nums": [95, 78, 62]},
]
HUB_INSTANCES = [Instance((44, 19, 35), 98), Instance((1, 3, 4, 6), 24), Instance((95, 78, 62), 79)]


@pytest.fixture(autouse=True)
def private_datasets_cache(tmp_path, monkeypatch):
    """Keep the datasets cache of local test files out of the user's home."""
    try:
        import datasets.config
    except ImportError:
        return
    monkeypatch.setattr(datasets.config, "HF_DATASETS_CACHE", tmp_path / "hf_cache")


def test_hub_loader_local_parquet(tmp_path):
    pd = pytest.importorskip("pandas")
    folder = tmp_path / "parquet_set"
    folder.mkdir()
    pd.DataFrame(HUB_ROWS).to_parquet(folder / "train.parquet")
    assert load_hub_instances(str(folder)) == HUB_INSTANCES
    assert load_hub_instances(str(folder), limit=2) == HUB_INSTANCES[:2]
    assert load_hub_instances(str(folder / "train.parquet")) == HUB_INSTANCES


def test_hub_loader_local_json_lines(tmp_path):
    pytest.importorskip("datasets")
    folder = tmp_path / "json_set"
    folder.mkdir()
    (folder / "train.jsonl").write_text("".join(json.dumps(row) + "\n" for row in HUB_ROWS))
    assert load_hub_instances(str(folder)) == HUB_INSTANCES
    assert load_hub_instances(str(folder / "train.jsonl"), limit=1) == HUB_INSTANCES[:1]


# --------------------------------------------------------------------------- prompts


def test_format_prompt():
    prompt = format_prompt(Instance((44, 19, 35), 98), DEFAULT_PROMPT_TEMPLATE)
    assert "Using the numbers [44, 19, 35], create an equation that equals 98." in prompt
    assert prompt.startswith("A conversation between User and Assistant.")
    assert prompt.endswith("Assistant: Let me solve this step by step.\n<think>")
    assert format_prompt(Instance((1, 2), 3), "{numbers}->{target}") == "[1, 2]->3"


def test_demonstration_scores_one():
    for instance in generate_instances(50, seed=11) + [Instance((1, 3, 4, 6), 24)]:
        text = demonstration(instance)
        assert text.startswith(" ") and "</think>\n<answer> " in text and text.endswith(" </answer>")
        assert score(text, list(instance.numbers), instance.target) == 1.0
        # The prompt's own example answer comes earlier, so the full transcript scores too.
        full = format_prompt(instance, DEFAULT_PROMPT_TEMPLATE) + text
        assert score(full, list(instance.numbers), instance.target) == 1.0


def test_demonstration_text():
    text = demonstration(Instance((44, 19, 35), 98))
    assert text == " 44 + 19 = 63, 35 + 63 = 98 </think>\n<answer> 35 + (44 + 19) </answer>"


def test_demonstration_unsolvable_raises():
    with pytest.raises(ValueError):
        demonstration(Instance((1, 1, 1), 99))


# --------------------------------------------------------------------------- splits


def generator_cfg(**overrides):
    cfg = dict(source="generator", dataset="Jiayi-Pan/Countdown-Tasks-3to4", split="train",
               train_size=300, heldout_size=50, seed=0, heldout_seed=1234, number_counts=[3, 4],
               min_number=1, max_number=99, min_target=1, max_target=99)
    cfg.update(overrides)
    return cfg


def test_train_and_heldout_generator_disjoint():
    train, heldout = train_and_heldout(generator_cfg())
    assert len(heldout) == 50 and len(train) == 300
    assert not {x.key for x in train} & {x.key for x in heldout}
    # Same seed for both: still disjoint, still the right sizes.
    train, heldout = train_and_heldout(generator_cfg(seed=1234))
    assert len(heldout) == 50 and not {x.key for x in train} & {x.key for x in heldout}


def test_train_and_heldout_heldout_fixed_by_its_seed():
    _, heldout_a = train_and_heldout(generator_cfg(seed=0))
    _, heldout_b = train_and_heldout(generator_cfg(seed=99))
    assert heldout_a == heldout_b


def test_train_and_heldout_omegaconf():
    omegaconf = pytest.importorskip("omegaconf")
    train, heldout = train_and_heldout(omegaconf.OmegaConf.create(generator_cfg(train_size=20)))
    assert len(train) == 20 and len(heldout) == 50


def test_train_and_heldout_hub_local(tmp_path):
    pd = pytest.importorskip("pandas")
    rows = [{"target": x.target, "nums": list(x.numbers)} for x in generate_instances(200, seed=3)]
    rows += rows[:20]  # the hub set may repeat a problem: disjointness is by key
    pd.DataFrame(rows).to_parquet(tmp_path / "train.parquet")
    cfg = generator_cfg(source="hub", dataset=str(tmp_path), train_size=100)
    train, heldout = train_and_heldout(cfg)
    assert len(heldout) == 50 and len(train) == 100
    assert len({x.key for x in heldout}) == 50
    assert not {x.key for x in train} & {x.key for x in heldout}
    assert train_and_heldout(cfg) == (train, heldout)  # deterministic


def test_train_and_heldout_unknown_source():
    with pytest.raises(ValueError):
        train_and_heldout(generator_cfg(source="nope"))
