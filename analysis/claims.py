"""The five papers' headline claims, each as comparisons over training seeds with a verdict (make reproduce-seedNNN).

A claim names the roles its cells play (which runs are the baseline, which the method) and turns the runs of a
reproduction into paired comparisons: the method against the baseline at the same training seed, on the paper's
metric, with what the paper says of the difference. Agreement needs evidence (SPEC 13, `analysis.seeds`):

- "higher" / "lower": a one-sided paired t-test over training seeds rejects "no difference" at 5 %;
- "at least" (non-inferiority): the one-sided test rejects "worse by the margin or more";
- "flat" (equivalence): two one-sided tests (TOST) reject "outside +- the margin".

Each margin is fixed here, before any run, and tied to the paper's own numbers where it gives them; for "higher"
and "lower" the margin is the paper's effect. A comparison rejects the claim only by a test of its own at 5 %: an
effect the paper's size or larger is excluded ("higher" / "lower"), the method is worse by more than the margin
("at least"), or the difference lies outside the margin ("flat"). Each row shows the 90 % interval, whose ends
are the one-sided 95 % bounds these tests read. A comparison that is true by construction (rollout counts fixed
by a schedule) is a `ScheduleCheck`, shown apart, never evidence. The claim's verdict:

- reproduced: every comparison's test rejects its null;
- not reproduced: some comparison rejects the claim;
- undecided: neither; the row names the seed count that would give its test 80 % power at its margin;
- not testable at this scale: the baseline does not learn, a role has no runs, or the seeds do not vary.

Runs from different commits are never pooled: `commit_refusal` says so in one line. Everything here is a pure
function of pandas objects; `analysis/reproduce.py` reads MLflow and writes the report section. The papers'
numbers are quoted with their lines (the seed texts beside the checkout; `tests/unit/test_verdicts.py` finds each).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

import numpy as np
import pandas as pd
from scipy import stats

from analysis.seeds import ALPHA, claim_outcomes, detectable, one_sided_p, seeds_to_decide, t_interval

REPRODUCED, NOT_REPRODUCED = "reproduced", "not reproduced"
UNDECIDED, NOT_TESTABLE = "undecided", "not testable at this scale"
VERDICTS = (REPRODUCED, NOT_REPRODUCED, UNDECIDED, NOT_TESTABLE)
EXPECTATIONS = ("higher", "at least", "flat", "lower")
COMMIT_TAG = "tags.mlflow.source.git.commit"  # set by MLflow's resolve_tags (src/runs/claim.py, create_claim_run)
DEFAULT_MARGIN = 0.02  # one of 50 held-out prompts: the resolution of the pilot's scores, kept for the planned runs
# The committed studies' ten comparisons, each a 95 % t half-width over 3 seeds (docs/reproductions.md, "Findings"):
# seed 000 L = 1 and 2, seed 001, seed 002 stale, replay and aggressive, seed 003 against DAPO and GRPO, seed 004
# pass@1 and pass@32. A comparison's seed-wise sd is hw sqrt(3) / t_0.975(2); DIFF_SD is their RMS (pooled over
# 20 degrees of freedom), PLAN_SD its 80 % upper confidence bound, which the studies' seed counts are planned at.
COMMITTED_HALF_WIDTHS = (0.076, 0.057, 0.064, 0.024, 0.036, 0.067, 0.052, 0.040, 0.029, 0.029)
_POOLED_DF = 2 * len(COMMITTED_HALF_WIDTHS)
DIFF_SD = float(np.sqrt(np.mean((np.array(COMMITTED_HALF_WIDTHS) * np.sqrt(3) / stats.t.ppf(0.975, 2)) ** 2)))
PLAN_SD = float(DIFF_SD * np.sqrt(_POOLED_DF / stats.chi2.ppf(0.20, _POOLED_DF)))


@dataclass(frozen=True)
class Spec:
    """What a claim compares, fixed before any run: `method` against `baseline` (roles) on `metric`.

    `margin` is the non-inferiority or equivalence margin ("at least", "flat") or the paper's effect the seeds
    must be able to detect ("higher", "lower"); `why` ties it to the paper. `source` is (line, verbatim quote)
    in the paper's seed text; `substitution` names what stands in for the paper's metric, if anything."""
    label: str
    method: str
    baseline: str
    metric: str
    expect: str
    margin: float
    why: str
    paper: str
    source: tuple[int, str]
    substitution: str = ""


@dataclass(frozen=True)
class Comparison:
    """`method` against `baseline` on one metric over training seeds (each a Series indexed by seed)."""
    label: str
    expect: str             # one of EXPECTATIONS: what the paper's claim says of method - baseline
    method: pd.Series
    baseline: pd.Series
    paper: str              # the paper's figure for this comparison
    margin: float = DEFAULT_MARGIN
    why: str = ""
    substitution: str = ""

    def pairs(self) -> int:
        """The training seeds at which both roles have a value: the count this comparison's test stands on."""
        return int(self.method.dropna().index.intersection(self.baseline.dropna().index).size)

    def judged(self, level: float = ALPHA) -> dict:
        """The paired difference (mean, 1 - 2 level two-sided half-width, 90 % at 5 %: its ends are the one-sided
        tests' bounds), the claim's one-sided test at `level` (p), the smallest difference the seeds detect (80 %
        power at `level`), the seeds that would decide an undecided row, and the outcome."""
        shared = self.method.dropna().index.intersection(self.baseline.dropna().index)
        d = (self.method[shared] - self.baseline[shared]).to_numpy(dtype=float)
        mean, half_width = t_interval(d, 1 - 2 * level)
        sd = float(np.std(d, ddof=1)) if d.size > 1 else np.nan
        outcome = str(claim_outcomes(d[None, :], self.expect, self.margin, level)[0]) if d.size else "no data"
        equivalence = self.expect == "flat"
        needed = seeds_to_decide(sd, self.margin, equivalence, level=level) if outcome == "undecided" else None
        row = {"n_pairs": int(d.size), "diff": mean, "diff_hw": half_width, "level": level,
               "p_value": claim_p(d, self.expect, self.margin),
               "detectable": float(detectable(sd, d.size, equivalence, level)) if d.size > 1 else np.nan,
               "seeds_needed": needed, "outcome": outcome}
        agrees = {"agrees": True, "against": False}.get(outcome)
        return {**row, "agrees": agrees}


def claim_p(d: np.ndarray, expect: str, margin: float) -> float:
    """p of the claim's own one-sided test (TOST: the larger of its two), NaN without spread."""
    if d.size < 2 or np.isclose(np.std(d, ddof=1), 0.0, atol=1e-12):
        return np.nan
    if expect == "flat":
        return float(max(one_sided_p(d, -margin, True), one_sided_p(d, margin, False)))
    shift, greater = {"higher": (0.0, True), "lower": (0.0, False), "at least": (-margin, True)}[expect]
    return float(one_sided_p(d, shift, greater))


@dataclass(frozen=True)
class ScheduleCheck:
    """A comparison the schedule decides (e.g. rollouts generated): `method` < `baseline` at every seed is a
    check that the runs followed the schedule, never evidence for the claim."""
    label: str
    method: pd.Series
    baseline: pd.Series
    paper: str

    def result(self) -> str:
        shared = self.method.dropna().index.intersection(self.baseline.dropna().index)
        if shared.empty:
            return f"{self.label}: no runs to check"
        method, baseline = self.method[shared], self.baseline[shared]
        broken = [str(seed) for seed in shared if not method[seed] < baseline[seed]]
        ratio = method.mean() / baseline.mean() if baseline.mean() else np.nan
        said = "holds at every seed" if not broken else "FAILS at seed(s) " + ", ".join(broken)
        return (f"{self.label}: {method.mean():,.0f} against {baseline.mean():,.0f} ({ratio:.0%}), {said} "
                f"(paper: {self.paper}); fixed by the schedule, so not evidence")


@dataclass(frozen=True)
class Claim:
    """One paper's headline claim: its sentence and number, which runs play which role, and its comparisons."""
    name: str                                        # seed000 ... seed004: the reproduce config and make target
    paper: str                                       # "Seed 000 (Replay-RLOO)"
    statement: str                                   # the claim in one sentence, with the paper's number
    source: tuple[int, str]                          # (line, verbatim quote) in the paper's seed text
    roles: dict[str, Callable[[pd.Series], bool]]    # role -> which runs (rows of the runs table) play it
    specs: tuple[Spec, ...]
    baseline: str                                    # the role whose learning makes the claim testable
    substitutions: tuple[str, ...] = ()              # data, evaluation protocol, model and scale
    checks: Callable[["Study"], list[ScheduleCheck]] = field(default=lambda study: [])
    notes: Callable[["Study"], list[str]] = field(default=lambda study: [])
    # A sequential design: the seed counts of its interim looks, fixed before the runs. The claim is then tested
    # at each of them and at its plan, each test at ALPHA / (interim looks + 1) (`look_levels`).
    looks: tuple[int, ...] = ()

    def compare(self, study: "Study") -> list[Comparison]:
        return [Comparison(spec.label, spec.expect, study.values(spec.method, study.metric(spec.metric)),
                           study.values(spec.baseline, study.metric(spec.metric)), spec.paper, spec.margin,
                           spec.why, study.substitution(spec)) for spec in self.specs]


@dataclass
class Study:
    """A reproduction's finished runs (one row per run: `role`, `seed`, `run_id` and `metrics.*` columns) and
    a reader of a run's learning curve (evaluation reward against fresh evaluations, for seed 000's figure)."""
    runs: pd.DataFrame
    curve: Callable[[str], pd.DataFrame] = field(default=lambda run_id: pd.DataFrame(columns=["fresh", "reward"]))
    # run_id, metric -> the value the run logged at each of its steps (none: the reader reads no history)
    history: Callable[[str, str], list[float]] = field(default=lambda run_id, metric: [])

    def of(self, role: str) -> pd.DataFrame:
        return self.runs[self.runs["role"] == role]

    def values(self, role: str, metric: str) -> pd.Series:
        """One value per training seed of the role's runs (NaN where a run lacks the metric)."""
        rows = self.of(role)
        column = rows["metrics." + metric] if "metrics." + metric in rows else pd.Series(np.nan, index=rows.index)
        return pd.Series(column.astype(float).to_numpy(), index=rows["seed"].to_numpy()).sort_index()

    def largest_k(self, most: int) -> int | None:
        """The largest k <= `most` whose quick/final/pass_at_k the runs logged."""
        ks = [int(column.rsplit("_", 1)[1]) for column in self.runs.columns
              if column.startswith("metrics.quick/final/pass_at_") and column.rsplit("_", 1)[1].isdigit()]
        ks = [k for k in ks if k <= most]
        return max(ks) if ks else None

    def metric(self, metric: str) -> str:
        """A spec's metric as logged: "pass@k<=K" is the largest logged k up to the paper's K."""
        if metric.startswith("pass@k<="):
            k = self.largest_k(int(metric.removeprefix("pass@k<=")))
            return f"quick/final/pass_at_{k}" if k is not None else "quick/final/pass_at_?"
        return metric

    def substitution(self, spec: Spec) -> str:
        if spec.metric.startswith("pass@k<="):
            paper_k, k = int(spec.metric.removeprefix("pass@k<=")), self.largest_k(int(spec.metric[8:]))
            if k is None:
                return f"no pass@k logged (the paper's pass@{paper_k})"
            if k != paper_k:
                return f"pass@{k} for the paper's pass@{paper_k}: the largest k the quick evaluation logs"
        return spec.substitution

    def step_means(self, role: str, metric: str) -> pd.Series:
        """One value per training seed of the role's runs: the mean of what the run logged at each step (NaN where
        it logged none)."""
        rows = self.of(role)
        means = [float(np.mean(steps)) if (steps := self.history(run_id, metric)) else np.nan
                 for run_id in rows["run_id"]]
        return pd.Series(means, index=rows["seed"].to_numpy(), dtype=float).sort_index()

    def spread(self, role: str, metric: str, values: pd.Series | None = None) -> str:
        """'0.312 ± 0.021 (3 seeds)': mean and 95 % t half-width over seeds (of `values`, else the metric's)."""
        values = (self.values(role, metric) if values is None else values).dropna()
        mean, half_width = t_interval(values)
        if values.empty:
            return "no runs"
        digits = ",.0f" if abs(mean) >= 100 else ".3f"  # counts (rollouts, evaluations) as whole numbers
        hw = f" ± {half_width:{digits}}" if not np.isnan(half_width) else ""
        return f"{mean:{digits}}{hw} ({values.size} seed{'s' if values.size != 1 else ''})"


def commit_refusal(runs: pd.DataFrame) -> str | None:
    """One line refusing a verdict over runs of several commits (None: one commit, or none recorded at all)."""
    if COMMIT_TAG not in runs or runs.empty:
        return None
    commits = runs[COMMIT_TAG].fillna("unrecorded").astype(str).str[:7].value_counts()
    if len(commits) < 2:
        return None
    return ("runs from different commits are not pooled: " + ", ".join(f"{c} ({n} run{'s' if n > 1 else ''})"
            for c, n in commits.items()) + "; rerun the study at one commit (trainer.rerun=true)")


def baseline_learns(study: Study, role: str) -> str | None:
    """Why the claim is not testable when its baseline ends at or below its warm start (None: it learns, or the
    runs have no start evaluation to tell)."""
    start, final = study.values(role, "quick/start/mean_reward"), study.values(role, "quick/final/mean_reward")
    if start.dropna().empty or final.dropna().empty or final.mean() > start.mean():
        return None
    return f"the baseline {role} ends at {final.mean():.3f}, not above its start {start.mean():.3f}: it does not learn"


def planned_seeds(claim: "Claim", sd: float = PLAN_SD) -> int:
    """The training seeds a study is run at, fixed before its runs: the fewest with 80 % power at its looks' level
    (5 % for a claim tested once) on every comparison of the claim (its margin, or the paper's effect for higher /
    lower) at seed-wise sd `sd`."""
    level = ALPHA / (len(claim.looks) + 1)
    counts = [seeds_to_decide(sd, spec.margin, spec.expect == "flat", level=level) for spec in claim.specs]
    if None in counts:
        raise ValueError(f"{claim.name}: no seed count up to 10,000 gives a comparison 80 % power at sd {sd:.4f}")
    planned = max(counts)
    if list(claim.looks) != sorted(set(claim.looks)) or any(n < 2 or n >= planned for n in claim.looks):
        raise ValueError(f"{claim.name}: looks={claim.looks}: interim looks are increasing seed counts from 2 to "
                         f"below the plan's {planned}")
    return planned


def look_levels(claim: "Claim") -> dict[int, float]:
    """The seed counts a claim is tested at, each with its one-sided level, all fixed before the runs: the plan at
    5 %, or for a sequential design each interim look and the plan at 5 % / (looks + 1). Bonferroni's split: the
    chance that a null study agrees at any look is at most the sum of the levels, 5 %, whatever the looks share."""
    level = ALPHA / (len(claim.looks) + 1)
    return {**{n: level for n in claim.looks}, planned_seeds(claim): level}


def verdict(judged: list[dict], next_look: int | None = None) -> tuple[str, str]:
    """The claim's verdict from its comparisons' judgements, with the reason in words. Undecided at an interim
    look, the reason names the `next_look` the design preset; at the last look, no seeds are added to the study
    (a further look would break its 5 %), so the count that would decide is a new study's plan at this spread."""
    if not judged or any(row["outcome"] == "no data" for row in judged):
        return NOT_TESTABLE, "a comparison has fewer than two seeds with both roles' runs"
    by = lambda outcome: [row for row in judged if row["outcome"] == outcome]
    if by("against"):
        return NOT_REPRODUCED, "; ".join(rejection(row) for row in by("against"))
    if not [row for row in judged if row["outcome"] != "agrees"]:
        level = judged[0].get("level", ALPHA)
        return REPRODUCED, (f"every comparison's one-sided test rejects its null at {100 * level:g} % (paired over "
                            "training seeds)")
    if by("no spread"):
        return NOT_TESTABLE, ("every seed gives the same difference, so there is no test: "
                              + "; ".join(row["label"] for row in by("no spread")))
    open_rows = by("undecided")
    needed = [row["seeds_needed"] for row in open_rows]
    count = f"{max(needed)} seeds" if None not in needed else "more than 10,000 seeds"
    why = (f"at this look; the next, preset, is at {next_look} seeds" if next_look else
           f"at its last look, so not tested again; a new study planned at this spread would need {count}")
    return UNDECIDED, (f"{why}: " + "; ".join(
        f"{row['label']} detects {row['detectable']:.3f} > margin {row['margin']:.3f}"
        if row["detectable"] > row["margin"] else f"{row['label']} ({row['diff']:+.3f}) rejects neither"
        for row in open_rows))


def rejection(row: dict) -> str:
    """Why a comparison rejects the claim, with the one-sided bound its test read (95 % at 5 %)."""
    low, high = row["diff"] - row["diff_hw"], row["diff"] + row["diff_hw"]
    margin, label, level = row["margin"], row["label"], row.get("level", ALPHA)
    bound, interval = f"{100 * (1 - level):g} %", f"{100 * (1 - 2 * level):g} %"
    if row["expect"] == "higher":
        return f"{label}: no effect as large as the paper's ({bound} upper bound {high:+.3f} < {margin:+.3f})"
    if row["expect"] == "lower":
        return f"{label}: no effect as large as the paper's ({bound} lower bound {low:+.3f} > {-margin:+.3f})"
    if row["expect"] == "at least":
        return f"{label}: worse by more than the margin ({bound} upper bound {high:+.3f} < {-margin:+.3f})"
    return f"{label}: outside +- {margin:g} ({interval} interval {low:+.3f} to {high:+.3f})"


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
TINY = "a ~1 M-parameter tiny policy, 60 steps, CPU sizes (the preset's -tiny twin) for the paper's model and scale"
COUNTDOWN_DATA = "Countdown prompts from the project's seeded generator (task.source=generator) for the paper's data set"
QUICK = "the quick evaluation (500 held-out prompts x 8 samples, one repeat, unbiased pass@k)"  # conf/reproduce/
ONE_OF_FIFTY = "one of 50 held-out prompts (0.02), the resolution of the pilot's 50-prompt scores"


def seed000_checks(study: Study) -> list[ScheduleCheck]:
    fresh = study.values("fresh-only", "budget/fresh_evaluations")
    return [ScheduleCheck(f"{role} vs fresh-only, fresh verifier evaluations a run",
                          study.values(role, "budget/fresh_evaluations"), fresh, "51.7K vs 102.4K (line 11)")
            for role in ("rho1-L1-c1", "rho1-L2-c1")]


def seed001_checks(study: Study) -> list[ScheduleCheck]:
    return [ScheduleCheck("FIFO vs LIFO at (W, T) = (6, 2), rollouts generated",
                          study.values("fifo-W6T2", "runtime/generated_rollouts"),
                          study.values("lifo-W6T2", "runtime/generated_rollouts"),
                          "up to 40 % less compute for a given accuracy (line 433)")]


def seed001_notes(study: Study) -> list[str]:
    caution = Comparison("", "at least", study.values("fifo-W4T4", COUNTDOWN_REWARD),
                         study.values("lifo-W4T4", COUNTDOWN_REWARD), "").judged()
    spread = f" ± {caution['diff_hw']:.3f}" if not np.isnan(caution["diff_hw"]) else ""
    return [f"(W, T) = (4, 4) is the paper's caution, not its claim (lines 457-461: replay ratio 17.6, "
            f"'aggressive replay eventually degrades performances'): FIFO minus LIFO held-out accuracy "
            f"{caution['diff']:+.3f}{spread} over {caution['n_pairs']} seed(s), not judged",
            "compute per update (1 + W/T with a buffer, 1 + mu without, lockstep): " + ", ".join(
                f"{role} {study.values(role, 'runtime/compute_per_update').mean():.2f}"
                for role in sorted(study.runs["role"].unique())),
            "workers' busy share on the lockstep clock (1 - runtime/idle_workers; 1.00: all W generate all along): "
            + ", ".join(f"{role} {1 - study.values(role, 'runtime/idle_workers').mean():.2f}"
                        for role in sorted(study.runs["role"].unique()))]


def seed003_checks(study: Study) -> list[ScheduleCheck]:
    return [ScheduleCheck("POPO vs DAPO, rollouts generated", study.values("popo", "budget/fresh_evaluations"),
                          study.values("dapo", "budget/fresh_evaluations"), "205k vs 877k (Table 2, line 98)")]


def seed003_notes(study: Study) -> list[str]:
    return ["effective-sample ratio of the training batches (batch/effective_fraction_cumulative): " + ", ".join(
        f"{role} {study.spread(role, 'batch/effective_fraction_cumulative')}" for role in ("popo", "grpo", "dapo"))]


def seed004_notes(study: Study) -> list[str]:
    """The held-out reward, and how many frontier prompts the curriculum injected: with its memory nearly empty
    the frontier arm samples uniformly, the two arms are one run, and "not raised" tests nothing."""
    injected, asked = (study.spread("frontier", metric, study.step_means("frontier", metric))
                       for metric in ("curriculum/retrieved", "curriculum/requested"))
    return ["held-out mean reward (the paper's average score, 0.46 -> 0.52): " + ", ".join(
        f"{role} {study.spread(role, COUNTDOWN_REWARD)}" for role in ("uniform", "frontier")),
            f"frontier prompts injected a step (curriculum/retrieved, each run's mean over its steps): {injected}, "
            f"of {asked} replacements asked (curriculum/requested); the rest were drawn uniformly; memory at the "
            f"end (curriculum/memory_size): {study.spread('frontier', 'curriculum/memory_size')}"]


SEED000_LINE11 = ("Replay at  $\\rho = 1$  cuts fresh verifier evaluations from 102.4K to 51.7K per run, about half, "
                  "while several replay settings match or exceed the fresh-only  $\\text{pass}@16$  of 0.756.")
SEED002_FLAT = ("flat", DEFAULT_MARGIN, "the paper's widest gap it reads as no clear gain, mild combined 0.451 "
                "against on-policy 0.467 (0.016, line 143), rounded up")

CLAIMS = {claim.name: claim for claim in (
    Claim("seed000", "Seed 000 (Replay-RLOO)",
          "At rho = 1 replay cuts fresh verifier evaluations from 102.4K to 51.7K a run while several replay "
          "settings match or exceed the fresh-only pass@16 of 0.756: at equal steps replay (rho = 1, L in {1, 2}, "
          "c = 1) reaches at least fresh-only's held-out pass@k.",
          (11, SEED000_LINE11),
          {"fresh-only": cell_is("rho0"), "rho1-L1-c1": cell_is("rho1-L1-c1"), "rho1-L2-c1": cell_is("rho1-L2-c1")},
          tuple(Spec(f"{role} vs fresh-only, held-out pass@k at equal steps", role, "fresh-only", "pass@k<=16",
                     "at least", DEFAULT_MARGIN, ONE_OF_FIFTY + ": the paper's 50 held-out prompts 'cannot reliably "
                     "separate' a 0.036 band of pass@16 (line 138)", "pass@16 0.792 / 0.756 (Table 1, line 118)",
                     (11, SEED000_LINE11)) for role in ("rho1-L1-c1", "rho1-L2-c1")),
          "fresh-only", (TINY, COUNTDOWN_DATA, QUICK + " for the canonical 5 x 16 samples on 50 prompts (line 9)"),
          seed000_checks),
    Claim("seed001", "Seed 001 (asynchronous replay)",
          "For a good buffer configuration, (W, T) = (6, 2) in the paper's Figure 1, a FIFO buffer reaches the "
          "LIFO pipe's accuracy with less inference compute, saving up to 40 % of the compute to reach a given "
          "accuracy; here at equal updates on the lockstep clock, where the compute is fixed by the schedule.",
          (433, "Figure 1 summarizes our central finding: for a good choice of buffer configuration, one may save "
                "up to 40% of"),
          {"lifo-W6T2": cell_has("W6T2", "lifo"), "lifo-W4T4": cell_has("W4T4", "lifo"),
           "fifo-W6T2": cell_has("W6T2", without="lifo"), "fifo-W4T4": cell_has("W4T4", without="lifo")},
          (Spec("FIFO vs LIFO at (W, T) = (6, 2), held-out accuracy at equal updates", "fifo-W6T2", "lifo-W6T2",
                COUNTDOWN_REWARD, "at least", DEFAULT_MARGIN, ONE_OF_FIFTY + "; the paper gives no tolerance",
                "FIFO reaches LIFO's accuracy (Figure 1, (W, T) = (6, 2), line 425)",
                (425, "(W,T ) = (6, 2) and various buffer sizes"),
                "final accuracy at equal updates for the paper's compute-to-accuracy curves"),),
          "lifo-W6T2", (TINY, "the built-in math set's fraction problems (4,000 to train, 350 held out) for "
                        "OpenR1-Math-220k (line 425)",
                        QUICK.replace("500", "350") + " for the paper's test accuracy"),
          # Sequential: a first sitting of 8 seeds (its eight Ray cells a seed take the longest of the five
          # studies), then the plan; each test at 2.5 %.
          seed001_checks, seed001_notes, looks=(8,)),
    Claim("seed002", "Seed 002 (off-policy sampling for RLOO)",
          "At an equal 15,360 rollouts no reuse mechanism clearly beats on-policy RLOO (0.467): stale sampling "
          "0.471 and replay R = 2 0.457 are within a point of it, and the aggressive run's final checkpoint "
          "collapses to 0.206 (its best checkpoint reached 0.477).",
          (133, "Table 1 summarizes main ablations at equal rollout budget (15,360)."),
          {"on-policy": tags_are(buffer="none", behaviour="current"), "stale": tags_are(buffer="none", behaviour="stale"),
           "replay-R2": tags_are(buffer="fifo", behaviour="current"), "aggressive": tags_are(buffer="fifo", behaviour="stale")},
          (Spec("stale vs on-policy, held-out reward (final checkpoint)", "stale", "on-policy", COUNTDOWN_REWARD,
                *SEED002_FLAT, "0.471 vs 0.467 (one seed)", (139, "Stale ($n=4$)	0.471")),
           Spec("replay-R2 vs on-policy, held-out reward (final checkpoint)", "replay-R2", "on-policy",
                COUNTDOWN_REWARD, *SEED002_FLAT, "0.457 vs 0.467 (one seed)", (142, "Replay ($R=2$)	0.457")),
           Spec("aggressive vs on-policy, held-out reward (final checkpoint)", "aggressive", "on-policy",
                COUNTDOWN_REWARD, "lower", 0.261, "the paper's collapse, 0.467 - 0.206",
                "final checkpoint 0.206 vs 0.467 (best one 0.477)", (145, "Aggressive (final ckpt) [†]	0.206"))),
          "on-policy", (TINY, COUNTDOWN_DATA, QUICK + " of the final checkpoint for the paper's best checkpoint "
                        "over temperatures", "30,720 rollouts a run for the paper's 15,360")),
    Claim("seed003", "Seed 003 (POPO)",
          "POPO matches DAPO's accuracy with fewer rollouts and beats GRPO: on Countdown 60.4 against DAPO's 61.5 "
          "with 205k rollouts against 877k, and against GRPO's 51.6.",
          (100, "POPO achieves competitive performance with DAPO using only 30% of its rollout budget"),
          {"popo": tags_are(buffer="popo"), "dapo": tags_are(buffer="none", sampling="dynamic"),
           "grpo": tags_are(buffer="none", sampling="standard")},
          (Spec("POPO vs DAPO, held-out reward (equivalence)", "popo", "dapo", COUNTDOWN_REWARD, "flat", 0.02,
                "the paper's own 1.1-point gap (60.4 vs 61.5) must pass: 2 points, its gap rounded up with room",
                "60.4 vs 61.5 (Table 2, Countdown avg.)", (98, "| +POPO | 48.7 | 72.1 | 60.4 | 3.2h | 205k |")),
           Spec("POPO vs GRPO, held-out reward", "popo", "grpo", COUNTDOWN_REWARD, "higher", 0.088,
                "the paper's gain, 60.4 - 51.6 points", "60.4 vs 51.6 (Table 2)",
                (94, "| +GRPO | 39.0 | 64.3 | 51.6 | 2.8h | 205k |"))),
          "grpo", (TINY, COUNTDOWN_DATA, QUICK + " (mean reward) for Avg@16 on 512 CD-34 + 512 CD-4 held-out "
                   "problems (line 258)"),
          seed003_checks, seed003_notes),
    Claim("seed004", "Seed 004 (frontier curriculum)",
          "The frontier curriculum (rho = 0.10) raises pass@1 over uniform sampling, 0.41 to 0.49, while pass@k "
          "stays flat (pass@128 0.82 for both).",
          (11, "Frontier-Curriculum RLOO improves average verifier score from 0.46 to 0.52 and pass@1 from 0.41 to "
               "0.49 over vanilla RLOO, while pass@128 remains at 0.82."),
          {"frontier": tags_are(curriculum="frontier"), "uniform": tags_are(curriculum="none")},
          (Spec("frontier vs uniform, held-out pass@1", "frontier", "uniform", "quick/final/pass_at_1", "higher", 0.08,
                "the paper's gain, 0.49 - 0.41", "0.49 vs 0.41 (Table 1)",
                (159, "Frontier-Curriculum RLOO	<b>0.52</b>	<b>0.49</b>	<b>0.77</b>	0.82")),
           Spec("frontier vs uniform, held-out pass@32 (equivalence)", "frontier", "uniform", "quick/final/pass_at_32",
                "flat", DEFAULT_MARGIN, "one of the paper's 50 held-out prompts (6400 rollouts / 128 samples, "
                "line 186)", "pass@128 0.82 vs 0.82 (Table 1)", (186, "Across the same 6400 evaluated rollouts "
                "per method"), "pass@32 for the paper's pass@128: the largest k of 32 samples a prompt")),
          "uniform", (TINY, COUNTDOWN_DATA, "500 held-out prompts x 32 samples (unbiased pass@k) for the paper's 128 samples a prompt"),
          notes=seed004_notes),
)}
