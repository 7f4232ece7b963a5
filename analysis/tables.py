"""The report's tables, built from the used runs (analysis.runs): results (paper Tables 2/3), variants (SPEC 9),
the design grids behind the heatmaps, the best-of-N probe (Table 4) and the failure taxonomy; and each
table's cells as text, shared by the markdown and LaTeX outputs.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field

import numpy as np
import pandas as pd

from analysis.runs import (grid_cell, is_plain, run_cell_key, run_fresh_evaluations, run_metric,
                           run_pass_ks, protocol_order, run_protocol, run_role, run_seed, run_tag, tag_column)
from src.task.countdown_failures import LABELS as COUNTDOWN_LABELS
from src.task.math.failures import LABELS as MATH_LABELS

# Every task's failure categories, each taxonomy in its order of checks; a report shows those its runs logged.
FAILURE_LABELS = {**COUNTDOWN_LABELS, **MATH_LABELS}
FAILURE_CATEGORIES = tuple(FAILURE_LABELS)

PROBE_KS = [1, 4, 8, 16, 32, 64]
SUMMARY_METRICS = {"mean_reward": "reward", "correction_rate": "correction_rate", "unique_rate": "unique_rate"}
# The two design grids of SPEC 8: a fixed coordinate plus rows x columns.
GRIDS = {
    "age": dict(title="L × c at ρ = 1", fixed=("rho", 1.0), row=("L", [1, 2, 3]), col=("c", [1, 3, 10])),
    "ratio": dict(title="ρ × c at L = 2", fixed=("L", 2), row=("rho", [0.5, 1, 1.5, 2]), col=("c", [1, 3, 10])),
}
HEATMAP_PANELS = ["pass@k_max", "reward", "correction_rate", "pass@1"]  # pass@1 panel: paper Figure 9
VARIANT_STUDY = "variants"  # the sweep whose report always has a Variants section
VARIANT_COLUMNS = ["variant", "cell", "setting", "fresh_evaluations", "gradient_steps", "effective_ratio",
                   "reward", "reward_hw", "pass@1", "pass@1_hw", "k_max", "pass@k_max", "pass@k_max_hw",
                   "protocol", "run_id"]


RESULT_COLUMNS = ["run_id", "sweep", "cell", "cell_id", "cell_key", "seed", "policy", "setting", "plain", "variant",
                  "rho", "L", "c", "coordinates", "protocol", "fresh_evaluations", "gradient_steps",
                  "effective_ratio", "k_max"]


def _result_row(run: pd.Series) -> dict:
    """One used run as numbers: labels, coordinates, budget, and each final metric with its half-width."""
    role, protocol = run_role(run), run_protocol(run)
    prefix = f"{protocol}/final"
    ks = run_pass_ks(run, prefix) if protocol != "none" else []
    row = {"run_id": run["run_id"], "sweep": run_tag(run, "sweep"), "cell": run_tag(run, "cell", "?"),
           "cell_id": run_tag(run, "cell_id"), "cell_key": run_cell_key(run), "seed": run_seed(run),
           "policy": run_tag(run, "policy"), **{key: role[key] for key in ("setting", "plain", "variant", "rho", "L",
                                                                           "c", "coordinates")},
           "protocol": protocol, "fresh_evaluations": run_fresh_evaluations(run),
           "gradient_steps": run_metric(run, "budget/gradient_steps"),
           # The cumulative share's last value is the share over the whole run.
           "effective_ratio": run_metric(run, "batch/effective_fraction_cumulative"),
           "k_max": ks[-1] if ks else np.nan}
    for k in ks:
        row[f"pass@{k}"] = run_metric(run, f"{prefix}/pass_at_{k}")
        row[f"pass@{k}_hw"] = run_metric(run, f"{prefix}/pass_at_{k}_hw")
    # The largest k of the run's own protocol (16 canonical, 8 quick): the frontier/heatmap axis.
    row["pass@k_max"] = row[f"pass@{ks[-1]}"] if ks else np.nan
    row["pass@k_max_hw"] = row[f"pass@{ks[-1]}_hw"] if ks else np.nan
    for metric, name in SUMMARY_METRICS.items():
        row[name] = run_metric(run, f"{prefix}/{metric}")
        row[f"{name}_hw"] = run_metric(run, f"{prefix}/{metric}_hw")
    return row


def results_table(used: pd.DataFrame) -> pd.DataFrame:
    """One numeric row per used run (paper Tables 2/3): role, coordinates, protocol, budget, metrics ± hw.

    Plain grid rows come first (fresh-only, then by rho, L, c), then variants by label and cell.
    """
    rows = [_result_row(run) for _, run in used.iterrows()]
    table = pd.DataFrame(rows, columns=None if rows else RESULT_COLUMNS)
    for column in ["pass@1", "pass@1_hw", "pass@k_max", "pass@k_max_hw",
                   *[f"{n}{s}" for n in SUMMARY_METRICS.values() for s in ("", "_hw")]]:
        if column not in table:
            table[column] = np.nan
    pass_columns = sorted((col for col in table if re.fullmatch(r"pass@\d+(_hw)?", col)),
                          key=lambda col: (int(re.search(r"\d+", col).group()), col.endswith("_hw")))
    rest = [col for col in table if col not in RESULT_COLUMNS and col not in pass_columns]
    table = table[RESULT_COLUMNS + pass_columns + rest]
    return table if table.empty else _grid_then_variants(table)


def _grid_then_variants(table: pd.DataFrame) -> pd.DataFrame:
    """Plain rows first (baseline, then rho, L, c: NaN L/c only on rho = 0 rows), then variants by label, cell."""
    plain = table["plain"].astype(bool)
    grid = table[plain].sort_values(["rho", "L", "c", "cell"], na_position="first", kind="stable")
    variants = table[~plain].sort_values(["variant", "cell"], kind="stable")
    # Concatenating only the non-empty parts keeps the column dtypes of the part that has rows.
    return pd.concat([part for part in (grid, variants) if not part.empty] or [table]).reset_index(drop=True)


def variants_table(results: pd.DataFrame, used: pd.DataFrame) -> pd.DataFrame:
    """The SPEC 9 comparison: references (fresh-only baseline, plain cells of the variants study), then variants.

    A plain cell belongs to the variants study by its `sweep` tag, or by the `sweeps` tag when another
    study ran it first (the variants study reuses the baseline and age cells, SPEC 8). Empty when the
    report has neither a variant run nor a cell of the variants study.
    """
    if results.empty:
        return pd.DataFrame(columns=VARIANT_COLUMNS)
    in_study = {run["run_id"] for _, run in used.iterrows()
                if run_tag(run, "sweep") == VARIANT_STUDY or f",{VARIANT_STUDY}," in run_tag(run, "sweeps")}
    plain = results["plain"].astype(bool)
    keep = ~plain | results["run_id"].isin(in_study)
    if keep.any():  # the baseline is a reference only where there is something to compare with it
        keep |= results.index.isin(results.index[plain & (results["rho"] == 0)][:1])
    return results.loc[keep, VARIANT_COLUMNS].reset_index(drop=True)


def same_label_configs(results: pd.DataFrame) -> pd.DataFrame:
    """Used runs that share a table label (variant, cell, policy) but not a config (`cell_id`).

    Such rows read like repeats of one experiment but are different experiments: a knob or the
    warm-start weights changed between them (src.study.sweep.cell_identity), e.g. a store holding a study
    from before and after `make sft-tiny` was rerun.
    """
    if results.empty:
        return results
    # Training seeds of one cell share its cell_key: they are repeats, not different configurations.
    label = ["variant", "cell", "policy"]
    one_per_key = results.drop_duplicates([*label, "cell_key"])
    return one_per_key[one_per_key.duplicated(label, keep=False)].sort_values(label, kind="stable")


def baseline_values(results: pd.DataFrame) -> dict[str, tuple[float, float]]:
    """(mean, half-width) of each metric for the fresh-only run (first one), empty when there is none."""
    # Plain only: a rho = 0 variant (DAPO, POPO, GRPO fresh-only) is no baseline for the grid.
    baseline = results[results["plain"].astype(bool) & (results["rho"] == 0)] if not results.empty else results
    if baseline.empty:
        return {}
    row = baseline.iloc[0]
    return {metric: (row[metric], row.get(metric + "_hw", np.nan)) for metric in HEATMAP_PANELS + ["unique_rate"]}


def heatmap_grid(results: pd.DataFrame, name: str, unfinished: pd.DataFrame | None = None) -> pd.DataFrame:
    """Every position of a design grid (GRIDS[name]) with its run's metrics; run_id NaN where no finished run.

    `unfinished` (runs from select_cells) fills the `unfinished` column: the status of the newest
    unfinished run of a position that has no finished run, so the report can say why it is missing.
    """
    pending = {}
    if unfinished is not None and not unfinished.empty:
        # An unfinished variant is no reason for a grid cell to be missing.
        plain = unfinished[[is_plain(run) for _, run in unfinished.iterrows()]]
        for cell, status in zip(tag_column(plain, "tags.cell", "?")[::-1], plain["status"][::-1]):
            pending[cell] = status  # newest first in `unfinished`, so the reversed walk ends on the newest
    spec = GRIDS[name]
    (fixed_key, fixed_value), (row_key, row_values), (col_key, col_values) = spec["fixed"], spec["row"], spec["col"]
    # Variants already have NaN coordinates (run_role); the plain filter states the rule outright.
    replay = results[results["plain"].astype(bool) & (results["rho"] > 0)] if not results.empty else results
    cells = []
    for row_value in row_values:
        for col_value in col_values:
            where = {fixed_key: fixed_value, row_key: row_value, col_key: col_value}
            match = replay[np.logical_and.reduce([np.isclose(replay[k], v) for k, v in where.items()])] \
                if not replay.empty else replay
            cell = {"row": row_value, "col": col_value,
                    "cell": grid_cell(where["rho"], where["L"], where["c"]), "run_id": np.nan, "protocol": ""}
            cell["unfinished"] = pending.get(cell["cell"], "")
            if not match.empty:
                # Several policies could share a position; the results order (newest first within a cell) decides.
                found = match.iloc[0]
                cell.update({"run_id": found["run_id"], "protocol": found["protocol"], "unfinished": ""})
                cell.update({m + s: found[m + s] for m in HEATMAP_PANELS for s in ("", "_hw")})
                # The paired test against fresh-only over training seeds (analysis/seeds.py), where the table has it.
                cell.update({m + "_verdict": found.get(m + "_verdict", "") for m in HEATMAP_PANELS})
            cells.append(cell)
    grid = pd.DataFrame(cells)
    for column in [m + s for m in HEATMAP_PANELS for s in ("", "_hw")]:
        if column not in grid:
            grid[column] = np.nan
    return grid


def missing_cells(grid: pd.DataFrame) -> tuple[list[str], list[str]]:
    """(grid cells without a finished run, cells whose run has no final evaluation)."""
    no_run = grid.loc[grid["run_id"].isna(), "cell"].tolist()
    no_eval = grid.loc[grid["run_id"].notna() & grid["pass@k_max"].isna(), "cell"].tolist()
    return no_run, no_eval


MIN_HEATMAP_CELLS = 2  # a colour scale compares values: a grid with fewer finished cells is left out


def drawable_grid(grid: pd.DataFrame) -> pd.DataFrame:
    """The rows and columns of a design grid that hold at least one run: the part a heatmap can fill."""
    ran = grid[grid["run_id"].notna()]
    return grid[grid["row"].isin(ran["row"]) & grid["col"].isin(ran["col"])].reset_index(drop=True)


def best_of_n_table(used: pd.DataFrame) -> tuple[pd.DataFrame, list[int]]:
    """Paper Table 4: probe/final pass@k (unbiased) for each used run that has probe results, and the ks."""
    rows, ks = [], set()
    for _, run in used.iterrows():
        found = run_pass_ks(run, "probe/final")
        if not found:
            continue
        ks.update(found)
        row = {"run_id": run["run_id"], "cell": run.get("tags.cell", "?"), **run_role(run)}
        for k in found:
            row[f"pass@{k}"] = run_metric(run, f"probe/final/pass_at_{k}")
            row[f"pass@{k}_hw"] = run_metric(run, f"probe/final/pass_at_{k}_hw")
        rows.append(row)
    ks = sorted(ks) or PROBE_KS
    table = pd.DataFrame(rows, columns=None if rows else ["run_id", "cell", "plain", "setting", "variant", "rho", "L",
                                                          "c", "coordinates"])
    for k in ks:
        for column in (f"pass@{k}", f"pass@{k}_hw"):
            if column not in table:
                table[column] = np.nan
    if not table.empty:
        table = _grid_then_variants(table)
    return table, ks


def failure_table(used: pd.DataFrame) -> pd.DataFrame:
    """Seed 004 Figures 3-4: failed rollouts per method and category, from `<protocol>/<stage>/failures/*`.

    One "warm start" row per policy (the start evaluation of the newest run that has one: every run of a
    policy starts from the same weights), then one row per used run's final evaluation, labelled by its
    variant. Counts are per evaluation repeat (means over repeats), shares are of all failed rollouts.
    """
    rows, started = [], set()
    for _, run in used.iterrows():
        protocol = run_protocol(run)
        if protocol == "none":
            continue
        role = run_role(run)
        stages = [("final", role["variant"])]
        policy = run_tag(run, "policy")
        if policy not in started and not pd.isna(run_metric(run, f"{protocol}/start/failures/failed")):
            started.add(policy)
            stages.insert(0, ("start", "warm start"))
        for stage, method in stages:
            prefix = f"{protocol}/{stage}/failures"
            if pd.isna(run_metric(run, f"{prefix}/failed")):
                continue
            row = {"method": method, "cell": run_tag(run, "cell", "?"), "stage": stage, "protocol": protocol,
                   "run_id": run["run_id"], "rollouts": run_metric(run, f"{prefix}/rollouts"),
                   "failed": run_metric(run, f"{prefix}/failed")}
            for category in FAILURE_CATEGORIES:
                row[category] = run_metric(run, f"{prefix}/{category}")
                row[f"share_{category}"] = run_metric(run, f"{protocol}/{stage}/failure_share/{category}")
            rows.append(row)
    logged = [c for c in FAILURE_CATEGORIES if any(not pd.isna(row[c]) for row in rows)]
    columns = ["method", "cell", "stage", "protocol", "run_id", "rollouts", "failed", *logged,
               *[f"share_{c}" for c in logged]]
    table = pd.DataFrame(rows, columns=columns)
    # Warm starts first, then methods by label.
    return table.sort_values(["stage", "method", "cell"], key=lambda col: col.map({"start": 0, "final": 1})
                             if col.name == "stage" else col, kind="stable").reset_index(drop=True)


def k_label(results: pd.DataFrame) -> str:
    """'pass@16' when every row has the same largest k, else a label saying that k differs by protocol."""
    ks = sorted({int(k) for k in results["k_max"].dropna()}) if not results.empty else []
    if len(ks) == 1:
        return f"pass@{ks[0]}"
    if not ks:
        return "pass@16"
    return "pass@k (largest k of each row's protocol: " + ", ".join(
        f"{p} k={int(results.loc[results['protocol'] == p, 'k_max'].max())}"
        for p in protocol_order(results["protocol"]) if p != "none") + ")"


def format_value(mean: float, hw: float = np.nan, digits: int = 3) -> str:
    """'mean ± half-width' with three decimals; just the mean without a half-width, '-' without a mean."""
    if not _finite(mean):
        return "-"
    return f"{mean:.{digits}f} ± {hw:.{digits}f}" if _finite(hw) else f"{mean:.{digits}f}"


def _finite(value) -> bool:
    return value is not None and not pd.isna(value) and np.isfinite(float(value))


def format_count(value: float) -> str:
    """Fresh-evaluation counts as in the paper: 51712 -> '51.7K' (small counts as integers)."""
    if pd.isna(value):
        return "-"
    return f"{value / 1000:.1f}K" if value >= 10_000 else f"{int(value)}"


def format_integer(value: float) -> str:
    """A count in full ('120'), '-' when the run did not log it."""
    return "-" if pd.isna(value) else f"{int(value)}"


def format_ratio(value: float) -> str:
    """A share with three decimals ('0.625'), '-' when the run did not log it."""
    return "-" if pd.isna(value) else f"{value:.3f}"


def format_seconds(value: float) -> str:
    """A duration: '8.3 s' under a minute, '12.5 min' above, '-' when unknown."""
    if pd.isna(value):
        return "-"
    return f"{value:.1f} s" if value < 60 else f"{value / 60:.1f} min"


def top_k(row: pd.Series, mixed_k: bool) -> str:
    """pass@k_max ± hw, naming k when rows of the table differ in their largest k."""
    top = format_value(row["pass@k_max"], row["pass@k_max_hw"])
    if mixed_k and not pd.isna(row["k_max"]):
        top += f" (k={int(row['k_max'])})"
    return top


def results_cells(results: pd.DataFrame) -> tuple[list[str], list[list[str]]]:
    """The results table's headers and rows as text, shared by the markdown and LaTeX outputs."""
    label = k_label(results)
    mixed_k = results["k_max"].dropna().nunique() > 1
    multi_policy = results["policy"].nunique() > 1
    # "variant" stands where "Setting" stood: for runs without the tag it is the same Fresh-only/Replay.
    headers = ["variant", "(ρ, L, c)", "cell", *(["policy"] if multi_policy else []), "protocol",
               "rollouts (fresh evals)", "gradient steps", "effective ratio",
               "pass@1", label if not mixed_k else "pass@k (largest k)", "reward", "correction rate", "run"]
    rows = []
    for _, row in results.iterrows():
        rows.append([row["variant"], row["coordinates"], row["cell"], *([row["policy"]] if multi_policy else []),
                     row["protocol"], format_count(row["fresh_evaluations"]), format_integer(row["gradient_steps"]),
                     format_ratio(row["effective_ratio"]),
                     format_value(row["pass@1"], row["pass@1_hw"]), top_k(row, mixed_k),
                     format_value(row["reward"], row["reward_hw"]),
                     format_value(row["correction_rate"], row["correction_rate_hw"]), f"`{row['run_id'][:8]}`"])
    return headers, rows


@dataclass
class ReportData:
    """Everything one report shows, read once from MLflow: the tables every output (CSV, LaTeX, markdown,
    figures) is written from."""
    used: pd.DataFrame
    superseded: pd.DataFrame
    unfinished: pd.DataFrame
    results: pd.DataFrame  # one row per used run
    cells: pd.DataFrame  # one row per cell over its training seeds (analysis.seeds.seed_table)
    history: pd.DataFrame  # per-step metrics, long (run_id, key, step, value)
    variants: pd.DataFrame
    probe: pd.DataFrame
    probe_ks: list[int]
    failures: pd.DataFrame
    grids: dict[str, pd.DataFrame] = field(default_factory=dict)
    baseline: dict[str, tuple[float, float]] = field(default_factory=dict)
    completions: pd.DataFrame | None = None  # quoted completions; None when no run logged them

    @property
    def per_cell(self) -> pd.DataFrame:
        """The seed table when there is one (a cell's mean over seeds), else the per-run table."""
        return self.cells if not self.cells.empty else self.results

    @property
    def label(self) -> str:
        return k_label(self.results)

    @property
    def short_label(self) -> str:
        """The high-k axis label of the figures: one k, or a note that k follows each row's protocol."""
        mixed = not self.results.empty and self.results["k_max"].dropna().nunique() > 1
        return "pass@k (largest k of the row's protocol)" if mixed else self.label

