"""Failure taxonomy (seed 004, appendix B.4; SPEC 10): one dominant category per failed rollout.

A rollout fails when its verifier score is below 1.0. Each failure gets exactly one category,
decided from the response text and the verifier's `Verdict` (its reason and extracted answer),
never by re-parsing the answer. Descriptive only: nothing here feeds the reward or any training
decision.

The appendix's rule for rollouts with several issues is "the dominant failure", with global
generation failures (repeated output, corrupted text) assigned before the local labels. This
module reads that as a fixed order of checks:

1. repetitive or incoherent: the completion is unstable as a whole (`instability`):
   - a complete answer span and more answer tags besides it (repeated answer tags, or several
     inconsistent final answers; an `<answer>` never closed before the final answer counts too),
   - more than one `</think>` (the reasoning restarted after it was closed),
   - text after the last `</answer>` (reasoning continued after the final answer),
   - and, read outside the final answer span: a loop (`has_loop`: the same clause, line or equation
     again and again with nothing new between), irrelevant code or markup, corrupted or
     multilingual fragments (letters of a non-Latin script, U+FFFD, control characters), or text
     that no longer follows the task (a new conversation turn, a chat special token).
   Mathematical symbols (x, -, /, LaTeX) are neither: they are how reasoning writes arithmetic.
   A loop that ran into the token budget before closing its answer is a repetition failure, not a
   format error: the missing tag is a symptom of the loop.
2. format error: no usable final answer: no complete answer span (missing or malformed tags),
   an empty one, or one the verifier cannot parse, whatever its characters (words, code, markup,
   `=`, unary signs, `×`, `÷`, `−`, `\\times`).
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

import re
import unicodedata
from typing import Hashable, Iterable, Sequence

from src.task import countdown_verdict as countdown
from src.task.countdown_verdict import Verdict
from src.task.failures import OTHER, REPETITIVE_OR_INCOHERENT, category_counts as _counts, taxonomy

FORMAT_ERROR = "format_error"
WRONG_TARGET = "wrong_target"
INVALID_NUMBER_USE = "invalid_number_use"
ARITHMETIC_ERROR = "arithmetic_error"
CATEGORIES, LABELS = taxonomy({FORMAT_ERROR: "format error", WRONG_TARGET: "wrong target",
                                INVALID_NUMBER_USE: "invalid number use", ARITHMETIC_ERROR: "arithmetic error"})

# A loop repeats text without adding anything: some block (one or more clauses, or a run of words) occurs
# LOOP_REPEATS times in a row. Trial and error repeats a lead phrase ("let me try") or a first step with
# new numbers after it, so the blocks differ and it is no loop. A block must cover LOOP_MIN_WORDS words in
# all, so a list of equal numbers ("4, 4, 4") is not one. In an unpunctuated run only words with a letter
# count (up to LOOP_RUN_PERIOD words a block), so arithmetic such as "4 + 4 + 4 + 4" never makes a loop.
LOOP_REPEATS = 3
LOOP_MIN_WORDS = 6
LOOP_RUN_PERIOD = 32
# A clause with no digit and at most this many words ("ok", "wait", "let me check") adds nothing between
# two equal clauses: "44 + 19 = 63. Hmm. 44 + 19 = 63. Right. 44 + 19 = 63" is a loop.
FILLER_WORDS = 3

_CLAUSES = re.compile(r"\n|[.,;:!?](?=\s|$)|<[^<>\n]{1,40}>")  # tags end a clause too
_WORD_EDGES = re.compile(r"^[^\w+\-*/=()]+|[^\w+\-*/=()]+$")
_CODE = re.compile(r"```|\bdef\s+\w+\s*\(|\bprint\s*\(|\blambda\b[^:\n]*:|\bfor\s+\w+\s+in\s+range\s*\("
                   r"|\b(?:console\.log|System\.out\.println|printf|eval)\s*\(|#include\s*<"
                   r"|^\s*import\s+[\w.]+\s*$|^\s*from\s+[\w.]+\s+import\b", re.MULTILINE)
_MARKUP_TAGS = ("a|b|i|u|p|br|hr|em|strong|code|pre|div|span|html|head|body|title|table|tr|td|th|ul|ol|li|"
                "h[1-6]|img|script|style|math|sup|sub|tex|latex|xml|svg|section|article|blockquote|details")
_MARKUP = re.compile(rf"</?(?:{_MARKUP_TAGS})(?:\s[^<>]*)?/?>", re.IGNORECASE)
_TURN = re.compile(r"^\s*(?:user|human|assistant|system)\s*:|<\|[\w-]{1,40}\|>", re.IGNORECASE | re.MULTILINE)
# Letter-like characters of mathematics (Letterlike Symbols, Mathematical Alphanumeric Symbols) are no script.
_MATH_LETTERS = ((0x2100, 0x214F), (0x1D400, 0x1D7FF))


def _tandem(sequence: Sequence[Hashable], weights: Sequence[int], periods: Iterable[int], repeats: int,
            min_weight: int) -> bool:
    """True when some block of `p` consecutive items (p in `periods`) occurs `repeats` times in a row and
    its `repeats` copies weigh `min_weight` or more (a weight per item, e.g. its words).

    A block of period p repeats when sequence[i] == sequence[i + p] for (repeats - 1) * p consecutive i,
    so one pass per period finds it: linear in the length for each period.
    """
    n = len(sequence)
    for period in periods:
        if period * repeats > n:
            break
        run = 0
        for i in range(n - period):
            run = run + 1 if sequence[i] == sequence[i + period] else 0
            if run >= (repeats - 1) * period:  # items i - (repeats-1)p + 1 .. i + p: `repeats` equal blocks
                start = i - (repeats - 1) * period + 1
                if sum(weights[start : start + repeats * period]) >= min_weight:
                    return True
    return False


def _clauses(text: str) -> list[str]:
    """Lines and clauses (split at newlines, tags, and . , ; : ! ? before a space), lower-cased, spaces collapsed."""
    return [" ".join(part.lower().split()) for part in _CLAUSES.split(text) if part.strip()]


def _is_filler(clause: str) -> bool:
    return not any(char.isdigit() for char in clause) and len(clause.split()) <= FILLER_WORDS


def has_loop(text: str, repeats: int = LOOP_REPEATS) -> bool:
    """True when the text repeats itself with no new content: a block of clauses, lines or equations that
    occurs `repeats` times in a row (fillers between them ignored), or an unpunctuated run of words that does.
    """
    clauses = _clauses(text)
    for sequence in (clauses, [c for c in clauses if not _is_filler(c)]):
        if _tandem(sequence, [len(c.split()) for c in sequence], range(1, len(sequence) // repeats + 1), repeats,
                   LOOP_MIN_WORDS):
            return True
    words = [word for word in (_WORD_EDGES.sub("", w.lower()) for w in text.split()) if word]
    lettered = [int(any(char.isalpha() for char in word)) for word in words]
    return _tandem(words, lettered, range(1, LOOP_RUN_PERIOD + 1), repeats, LOOP_MIN_WORDS)


def foreign_characters(text: str) -> str:
    """The characters of `text` that are corrupted or from another language: letters of a script other than
    Latin or Greek, U+FFFD, control, private-use or unassigned code points. Mathematical symbols (× ÷ − ≠ √),
    punctuation, superscripts and letter-like math symbols are none of these."""
    found = []
    for char in text:
        if char.isascii() and (char.isprintable() or char in "\t\n\r"):
            continue
        category = unicodedata.category(char)
        if category in ("Cc", "Co", "Cn", "Cs") and char not in "\t\n\r" or char == "\ufffd":
            found.append(char)
        elif category.startswith("L") and not any(low <= ord(char) <= high for low, high in _MATH_LETTERS):
            if not unicodedata.name(char, "").startswith(("LATIN", "GREEK", "MICRO SIGN", "MODIFIER LETTER")):
                found.append(char)
    return "".join(found)


def _outside_final_answer(response: str) -> str:
    """The response without the content of its last complete answer span (what the verifier parsed)."""
    end = response.rfind(countdown.ANSWER_CLOSE)
    start = response.rfind(countdown.ANSWER_OPEN, 0, end) if end >= 0 else -1
    if start < 0:
        return response
    return response[: start + len(countdown.ANSWER_OPEN)] + " " + response[end:]


def answer_spans(response: str) -> int:
    """Complete `<answer>...</answer>` spans, left to right (an `<answer>` never closed is a malformed tag)."""
    count, position = 0, 0
    while (start := response.find(countdown.ANSWER_OPEN, position)) >= 0:
        end = response.find(countdown.ANSWER_CLOSE, start + len(countdown.ANSWER_OPEN))
        if end < 0:
            break
        count, position = count + 1, end + len(countdown.ANSWER_CLOSE)
    return count


def instability(response: str) -> str | None:
    """Which global instability the response shows (a short reason), or None for a single clean attempt."""
    tags = response.count(countdown.ANSWER_OPEN) + response.count(countdown.ANSWER_CLOSE)
    if answer_spans(response) and tags > 2:  # with no complete span, stray tags are malformed ones (format)
        return "repeated answer tags"
    if response.count("</think>") > 1:
        return "reasoning restarted"
    end = response.rfind(countdown.ANSWER_CLOSE)
    if end >= 0 and response[end + len(countdown.ANSWER_CLOSE) :].strip():
        return "text after the final answer"
    outside = _outside_final_answer(response)
    if _TURN.search(outside):
        return "left the task (a new turn or a chat token)"
    if foreign_characters(outside):
        return "corrupted or multilingual text"
    if _CODE.search(outside) or _MARKUP.search(outside):
        return "code or markup outside the answer"
    if has_loop(outside):
        return "repetition loop"
    return None


_BY_REASON = {
    countdown.REASON_NO_ANSWER: FORMAT_ERROR,
    countdown.REASON_EMPTY_ANSWER: FORMAT_ERROR,
    countdown.REASON_MALFORMED: FORMAT_ERROR,
    countdown.REASON_WRONG_NUMBERS: INVALID_NUMBER_USE,
    countdown.REASON_DIVISION_BY_ZERO: ARITHMETIC_ERROR,
    countdown.REASON_WRONG_VALUE: WRONG_TARGET,
    countdown.REASON_TOO_LONG: OTHER,
}


def classify_failure(response: str, verdict: Verdict) -> str:
    """The dominant failure category of a failed rollout (reward < 1.0); see the module docstring for the order."""
    if verdict.reward >= countdown.REWARD_CORRECT:
        raise ValueError("classify_failure takes failed rollouts only (reward < 1.0)")
    if instability(response) is not None:
        return REPETITIVE_OR_INCOHERENT
    return _BY_REASON.get(verdict.reason, OTHER)


def category_counts(categories: Iterable[str | None]) -> dict[str, int]:
    """Count per Countdown category (every category present, 0 when absent); None entries (successes) are skipped."""
    return _counts(categories, CATEGORIES)
