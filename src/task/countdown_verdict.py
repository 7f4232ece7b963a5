"""What Countdown's verifier says about a response: its answer tags, rewards, reasons and `Verdict`.

A module of its own because two readers need these words without the verifier: the task's
failure taxonomy (src/task/countdown_failures.py) classifies by them, and the verifier
(src/task/countdown.py) produces them.
"""

from __future__ import annotations

from dataclasses import dataclass
from fractions import Fraction

REWARD_CORRECT = 1.0
REWARD_FORMAT = 0.1
REWARD_NONE = 0.0

ANSWER_OPEN = "<answer>"
ANSWER_CLOSE = "</answer>"


# Why the verifier gave its reward: one reason per response, decided in the order the checks run.
REASON_CORRECT = "correct"
REASON_NO_ANSWER = "no_answer"  # no complete <answer>...</answer> span
REASON_EMPTY_ANSWER = "empty_answer"  # the span holds only whitespace
REASON_TOO_LONG = "too_long"  # longer than MAX_EXPRESSION_CHARS: refused unparsed
REASON_MALFORMED = "malformed"  # not a well-formed expression (text, code, unary signs, ...)
REASON_WRONG_NUMBERS = "wrong_numbers"  # literals are not the given multiset (checked before evaluating)
REASON_DIVISION_BY_ZERO = "division_by_zero"  # the given numbers, but the expression divides by zero
REASON_WRONG_VALUE = "wrong_value"  # the given numbers, evaluates, but not to the target
REASONS = (REASON_CORRECT, REASON_NO_ANSWER, REASON_EMPTY_ANSWER, REASON_TOO_LONG, REASON_MALFORMED,
           REASON_WRONG_NUMBERS, REASON_DIVISION_BY_ZERO, REASON_WRONG_VALUE)


@dataclass(frozen=True)
class Verdict:
    """The verifier's outcome: reward, the reason for it, the extracted answer and its value (if evaluated)."""

    reward: float
    reason: str
    expression: str | None = None  # content of the last complete answer span; None without one
    value: Fraction | None = None  # exact value, only when the literals were the given numbers
