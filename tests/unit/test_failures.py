"""Failure taxonomy (seed 004 appendix B.4): the verifier's reasons and one dominant category per failure."""

import pytest

from src.task import countdown_failures as failures
from src.task.countdown_failures import (ARITHMETIC_ERROR, CATEGORIES, FORMAT_ERROR, INVALID_NUMBER_USE, OTHER,
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


# Every example phrase of seed 004 appendix B.4, by category: each must label at least one row of CASES.
B4_PHRASES = {
    FORMAT_ERROR: ("missing <answer> tags", "malformed answer tags", "empty answer fields",
                   "non-arithmetic text inside the answer field",
                   "code-like output instead of a mathematical expression",
                   "an expression that cannot be parsed by the verifier"),
    WRONG_TARGET: ("evaluate to 60 when the target is 98",),
    INVALID_NUMBER_USE: ("reusing a number more times than allowed", "omitting a required number",
                         "introducing an extra constant", "using a modified number"),
    ARITHMETIC_ERROR: ("division by zero",),
    REPETITIVE_OR_INCOHERENT: ("repeated answer tags", "repeated verification loops",
                               "multiple inconsistent final answers",
                               "continued reasoning after a final answer", "irrelevant code or markup",
                               "corrupted multilingual fragments", "text that no longer follows the task"),
    OTHER: ("unusual parser edge cases",),
}
N, T = NUMBERS, TARGET
LOOP = "Let me verify: 44 + 19 = 63, 63 + 35 = 98. "

# Hand-labelled responses: (response, numbers, target, expected category, the B.4 phrase or the case it shows).
CASES = [
    # format error: no usable final answer, whatever characters the answer holds
    (" 44 + 19 = 63, 63 + 35 = 98 </think> The answer is 44 + 19 + 35.", N, T, FORMAT_ERROR,
     "missing <answer> tags"),
    (" 44 + 19 = 63, 63 + 35 = 98 </think> <answer> 44 + 19", N, T, FORMAT_ERROR, "missing <answer> tags"),
    (" </think> <answer> 44 + 19 + 35 <answer>", N, T, FORMAT_ERROR, "malformed answer tags"),
    (" </think> <answer> 44 + 19 + 35 </answr>", N, T, FORMAT_ERROR, "malformed answer tags"),
    (" </think> <Answer> 44 + 19 + 35 </Answer>", N, T, FORMAT_ERROR, "malformed answer tags"),
    (" </think> answer> 44 + 19 + 35 </answer>", N, T, FORMAT_ERROR, "malformed answer tags"),
    (" 44 + 19 = 63 </think> <answer> </answer>", N, T, FORMAT_ERROR, "empty answer fields"),
    (" </think> <answer> forty-four plus nineteen plus thirty-five </answer>", N, T, FORMAT_ERROR,
     "non-arithmetic text inside the answer field"),
    (" </think> <answer> print(44 + 19 + 35) </answer>", N, T, FORMAT_ERROR,
     "code-like output instead of a mathematical expression"),
    (" </think> <answer> sum([44, 19, 35]) </answer>", N, T, FORMAT_ERROR,
     "code-like output instead of a mathematical expression"),
    (" </think> <answer> <b>44 + 19 + 35</b> </answer>", N, T, FORMAT_ERROR, "markup as the answer"),
    (" 44 + 19 = 63 </think> <answer> 44 + 19 + 35 = 98 </answer>", N, T, FORMAT_ERROR,
     "an expression that cannot be parsed by the verifier"),
    (" 3 × 4 = 12, 12 + 2 = 14 </think> <answer> (3 × 4) + 2 </answer>", (3, 4, 2), 14, FORMAT_ERROR,
     "× in the answer, not corrupted text"),
    (" 44 − 19 = 25, 25 + 35 = 60 </think> <answer> 44 − 19 + 35 </answer>", N, 60, FORMAT_ERROR,
     "a Unicode minus in the answer"),
    (" 8 ÷ 4 = 2 </think> <answer> 8 ÷ 4 + 5 </answer>", (8, 4, 5), 7, FORMAT_ERROR, "÷ in the answer"),
    (" </think> <answer> 3 \\times 4 + 2 </answer>", (3, 4, 2), 14, FORMAT_ERROR, "LaTeX \\times in the answer"),
    (" </think> <answer> \\frac{6}{3} + 2 </answer>", (6, 3, 2), 4, FORMAT_ERROR, "LaTeX \\frac in the answer"),
    (" </think> <answer> -19 + 44 + 35 </answer>", N, 60, FORMAT_ERROR, "a unary sign"),
    (" </think> <answer> (44 + 19 + 35 </answer>", N, T, FORMAT_ERROR, "unbalanced parentheses"),
    (" 44 + 19 = 63, 63 + 35 = 98, = 98 </think> <answer> 44 + + 19 </answer>", N, T, FORMAT_ERROR,
     "a phrase twice is no loop"),
    # wrong target: the given numbers, a value that is not the target; trial and error is no loop
    (" 44 - 19 = 25, 25 + 35 = 60 </think> <answer> 44 - 19 + 35 </answer>", N, T, WRONG_TARGET,
     "evaluate to 60 when the target is 98"),
    (" Let me try 44 + 19 = 63, no. Let me try 44 - 19 = 25, no. Let me try 35 - 19 = 16, no. Let me try "
     "44 + 35 = 79, no. </think> <answer> 44 + 35 - 19 </answer>", N, T, WRONG_TARGET,
     "trial and error repeating a lead phrase with new numbers"),
    (" 44 + 19 = 63, which is not 98. 44 - 19 = 25, which is not 98. 35 - 19 = 16, which is not 98. </think> "
     "<answer> 35 - 19 + 44 </answer>", N, T, WRONG_TARGET, "a recurring verdict after new attempts"),
    (" 44 + 19 = 63, 63 - 35 = 28. 44 + 19 = 63, 63 * 35 = 2205. 44 + 19 = 63, 63 / 35 = 1.8. </think> "
     "<answer> (44 + 19) / 35 </answer>", N, T, WRONG_TARGET, "one first step with three different second steps"),
    (" 44 × 2 = 88 is too big; 44 − 19 = 25, then 25 + 35 = 60 </think> <answer> 44 - 19 + 35 </answer>", N, T,
     WRONG_TARGET, "math symbols in the reasoning"),
    (" we need Δ = 98 - 44 = 54 and 35 + 19 = 54, but I wrote 44 - 19 = 25 </think> <answer> 44 - 19 + 35 </answer>",
     N, T, WRONG_TARGET, "a Greek letter in the reasoning"),
    (" the numbers are 4, 4, 4. 4 + 4 + 4 = 12 </think> <answer> 4 + 4 + 4 </answer>", (4, 4, 4), 4, WRONG_TARGET,
     "equal numbers listed are no loop"),
    # invalid number use: parseable, not the given multiset
    (" </think> <answer> 44 + 19 + 35 + 19 </answer>", N, T, INVALID_NUMBER_USE,
     "reusing a number more times than allowed"),
    (" 44 + 19 = 63 </think> <answer> 44 + 19 </answer>", N, T, INVALID_NUMBER_USE, "omitting a required number"),
    (" </think> <answer> 44 + 19 + 35 * 1 </answer>", N, T, INVALID_NUMBER_USE, "introducing an extra constant"),
    (" 19 + 35 = 54 </think> <answer> 44 + 54 </answer>", N, T, INVALID_NUMBER_USE, "using a modified number"),
    (" </think> <answer> 4419 - 35 </answer>", N, T, INVALID_NUMBER_USE, "using a modified number"),
    (" </think> <answer> 44 / (35 - 35) + 19 </answer>", N, T, INVALID_NUMBER_USE,
     "wrong numbers beat division by zero (checked first)"),
    (" </think> <answer> 44 + 19 + 1 </answer>", N, T, INVALID_NUMBER_USE, "wrong numbers beat a wrong value"),
    # arithmetic error: the given numbers, but undefined
    (" </think> <answer> 4 / (4 - 4) </answer>", (4, 4, 4), 1, ARITHMETIC_ERROR, "division by zero"),
    (" 3 - 3 = 0 </think> <answer> 6 / (3 - 3) </answer>", (6, 3, 3), 2, ARITHMETIC_ERROR, "division by zero"),
    # repetitive or incoherent: global instability, before every local label
    (" 44 - 19 = 25 </think> <answer> 44 - 19 + 35 </answer> <answer> 44 - 19 + 35 </answer>", N, T,
     REPETITIVE_OR_INCOHERENT, "repeated answer tags"),
    (" 44 + 19 = 63, 63 + 35 = 98. " + LOOP * 3 + "Let me verify: 44", N, T, REPETITIVE_OR_INCOHERENT,
     "repeated verification loops"),
    (" " + LOOP * 3 + "</think> <answer> 44 + 19 + 35 * 1 </answer>", N, T, REPETITIVE_OR_INCOHERENT,
     "repeated verification loops"),
    (" </think> <answer> 44 + 19 + 35 </answer> wait <answer> 44 + 54 </answer>", N, T, REPETITIVE_OR_INCOHERENT,
     "multiple inconsistent final answers"),
    (" 44 + 19 = 63 <answer> 44 + 19 </think>\n<answer> 44 + 19 + 35 * 1 </answer>", N, T, REPETITIVE_OR_INCOHERENT,
     "multiple inconsistent final answers (the first never closed)"),
    (" 44 - 19 = 25 </think> <answer> 44 - 19 + 35 </answer> Hmm, that gives 60, not 98. Let me try again", N, T,
     REPETITIVE_OR_INCOHERENT, "continued reasoning after a final answer"),
    (" ```python\nprint(44 + 19 + 35)\n``` </think> <answer> 44 + 19 + 34 </answer>", N, T,
     REPETITIVE_OR_INCOHERENT, "irrelevant code or markup"),
    (" def solve(nums):\n    return sum(nums)\n</think> <answer> 44 − 19 + 35 </answer>", N, T,
     REPETITIVE_OR_INCOHERENT, "irrelevant code or markup"),
    (" <div>44 + 19 = 63</div> </think> <answer> 44 + 19 </answer>", N, T, REPETITIVE_OR_INCOHERENT,
     "irrelevant code or markup"),
    (" 44 + 19 = 63 \u8ba1\u7b97 </think> <answer> 44 + 19 </answer>", N, T, REPETITIVE_OR_INCOHERENT,
     "corrupted multilingual fragments"),
    (" 44 + 19 = 63, \u043f\u0440\u043e\u0432\u0435\u0440\u043a\u0430 </think> <answer> 44 - 19 + 35 </answer>",
     N, T, REPETITIVE_OR_INCOHERENT, "corrupted multilingual fragments"),
    (" 44 + 19 = 63 \ufffd\ufffd </think> <answer> 44 - 19 + 35 </answer>", N, T, REPETITIVE_OR_INCOHERENT,
     "corrupted multilingual fragments"),
    (" 44 - 19 = 25\nUser: Using the numbers [1, 2, 3], create an equation that equals 6.\nAssistant: </think> "
     "<answer> 44 - 19 + 35 </answer>", N, T, REPETITIVE_OR_INCOHERENT, "text that no longer follows the task"),
    (" 44 + 19 = 63 <|im_end|><|im_start|>user </think> <answer> 44 + 19 </answer>", N, T,
     REPETITIVE_OR_INCOHERENT, "text that no longer follows the task"),
    (" 44 - 19 = 25 </think> hmm </think> <answer> 44 - 19 + 35 </answer>", N, T, REPETITIVE_OR_INCOHERENT,
     "reasoning restarted after it was closed"),
    (" I need to find a combination.\nI need to find a combination.\nI need to find a combination.\nI need", N, T,
     REPETITIVE_OR_INCOHERENT, "the same line again and again"),
    (" 44 + 19 = 63. Hmm. 44 + 19 = 63. Right. 44 + 19 = 63. </think> <answer> 44 + 19 </answer>", N, T,
     REPETITIVE_OR_INCOHERENT, "the same equation again and again, fillers between"),
    (" 44 + 19 = 63, 44 + 19 = 63, 44 + 19 = 63 </think> <answer> 44 × 19 </answer>", N, T,
     REPETITIVE_OR_INCOHERENT, "a loop beats an unparseable answer"),
    (" let me check let me check let me check let me check", N, T, REPETITIVE_OR_INCOHERENT,
     "an unpunctuated loop that ran out of tokens"),
    # other: refused unparsed, so neither format nor arithmetic can be told
    (" </think> <answer>" + "1+" * 200 + "1</answer>", N, T, OTHER, "unusual parser edge cases"),
    (" </think> <answer> " + "44 + 19 + 35 " * 30 + "</answer>", N, T, OTHER,
     "unusual parser edge cases (a loop inside the answer is the answer's, not the reasoning's)"),
]


def test_the_table_is_large_and_covers_every_example_phrase_of_b4():
    assert len(CASES) >= 40
    labelled = {(expected, why) for *_, expected, why in CASES}
    for category_, phrases in B4_PHRASES.items():
        for phrase in phrases:
            assert any(c == category_ and why.startswith(phrase) for c, why in labelled), (category_, phrase)


@pytest.mark.parametrize("response, numbers, target, expected, why", CASES, ids=[case[-1][:60] for case in CASES])
def test_hand_labelled_responses(response, numbers, target, expected, why):
    verdict = verify(response, numbers, target)
    assert verdict.reward < 1.0, "a labelled failure must fail the verifier"
    assert classify_failure(response, verdict) == expected, (why, failures.instability(response), verdict.reason)


def test_correct_rollouts_are_not_classified():
    with pytest.raises(ValueError, match="failed rollouts only"):
        category(" </think> <answer> 44 + 19 + 35 </answer>")


def test_loop_detector_threshold():
    phrase = "let me check it again,"
    assert not has_loop(" ".join([phrase] * 2))  # twice is not yet a loop
    assert has_loop(" ".join([phrase] * 3))
    assert has_loop(" ".join([phrase] * 3).replace(",", ""))  # unpunctuated too
    assert not has_loop("98 - 54 = 44, 34 - 6 = 28, 44 + 28 = 72")
    assert not has_loop("4 + 4 + 4 + 4 + 4 + 4 + 4 + 4 + 4")  # arithmetic is no run of words
    assert not has_loop("4, 4, 4, 4")  # too short a block: a list of equal numbers
    assert has_loop("wait " * 6) and not has_loop("wait " * 5)
    # Repeats separated by new content are no loop; by a filler only, they are.
    assert not has_loop("44 + 19 = 63. 44 - 19 = 25. 44 + 19 = 63. 35 - 19 = 16. 44 + 19 = 63.")
    assert has_loop("44 + 19 = 63. OK. 44 + 19 = 63. Wait. 44 + 19 = 63.")
    assert failures.instability(" 1 + 2 = 3 </think> <answer> 1 + 2 </answer>") is None


def test_foreign_characters_are_other_scripts_and_corruption_not_mathematics():
    assert failures.foreign_characters("3 × 4 − 2 ÷ 1 ≠ √9 π² … – “x” ℓ 𝑥 µ é ʼ") == ""
    assert failures.foreign_characters("ok 计算 пр م � ") == "计算прم�"


def test_instability_reads_the_final_answer_apart():
    """What the verifier parsed is judged by the verifier (format error): the same characters outside the
    final answer are an instability, inside it they are not."""
    assert failures.instability(" </think> <answer> <b>1 + 2</b> </answer>") is None
    assert failures.instability(" <b>1 + 2</b> </think> <answer> 1 + 2 </answer>") is not None
    assert failures.instability(" </think> <answer> 1 + 2 \u8ba1 </answer>") is None
    assert failures.answer_spans(" <answer> 1 <answer> 2 </answer> <answer> 3 </answer>") == 2
    assert failures.answer_spans(" <answer> 1 + 2 <answer>") == 0


def test_category_counts():
    counts = category_counts([FORMAT_ERROR, None, WRONG_TARGET, FORMAT_ERROR, None])
    assert counts == {**{c: 0 for c in CATEGORIES}, FORMAT_ERROR: 2, WRONG_TARGET: 1}
    with pytest.raises(ValueError, match="unknown failure categories"):
        category_counts(["typo"])


def test_length_bound_is_the_verifiers():
    assert len("1+" * 200 + "1") > MAX_EXPRESSION_CHARS


def test_every_task_shares_the_global_failure_and_the_catch_all_written_once():
    import src.task.failures as shared
    from src.task import countdown_failures
    from src.task.math import failures as math_failures

    for taxonomy in (countdown_failures, math_failures):
        assert taxonomy.CATEGORIES[-2:] == (shared.REPETITIVE_OR_INCOHERENT, shared.OTHER)
        assert {key: taxonomy.LABELS[key] for key in shared.SHARED_LABELS} == shared.SHARED_LABELS
