"""Failure taxonomy (seed 004, appendix B.4; SPEC 10): one dominant category per failed rollout.

A rollout fails when its verifier score is below 1.0. Each failure gets exactly one category,
decided from the response text and the verifier's `Verdict` (its reason and extracted answer),
never by re-parsing. Descriptive only: nothing here feeds the reward or any training decision.

The appendix's rule for rollouts with several issues is "the dominant failure", with global
generation failures (missing tags, repeated output, corrupted text) assigned before the local
arithmetic labels. This module reads that as a fixed order of checks:

1. repetitive or incoherent (global instability, decided from the whole response):
   - more than one `<answer>` tag (repeated answer tags, or several inconsistent final answers),
   - more than one `</think>` (the reasoning restarted after it was closed),
   - text after the last `</answer>` (reasoning continued after the final answer),
   - a loop: some run of LOOP_WORDS consecutive words occurring LOOP_REPEATS times or more,
   - non-ASCII characters (corrupted or multilingual fragments: the task is plain ASCII).
   A loop that ran into the token budget before closing its answer is therefore a repetition
   failure, not a format error: the missing tag is a symptom of the loop.
2. format error: no complete answer span, an empty one, or one the verifier cannot parse
   (text or code instead of an expression, unary signs, unbalanced parentheses).
3. invalid number use: parseable, but the literals are not the given multiset. The verifier
   checks numbers before it evaluates, so an expression with the wrong numbers that also divides
   by zero or misses the target is invalid number use: the constraint violation is what the
   response got wrong first.
4. arithmetic error: the given numbers, but the expression divides by zero.
5. wrong target: the given numbers, evaluates, but not to the target.
6. other: what fits none of these; here the answers over the verifier's length bound
   (MAX_EXPRESSION_CHARS), refused unparsed, so whether they are arithmetic is unknown.
"""

from __future__ import annotations

from collections import Counter
from typing import Iterable

from src.task import countdown
from src.task.countdown import Verdict

FORMAT_ERROR = "format_error"
WRONG_TARGET = "wrong_target"
INVALID_NUMBER_USE = "invalid_number_use"
ARITHMETIC_ERROR = "arithmetic_error"
REPETITIVE_OR_INCOHERENT = "repetitive_or_incoherent"
OTHER = "other"
CATEGORIES = (FORMAT_ERROR, WRONG_TARGET, INVALID_NUMBER_USE, ARITHMETIC_ERROR, REPETITIVE_OR_INCOHERENT, OTHER)
LABELS = {FORMAT_ERROR: "format error", WRONG_TARGET: "wrong target", INVALID_NUMBER_USE: "invalid number use",
          ARITHMETIC_ERROR: "arithmetic error", REPETITIVE_OR_INCOHERENT: "repetitive or incoherent", OTHER: "other"}

# A Countdown solution states each step once ("98 - 54 = 44, 34 - 6 = 28, ..."), so the same five
# words three times over is a loop, while short phrases ("= 44,") may legitimately recur.
LOOP_WORDS = 5
LOOP_REPEATS = 3

_BY_REASON = {
    countdown.REASON_NO_ANSWER: FORMAT_ERROR,
    countdown.REASON_EMPTY_ANSWER: FORMAT_ERROR,
    countdown.REASON_MALFORMED: FORMAT_ERROR,
    countdown.REASON_WRONG_NUMBERS: INVALID_NUMBER_USE,
    countdown.REASON_DIVISION_BY_ZERO: ARITHMETIC_ERROR,
    countdown.REASON_WRONG_VALUE: WRONG_TARGET,
    countdown.REASON_TOO_LONG: OTHER,
}


def has_loop(text: str, words: int = LOOP_WORDS, repeats: int = LOOP_REPEATS) -> bool:
    """True when some run of `words` consecutive whitespace-separated words occurs `repeats` times or more."""
    tokens = text.split()
    counts = Counter(tuple(tokens[i : i + words]) for i in range(len(tokens) - words + 1))
    return any(count >= repeats for count in counts.values())


def instability(response: str) -> str | None:
    """Which global instability the response shows (a short reason), or None for a single clean attempt."""
    if response.count(countdown.ANSWER_OPEN) > 1:
        return "several answer tags"
    if response.count("</think>") > 1:
        return "reasoning restarted"
    end = response.rfind(countdown.ANSWER_CLOSE)
    if end >= 0 and response[end + len(countdown.ANSWER_CLOSE) :].strip():
        return "text after the final answer"
    if not response.isascii():
        return "non-ASCII text"
    if has_loop(response):
        return "repetition loop"
    return None


def classify_failure(response: str, verdict: Verdict) -> str:
    """The dominant failure category of a failed rollout (reward < 1.0); see the module docstring for the order."""
    if verdict.reward >= countdown.REWARD_CORRECT:
        raise ValueError("classify_failure takes failed rollouts only (reward < 1.0)")
    if instability(response) is not None:
        return REPETITIVE_OR_INCOHERENT
    return _BY_REASON.get(verdict.reason, OTHER)


def category_counts(categories: Iterable[str | None]) -> dict[str, int]:
    """Count per category (every category present, 0 when absent); None entries (successes) are skipped."""
    counts = Counter(c for c in categories if c is not None)
    unknown = set(counts) - set(CATEGORIES)
    if unknown:
        raise ValueError(f"unknown failure categories {sorted(unknown)}; valid: {', '.join(CATEGORIES)}")
    return {category: counts.get(category, 0) for category in CATEGORIES}
