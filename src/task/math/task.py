"""Competition math behind the task interface (`task=math`, SPEC 12; seeds 001 and 003).

The prompt is the problem, then seed 003's instruction to reason step by step and put the final
answer in `\\boxed{}`; the reward is 1.0 when the last boxed answer is equivalent to the reference
(math-verify, bounded: `src.task.math.verify`), else 0.0. The data is the built-in procedural set
(`task.data=null`, the default: no download, the CPU demo) or the user's files (`task.data=PATH`,
columns by `task.preset` or `task.question_column`/`task.answer_column`). The frontier curricula
are refused: their embedding is Countdown's (seed 004 app. B.2).
"""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence
from types import MappingProxyType

from src.task.base import Task, TaskDataError
from src.task.math import data as files
from src.task.math import failures
from src.task.math.data import MathProblem
from src.task.math.generate import KINDS, generate_problems
from src.task.math.verify import MathVerdict, MathVerifier, last_boxed

log = logging.getLogger(__name__)

DEFAULT_PROMPT_TEMPLATE = "{problem} Let's think step by step and output the final answer within \\boxed{{}}.\n"
VERIFIER_DEFAULTS = {"timeout_s": 1.0, "max_answer_chars": 1000, "memory_mb": 1024, "workers": 2,
                     "format_reward": 0.0}
BUILTIN_DEFAULTS = {"kinds": list(KINDS), "max_operand": 20}
BRIEF_CHARS = 300  # a problem's brief (the completions tables' `problem` column): its first characters


class MathTask(Task):
    """`task=math`: see the module docstring; settings are conf/task/math.yaml's keys."""

    name = "math"
    failure_categories = failures.CATEGORIES
    cell_suffix = "-math"
    reader_name = "math task"
    # Multi-digit arithmetic needs more demonstrations and steps than Countdown's format does: 300 steps on
    # 4,000 left the tiny policy at 0.05 held-out reward, copying numbers wrongly (docs/math.md).
    warm_start = MappingProxyType({"examples": 20000, "steps": 1000})

    def __init__(self, data: str | None = None, preset: str | None = None, question_column: str = "problem",
                 answer_column: str = "answer", answer_format: str = "plain", heldout_data: str | None = None,
                 train_size: int = 20000, heldout_size: int = 50, seed: int = 0, heldout_seed: int = 12345,
                 builtin: Mapping | None = None, verifier: Mapping | None = None,
                 prompt_template: str = DEFAULT_PROMPT_TEMPLATE) -> None:
        self.columns = files.columns_for(preset, question_column, answer_column, answer_format)
        self.data, self.heldout_data = data, heldout_data
        self.train_size, self.heldout_size = int(train_size), int(heldout_size)
        self.seed, self.heldout_seed = int(seed), int(heldout_seed)
        self.builtin = {**BUILTIN_DEFAULTS, **dict(builtin or {})}
        self.template = _checked_template(prompt_template)
        settings = _checked_verifier({**VERIFIER_DEFAULTS, **dict(verifier or {})})
        if data is None:
            generate_problems(0, 0, self.builtin["kinds"], int(self.builtin["max_operand"]))  # checks the kinds
            if heldout_data is not None:
                raise ValueError(f"task.heldout_data='{heldout_data}' needs task.data: the built-in set makes its "
                                 "own held-out problems; set task.data=PATH or drop task.heldout_data")
        else:
            files.check_columns(data, self.columns)
        if heldout_data is not None:
            files.check_columns(heldout_data, self.columns, key="task.heldout_data")
        self.verifier = MathVerifier(**settings)

    # ---- data

    def splits(self, train_size: int | None = None) -> tuple[list[MathProblem], list[MathProblem]]:
        wanted = self.train_size if train_size is None else int(train_size)
        if self.data is None:
            kinds, top = self.builtin["kinds"], int(self.builtin["max_operand"])
            heldout = generate_problems(self.heldout_size, self.heldout_seed, kinds, top)
            train = generate_problems(wanted, self.seed, kinds, top, exclude={p.key for p in heldout})
            return train, heldout
        problems = files.load_problems(self.data, self.columns)
        pool = problems if self.heldout_data is None else files.load_problems(self.heldout_data, self.columns,
                                                                              "task.heldout_data")
        heldout = files.distinct_sample(pool, self.heldout_size, self.heldout_seed)
        if len(heldout) < self.heldout_size:
            raise TaskDataError(f"task.heldout_size={self.heldout_size}: the held-out data has only {len(heldout)} "
                                "distinct problems; lower task.heldout_size (and evaluation.prompts)")
        train = files.distinct_sample(problems, wanted, self.seed, exclude={p.key for p in heldout})
        if wanted and not train:
            raise TaskDataError(f"task.data='{self.data}': no training problem is left outside the held-out set; "
                                "give task.heldout_data or more data")
        if len(train) < wanted:
            log.info("task.data: %d distinct training problems (task.train_size=%d is an upper bound)",
                     len(train), wanted)
        return train, heldout

    def demonstrations(self, count: int, seed: int) -> list[tuple[str, str]]:
        if self.data is not None:
            raise TaskDataError(f"task.data='{self.data}': worked solutions come with the built-in set only; "
                                "warm-start with task.data=null")
        _, heldout = self.splits(train_size=0)
        problems = generate_problems(count, seed, self.builtin["kinds"], int(self.builtin["max_operand"]),
                                     exclude={p.key for p in heldout})
        return [(self.prompt(problem), " " + problem.solution) for problem in problems]

    # ---- prompts, answers, verifier

    def prompt(self, instance: MathProblem) -> str:
        return self.template.format(problem=instance.question)

    def extract(self, response: str) -> str | None:
        return last_boxed(response)

    def verify(self, response: str, instance: MathProblem) -> MathVerdict:
        return self.verifier.verify(response, instance.answer)

    def verify_all(self, responses: Sequence[str], instance: MathProblem) -> list[MathVerdict]:
        return self.verifier.verify_all(list(responses), instance.answer)

    def classify_failure(self, response: str, verdict: MathVerdict, truncated: bool) -> str:
        return failures.classify_failure(response, verdict, truncated)

    def truth(self, instance: MathProblem) -> str:
        return instance.answer  # the problem itself is in the group's prompt (`problem_in`)

    def describe(self, instance: MathProblem) -> dict:
        return {"problem": instance.question[:200], "answer": instance.answer}

    def brief(self, instance: MathProblem) -> str:
        text = " ".join(instance.question.split())
        return text if len(text) <= BRIEF_CHARS else text[:BRIEF_CHARS] + "…"

    def instance_of(self, group) -> MathProblem:
        return MathProblem(question=self.problem_in(group.prompt), answer=str(group.truth))

    def problem_in(self, prompt: str) -> str:
        """The problem inside a prompt this task wrote: the text between the template's words before and after
        `{problem}` (a chat template around it stays in front when the template has nothing before the slot)."""
        before, after = self.template.format(problem="\0").split("\0")
        end = prompt.rfind(after.strip()) if after.strip() else -1
        end = end if end >= 0 else len(prompt)
        start = prompt.rfind(before.strip(), 0, end) if before.strip() else -1
        return prompt[start + len(before.strip()) if start >= 0 else 0:end].strip()

    def close(self) -> None:
        self.verifier.close()


def _checked_template(template: str) -> str:
    try:
        template.format(problem="")
    except (KeyError, IndexError, ValueError) as error:
        raise ValueError(f"task.prompt_template={template!r} does not format ({error.__class__.__name__}: {error}); "
                         "it takes one slot, {problem}, and writes literal braces doubled: \\\\boxed{{}}") from None
    if "{problem}" not in template:
        raise ValueError(f"task.prompt_template={template!r} has no {{problem}} slot; the problem text goes there")
    return template


def _checked_verifier(settings: dict) -> dict:
    unknown = sorted(set(settings) - set(VERIFIER_DEFAULTS))
    if unknown:
        raise ValueError(f"task.verifier has unknown key(s) {unknown}; the keys are {sorted(VERIFIER_DEFAULTS)}")
    for key in ("timeout_s", "max_answer_chars", "memory_mb", "workers"):
        if not settings[key] > 0:
            raise ValueError(f"task.verifier.{key}={settings[key]}: must be > 0 (default {VERIFIER_DEFAULTS[key]})")
    if not 0 <= settings["format_reward"] < 1:
        raise ValueError(f"task.verifier.format_reward={settings['format_reward']}: must be in [0, 1) "
                         "(0.1 rewards a boxed but wrong answer; 0 is seed 003's binary reward)")
    return settings
