"""Failure taxonomy (seed 004 appendix B.4): the verifier's reasons and one dominant category per failure."""

import pytest

from src.eval import failures
from src.eval.failures import (ARITHMETIC_ERROR, CATEGORIES, FORMAT_ERROR, INVALID_NUMBER_USE, OTHER,
                               REPETITIVE_OR_INCOHERENT, WRONG_TARGET, category_counts, classify_failure, has_loop)
from src.task import countdown
from src.task.countdown import MAX_EXPRESSION_CHARS, verify

NUMBERS, TARGET = (44, 19, 35), 98  # 44 + 19 + 35 = 98


@pytest.mark.parametrize("response, reward, reason, expression, value", [
    (" 44 + 19 = 63 </think> <answer> 44 + 19 + 35 </answer>", 1.0, "correct", "44 + 19 + 35", 98),
    ("44 + 19 = 63, no answer given", 0.0, "no_answer", None, None),
    ("<answer>   </answer>", 0.0, "empty_answer", "", None),
    ("<answer> 44 plus 19 plus 35 </answer>", 0.0, "malformed", "44 plus 19 plus 35", None),
    ("<answer>" + "1+" * 200 + "1</answer>", 0.0, "too_long", "1+" * 200 + "1", None),
    ("<answer> 44 + 19 + 35 + 1 </answer>", 0.1, "wrong_numbers", "44 + 19 + 35 + 1", None),
    ("<answer> 44 / (35 - 35) + 19 </answer>", 0.1, "wrong_numbers", "44 / (35 - 35) + 19", None),
    ("<answer> 44 / (19 - 19 * 1) </answer>", 0.1, "wrong_numbers", "44 / (19 - 19 * 1)", None),
    ("<answer> 44 - 19 + 35 </answer>", 0.1, "wrong_value", "44 - 19 + 35", 60),
])
def test_verify_reason_agrees_with_score(response, reward, reason, expression, value):
    verdict = verify(response, NUMBERS, TARGET)
    assert (verdict.reward, verdict.reason, verdict.expression) == (reward, reason, expression)
    assert verdict.value == value
    assert countdown.score(response, NUMBERS, TARGET) == reward  # the score API is the verdict's reward


def test_division_by_zero_with_the_given_numbers():
    # (4 - 4) can only come from the numbers themselves: 4 / (4 - 4) uses [4, 4, 4] exactly once each.
    verdict = verify("<answer> 4 / (4 - 4) </answer>", (4, 4, 4), 1)
    assert (verdict.reward, verdict.reason, verdict.value) == (0.1, "division_by_zero", None)
    assert classify_failure("<answer> 4 / (4 - 4) </answer>", verdict) == ARITHMETIC_ERROR


def category(response, numbers=NUMBERS, target=TARGET):
    return classify_failure(response, verify(response, numbers, target))


@pytest.mark.parametrize("response, expected", [
    # one clean issue each
    (" 44 + 19 = 63 </think> no answer tags at all", FORMAT_ERROR),
    (" 44 + 19 = 63 </think> <answer> </answer>", FORMAT_ERROR),
    (" 44 + 19 = 63 </think> <answer> print(44 + 19 + 35) </answer>", FORMAT_ERROR),
    (" 44 + 19 = 63 </think> <answer> 44 + 19 + 35 = 98 </answer>", FORMAT_ERROR),  # '=' is not an operator
    (" 44 - 19 = 25 </think> <answer> 44 - 19 + 35 </answer>", WRONG_TARGET),  # 60, numbers right
    (" 44 + 44 = 88 </think> <answer> 44 + 44 + 10 </answer>", INVALID_NUMBER_USE),  # reuse + constant
    (" 44 + 19 = 63 </think> <answer> 44 + 19 </answer>", INVALID_NUMBER_USE),  # omits 35
    (" </think> <answer>" + "1+" * 200 + "1</answer>", OTHER),  # over the verifier's length bound
    (" ok </think> <answer> 44 </answer> <answer> 44 + 19 + 35 + 1 </answer>", REPETITIVE_OR_INCOHERENT),
])
def test_single_issue_categories(response, expected):
    assert category(response) == expected


def test_arithmetic_error_category():
    assert category(" </think> <answer> 6 / (3 - 3) </answer>", (6, 3, 3), 2) == ARITHMETIC_ERROR


@pytest.mark.parametrize("response, expected, why", [
    # Repeated answer tags AND a wrong value: the global instability dominates (the appendix's example).
    (" 44 - 19 = 25 </think> <answer> 44 - 19 + 35 </answer> <answer> 44 - 19 + 35 </answer>",
     REPETITIVE_OR_INCOHERENT, "repeated answer tags beat wrong target"),
    # Two different final answers, the last one with wrong numbers: inconsistent answers, not number use.
    (" </think> <answer> 44 + 19 + 35 </answer> wait <answer> 44 + 54 </answer>",
     REPETITIVE_OR_INCOHERENT, "inconsistent final answers beat invalid number use"),
    # A loop that ran out of tokens before any answer tag: the loop, not the missing tag.
    (" 44 + 19 = 63, let me check again, 44 + 19 = 63, let me check again, 44 + 19 = 63, let me check again",
     REPETITIVE_OR_INCOHERENT, "repetition loop beats missing answer"),
    # Reasoning reopened after it was closed, then a wrong target.
    (" 44 - 19 = 25 </think> hmm </think> <answer> 44 - 19 + 35 </answer>",
     REPETITIVE_OR_INCOHERENT, "restarted reasoning beats wrong target"),
    # Corrupted multilingual fragment in the reasoning, answer with wrong numbers.
    (" 44 + 19 = 63 \u8ba1\u7b97 </think> <answer> 44 + 19 </answer>",
     REPETITIVE_OR_INCOHERENT, "corrupted text beats invalid number use"),
    # Wrong numbers AND a division by zero: the verifier rejects the numbers before evaluating.
    (" </think> <answer> 44 / (35 - 35) + 19 </answer>", INVALID_NUMBER_USE,
     "invalid number use beats arithmetic error"),
    # Wrong numbers AND the wrong value: the number-use violation is the dominant one.
    (" </think> <answer> 44 + 19 + 1 </answer>", INVALID_NUMBER_USE, "invalid number use beats wrong target"),
    # Unparseable answer after a clean reasoning with repeated short phrases (no 5-word loop): format.
    (" 44 + 19 = 63, 63 + 35 = 98, = 98, = 98 </think> <answer> 44 + + 19 </answer>", FORMAT_ERROR,
     "short repeated phrases are no loop"),
])
def test_multi_issue_cases_take_the_dominant_failure(response, expected, why):
    assert category(response) == expected, why


def test_correct_rollouts_are_not_classified():
    with pytest.raises(ValueError, match="failed rollouts only"):
        category(" </think> <answer> 44 + 19 + 35 </answer>")


def test_loop_detector_threshold():
    phrase = "let me check it again"
    assert not has_loop(" ".join([phrase] * 2))  # twice is not yet a loop
    assert has_loop(" ".join([phrase] * 3))
    assert not has_loop("98 - 54 = 44, 34 - 6 = 28, 44 + 28 = 72")
    assert failures.instability(" 1 + 2 = 3 </think> <answer> 1 + 2 </answer>") is None


def test_category_counts():
    counts = category_counts([FORMAT_ERROR, None, WRONG_TARGET, FORMAT_ERROR, None])
    assert counts == {**{c: 0 for c in CATEGORIES}, FORMAT_ERROR: 2, WRONG_TARGET: 1}
    with pytest.raises(ValueError, match="unknown failure categories"):
        category_counts(["typo"])


def test_length_bound_is_the_verifiers():
    assert len("1+" * 200 + "1") > MAX_EXPRESSION_CHARS
