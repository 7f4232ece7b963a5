"""The five papers' headline claims, each as comparisons over training seeds with a verdict (make reproduce-seedNNN).

A claim names the roles its cells play (which runs are the baseline, which the method), and turns the runs of
a reproduction into paired comparisons: the method against the baseline at the same training seed, on one
metric, with the direction the paper's claim expects. Each comparison is judged by the paired t-test of
`analysis.seeds` (95 %, over training seeds), and the claim's verdict follows from its comparisons:

- reproduced in direction: every comparison goes the way the claim says (a "higher" significantly higher, an
  "at least" not significantly lower with a mean difference >= 0, a "flat" not significantly different);
- not reproduced: some comparison is significantly the other way;
- inconclusive at this scale: neither, e.g. a difference in the claim's direction within the seeds' noise.

Everything here is a pure function of pandas objects; `analysis/reproduce.py` reads MLflow and writes the
report section. The papers' numbers are quoted with their lines (docs/papers.md).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

import numpy as np
import pandas as pd

from analysis.seeds import paired_difference, t_interval

REPRODUCED, NOT_REPRODUCED, INCONCLUSIVE = "reproduced in direction", "not reproduced", "inconclusive at this scale"
EXPECTATIONS = ("higher", "at least", "flat", "lower")


@dataclass(frozen=True)
class Comparison:
    """`method` against `baseline` on one metric over training seeds (each a Series indexed by seed)."""
    label: str              # what is compared, e.g. "rho1-L1-c1 vs fresh-only, reward at equal fresh evaluations"
    expect: str             # one of EXPECTATIONS: what the paper's claim says of method - baseline
    method: pd.Series
    baseline: pd.Series
    paper: str              # the paper's figure for this comparison

    def judged(self) -> dict:
        """The paired difference (mean, 95 % half-width, p, test verdict) and whether it agrees with the claim."""
        result = paired_difference(self.method, self.baseline)
        test, mean = result["verdict"], result["diff"]
        if test in ("one seed", "no baseline"):
            agrees = None
        elif self.expect == "higher":
            agrees = True if test == "better" else False if test == "worse" else None
        elif self.expect == "lower":
            agrees = True if test == "worse" else False if test == "better" else None
        elif self.expect == "at least":
            agrees = False if test == "worse" else True if mean >= 0 else None
        else:  # flat
            agrees = test == "within noise"
        return {**result, "agrees": agrees}


@dataclass(frozen=True)
class Claim:
    """One paper's headline claim: its sentence and number, which runs play which role, and its comparisons."""
    name: str                                        # seed000 ... seed004: the reproduce config and make target
    paper: str                                       # "Seed 000 (Replay-RLOO)"
    statement: str                                   # the claim in one sentence, with the paper's number
    source: str                                      # where the paper says it
    roles: dict[str, Callable[[pd.Series], bool]]    # role -> which runs (rows of the runs table) play it
    compare: Callable[["Study"], list[Comparison]]
    notes: Callable[["Study"], list[str]] = field(default=lambda study: [])


@dataclass
class Study:
    """A reproduction's finished runs (one row per run: `role`, `seed`, `run_id` and `metrics.*` columns) and
    a reader of a run's learning curve (evaluation reward against fresh evaluations, for seed 000)."""
    runs: pd.DataFrame
    curve: Callable[[str], pd.DataFrame] = field(default=lambda run_id: pd.DataFrame(columns=["fresh", "reward"]))

    def of(self, role: str) -> pd.DataFrame:
        return self.runs[self.runs["role"] == role]

    def values(self, role: str, metric: str) -> pd.Series:
        """One value per training seed of the role's runs (NaN where a run lacks the metric)."""
        rows = self.of(role)
        column = rows["metrics." + metric] if "metrics." + metric in rows else pd.Series(np.nan, index=rows.index)
        return pd.Series(column.astype(float).to_numpy(), index=rows["seed"].to_numpy()).sort_index()

    def spread(self, role: str, metric: str) -> str:
        """'0.312 ± 0.021 (3 seeds)': mean and 95 % t half-width over seeds."""
        values = self.values(role, metric).dropna()
        mean, half_width = t_interval(values)
        if values.empty:
            return "no runs"
        digits = ",.0f" if abs(mean) >= 100 else ".3f"  # counts (rollouts, evaluations) as whole numbers
        hw = f" ± {half_width:{digits}}" if not np.isnan(half_width) else ""
        return f"{mean:{digits}}{hw} ({values.size} seed{'s' if values.size != 1 else ''})"


def verdict(judged: list[dict]) -> tuple[str, str]:
    """The claim's verdict from its comparisons' judgements, with the reason in words."""
    if not judged:
        return INCONCLUSIVE, "no comparison could be made: a role has no finished runs"
    against = [row["label"] for row in judged if row["agrees"] is False]
    if against:
        return NOT_REPRODUCED, "significantly the other way: " + "; ".join(against)
    open_rows = [row for row in judged if row["agrees"] is None]
    if not open_rows:
        return REPRODUCED, "every comparison goes the claim's way (paired t-test over training seeds, 95 %)"
    seeds = min(row["n_pairs"] for row in judged)
    reasons = "; ".join(f"{row['label']}: {row['diff']:+.3f}" + (f" ± {row['diff_hw']:.3f}"
                                                                if not np.isnan(row["diff_hw"]) else "")
                        for row in open_rows)
    return INCONCLUSIVE, f"within the noise of {seeds} training seed(s): {reasons}"


# --------------------------------------------------------------------------- the runs' roles


def tag(run: pd.Series, name: str) -> str:
    value = run.get(f"tags.{name}")
    return "" if value is None or (isinstance(value, float) and np.isnan(value)) else str(value)


def cell_is(label: str) -> Callable[[pd.Series], bool]:
    return lambda run: tag(run, "cell") == label


def cell_has(*parts: str, without: str = "\0") -> Callable[[pd.Series], bool]:
    return lambda run: all(part in tag(run, "cell") for part in parts) and without not in tag(run, "cell")


def tags_are(**wanted: str) -> Callable[[pd.Series], bool]:
    return lambda run: all(tag(run, name) == value for name, value in wanted.items())


def assign_roles(runs: pd.DataFrame, claim: Claim) -> pd.DataFrame:
    """The runs with a `role` column: the first role whose rule the run meets; runs of no role are dropped."""
    roles = [next((role for role, rule in claim.roles.items() if rule(run)), None) for _, run in runs.iterrows()]
    return runs.assign(role=roles).dropna(subset=["role"]).reset_index(drop=True)


# --------------------------------------------------------------------------- the five claims

COUNTDOWN_REWARD = "quick/final/mean_reward"   # the held-out reward of the tiny presets' quick evaluation


def fresh_evaluations(run: pd.Series) -> float:
    value = run.get("metrics.budget/fresh_evaluations")
    return float(value) if value is not None and not pd.isna(value) else np.nan


def reward_at(curve: pd.DataFrame, fresh: float) -> float:
    """The evaluation reward a learning curve reaches at `fresh` fresh evaluations (linear between its points)."""
    curve = curve.dropna().sort_values("fresh")
    if curve.empty or fresh > curve["fresh"].max():
        return np.nan
    return float(np.interp(fresh, curve["fresh"], curve["reward"]))


def seed000_comparisons(study: Study) -> list[Comparison]:
    """Each replay cell's final reward against the fresh-only run of its seed, read off that run's curve at the
    replay run's own fresh-evaluation count."""
    fresh_runs = study.of("fresh-only").set_index("seed")
    comparisons = []
    for role in ("rho1-L1-c1", "rho1-L2-c1"):
        method, baseline = {}, {}
        for _, run in study.of(role).iterrows():
            if run["seed"] in fresh_runs.index:
                method[run["seed"]] = float(run["metrics." + COUNTDOWN_REWARD])
                budget = fresh_evaluations(run)
                baseline[run["seed"]] = reward_at(study.curve(fresh_runs.loc[run["seed"], "run_id"]), budget)
        comparisons.append(Comparison(
            f"{role} vs fresh-only, held-out reward at the replay run's fresh evaluations", "at least",
            pd.Series(method, dtype=float), pd.Series(baseline, dtype=float),
            "replay matches or exceeds fresh-only pass@16 0.756 with 51.7K of its 102.4K evaluations"))
    return comparisons


def seed000_notes(study: Study) -> list[str]:
    budgets = {role: study.values(role, "budget/fresh_evaluations").mean() for role in study.runs["role"].unique()}
    fresh = budgets.get("fresh-only", np.nan)
    return [f"fresh verifier evaluations a run: " + ", ".join(
        f"{role} {value:,.0f}" + (f" ({value / fresh:.0%} of fresh-only)" if role != "fresh-only" else "")
        for role, value in budgets.items())]


def seed001_comparisons(study: Study) -> list[Comparison]:
    rows = []
    for split in ("W6T2", "W4T4"):
        rows.append(Comparison(f"FIFO vs LIFO at {split}, held-out accuracy", "at least",
                               study.values(f"fifo-{split}", COUNTDOWN_REWARD),
                               study.values(f"lifo-{split}", COUNTDOWN_REWARD),
                               "FIFO reaches LIFO's accuracy (Figure 1)"))
        rows.append(Comparison(f"FIFO vs LIFO at {split}, rollouts generated (inference compute)", "lower",
                               study.values(f"fifo-{split}", "runtime/generated_rollouts"),
                               study.values(f"lifo-{split}", "runtime/generated_rollouts"),
                               "up to 40 % less compute for a given accuracy (line 433)"))
    return rows


def seed001_notes(study: Study) -> list[str]:
    return ["compute per update (1 + gamma or 1 + mu, lockstep): " + ", ".join(
        f"{role} {study.values(role, 'runtime/compute_per_update').mean():.2f}"
        for role in sorted(study.runs["role"].unique()))]


def seed002_comparisons(study: Study) -> list[Comparison]:
    expected = {"stale": ("flat", "stale 0.471 vs on-policy 0.467 (one seed)"),
                "replay-R2": ("flat", "replay 0.457 vs on-policy 0.467 (one seed)"),
                "aggressive": ("lower", "aggressive final checkpoint 0.206 vs 0.467 (best one 0.477)")}
    return [Comparison(f"{role} vs on-policy, held-out reward (final checkpoint)", expect,
                       study.values(role, COUNTDOWN_REWARD), study.values("on-policy", COUNTDOWN_REWARD), paper)
            for role, (expect, paper) in expected.items()]


def seed003_comparisons(study: Study) -> list[Comparison]:
    return [
        Comparison("POPO vs DAPO, held-out reward", "at least", study.values("popo", COUNTDOWN_REWARD),
                   study.values("dapo", COUNTDOWN_REWARD), "60.4 vs 61.5 (Table 2, Countdown avg.)"),
        Comparison("POPO vs DAPO, rollouts generated", "lower", study.values("popo", "budget/fresh_evaluations"),
                   study.values("dapo", "budget/fresh_evaluations"), "205k vs 877k rollouts (23 %)"),
        Comparison("POPO vs GRPO, held-out reward", "higher", study.values("popo", COUNTDOWN_REWARD),
                   study.values("grpo", COUNTDOWN_REWARD), "60.4 vs 51.6 (Table 2)"),
    ]


def seed003_notes(study: Study) -> list[str]:
    return ["effective-sample ratio of the training batches (batch/effective_fraction_cumulative): " + ", ".join(
        f"{role} {study.spread(role, 'batch/effective_fraction_cumulative')}" for role in ("popo", "grpo", "dapo"))]


def seed004_comparisons(study: Study) -> list[Comparison]:
    return [
        Comparison("frontier vs uniform, held-out pass@1", "higher", study.values("frontier", "quick/final/pass_at_1"),
                   study.values("uniform", "quick/final/pass_at_1"), "0.49 vs 0.41 (Table 1)"),
        Comparison("frontier vs uniform, held-out pass@32", "flat", study.values("frontier", "quick/final/pass_at_32"),
                   study.values("uniform", "quick/final/pass_at_32"), "pass@128 0.82 vs 0.82 (Table 1)"),
    ]


def seed004_notes(study: Study) -> list[str]:
    return ["held-out mean reward (the paper's average score, 0.46 -> 0.52): " + ", ".join(
        f"{role} {study.spread(role, COUNTDOWN_REWARD)}" for role in ("uniform", "frontier"))]


CLAIMS = {claim.name: claim for claim in (
    Claim("seed000", "Seed 000 (Replay-RLOO)",
          "At rho = 1 replay cuts fresh verifier evaluations from 102.4K to 51.7K a run while several replay "
          "settings match or exceed the fresh-only pass@16 of 0.756: at equal fresh evaluations replay "
          "(rho = 1, L in {1, 2}, c = 1) reaches at least the fresh-only held-out reward.",
          "seed 000 line 11", {"fresh-only": cell_is("rho0"), "rho1-L1-c1": cell_is("rho1-L1-c1"),
                               "rho1-L2-c1": cell_is("rho1-L2-c1")},
          seed000_comparisons, seed000_notes),
    Claim("seed001", "Seed 001 (asynchronous replay)",
          "A FIFO buffer reaches the LIFO pipe's accuracy with less inference compute, saving up to 40 % of the "
          "compute to reach a given accuracy; here at (W, T) = (6, 2) and (4, 4) under the lockstep schedule.",
          "seed 001 line 433", {"lifo-W6T2": cell_has("W6T2", "lifo"), "lifo-W4T4": cell_has("W4T4", "lifo"),
                                "fifo-W6T2": cell_has("W6T2", without="lifo"), "fifo-W4T4": cell_has("W4T4", without="lifo")},
          seed001_comparisons, seed001_notes),
    Claim("seed002", "Seed 002 (off-policy sampling for RLOO)",
          "At an equal 15,360 rollouts no reuse mechanism clearly beats on-policy RLOO (0.467): stale sampling "
          "0.471 and replay R = 2 0.457 are within a point of it, and the aggressive run's final checkpoint "
          "collapses to 0.206 (its best checkpoint reached 0.477).",
          "seed 002 Table 1, lines 135-147",
          {"on-policy": tags_are(buffer="none", behaviour="current"), "stale": tags_are(buffer="none", behaviour="stale"),
           "replay-R2": tags_are(buffer="fifo", behaviour="current"), "aggressive": tags_are(buffer="fifo", behaviour="stale")},
          seed002_comparisons),
    Claim("seed003", "Seed 003 (POPO)",
          "POPO matches DAPO's accuracy with fewer rollouts and beats GRPO: on Countdown 60.4 against DAPO's 61.5 "
          "with 205k rollouts against 877k, and against GRPO's 51.6.",
          "seed 003 Table 2 and line 100",
          {"popo": tags_are(buffer="popo"), "dapo": tags_are(buffer="none", sampling="dynamic"),
           "grpo": tags_are(buffer="none", sampling="standard")},
          seed003_comparisons, seed003_notes),
    Claim("seed004", "Seed 004 (frontier curriculum)",
          "The frontier curriculum (rho = 0.10) raises pass@1 over uniform sampling, 0.41 to 0.49, while pass@k "
          "stays flat (pass@128 0.82 for both).",
          "seed 004 line 11, Table 1 lines 153-159",
          {"frontier": tags_are(curriculum="frontier"), "uniform": tags_are(curriculum="none")},
          seed004_comparisons, seed004_notes),
)}
