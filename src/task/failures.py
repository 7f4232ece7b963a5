"""What every task's failure taxonomy shares (seed 004 appendix B.4, SPEC 10; SPEC 12 for math).

Each task labels a failed rollout with one dominant category, its own checks deciding which. The
global generation failure (the completion repeats itself or stops being coherent) and the
catch-all are the same category for every task, and come last in every task's list, so reports
can line the tasks' categories up. Counting labels against a task's list is here too.
"""

from __future__ import annotations

from collections import Counter
from typing import Iterable, Sequence

REPETITIVE_OR_INCOHERENT = "repetitive_or_incoherent"
OTHER = "other"
SHARED_LABELS = {REPETITIVE_OR_INCOHERENT: "repetitive or incoherent", OTHER: "other"}


def taxonomy(own: dict[str, str]) -> tuple[tuple[str, ...], dict[str, str]]:
    """A task's categories (its own, in checking order, then the shared ones) and their labels for people."""
    labels = {**own, **SHARED_LABELS}
    return tuple(labels), labels


def category_counts(categories: Iterable[str | None], known: Sequence[str]) -> dict[str, int]:
    """Count per category of `known` (every one present, 0 when absent); None entries (successes) are skipped."""
    counts = Counter(c for c in categories if c is not None)
    unknown = set(counts) - set(known)
    if unknown:
        raise ValueError(f"unknown failure categories {sorted(unknown)}; valid: {', '.join(known)}")
    return {category: counts.get(category, 0) for category in known}
