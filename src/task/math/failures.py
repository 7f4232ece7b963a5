"""Failure categories of a math response (SPEC 12): one dominant category per failed response.

Descriptive only, never used in the reward. Checked in this order, global failures first (as the
Countdown taxonomy does, seed 004 app. B.4):

1. repetitive or incoherent: some run of LOOP_WORDS words occurs LOOP_REPEATS times or more;
2. truncated: the response hit the token limit before a boxed answer;
3. no boxed answer: no complete `\\boxed{}`, or an empty one;
4. unparseable answer: boxed, but math-verify finds no mathematical object in it;
5. wrong answer: parsed, not equivalent to the reference;
6. other: refused by a bound (too long, timeout, memory) or a reference answer that does not parse.
"""

from __future__ import annotations

from collections import Counter

from src.task.failures import OTHER, REPETITIVE_OR_INCOHERENT, taxonomy
from src.task.math import verify as v

NO_BOXED = "no_boxed_answer"
UNPARSEABLE = "unparseable_answer"
WRONG = "wrong_answer"
TRUNCATED = "truncated"
REPETITIVE = REPETITIVE_OR_INCOHERENT
CATEGORIES, LABELS = taxonomy({NO_BOXED: "no boxed answer", UNPARSEABLE: "unparseable answer", WRONG: "wrong answer",
                               TRUNCATED: "truncated"})

# A worked solution states each step once; the same eight words three times over is a loop.
LOOP_WORDS = 8
LOOP_REPEATS = 3

_BY_REASON = {v.REASON_NO_BOXED: NO_BOXED, v.REASON_EMPTY: NO_BOXED, v.REASON_UNPARSEABLE: UNPARSEABLE,
              v.REASON_WRONG: WRONG}


def has_loop(text: str, words: int = LOOP_WORDS, repeats: int = LOOP_REPEATS) -> bool:
    """True when some run of `words` consecutive whitespace-separated words occurs `repeats` times or more."""
    tokens = text.split()
    counts = Counter(tuple(tokens[i : i + words]) for i in range(len(tokens) - words + 1))
    return any(count >= repeats for count in counts.values())


def classify_failure(response: str, verdict: v.MathVerdict, truncated: bool) -> str:
    """The dominant category of a failed response (reward below 1.0); see the module docstring."""
    if verdict.reward >= v.REWARD_CORRECT:
        raise ValueError("classify_failure takes failed responses only (reward < 1.0)")
    if has_loop(response):
        return REPETITIVE
    if truncated and verdict.reason in (v.REASON_NO_BOXED, v.REASON_EMPTY):
        return TRUNCATED
    return _BY_REASON.get(verdict.reason, OTHER)
