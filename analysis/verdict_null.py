"""How often a claim's verdict says "reproduced" when the claim is false: a model-free null simulation.

Each simulated study draws every role's value at each training seed from one distribution (a seed effect the
roles share, as paired arms do, plus each run's own noise), so no arm differs from another. "edge" moves each
comparison to its null's edge instead: a method worse by the margin for "at least", better by it for "flat"
(still no difference for "higher" / "lower"). A claim is reproduced in a study when every comparison agrees,
as `analysis.claims.verdict` decides. `python -m analysis.verdict_null` prints the table docs/reproductions.md
quotes, under the rules of `analysis.claims` ("new") and under the rules they replaced ("old": a two-sided
paired t-test at 95 %, "at least" agreeing on a mean >= 0 without significance, "flat" on no significant
difference, and the schedule's rollout rows, constant over seeds, always agreeing).

The rules are weakest where one row sits at an edge and the claim's other rows are clearly true, so that
row alone decides: "least favourable" puts each row in turn at its null's edge (a false claim, to come out
"reproduced") and "at the paper's effect" each row in turn at the claim's own edge (the paper's effect for
higher / lower, the margin for at least / flat: a true claim, to come out "not reproduced"), the others far
inside their claims, and reports the largest share over the rows. Seed-wise differences there have the
committed studies' spread, DIFF_SD.
"""

from __future__ import annotations

import sys

import numpy as np
from scipy import stats

from analysis.claims import CLAIMS, DEFAULT_MARGIN, DIFF_SD, Claim
from analysis.seeds import ALPHA, claim_outcomes, detectable, one_sided_p

SEED_SD, RUN_SD = 0.02, 0.03  # about the spread of the committed studies' held-out rewards (docs/reproductions.md)

# The replaced claims' rows: (method, baseline, metric, expect, margin for the edge); None: a schedule row, always
# agreeing. Rows on one metric share their roles' draws (seed 003's POPO against DAPO and GRPO); other metrics
# are drawn apart.
OLD_ROWS = {
    "seed000": [("rho1-L1-c1", "fresh-only", "r", "at least", DEFAULT_MARGIN),
                ("rho1-L2-c1", "fresh-only", "r", "at least", DEFAULT_MARGIN)],
    "seed001": [("fifo-W6T2", "lifo-W6T2", "r", "at least", DEFAULT_MARGIN), None,
                ("fifo-W4T4", "lifo-W4T4", "r", "at least", DEFAULT_MARGIN), None],
    "seed002": [("stale", "on-policy", "r", "flat", DEFAULT_MARGIN), ("replay-R2", "on-policy", "r", "flat", DEFAULT_MARGIN),
                ("aggressive", "on-policy", "r", "lower", 0.0)],
    "seed003": [("popo", "dapo", "r", "at least", DEFAULT_MARGIN), None, ("popo", "grpo", "r", "higher", 0.0)],
    "seed004": [("frontier", "uniform", "quick/final/pass_at_1", "higher", 0.0),
                ("frontier", "uniform", "quick/final/pass_at_32", "flat", DEFAULT_MARGIN)],
}


def edge_shift(expect: str, margin: float) -> float:
    return {"at least": -margin, "flat": margin}.get(expect, 0.0)


def draw(keys, studies: int, seeds: int, rng: np.random.Generator) -> dict[tuple[str, str], np.ndarray]:
    """(role, metric) -> values [study, seed]: a seed effect shared within a metric plus each run's noise."""
    shared = {metric: rng.normal(0.0, SEED_SD, (studies, seeds)) for metric in sorted({m for _, m in keys})}
    return {key: shared[key[1]] + rng.normal(0.0, RUN_SD, (studies, seeds)) for key in sorted(keys)}


def old_agrees(d: np.ndarray, expect: str) -> np.ndarray:
    """The replaced rule: a two-sided paired t-test at 95 % and the agreement it read off it."""
    n = d.shape[-1]
    t = d.mean(axis=-1) / (d.std(axis=-1, ddof=1) / np.sqrt(n))
    significant = 2 * stats.t.sf(np.abs(t), n - 1) < 0.05
    mean = d.mean(axis=-1)
    return {"higher": significant & (mean > 0), "lower": significant & (mean < 0),
            "at least": ~(significant & (mean < 0)) & (mean >= 0), "flat": ~significant}[expect]


def reproduced_rate(claim: Claim, rules: str = "new", edge: bool = False, studies: int = 2000, seeds: int = 3,
                    seed: int = 0) -> float:
    """The share of simulated studies whose verdict is "reproduced" (rules "new" or "old")."""
    rng = np.random.default_rng(seed)
    rows = ([(s.method, s.baseline, s.metric, s.expect, s.margin) for s in claim.specs] if rules == "new"
            else [row for row in OLD_ROWS[claim.name] if row is not None])
    metric = lambda m: "r" if m == "quick/final/mean_reward" else m  # the old rows' reward is the same metric
    values = draw({(role, metric(m)) for method, baseline, m, *_ in rows for role in (method, baseline)},
                  studies, seeds, rng)
    agree = np.ones(studies, dtype=bool)
    for method, baseline, m, expect, margin in rows:
        d = values[method, metric(m)] - values[baseline, metric(m)] + (edge_shift(expect, margin) if edge else 0.0)
        agree &= claim_outcomes(d, expect, margin) == "agrees" if rules == "new" else old_agrees(d, expect)
    return float(agree.mean())


def old_rejects(d: np.ndarray, expect: str, margin: float) -> np.ndarray:
    """The replaced rejection: significantly the other way, or not shown where the seeds' observed spread could
    detect the margin (post-hoc power)."""
    outcomes = claim_outcomes(d, expect, margin)
    if expect in ("higher", "lower"):  # the other way: significantly below 0 for higher, above it for lower
        against = one_sided_p(d, 0.0, expect == "lower") < ALPHA
    else:
        against = outcomes == "against"
    powered = detectable(d.std(axis=-1, ddof=1), d.shape[-1], expect == "flat") <= margin
    return against | ((outcomes != "agrees") & powered)


CLEARLY = {"higher": 1.0, "lower": -1.0, "at least": 1.0, "flat": 0.0}  # far inside each claim


def one_row_at_its_edge(claim: Claim, outcome: str, rules: str = "new", studies: int = 2000, seeds: int = 3,
                        seed: int = 0) -> float:
    """The largest share, over the claim's rows, of simulated studies whose verdict is `outcome` when that row
    sits at its edge and the others are clearly true (their differences far inside the claim, nearly without
    noise). `outcome` "reproduced": the row at its null's edge (false agreement); "not reproduced": the row at
    the claim's edge, the paper's effect or the margin (false rejection; `rules` "old": post-hoc power)."""
    rng = np.random.default_rng(seed)
    specs, worst = claim.specs, 0.0
    for row in range(len(specs)):
        decided = np.ones(studies, dtype=bool) if outcome == "reproduced" else np.zeros(studies, dtype=bool)
        for i, spec in enumerate(specs):
            if i != row:
                d = CLEARLY[spec.expect] + rng.normal(0.0, DIFF_SD / 1000, (studies, seeds))
            elif outcome == "reproduced":
                d = edge_shift(spec.expect, spec.margin) + rng.normal(0.0, DIFF_SD, (studies, seeds))
            else:
                paper = {"higher": spec.margin, "lower": -spec.margin, "at least": -spec.margin,
                         "flat": spec.margin}[spec.expect]
                d = paper + rng.normal(0.0, DIFF_SD, (studies, seeds))
            if outcome == "reproduced":
                decided &= claim_outcomes(d, spec.expect, spec.margin) == "agrees"
            else:
                decided |= (claim_outcomes(d, spec.expect, spec.margin) == "against" if rules == "new"
                            else old_rejects(d, spec.expect, spec.margin))
        worst = max(worst, float(decided.mean()))
    return worst


def any_look_agrees(claim: Claim, levels: dict[int, float], studies: int = 20_000, seed: int = 0) -> float:
    """The share of simulated null studies that come out "reproduced" at any of the looks in `levels` (seed count ->
    one-sided level), each look reading the first n seeds of the same study: the least favourable configuration,
    one row at its null's edge at the committed studies' spread and the others clearly true, its worst row."""
    rng = np.random.default_rng(seed)
    most, worst = max(levels), 0.0
    for row in range(len(claim.specs)):
        draws = [(spec, (edge_shift(spec.expect, spec.margin) + rng.normal(0.0, DIFF_SD, (studies, most))) if i == row
                  else CLEARLY[spec.expect] + rng.normal(0.0, DIFF_SD / 1000, (studies, most)))
                 for i, spec in enumerate(claim.specs)]
        agreed = np.zeros(studies, dtype=bool)
        for n, level in levels.items():
            at_look = np.ones(studies, dtype=bool)
            for spec, d in draws:
                at_look &= claim_outcomes(d[:, :n], spec.expect, spec.margin, level) == "agrees"
            agreed |= at_look
        worst = max(worst, float(agreed.mean()))
    return worst


def table(studies: int = 2000, seeds: int = 3) -> list[str]:
    lines = ["| claim | old rules, no effect | new rules, no effect | old rules, null edge | new rules, null edge "
             "| new rules, least favourable | old rules, not reproduced at the paper's effect | new rules, not "
             "reproduced at the paper's effect |", "| --- |" + " --- |" * 7]
    for name, claim in CLAIMS.items():
        rates = [reproduced_rate(claim, rules, edge, studies, seeds) for edge in (False, True)
                 for rules in ("old", "new")]
        rates += [one_row_at_its_edge(claim, "reproduced", "new", studies, seeds),
                  one_row_at_its_edge(claim, "not reproduced", "old", studies, seeds),
                  one_row_at_its_edge(claim, "not reproduced", "new", studies, seeds)]
        lines.append(f"| {name} | " + " | ".join(f"{rate:.1%}" for rate in rates) + " |")
    return lines


if __name__ == "__main__":
    count = int(sys.argv[1]) if len(sys.argv) > 1 else 2000
    print(f"{count:,} simulated studies of 3 seeds, seed sd {SEED_SD}, run sd {RUN_SD}; one row at its edge: "
          f"differences of sd {DIFF_SD:.4f}")
    print("\n".join(table(count)))
