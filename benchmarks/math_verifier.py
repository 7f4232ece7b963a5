"""Worst-case time of the math verifier (SPEC 12) on the hand-checked pairs and the adversarial answers.

    python -m benchmarks.math_verifier                      # defaults: 1 s bound, 2 workers
    python -m benchmarks.math_verifier --timeout-s 2 --workers 1

Prints, per set, the pairs checked, those scored against expectation, and the worst and median wall
time of one call as the caller sees it (worker start-up excluded: it happens once, before any bound),
then each adversarial answer's reason and time. The worst case is the time bound plus the kill.
"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path

from rich.console import Console
from rich.table import Table

from src.task.math.verify import MathVerifier
from tests.math_pairs import ADVERSARIAL, EQUIVALENT, NEAR_MISSES

SENTINEL = Path("/tmp/replay_rloo_math_pwned")


def timed(verifier: MathVerifier, gold: str, answer: str):
    started = time.perf_counter()
    verdict = verifier.verify(f"Step by step. The answer is \\boxed{{{answer}}}.", gold)
    return verdict, time.perf_counter() - started


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--timeout-s", type=float, default=1.0)
    parser.add_argument("--workers", type=int, default=2)
    args = parser.parse_args()
    SENTINEL.unlink(missing_ok=True)
    verifier = MathVerifier(timeout_s=args.timeout_s, workers=args.workers)
    verifier.verify("\\boxed{1}", "\\frac{1}{2}")  # starts the workers: their start-up is not a call's time
    console = Console()
    table = Table(title=f"math verifier, {args.timeout_s:g} s bound, {args.workers} worker(s)")
    for column in ("set", "pairs", "against expectation", "median s", "worst s"):
        table.add_column(column, justify="right" if column != "set" else "left")
    adversarial_rows = []
    for name, pairs, expected in (("equivalent", EQUIVALENT, 1.0), ("near misses", NEAR_MISSES, 0.0),
                                  ("adversarial", [("2", a) for a in ADVERSARIAL], 0.0)):
        times, wrong = [], 0
        for gold, answer in pairs:
            verdict, seconds = timed(verifier, gold, answer)
            times.append(seconds)
            wrong += verdict.reward != expected
            if name == "adversarial":
                adversarial_rows.append((answer, verdict.reason, seconds))
        table.add_row(name, str(len(pairs)), str(wrong), f"{statistics.median(times):.3f}", f"{max(times):.3f}")
    console.print(table)
    detail = Table(title="adversarial answers (reference 2)")
    for column in ("answer", "reason", "seconds"):
        detail.add_column(column)
    for answer, reason, seconds in adversarial_rows:
        shown = answer if len(answer) <= 48 else f"{answer[:40]}... ({len(answer)} chars)"
        detail.add_row(shown, reason, f"{seconds:.3f}")
    console.print(detail)
    console.print(f"worst case over all calls: {verifier.pool.worst_seconds:.3f} s (bound {args.timeout_s:g} s); "
                  f"timeouts {verifier.pool.timeouts}; code-execution sentinel written: {SENTINEL.exists()}")
    verifier.close()


if __name__ == "__main__":
    main()
