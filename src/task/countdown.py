"""Countdown task: instances, verifier, exact solver, generator, hub loader, prompts, splits.

An instance is a target integer and 3 or 4 given integers; the model must write one
expression with ``+ - * /`` and parentheses that uses each given number exactly once
and equals the target (SPEC section 2).

The verifier runs on untrusted model output, so it never calls ``eval``; it extracts
the answer span with ``str.rfind`` (linear time), refuses answers longer than
``MAX_EXPRESSION_CHARS``, parses with an iterative state machine plus shunting-yard
(no recursion, so nesting depth cannot hit the recursion limit), compares literals as
digit strings before converting anything to ``int``, and evaluates with exact
``fractions.Fraction`` arithmetic.
"""

from __future__ import annotations

import math
import os
import random
from collections import Counter
from dataclasses import dataclass
from fractions import Fraction
from pathlib import Path
from typing import Any, Collection, Sequence

from src.task.base import Task
from src.task.set_cache import cached_sets
from src.task.countdown_failures import CATEGORIES, classify_failure
from src.task.countdown_verdict import (  # noqa: F401  (part of this module's interface)
    ANSWER_CLOSE, ANSWER_OPEN, REASON_CORRECT, REASON_DIVISION_BY_ZERO, REASON_EMPTY_ANSWER, REASON_MALFORMED,
    REASON_NO_ANSWER, REASON_TOO_LONG, REASON_WRONG_NUMBERS, REASON_WRONG_VALUE, REASONS,
    REWARD_CORRECT, REWARD_FORMAT, REWARD_NONE, Verdict)

# No legitimate Countdown answer (3-4 numbers of at most a few digits) comes near this;
# the bound keeps parsing and exact arithmetic cheap whatever the model writes.
MAX_EXPRESSION_CHARS = 256

SOURCES = ("generator", "hub")  # task.source: the seeded generator, or a hub dataset / local copy

DEFAULT_PROMPT_TEMPLATE = (
    "A conversation between User and Assistant. The user asks a question, and the Assistant "
    "solves it. The assistant first thinks about the reasoning process in the mind and then "
    "provides the user with the answer.\n"
    "User: Using the numbers {numbers}, create an equation that equals {target}. You can use "
    "basic arithmetic operations (+, -, *, /) and each number can only be used once. Show your "
    "work in <think> </think> tags. And return the final answer in <answer> </answer> tags, "
    "for example <answer> (1 + 2) / 3 </answer>.\n"
    "Assistant: Let me solve this step by step.\n<think>"
)

# ASCII only: str.isdigit would accept superscripts and other scripts' digits.
_DIGITS = frozenset("0123456789")
_WHITESPACE = frozenset(" \t\n\r")
_PRECEDENCE = {"+": 1, "-": 1, "*": 2, "/": 2}
_ATOM_PRECEDENCE = 3

Number = int | Fraction


@dataclass(frozen=True)
class Instance:
    """One Countdown problem: the given numbers (in presentation order) and the target."""

    numbers: tuple[int, ...]
    target: int

    @property
    def key(self) -> tuple[int, tuple[int, ...]]:
        """Order-free identity used for duplicate and held-out disjointness checks."""
        return (self.target, tuple(sorted(self.numbers)))


@dataclass(frozen=True)
class Solution:
    """A solver result: the infix expression and its binary steps (a, op, b, result) in order."""

    expression: str
    steps: tuple[tuple[Number, str, Number, Number], ...]


# --------------------------------------------------------------------------- verifier


def extract_answer(response: str) -> str | None:
    """Return the stripped content of the last complete <answer>...</answer> span, or None.

    The span is found with ``rfind``: the last ``</answer>``, then the last ``<answer>``
    before it. This is linear in the response length, unlike a lazy ``.*?`` regex, which
    goes quadratic on many unclosed ``<answer>`` tags.
    """
    end = response.rfind(ANSWER_CLOSE)
    if end < 0:
        return None
    start = response.rfind(ANSWER_OPEN, 0, end)
    if start < 0:
        return None
    return response[start + len(ANSWER_OPEN) : end].strip()


def parse_expression(expression: str) -> list[str] | None:
    """Parse an infix expression into RPN tokens, or None if it is not well-formed.

    Well-formed means: non-negative integer literals (ASCII digit strings), binary
    ``+ - * /``, parentheses and whitespace, nothing else, and at most
    ``MAX_EXPRESSION_CHARS`` characters. A two-state machine (expecting an operand vs an
    operator) rejects unary signs, ``**``, ``//``, ``()`` and adjacent operands.
    """
    if len(expression) > MAX_EXPRESSION_CHARS:
        return None
    output: list[str] = []
    stack: list[str] = []
    expect_operand = True
    depth = 0
    i, n = 0, len(expression)
    while i < n:
        char = expression[i]
        if char in _WHITESPACE:
            i += 1
            continue
        if char in _DIGITS:
            if not expect_operand:
                return None
            j = i + 1
            while j < n and expression[j] in _DIGITS:
                j += 1
            output.append(expression[i:j])
            expect_operand = False
            i = j
            continue
        if char == "(":
            if not expect_operand:
                return None
            stack.append(char)
            depth += 1
        elif char == ")":
            if expect_operand or depth == 0:
                return None
            while stack[-1] != "(":
                output.append(stack.pop())
            stack.pop()
            depth -= 1
        elif char in _PRECEDENCE:
            if expect_operand:
                return None
            # All four operators are left-associative, hence >=.
            while stack and stack[-1] != "(" and _PRECEDENCE[stack[-1]] >= _PRECEDENCE[char]:
                output.append(stack.pop())
            stack.append(char)
            expect_operand = True
        else:
            return None
        i += 1
    if expect_operand or depth != 0:
        return None
    while stack:
        output.append(stack.pop())
    return output


def evaluate_rpn(tokens: Sequence[str]) -> Fraction | None:
    """Evaluate RPN tokens from ``parse_expression`` exactly; None on division by zero."""
    values: list[Fraction] = []
    for token in tokens:
        if token in _PRECEDENCE:
            b = values.pop()
            a = values.pop()
            if token == "+":
                values.append(a + b)
            elif token == "-":
                values.append(a - b)
            elif token == "*":
                values.append(a * b)
            elif b == 0:
                return None
            else:
                values.append(a / b)
        else:
            values.append(Fraction(int(token)))
    return values[0]


def evaluate_expression(expression: str) -> tuple[bool, list[str], Fraction | None]:
    """Return (well_formed, literals, value) for an answer expression; value None if malformed or x/0."""
    tokens = parse_expression(expression)
    if tokens is None:
        return False, [], None
    literals = [t for t in tokens if t not in _PRECEDENCE]
    return True, literals, evaluate_rpn(tokens)


def _normalise_literal(literal: str) -> str:
    # Compare digit strings, never ints: a 200-digit literal costs nothing this way.
    return literal.lstrip("0") or "0"


def verify(response: str, numbers: Sequence[int], target: int) -> Verdict:
    """Verifier with its reason: 1.0 correct, 0.1 well-formed but wrong value or numbers, 0.0 no well-formed answer."""
    content = extract_answer(response)
    if content is None:
        return Verdict(REWARD_NONE, REASON_NO_ANSWER)
    if not content:
        return Verdict(REWARD_NONE, REASON_EMPTY_ANSWER, content)
    if len(content) > MAX_EXPRESSION_CHARS:
        return Verdict(REWARD_NONE, REASON_TOO_LONG, content)
    tokens = parse_expression(content)
    if tokens is None:
        return Verdict(REWARD_NONE, REASON_MALFORMED, content)
    literals = Counter(_normalise_literal(t) for t in tokens if t not in _PRECEDENCE)
    if literals != Counter(str(int(n)) for n in numbers):
        return Verdict(REWARD_FORMAT, REASON_WRONG_NUMBERS, content)
    # Only now evaluate: the literals are the given (small) numbers.
    value = evaluate_rpn(tokens)
    if value is None:
        return Verdict(REWARD_FORMAT, REASON_DIVISION_BY_ZERO, content)
    if value == int(target):
        return Verdict(REWARD_CORRECT, REASON_CORRECT, content, value)
    return Verdict(REWARD_FORMAT, REASON_WRONG_VALUE, content, value)


def score(response: str, numbers: Sequence[int], target: int) -> float:
    """Verifier reward only (`verify` also says why)."""
    return verify(response, numbers, target).reward


# --------------------------------------------------------------------------- solver


def _apply(a: Number, op: str, b: Number, integer_only: bool) -> Number | None:
    """One binary operation; None where it is undefined (or leaves the integer space)."""
    if op == "+":
        return a + b
    if op == "*":
        return a * b
    if op == "-":
        if integer_only and a < b:
            return None
        return a - b
    if b == 0:
        return None
    if integer_only:
        return a // b if a % b == 0 else None
    return Fraction(a) / b


def _plain(value: Number) -> Number:
    """Show integral Fractions as ints (in steps and in the demonstration text)."""
    if isinstance(value, Fraction) and value.denominator == 1:
        return value.numerator
    return value


def _join(left: tuple[str, int], op: str, right: tuple[str, int]) -> tuple[str, int]:
    """Infix text in step order, e.g. ``98 - 54 + (34 - 6)`` for 98 - 54, 34 - 6, 44 + 28."""
    prec = _PRECEDENCE[op]
    left_text, left_prec = left
    right_text, right_prec = right
    if left_prec < prec:
        left_text = f"({left_text})"
    # a - (b - c) and a / (b / c) need them for the value; a + (b + c) keeps them so the
    # expression reads in the same order as the demonstration's steps.
    if right_prec <= prec:
        right_text = f"({right_text})"
    return f"{left_text} {op} {right_text}", prec


def _search(numbers: Sequence[int], target: int, integer_only: bool) -> Solution | None:
    """Depth-first search over pairwise combinations; stops at the first solution."""
    start = [(n if integer_only else Fraction(n), (str(n), _ATOM_PRECEDENCE)) for n in numbers]
    steps: list[tuple[Number, str, Number, Number]] = []
    failed: set[tuple[Number, ...]] = set()  # value multisets known to miss the target

    def dfs(items: list[tuple[Number, tuple[str, int]]]) -> str | None:
        if len(items) == 1:
            return items[0][1][0] if items[0][0] == target else None
        state = tuple(sorted(value for value, _ in items))
        if state in failed:
            return None
        for i in range(len(items)):
            for j in range(i + 1, len(items)):
                rest = items[:i] + items[i + 1 : j] + items[j + 1 :]
                for first, second in ((items[i], items[j]), (items[j], items[i])):
                    for op in "+-*/":
                        if op in "+*" and first is items[j]:
                            continue  # commutative: one operand order is enough
                        value = _apply(first[0], op, second[0], integer_only)
                        if value is None:
                            continue
                        steps.append((_plain(first[0]), op, _plain(second[0]), _plain(value)))
                        found = dfs(rest + [(value, _join(first[1], op, second[1]))])
                        if found is not None:
                            return found
                        steps.pop()
        failed.add(state)
        return None

    expression = dfs(start)
    return None if expression is None else Solution(expression, tuple(steps))


def solve(numbers: Sequence[int], target: int) -> Solution | None:
    """Exact solver: a solution using every number once, preferring non-negative integer steps."""
    numbers = [int(n) for n in numbers]
    if not numbers:
        return None
    # Integer space first (readable demonstrations, and much faster on plain ints),
    # then the full rational space, e.g. 6 / (1 - 3 / 4) = 24.
    return _search(numbers, int(target), True) or _search(numbers, int(target), False)


# --------------------------------------------------------------------------- generator


def _random_tree_value(numbers: Sequence[int], rng: random.Random) -> int:
    """Value of a random binary expression tree over the numbers, with non-negative integer steps."""
    values = list(numbers)
    while len(values) > 1:
        a = values.pop(rng.randrange(len(values)))
        b = values.pop(rng.randrange(len(values)))
        big, small = max(a, b), min(a, b)
        ops = ["+", "-", "*", "/"]
        rng.shuffle(ops)
        for op in ops:  # "+" always succeeds, so the loop always picks something
            value = _apply(big, op, small, integer_only=True)
            if value is not None:
                break
        values.append(value)
    return values[0]


def generate_instances(
    count: int,
    seed: int,
    *,
    number_counts: Sequence[int] = (3, 4),
    min_number: int = 1,
    max_number: int = 99,
    min_target: int = 1,
    max_target: int = 99,
    exclude: Collection[tuple] = (),
    trees_per_draw: int = 10,
) -> list[Instance]:
    """Seeded, deterministic solvable instances with distinct keys, none of them in ``exclude``."""
    if not number_counts or min(number_counts) < 1:
        raise ValueError(f"number_counts must be non-empty and positive, got {number_counts}")
    if min_number > max_number or min_target > max_target:
        raise ValueError("empty number or target range")
    rng = random.Random(seed)
    seen = set(exclude)
    out: list[Instance] = []
    max_draws = 1000 * count + 10_000  # refuses impossible ranges instead of looping forever
    for _ in range(max_draws):
        if len(out) >= count:
            break
        size = rng.choice(list(number_counts))
        numbers = tuple(rng.randint(min_number, max_number) for _ in range(size))
        # A few random trees per draw: most trees over 4 numbers overshoot the target range.
        for _ in range(trees_per_draw):
            target = _random_tree_value(numbers, rng)
            if min_target <= target <= max_target:
                break
        else:
            continue
        instance = Instance(numbers, target)
        if instance.key in seen:
            continue
        if solve(numbers, target) is None:  # the contract: solvability checked by the exact solver
            continue
        seen.add(instance.key)
        out.append(instance)
    if len(out) < count:
        raise ValueError(f"could only generate {len(out)} of {count} instances; ranges too narrow?")
    return out


# --------------------------------------------------------------------------- hub data


def load_hub_instances(path: str, split: str = "train", limit: int | None = None) -> list[Instance]:
    """Load instances (columns ``target``, ``nums``) from a hub dataset, a local folder or a local file."""
    import datasets  # heavy: imported only when hub data is actually used

    if os.path.isfile(path):
        # A single local file: pick the builder from its extension.
        builder = "parquet" if path.endswith(".parquet") else "json"
        dataset = datasets.load_dataset(builder, data_files=path, split=split)
    else:
        dataset = datasets.load_dataset(path, split=split)
    if limit is not None:
        dataset = dataset.select(range(min(limit, len(dataset))))
    return [
        Instance(tuple(int(n) for n in nums), int(target))
        for nums, target in zip(dataset["nums"], dataset["target"])
    ]


# --------------------------------------------------------------------------- prompts


def format_prompt(instance: Instance, template: str = DEFAULT_PROMPT_TEMPLATE) -> str:
    """Fill the prompt template with the instance's numbers (as a list) and target."""
    return template.format(numbers=list(instance.numbers), target=instance.target)


def demonstration(instance: Instance) -> str:
    """Solver-written response (think steps, then the answer) that follows the prompt."""
    solution = solve(instance.numbers, instance.target)
    if solution is None:
        raise ValueError(f"unsolvable instance: {instance}")
    work = ", ".join(f"{a} {op} {b} = {r}" for a, op, b, r in solution.steps)
    return f" {work} </think>\n<answer> {solution.expression} </answer>"


# --------------------------------------------------------------------------- curriculum embedding

# Scale normalisers from seed 004 app. B.2: values "on the order of 10^2" are divided by
# 100, sum-based features by 300; the operand count by the maximum count (4 there).
_VALUE_SCALE = 100.0
_SUM_SCALE = 300.0


def prompt_features(instance: Instance, max_numbers: int = 4) -> list[float]:
    """The raw (unnormalised) feature vector phi(x) of seed 004 app. B.2: 10 + max_numbers floats.

    In the paper's order: t/100, n/4, min/100, max/100, mean/100, std/100, S/300,
    (S - t)/300, |S - t|/300, parity, then the numbers sorted ascending and padded to
    `max_numbers`, each /100. The paper calls this "the 14-dimensional feature vector":
    10 scalars + 4 padded numbers = 14, which agrees with max_numbers = 4 (Countdown
    3to4 has at most four numbers). Choices the paper leaves open, taken here:
    * std is the population std (divide by n), numpy's default;
    * padding is 0.0 appended after the sorted numbers (a 3-number prompt keeps its
      three numbers in the first three slots, aligned with a 4-number prompt's smallest three);
    * the count is divided by `max_numbers` (= 4, the paper's constant, by default).
    """
    numbers = [int(a) for a in instance.numbers]
    n = len(numbers)
    if n == 0:
        raise ValueError(f"instance {instance!r} has no numbers; a Countdown prompt has 3 or 4.")
    if n > max_numbers:
        raise ValueError(
            f"instance has {n} numbers but max_numbers={max_numbers}; raise max_numbers to at least {n} "
            "(and use the same value for memory and prompt bank)."
        )
    t = int(instance.target)
    s = sum(numbers)
    mean = s / n
    std = math.sqrt(sum((a - mean) ** 2 for a in numbers) / n)
    parity = sum(a % 2 for a in numbers) / n  # share of odd numbers
    padded = sorted(numbers) + [0] * (max_numbers - n)
    return [
        t / _VALUE_SCALE,
        n / max_numbers,
        min(numbers) / _VALUE_SCALE,
        max(numbers) / _VALUE_SCALE,
        mean / _VALUE_SCALE,
        std / _VALUE_SCALE,
        s / _SUM_SCALE,
        (s - t) / _SUM_SCALE,
        abs(s - t) / _SUM_SCALE,
        parity,
        *(a / _VALUE_SCALE for a in padded),
    ]


# --------------------------------------------------------------------------- splits


def _cfg(cfg: Any, key: str, default: Any = None) -> Any:
    # dict and OmegaConf DictConfig both have .get; plain objects fall back to attributes.
    if hasattr(cfg, "get"):
        return cfg.get(key, default)
    return getattr(cfg, key, default)


def generated_splits(train_size: int, heldout_size: int, seed: int, heldout_seed: int,
                     ranges: dict[str, Any]) -> tuple[list[Instance], list[Instance]]:
    """The generator's training and held-out sets, made once and then read from src/task/set_cache.py's files."""

    def make() -> dict[str, list]:
        heldout = generate_instances(heldout_size, heldout_seed, **ranges)
        train = generate_instances(train_size, seed, exclude={inst.key for inst in heldout}, **ranges)
        return {name: [[inst.target, list(inst.numbers)] for inst in rows]
                for name, rows in (("train", train), ("heldout", heldout))}

    def row_ok(row: Any) -> bool:
        return (isinstance(row, list) and len(row) == 2 and type(row[0]) is int and isinstance(row[1], list)
                and len(row[1]) in ranges["number_counts"] and all(type(n) is int for n in row[1]))

    settings = dict(ranges, train_size=train_size, heldout_size=heldout_size, seed=seed, heldout_seed=heldout_seed)
    sets = cached_sets("countdown", settings, Path(__file__), {"train": train_size, "heldout": heldout_size},
                       row_ok, make)
    train, heldout = ([Instance(tuple(numbers), target) for target, numbers in sets[name]]
                      for name in ("train", "heldout"))
    return train, heldout


def heldout_instances(cfg: Any) -> list[Instance]:
    """Only the held-out set (evaluation needs no training data; generating it costs seconds)."""
    if _cfg(cfg, "source", "generator") == "generator":
        return train_and_heldout(cfg, train_size=0)[1]
    return train_and_heldout(cfg)[1]


def train_and_heldout(cfg: Any, train_size: int | None = None) -> tuple[list[Instance], list[Instance]]:
    """Training and held-out instances for a task config, disjoint by key (`train_size` overrides the config's)."""
    source = _cfg(cfg, "source", "generator")
    train_size = int(_cfg(cfg, "train_size") if train_size is None else train_size)
    heldout_size = int(_cfg(cfg, "heldout_size", 50))
    seed = int(_cfg(cfg, "seed", 0))
    heldout_seed = int(_cfg(cfg, "heldout_seed", 1))

    if source == "generator":
        ranges = dict(
            number_counts=tuple(int(n) for n in _cfg(cfg, "number_counts", (3, 4))),
            min_number=int(_cfg(cfg, "min_number", 1)),
            max_number=int(_cfg(cfg, "max_number", 99)),
            min_target=int(_cfg(cfg, "min_target", 1)),
            max_target=int(_cfg(cfg, "max_target", 99)),
        )
        return generated_splits(train_size, heldout_size, seed, heldout_seed, ranges)

    if source == "hub":
        rows = load_hub_instances(_cfg(cfg, "dataset"), split=_cfg(cfg, "split", "train"))
        # Held-out: a seeded random selection of rows with distinct keys.
        order = list(range(len(rows)))
        random.Random(heldout_seed).shuffle(order)
        heldout: list[Instance] = []
        heldout_keys: set[tuple] = set()
        for index in order:
            if len(heldout) >= heldout_size:
                break
            if rows[index].key not in heldout_keys:
                heldout_keys.add(rows[index].key)
                heldout.append(rows[index])
        if len(heldout) < heldout_size:
            raise ValueError(f"dataset has only {len(heldout)} distinct instances for the held-out set")
        # Training: the other rows (by key, since the hub set may repeat a problem), seeded shuffle.
        remaining = [inst for inst in rows if inst.key not in heldout_keys]
        random.Random(seed).shuffle(remaining)
        train = remaining[:train_size]
        if len(train) < train_size:
            raise ValueError(f"dataset has only {len(train)} training rows, {train_size} requested")
        return train, heldout

    raise ValueError(f"unknown task source {source!r}; expected 'generator' or 'hub'")


# --------------------------------------------------------------------------- the task interface


class CountdownTask(Task):
    """Countdown behind the task interface (`task=countdown`, SPEC 2): the functions above, unchanged."""

    name = "countdown"
    correct_reward = REWARD_CORRECT
    supports_curriculum = True  # `features`: seed 004 app. B.2's embedding of a Countdown prompt

    def __init__(self, source: str = "generator", dataset: str = "Jiayi-Pan/Countdown-Tasks-3to4",
                 split: str = "train", train_size: int = 20000, heldout_size: int = 50, seed: int = 0,
                 heldout_seed: int = 1, number_counts: Sequence[int] = (3, 4), min_number: int = 1,
                 max_number: int = 99, min_target: int = 1, max_target: int = 99,
                 prompt_template: str = DEFAULT_PROMPT_TEMPLATE) -> None:
        if source not in SOURCES:
            raise ValueError(f"task.source='{source}': choose one of {SOURCES}")
        if not (min_number <= max_number and min_target <= max_target):
            raise ValueError(f"task.min_number={min_number}, task.max_number={max_number}, task.min_target="
                             f"{min_target}, task.max_target={max_target}: each minimum must be <= its maximum")
        self.settings = dict(source=source, dataset=dataset, split=split, train_size=train_size,
                             heldout_size=heldout_size, seed=seed, heldout_seed=heldout_seed,
                             number_counts=tuple(number_counts), min_number=min_number, max_number=max_number,
                             min_target=min_target, max_target=max_target, prompt_template=prompt_template)
        self.template = prompt_template

    @property
    def failure_categories(self) -> tuple[str, ...]:
        return CATEGORIES  # seed 004 app. B.4 (src/task/countdown_failures.py)

    def splits(self, train_size: int | None = None) -> tuple[list[Instance], list[Instance]]:
        return train_and_heldout(self.settings, train_size)

    def heldout(self) -> list[Instance]:
        return heldout_instances(self.settings)

    def prompt(self, instance: Instance) -> str:
        return format_prompt(instance, self.template)

    def extract(self, response: str) -> str | None:
        return extract_answer(response)

    def verify(self, response: str, instance: Instance) -> Verdict:
        return verify(response, instance.numbers, instance.target)

    def classify_failure(self, response: str, verdict: Verdict, truncated: bool) -> str:
        return classify_failure(response, verdict)

    def truth(self, instance: Instance) -> dict:
        return {"numbers": list(instance.numbers), "target": instance.target}

    def describe(self, instance: Instance) -> dict:
        return {"numbers": str(list(instance.numbers)), "target": instance.target}

    def brief(self, instance: Instance) -> str:
        return f"numbers {', '.join(map(str, instance.numbers))}; target {instance.target}"

    def instance_of(self, group) -> Instance:
        return self.instance_from_truth(group.truth)

    def features(self, instance: Instance, width: int) -> list[float]:
        return prompt_features(instance, width)

    def instance_from_truth(self, truth: dict) -> Instance:
        # Read back from checkpoints and rollout files: every field converted, nothing evaluated.
        return Instance(tuple(int(n) for n in truth["numbers"]), int(truth["target"]))

    def demonstrations(self, count: int, seed: int) -> list[tuple[str, str]]:
        settings = self.settings
        _, heldout = self.splits(train_size=0)
        instances = generate_instances(
            count, seed=seed, number_counts=settings["number_counts"], min_number=settings["min_number"],
            max_number=settings["max_number"], min_target=settings["min_target"],
            max_target=settings["max_target"], exclude={instance.key for instance in heldout})
        return [(self.prompt(instance), demonstration(instance)) for instance in instances]
