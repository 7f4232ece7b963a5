"""Pure metric functions of the evaluation protocol (SPEC 7): pass@k, t-intervals, answer diversity.

`first_k_pass_at_k` is the canonical protocol's ordered first-k rule; `unbiased_pass_at_k` is
the best-of-N probe's estimator `1 - C(n-c, k) / C(n, k)`, computed as a product so that it
stays exact and finite for n in the thousands.
"""

from __future__ import annotations

import math
import re
from typing import Callable, Sequence

import numpy as np

ESTIMATORS = ("first_k", "unbiased")  # pass@k estimators (first_k_pass_at_k, unbiased_pass_at_k)

# Every sample without an answer span maps to this one value (see `answer_unique_rate`).
NO_ANSWER = ""

_WHITESPACE = re.compile(r"\s+")


def first_k_pass_at_k(correct: Sequence[bool], k: int) -> float:
    """1.0 if any of the first k samples (in generation order) is correct, else 0.0."""
    if k < 1 or k > len(correct):
        raise ValueError(f"k must be in [1, {len(correct)}] (the number of samples), got {k}")
    return 1.0 if any(correct[:k]) else 0.0


def unbiased_pass_at_k(n: int, c: int, k: int) -> float:
    """Unbiased pass@k = 1 - C(n-c, k) / C(n, k) from n samples with c correct, in stable product form."""
    if n < 0 or c < 0 or k < 1:
        raise ValueError(f"need n >= 0, c >= 0, k >= 1; got n={n}, c={c}, k={k}")
    if c > n or k > n:
        raise ValueError(f"need c <= n and k <= n; got n={n}, c={c}, k={k}")
    if n - c < k:
        return 1.0  # every k-subset contains a correct sample
    # C(n-c, k) / C(n, k) = prod_{i=n-c+1}^{n} (i - k) / i: c factors in (0, 1], no factorials.
    miss = math.prod(1.0 - k / i for i in range(n - c + 1, n + 1))
    return 1.0 - miss


def t_half_width(values: Sequence[float], confidence: float = 0.95) -> float:
    """Half-width of the Student-t confidence interval of the mean over repeats; nan for fewer than 2."""
    x = np.asarray(values, dtype=float)
    n = x.size
    if n < 2:
        return math.nan
    from scipy import stats  # here: scipy's import costs the command-line check (src.command.cli) most of a second

    t = stats.t.ppf((1.0 + confidence) / 2.0, n - 1)
    return float(t * x.std(ddof=1) / math.sqrt(n))


def normalise_answer(response: str, extract: Callable[[str], str | None]) -> str:
    """Diversity key of one response: its extracted answer with all whitespace removed, "" if none."""
    answer = extract(response)
    if answer is None:
        return NO_ANSWER
    return _WHITESPACE.sub("", answer)


def answer_unique_rate(responses: Sequence[str], extract: Callable[[str], str | None]) -> float:
    """Distinct normalised answer expressions over the number of samples, for one prompt.

    Normalisation: the task's `extract` (`Task.extract`; Countdown: the last complete <answer> span, stripped;
    task=math: the last boxed answer),
    then all whitespace removed, so "1+2" and " 1 + 2 " are the same answer while "2+1" is
    a different one (no algebraic canonicalisation). Samples with no answer span, and
    samples with an empty span, all share the one value "": a model that never answers
    has unique rate 1/n rather than a spurious 1.0.
    """
    if len(responses) == 0:
        raise ValueError("answer_unique_rate needs at least one response")
    return len({normalise_answer(r, extract) for r in responses}) / len(responses)
