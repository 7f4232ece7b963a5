"""Training-seed repeats: a cell's result over seeds, and its paired difference to the fresh-only baseline.

The unit of replication is the training seed. Evaluation repeats (the protocol's seeds) measure
one trained policy several times; they are nested inside a training seed, so they are averaged
within the seed first and the interval is taken over the per-seed means (n = number of training
seeds, t with n - 1 degrees of freedom). A cell is compared with the fresh-only baseline trained
at the same seed: the seed-wise differences are tested with a paired t-test (two-sided, 95 %),
which is the same as asking whether their 95 % t-interval excludes 0.

Everything here is a pure function of pandas objects; `analysis/report.py` wires it in.
"""

from __future__ import annotations

import numpy as np
import pandas as pd
from scipy import stats

CONFIDENCE = 0.95
TEST_NAME = "paired t-test over training seeds, 95 %"
VERDICTS = ("better", "within noise", "worse", "one seed", "no baseline")
# Metrics that get a paired difference and a verdict; higher is better for each.
VERDICT_METRICS = ["reward", "pass@1", "pass@k_max", "correction_rate"]
SUMMARY_COLUMNS = ["pass@1", "pass@k_max", "reward", "correction_rate", "unique_rate", "fresh_evaluations",
                   "gradient_steps", "effective_ratio", "replay_ess", "generated_tokens", "trained_tokens", "wall_time_s"]


def t_interval(values, confidence: float = CONFIDENCE) -> tuple[float, float]:
    """(mean, t half-width at `confidence`, two-sided) of independent values; the half-width is NaN for fewer
    than two values."""
    values = np.asarray(pd.Series(values).dropna(), dtype=float)
    if values.size == 0:
        return np.nan, np.nan
    mean = float(values.mean())
    if values.size < 2:
        return mean, np.nan
    sem = float(values.std(ddof=1)) / np.sqrt(values.size)
    return mean, float(stats.t.ppf(0.5 + confidence / 2, values.size - 1) * sem)


def per_seed_means(table: pd.DataFrame, value: str, seed: str = "seed") -> pd.Series:
    """The mean of `value` within each training seed (evaluation repeats nested in a seed), indexed by seed."""
    return table.groupby(seed)[value].mean().dropna()


def over_seeds(table: pd.DataFrame, value: str, seed: str = "seed") -> dict:
    """Mean and 95 % t half-width over training seeds, the repeats of a seed averaged first."""
    means = per_seed_means(table, value, seed)
    mean, half_width = t_interval(means)
    return {"n_seeds": int(means.size), "mean": mean, "hw": half_width}


def paired_difference(cell: pd.Series, baseline: pd.Series) -> dict:
    """cell - baseline over the seeds both have (Series indexed by seed), with the paired t-test's verdict.

    'better' / 'worse' when the test rejects equal means at 95 % (the difference's interval excludes 0),
    'within noise' when it does not, 'one seed' with a single shared seed (nothing to test with),
    'no baseline' with none.
    """
    shared = cell.dropna().index.intersection(baseline.dropna().index)
    differences = (cell[shared] - baseline[shared]).astype(float)
    mean, half_width = t_interval(differences)
    result = {"n_pairs": int(shared.size), "diff": mean, "diff_hw": half_width, "p_value": np.nan}
    if shared.size == 0:
        return {**result, "verdict": "no baseline"}
    if shared.size == 1:
        return {**result, "verdict": "one seed"}
    if np.allclose(differences, differences.iloc[0]):  # no spread: the t statistic is undefined
        exact = "within noise" if np.isclose(mean, 0.0) else ("better" if mean > 0 else "worse")
        return {**result, "p_value": 0.0 if exact != "within noise" else 1.0, "verdict": exact}
    p_value = float(stats.ttest_rel(cell[shared], baseline[shared]).pvalue)
    verdict = "within noise" if p_value >= 1 - CONFIDENCE else ("better" if mean > 0 else "worse")
    return {**result, "p_value": p_value, "verdict": verdict}


def baseline_key(results: pd.DataFrame) -> str | None:
    """The fresh-only cell (plain, rho = 0) the others are compared with: the one with the most seeds."""
    if results.empty:
        return None
    fresh = results[results["plain"].astype(bool) & (results["rho"] == 0)]
    if fresh.empty:
        return None
    counts = fresh.groupby("cell_key", sort=False)["seed"].nunique()
    return str(counts.idxmax())  # ties: the first in table order


def seed_table(results: pd.DataFrame) -> pd.DataFrame:
    """One row per cell (`cell_key`) and protocol aggregated over its training seeds, in the results table's order.

    Columns: the cell's labels (variant, cell, coordinates, plain, setting, rho, L, c, policy, protocol),
    `n_seeds`, `seeds`, `run_ids`; for each metric in SUMMARY_COLUMNS its mean over seeds and
    `<metric>_hw` (the 95 % t half-width over seeds; with one seed the run's own evaluation half-width,
    as in the per-run table); for each VERDICT_METRICS metric `<metric>_diff`, `_diff_hw`, `_p` and
    `_verdict` against the fresh-only baseline at the same seeds and protocol (the baseline row itself has none).
    """
    if results.empty:
        return pd.DataFrame()
    baseline = baseline_key(results)
    rows = []
    # Seeds evaluated under different protocols (quick, canonical) are never averaged together.
    for (key, protocol), runs in results.groupby(["cell_key", "protocol"], sort=False):
        base_rows = results[(results["cell_key"] == baseline) & (results["protocol"] == protocol)]
        first = runs.iloc[0]
        row = {name: first[name] for name in ("variant", "cell", "coordinates", "plain", "setting", "rho", "L", "c",
                                              "policy", "protocol", "k_max") if name in runs}
        seeds = sorted(runs["seed"].dropna().unique())
        row.update({"cell_key": key, "run_id": first["run_id"], "n_seeds": len(seeds),
                    "seeds": ",".join(f"{s:g}" for s in seeds), "run_ids": ",".join(runs["run_id"]),
                    "is_baseline": key == baseline})
        for metric in SUMMARY_COLUMNS:
            if metric not in runs:
                continue
            summary = over_seeds(runs, metric)
            own_hw = runs[metric + "_hw"].iloc[0] if metric + "_hw" in runs and len(runs) == 1 else np.nan
            row[metric] = summary["mean"]
            row[metric + "_hw"] = summary["hw"] if summary["n_seeds"] > 1 else own_hw
        for metric in VERDICT_METRICS:
            if key == baseline or metric not in runs:
                continue
            compared = paired_difference(per_seed_means(runs, metric), per_seed_means(base_rows, metric))
            row.update({f"{metric}_diff": compared["diff"], f"{metric}_diff_hw": compared["diff_hw"],
                        f"{metric}_p": compared["p_value"], f"{metric}_verdict": compared["verdict"],
                        f"{metric}_pairs": compared["n_pairs"]})
        rows.append(row)
    return pd.DataFrame(rows)


def seed_bands(history: pd.DataFrame, results: pd.DataFrame) -> pd.DataFrame:
    """Per-step training curves across the seeds of each cell: mean, min and max over seeds.

    `history` is the long (run_id, key, step, value) table; the answer has one curve per cell under the
    run id of the cell's first run (as in `seed_table`), with columns value (the mean), low, high and
    n_seeds (how many seeds logged that step).
    """
    columns = ["run_id", "key", "step", "value", "low", "high", "n_seeds"]
    if history.empty or results.empty:
        return pd.DataFrame(columns=columns)
    first_run = results.groupby("cell_key", sort=False)["run_id"].transform("first")
    representative = dict(zip(results["run_id"], first_run))
    curves = history.assign(run_id=history["run_id"].map(representative)).dropna(subset=["run_id"])
    bands = curves.groupby(["run_id", "key", "step"], sort=True)["value"].agg(
        value="mean", low="min", high="max", n_seeds="count").reset_index()
    return bands[columns]


def mean_per_run(history: pd.DataFrame, key: str) -> pd.Series:
    """The mean over logged steps of one per-step metric, indexed by run id (runs without it are absent)."""
    if history.empty:
        return pd.Series(dtype=float)
    return history[history["key"] == key].groupby("run_id")["value"].mean()


# --------------------------------------------------------------------------- a claim's test over training seeds
# A claim's comparison is paired: both arms of training seed s start from the same warm start and draw the same
# seeded prompts, so the seed-wise difference removes what the seed shares. Each rule is one-sided at ALPHA:
#   higher / lower  H0: mean difference <= 0 (>= 0), rejected -> the claim's direction is shown;
#   at least        H0: mean difference <= -margin (non-inferiority), rejected -> not worse than the margin;
#   flat            H0: |mean difference| >= margin, both one-sided tests rejected (TOST) -> equivalent.
# The claim itself is rejected by the opposite one-sided test at ALPHA, never by a test that merely fails:
#   higher / lower  H0: mean difference >= the paper's effect (<= minus it), rejected -> no effect as large
#                   as the paper's (the 95 % one-sided bound lies inside the paper's effect);
#   at least        H0: mean difference >= -margin, rejected -> worse by more than the margin;
#   flat            either H0: mean difference <= margin (>= -margin) rejected -> outside the margin.
# A comparison neither test decides is undecided. Its interval is the one its tests read: 90 % two-sided, whose
# ends are the 95 % one-sided bounds. The arrays' last axis is the seeds, so one call judges one study or
# thousands of simulated ones. A sequential study tests each of its looks at a preset level below ALPHA
# (`level`, analysis.claims.Claim.looks); the interval then widens to match (1 - 2 level).
ALPHA = 0.05
POWER = 0.80


def claim_test(level: float = ALPHA) -> str:
    """The claims' test in words, at its one-sided level."""
    return f"paired t over training seeds, one-sided at {100 * level:g} % (TOST for equivalence)"


OUTCOMES = ("agrees", "against", "undecided", "no spread", "no data")


def one_sided_p(differences: np.ndarray, shift: float, greater: bool) -> np.ndarray:
    """p of the paired t-test of H0 mean(d) <= shift (greater) or >= shift (not greater), along the last axis."""
    d = np.asarray(differences, dtype=float)
    n = d.shape[-1]
    se = d.std(axis=-1, ddof=1) / np.sqrt(n)
    with np.errstate(divide="ignore", invalid="ignore"):
        t = (d.mean(axis=-1) - shift) / se
    return stats.t.sf(t, n - 1) if greater else stats.t.cdf(t, n - 1)


def detectable(sd, n, equivalence: bool = False, level: float = ALPHA):
    """The smallest true difference (or, for equivalence, margin) n seeds detect with POWER at `level`, one-sided,
    given the seed-wise differences' standard deviation sd: (t_{1-level} + t_{power}) sd / sqrt(n), with
    t_{(1+power)/2} for equivalence (both one-sided tests must reject at a true difference of 0)."""
    n = np.asarray(n, dtype=float)
    beta_quantile = (1 + POWER) / 2 if equivalence else POWER
    return (stats.t.ppf(1 - level, n - 1) + stats.t.ppf(beta_quantile, n - 1)) * np.asarray(sd) / np.sqrt(n)


def seeds_to_decide(sd: float, margin: float, equivalence: bool = False, most: int = 10_000,
                    level: float = ALPHA) -> int | None:
    """The fewest training seeds whose detectable difference (at `level`) is within `margin` (None: more than
    `most`)."""
    if not np.isfinite(sd) or margin <= 0:
        return None
    counts = np.arange(2, most + 1)
    fits = counts[detectable(sd, counts, equivalence, level) <= margin]
    return int(fits[0]) if fits.size else None


def claim_outcomes(differences: np.ndarray, expect: str, margin: float, level: float = ALPHA) -> np.ndarray:
    """Each study's outcome (OUTCOMES) from its seed-wise differences (last axis: seeds; no NaN).

    'agrees': the rule above rejects its null; 'against': the claim is rejected (for higher / lower: an effect the
    size of `margin`, the paper's, is excluded; for at least: worse by more than the margin; for flat: outside the
    margin); else 'undecided'. 'no spread': every seed gives the same difference, so no t-test exists; 'no data':
    fewer than two seeds. Every test is one-sided at `level`."""
    d = np.atleast_2d(np.asarray(differences, dtype=float))
    if d.shape[-1] < 2:
        return np.full(d.shape[0], "no data", dtype=object)
    sd = d.std(axis=-1, ddof=1)
    if expect == "higher":
        agrees, against = one_sided_p(d, 0.0, True) < level, one_sided_p(d, margin, False) < level
    elif expect == "lower":
        agrees, against = one_sided_p(d, 0.0, False) < level, one_sided_p(d, -margin, True) < level
    elif expect == "at least":
        agrees = one_sided_p(d, -margin, True) < level
        against = one_sided_p(d, -margin, False) < level
    elif expect == "flat":
        agrees = (one_sided_p(d, -margin, True) < level) & (one_sided_p(d, margin, False) < level)
        against = (one_sided_p(d, margin, True) < level) | (one_sided_p(d, -margin, False) < level)
    else:
        raise ValueError(f"expect={expect!r}: choose one of higher, lower, at least, flat")
    outcome = np.where(agrees, "agrees", np.where(against, "against", "undecided"))
    return np.where(np.isclose(sd, 0.0, atol=1e-12), "no spread", outcome).astype(object)
