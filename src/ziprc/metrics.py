"""ZIP-RC-Lite's offline numbers (seed 004 Table 3, Table 5, adaptive-K): pure functions over value traces."""

from __future__ import annotations

from math import comb
from typing import Sequence

import numpy as np

VALUE_END_POSITIONS = 16  # value_end: mean V-hat over the last 16 response positions (Table 7)


def value_end(values: Sequence[float], positions: int = VALUE_END_POSITIONS) -> float:
    """Mean of the last `positions` values of a trace (all of them when it is shorter)."""
    if not len(values):
        raise ValueError("empty value trace")
    tail = list(values)[-positions:]
    return float(sum(tail) / len(tail))


def auc(scores: Sequence[float], labels: Sequence[bool]) -> float:
    """Area under the ROC curve: P(score of a positive > score of a negative), ties counting 1/2; NaN with one class."""
    scores, labels = np.asarray(scores, dtype=float), np.asarray(labels, dtype=bool)
    positives, negatives = scores[labels], scores[~labels]
    if not len(positives) or not len(negatives):
        return float("nan")
    greater = (positives[:, None] > negatives[None, :]).sum()
    ties = (positives[:, None] == negatives[None, :]).sum()
    return float((greater + 0.5 * ties) / (len(positives) * len(negatives)))


def f1_and_accuracy(predicted: Sequence[bool], actual: Sequence[bool]) -> tuple[float, float]:
    """(F1 of the positive class, accuracy); F1 is 0 when there are no true positives."""
    predicted, actual = np.asarray(predicted, dtype=bool), np.asarray(actual, dtype=bool)
    true_positive = int((predicted & actual).sum())
    precision_denominator, recall_denominator = int(predicted.sum()), int(actual.sum())
    if true_positive == 0:
        f1 = 0.0
    else:
        precision, recall = true_positive / precision_denominator, true_positive / recall_denominator
        f1 = 2 * precision * recall / (precision + recall)
    return f1, float((predicted == actual).mean())


def total_variation(predicted: np.ndarray, observed_cells: Sequence[int]) -> float:
    """TV distance between a predicted joint (flattened cells) and the empirical joint of the observed cells."""
    predicted = np.asarray(predicted, dtype=float)
    empirical = np.bincount(np.asarray(observed_cells, dtype=int), minlength=len(predicted)) / len(observed_cells)
    return float(0.5 * np.abs(predicted - empirical).sum())


def percentile_ranks(values: Sequence[float]) -> np.ndarray:
    """Rank of each value among all, scaled to [0, 1] (ties share their mean rank); 0.5 for a single value."""
    values = np.asarray(values, dtype=float)
    if len(values) == 1:
        return np.array([0.5])
    order = values.argsort(kind="stable")
    ranks = np.empty(len(values))
    ranks[order] = np.arange(len(values))
    for value in np.unique(values):  # ties: the mean of their ranks
        same = values == value
        ranks[same] = ranks[same].mean()
    return ranks / (len(values) - 1)


def adaptive_k(prompt_values: Sequence[float], mean_k: int, spread: float = 0.5, k_min: int = 1) -> list[int]:
    """Samples per prompt for an average budget of `mean_k`: more for predicted-hard prompts (low V-hat(x)).

    Allocation is linear in the percentile rank r of V-hat(x) (seed 004 uses ranks because the raw
    values are compressed): weight 1 + spread * (1 - 2r), so the hardest prompt gets (1 + spread)
    times the average and the easiest (1 - spread) times. Counts are rounded by largest remainder so
    they sum to exactly mean_k x prompts, and none goes below k_min.
    """
    if not 0 <= spread <= 1:
        raise ValueError(f"spread={spread}: use 0 <= spread <= 1 (0 is uniform allocation)")
    count = len(prompt_values)
    weights = 1 + spread * (1 - 2 * percentile_ranks(prompt_values))
    ideal = weights / weights.sum() * mean_k * count
    ideal = np.maximum(ideal, k_min)
    ideal *= mean_k * count / ideal.sum()
    floors = np.floor(ideal).astype(int)
    remainder = mean_k * count - floors.sum()
    for index in np.argsort(-(ideal - floors), kind="stable")[:remainder]:
        floors[index] += 1
    return floors.tolist()



def best_of_n(value_ends: Sequence[float], correct: Sequence[bool], lengths: Sequence[int],
              n: int) -> tuple[float, float, float]:
    """Best-of-n from one prompt's K finished samples: the mean over all n-subsets of (the highest-value_end
    sample is correct, active forward passes, decode steps), exactly, like unbiased pass@k.

    A subset's answer is its highest value_end (ties: the lower index, as the decoder's `max`), so sample j is
    the answer of C(below_j, n - 1) of the C(K, n) subsets, below_j counting the samples ranked under it;
    likewise a subset's latency is its longest sample. Cost adds the shared prompt encoding, as the decoder.
    """
    k = len(value_ends)
    if not 1 <= n <= k or len(correct) != k or len(lengths) != k:
        raise ValueError(f"best_of_n needs 1 <= n <= K and K values, outcomes and lengths; got n={n}, K={k}")
    subsets = comb(k, n)
    ranked = sorted(range(k), key=lambda j: (-value_ends[j], j))  # the answer of a subset: its first here
    accuracy = sum(bool(correct[j]) * comb(k - 1 - rank, n - 1) for rank, j in enumerate(ranked)) / subsets
    longest = sorted(lengths, reverse=True)
    latency = sum(length * comb(k - 1 - rank, n - 1) for rank, length in enumerate(longest)) / subsets
    return float(accuracy), 1.0 + n * sum(lengths) / k, float(latency)


def matched_cost(curve: Sequence[tuple[float, float]], accuracy: float) -> float:
    """The compute best-of-N needs to reach `accuracy`, from its (cost, accuracy) points: linear between the
    points of its frontier (mixing two N across prompts reaches any accuracy between them); the cheapest
    point's cost below its accuracy (no fewer than one sample); NaN above the best accuracy it reaches."""
    frontier, best = [], -np.inf
    for cost, reached in sorted(curve):
        if reached > best:
            frontier.append((cost, reached))
            best = reached
    if not frontier or accuracy > best:
        return float("nan")
    if accuracy <= frontier[0][1]:
        return float(frontier[0][0])
    for (c0, a0), (c1, a1) in zip(frontier, frontier[1:]):
        if a0 < accuracy <= a1:
            return float(c0 + (c1 - c0) * (accuracy - a0) / (a1 - a0))
    return float(frontier[-1][0])
