"""The math verifier (SPEC 12): extraction of the last boxed answer, the hand-checked pairs, and the bounds
(size, time, memory, threads) that keep hostile answers from hanging or crashing a run. Worst-case times
are measured by `python -m benchmarks.math_verifier`, not asserted here."""

from __future__ import annotations

import threading
from pathlib import Path

import pytest

from src.task.math import verify as v
from src.task.math.verify import MathVerifier, fast_verdict, last_boxed
from tests.math_pairs import ADVERSARIAL, EQUIVALENT, NEAR_MISSES

SENTINEL = Path("/tmp/replay_rloo_math_pwned")


@pytest.fixture(scope="module")
def verifier():
    checker = MathVerifier(timeout_s=1.0, workers=2)
    yield checker
    checker.close()


def boxed(answer: str) -> str:
    return f"Let's see. 2 + 2 = 4, so the result is \\boxed{{{answer}}}."


@pytest.mark.parametrize("response, expected", [
    ("so \\boxed{5}", "5"),
    ("\\boxed{1} then \\boxed{2}", "2"),                       # the last box
    ("\\boxed{\\frac{1}{2}}", "\\frac{1}{2}"),                 # nested braces
    ("\\boxed{\\{1, 2\\}}", "\\{1, 2\\}"),                     # escaped braces do not count
    ("\\fbox{7}", "7"),
    ("\\boxed{ 3 }", "3"),
    ("\\boxed{}", ""),
    ("no box here", None),
    ("\\boxed{\\frac{1}{2}", None),                            # unclosed: a truncated response
    ("\\boxed{1} and \\boxed{2", None),                        # the last box is unclosed
])
def test_last_boxed(response, expected):
    assert last_boxed(response) == expected


def test_last_boxed_is_linear_on_many_unclosed_boxes():
    assert last_boxed("\\boxed{" * 20000) is None


@pytest.mark.parametrize("gold, answer, expected", [
    ("12", "12", True), ("12", " 1 2 ", True), ("12", "012", True), ("-0", "0", True), ("12", "13", False),
    ("12", "-12", False), ("\\frac{1}{2}", "\\frac{1}{2}", True), ("\\frac{1}{2}", "0.5", None), ("3", "3.0", None),
])
def test_fast_verdict_decides_only_exact_cases(gold, answer, expected):
    assert fast_verdict(gold, answer) is expected


def test_equivalent_forms_score_one(verifier):
    verdicts = [verifier.verify(boxed(answer), gold) for gold, answer in EQUIVALENT]
    wrong = [(pair, verdict) for pair, verdict in zip(EQUIVALENT, verdicts) if verdict.reward != 1.0]
    assert not wrong
    assert all(verdict.reason == v.REASON_CORRECT for verdict in verdicts)


def test_near_misses_score_zero(verifier):
    verdicts = [verifier.verify(boxed(answer), gold) for gold, answer in NEAR_MISSES]
    wrong = [(pair, verdict) for pair, verdict in zip(NEAR_MISSES, verdicts) if verdict.reward != 0.0]
    assert not wrong
    assert {verdict.reason for verdict in verdicts} <= {v.REASON_WRONG, v.REASON_UNPARSEABLE}


def test_adversarial_answers_score_zero_and_run_nothing(verifier):
    SENTINEL.unlink(missing_ok=True)
    verdicts = verifier.verify_all([boxed(answer) for answer in ADVERSARIAL], "2")
    assert [verdict.reward for verdict in verdicts] == [0.0] * len(ADVERSARIAL)
    reasons = dict(zip(ADVERSARIAL, (verdict.reason for verdict in verdicts)))
    assert reasons["1" * 5000] == v.REASON_TOO_LONG
    assert reasons["9^{9^{9^{9}}}"] == v.REASON_TIMEOUT  # sympy would work on it for minutes
    assert not SENTINEL.exists()
    assert verifier.verify(boxed("\\frac{4}{2}"), "2").reward == 1.0  # the pool still works after the kills


def test_reasons_without_math_verify(verifier):
    assert verifier.verify("I think it is 4", "4").reason == v.REASON_NO_BOXED
    assert verifier.verify("\\boxed{ }", "4").reason == v.REASON_EMPTY
    assert verifier.verify(boxed("9" * 1001), "4").reason == v.REASON_TOO_LONG


def test_an_unparseable_reference_is_named_not_blamed_on_the_answer(verifier):
    verdict = verifier.verify(boxed("4"), "\\begin{matrix")
    assert (verdict.reward, verdict.reason) == (0.0, v.REASON_BAD_REFERENCE)


def test_format_reward_only_for_a_boxed_wrong_answer():
    checker = MathVerifier(format_reward=0.1, workers=1)
    try:
        assert checker.verify(boxed("5"), "4").reward == 0.1
        assert checker.verify("no box", "4").reward == 0.0
        assert checker.verify(boxed("4"), "4").reward == 1.0
    finally:
        checker.close()


def test_runs_from_a_non_main_thread_with_its_bound(verifier):
    results = []
    worker = threading.Thread(target=lambda: results.extend(
        [verifier.verify(boxed("\\dfrac{2}{4}"), "0.5"), verifier.verify(boxed("9^{9^{9^{9}}}"), "2")]))
    worker.start()
    worker.join(timeout=120)
    assert not worker.is_alive()
    assert [(r.reward, r.reason) for r in results] == [(1.0, v.REASON_CORRECT), (0.0, v.REASON_TIMEOUT)]


def test_workers_cap_their_address_space():
    checker = MathVerifier(memory_mb=700, workers=1)
    try:
        assert checker.verify(boxed("0.5"), "\\frac{1}{2}").reward == 1.0
        pid = checker.pool._idle.queue[0].process.pid
        limits = Path(f"/proc/{pid}/limits").read_text()
        address_space = next(line for line in limits.splitlines() if line.startswith("Max address space"))
        assert address_space.split()[3] == str(700 * 1024 * 1024)
    finally:
        checker.close()
