"""The built-in math set (SPEC 12): seeded problems with exact answers and a short worked solution.

Five kinds, all with small numbers so the tiny CPU policy can learn them: integer arithmetic with
precedence, fraction sums, percentages, linear equations and one-step word problems. Answers are
exact: integers as digits, non-integer fractions as `\\frac{p}{q}` in lowest terms. The worked
solution (the SFT demonstration) ends with the answer in `\\boxed{}`. The held-out set is generated
from its own seed first and the training set excludes its problems, so the two are disjoint.
"""

from __future__ import annotations

import math
import random
from fractions import Fraction
from typing import Callable, Collection, Sequence

from src.task.base import TaskDataError
from src.task.math.data import MathProblem

KINDS = ("arithmetic", "fractions", "percent", "linear", "word")

NAMES = ("Ann", "Ben", "Cara", "Dan", "Eve", "Finn", "Gia", "Hugo")
ITEMS = ("apples", "books", "coins", "pens", "cards", "eggs", "shells", "stamps")


def latex_number(value: Fraction) -> str:
    """An exact answer in LaTeX: `7`, `-3` or `\\frac{5}{6}` (`-\\frac{1}{2}`), in lowest terms."""
    if value.denominator == 1:
        return str(value.numerator)
    sign = "-" if value < 0 else ""
    return f"{sign}\\frac{{{abs(value.numerator)}}}{{{value.denominator}}}"


def _solved(question: str, steps: str, answer: Fraction | int) -> MathProblem:
    answer_text = latex_number(Fraction(answer))
    return MathProblem(question, answer_text, f"{steps} The answer is \\boxed{{{answer_text}}}.")


def arithmetic(rng: random.Random, top: int) -> MathProblem:
    a, b, c = (rng.randint(1, top) for _ in range(3))
    first, second = rng.choice("+-*"), rng.choice("+-*")
    if second == "*" and first != "*":  # precedence: the product first
        product = b * c
        total = a + product if first == "+" else a - product
        steps = f"{b} * {c} = {product}. {a} {first} {product} = {total}."
    else:
        left = {"+": a + b, "-": a - b, "*": a * b}[first]
        total = {"+": left + c, "-": left - c, "*": left * c}[second]
        steps = f"{a} {first} {b} = {left}. {left} {second} {c} = {total}."
    return _solved(f"Compute {a} {first} {b} {second} {c}.", steps, total)


def fractions(rng: random.Random, top: int) -> MathProblem:
    b, d = rng.randint(2, min(top, 12)), rng.randint(2, min(top, 12))
    a, c = rng.randint(1, b - 1), rng.randint(1, d - 1)
    common = b * d // math.gcd(b, d)
    left, right = a * (common // b), c * (common // d)
    total = Fraction(left + right, common)
    steps = f"{a}/{b} + {c}/{d} = {left}/{common} + {right}/{common} = {left + right}/{common}."
    if total.denominator != common:
        steps += f" {left + right}/{common} = {total}."
    return _solved(f"Compute {a}/{b} + {c}/{d}.", steps, total)


def percent(rng: random.Random, top: int) -> MathProblem:
    share = rng.choice((10, 20, 25, 50, 75))
    base = rng.randint(1, top) * (100 // math.gcd(share, 100))  # so that the share is a whole number
    value = share * base // 100
    # A share of 100 / n is a division by n, which the tiny policy learns; 75% is a quarter, three times.
    if share == 75:
        steps = f"{share}% of {base} is {base} / 4 * 3. {base} / 4 = {base // 4}. {base // 4} * 3 = {value}."
    else:
        steps = f"{share}% of {base} is {base} / {100 // share} = {value}."
    return _solved(f"What is {share}% of {base}?", steps, value)


def linear(rng: random.Random, top: int) -> MathProblem:
    a, x, b = rng.randint(2, 9), rng.randint(-top, top), rng.randint(1, top)
    c = a * x + b
    steps = f"{a}x = {c} - {b} = {c - b}. x = {c - b} / {a} = {x}."
    return _solved(f"Solve for x: {a}x + {b} = {c}.", steps, x)


def word(rng: random.Random, top: int) -> MathProblem:
    name, item = rng.choice(NAMES), rng.choice(ITEMS)
    a, b = rng.randint(2, top), rng.randint(2, top)
    story = rng.randrange(4)
    if story == 0:
        question = f"{name} has {a} {item} and gets {b} more. How many {item} does {name} have now?"
        return _solved(question, f"{a} + {b} = {a + b}.", a + b)
    if story == 1:
        a, b = max(a, b), min(a, b)
        question = f"{name} has {a} {item} and gives away {b}. How many {item} are left?"
        return _solved(question, f"{a} - {b} = {a - b}.", a - b)
    if story == 2:
        question = f"{name} buys {a} bags with {b} {item} in each bag. How many {item} is that in all?"
        return _solved(question, f"{a} * {b} = {a * b}.", a * b)
    question = f"{name} shares {a * b} {item} equally among {b} friends. How many {item} does each friend get?"
    return _solved(question, f"{a * b} / {b} = {a}.", a)


GENERATORS: dict[str, Callable[[random.Random, int], MathProblem]] = {
    "arithmetic": arithmetic, "fractions": fractions, "percent": percent, "linear": linear, "word": word}


def generate_problems(count: int, seed: int, kinds: Sequence[str] = KINDS, max_operand: int = 20,
                      exclude: Collection[str] = ()) -> list[MathProblem]:
    """`count` seeded problems with distinct keys, none in `exclude`; kinds drawn uniformly."""
    unknown = [kind for kind in kinds if kind not in GENERATORS]
    if unknown or not kinds:
        raise ValueError(f"task.builtin.kinds={list(kinds)}: choose from {list(KINDS)}")
    rng = random.Random(seed)
    seen, out = set(exclude), []
    for _ in range(50 * count + 1000):  # a range too narrow for `count` is refused, not looped on
        if len(out) >= count:
            break
        problem = GENERATORS[rng.choice(list(kinds))](rng, max_operand)
        if problem.key not in seen:
            seen.add(problem.key)
            out.append(problem)
    if len(out) < count:
        raise TaskDataError(f"the built-in set has only {len(out)} distinct problems of kinds {list(kinds)} with "
                         f"task.builtin.max_operand={max_operand}; lower task.train_size or raise max_operand")
    return out
