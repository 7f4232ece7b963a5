"""Pass@k estimators, t half-widths and the answer unique rate (SPEC 7) against hand-worked numbers."""

import itertools
import math

import pytest

from src.passk import answer_unique_rate, first_k_pass_at_k, t_half_width, unbiased_pass_at_k
from src.task.countdown import extract_answer

T, F = True, False


# --------------------------------------------------------------------------- first-k rule


def test_first_k_rule_on_constructed_list():
    correct = [F, F, T, F]
    assert [first_k_pass_at_k(correct, k) for k in (1, 2, 3, 4)] == [0.0, 0.0, 1.0, 1.0]


def test_first_k_order_matters_unlike_unbiased():
    early, late = [T, F, F, F], [F, F, F, T]
    assert first_k_pass_at_k(early, 1) == 1.0
    assert first_k_pass_at_k(late, 1) == 0.0
    # The unbiased estimator sees only (n, c), the same for both lists.
    assert unbiased_pass_at_k(4, sum(early), 1) == unbiased_pass_at_k(4, sum(late), 1) == 0.25


@pytest.mark.parametrize("k", [0, -1, 5])
def test_first_k_rejects_bad_k(k):
    with pytest.raises(ValueError, match="k must be"):
        first_k_pass_at_k([F, F, T, F], k)


# --------------------------------------------------------------------------- unbiased estimator


@pytest.mark.parametrize(
    "n, c, k, expected",
    [
        (4, 1, 1, 0.25),
        (4, 2, 2, 1 - 1 / 6),  # 1 - C(2,2)/C(4,2)
        (4, 1, 2, 0.5),  # 1 - C(3,2)/C(4,2) = 1 - 3/6
        (5, 0, 1, 0.0),
        (5, 0, 5, 0.0),
        (5, 3, 3, 1.0),  # n - c = 2 < k
        (5, 5, 1, 1.0),
        (8, 4, 4, 1 - 1 / 70),  # 1 - C(4,4)/C(8,4)
    ],
)
def test_unbiased_hand_values(n, c, k, expected):
    assert unbiased_pass_at_k(n, c, k) == pytest.approx(expected, abs=1e-12)


def test_unbiased_equals_brute_force_over_all_subsets():
    # Samples 0..c-1 are the correct ones; pass@k is the share of k-subsets containing one.
    for n in range(1, 9):
        for c in range(n + 1):
            for k in range(1, n + 1):
                subsets = list(itertools.combinations(range(n), k))
                brute = sum(any(i < c for i in s) for s in subsets) / len(subsets)
                assert unbiased_pass_at_k(n, c, k) == pytest.approx(brute, abs=1e-12), (n, c, k)


def test_unbiased_stable_at_n_1024():
    n = 1024
    for c in (0, 1, 7, 100, 512, 1000, 1024):
        values = [unbiased_pass_at_k(n, c, k) for k in range(1, n + 1)]
        assert all(math.isfinite(v) and 0.0 <= v <= 1.0 for v in values)
        assert all(b >= a - 1e-12 for a, b in zip(values, values[1:])), c  # monotone in k
        # Exact big-integer binomials agree (Python ints do not overflow; the estimator avoids them).
        for k in (1, 16, 64, 512):
            exact = 1 - math.comb(n - c, k) / math.comb(n, k)
            assert unbiased_pass_at_k(n, c, k) == pytest.approx(exact, rel=1e-9, abs=1e-12), (c, k)


@pytest.mark.parametrize("n, c, k", [(4, 5, 1), (4, 1, 5), (-1, 0, 1), (4, -1, 1), (4, 1, -1), (4, 1, 0)])
def test_unbiased_rejects_bad_arguments(n, c, k):
    with pytest.raises(ValueError):
        unbiased_pass_at_k(n, c, k)


# --------------------------------------------------------------------------- t half-width


def test_t_half_width_hand_worked():
    # sd(ddof=1) = 0.1581, t_{0.975,4} = 2.776, sqrt(5) = 2.236 -> 2.776 * 0.1581 / 2.236 = 0.1963
    assert t_half_width([0.5, 0.6, 0.7, 0.8, 0.9]) == pytest.approx(0.1963, abs=1e-4)


def test_t_half_width_degenerate_cases():
    assert math.isnan(t_half_width([0.7]))
    assert math.isnan(t_half_width([]))
    assert t_half_width([0.4, 0.4, 0.4]) == pytest.approx(0.0, abs=1e-12)  # mean 0.4 is inexact in binary


# --------------------------------------------------------------------------- answer unique rate


def test_answer_unique_rate_constructed_set():
    responses = [
        "<think>x</think><answer>1+2</answer>",
        "<answer> 1 + 2 </answer>",  # same as the first once whitespace is removed
        "<answer>2+1</answer>",  # different expression text: no algebraic canonicalisation
        "I give up",  # no answer span
        "<answer>unclosed",  # no complete span: shares the no-answer value with the one above
    ]
    # distinct values {"1+2", "2+1", ""} over 5 samples
    assert answer_unique_rate(responses, extract_answer) == pytest.approx(3 / 5)


def test_answer_unique_rate_never_answering_is_one_over_n():
    assert answer_unique_rate(["nothing"] * 4, extract_answer) == pytest.approx(1 / 4)
    # An empty span counts as no answer.
    assert answer_unique_rate(["nothing", "<answer>  </answer>"], extract_answer) == pytest.approx(1 / 2)


def test_answer_unique_rate_all_distinct_and_empty_input():
    assert answer_unique_rate([f"<answer>{i}</answer>" for i in range(3)], extract_answer) == 1.0
    with pytest.raises(ValueError):
        answer_unique_rate([], extract_answer)
