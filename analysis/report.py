"""A self-contained report folder (report.md, CSV tables, PNG figures) for the runs of a study, read from MLflow.

    python -m analysis.report --sweep age --sweep ratio --sweep baseline
    python -m analysis.report --experiment replay-rloo --out reports/all tracking.uri=sqlite:////tmp/x/mlruns.db

Only FINISHED runs give numbers; the newest finished run of a cell is used and older ones are listed
as superseded. Results come from `canonical/final/*` when a run has it, else `quick/final/*`, and every
row says which. Figures follow the paper: budget frontier (Fig. 3), L x c and rho x c heatmaps
(Figs. 4, 5, 9), best-of-N probe (Table 4, Fig. 6), training dynamics (Fig. 7), diversity (Fig. 8).

A run is either a plain grid run (age buffer or none, RLOO loss, standard sampling, current behaviour,
no curriculum: a (rho, L, c) point of SPEC 8) or a variant (SPEC 9: FIFO, POPO, GRPO loss, DAPO dynamic
sampling, stale/diverse behaviour, curricula). Only plain runs are Fresh-only/Replay rows keyed by
(rho, L, c), fill heatmap cells and centre them; variants get no coordinates, their own "Variants"
table (variants.csv, with rollouts generated, gradient steps and effective ratio) and their own
labelled markers in the budget frontier.
"""

from __future__ import annotations

import argparse
import re
import sys
from datetime import datetime
from pathlib import Path

import mlflow
import numpy as np
import pandas as pd
from mlflow.tracking import MlflowClient
from rich.console import Console

from analysis import compute, figures, seeds
from src.task.countdown_failures import CATEGORIES as FAILURE_CATEGORIES, LABELS as FAILURE_LABELS

PROTOCOL_PREFERENCE = ["canonical", "quick"]  # results-table protocol, first one a run has
PROBE_KS = [1, 4, 8, 16, 32, 64]
SUMMARY_METRICS = {"mean_reward": "reward", "correction_rate": "correction_rate", "unique_rate": "unique_rate"}
DYNAMICS_KEYS = [key for key, _ in figures.DYNAMICS_PANELS]
def probe_hint(sweeps: list[str] | None) -> str:
    """What to run for the best-of-N probe: `src.eval.standalone` needs the runs named (--sweep or --run)."""
    target = " ".join(f"--sweep {sweep}" for sweep in sweeps) if sweeps else "--run <run id>"
    return ("no probe results yet: run the best-of-N probe on this report's runs,\n"
            f"python -m src.eval {target} evaluation=probe\n(it logs probe/final/pass_at_<k> into each run)")


PROBE_HINT = probe_hint(None)
UNFINISHED = ("FAILED", "RUNNING", "KILLED", "SCHEDULED")

# The two design grids of SPEC 8: a fixed coordinate plus rows x columns.
GRIDS = {
    "age": dict(title="L × c at ρ = 1", fixed=("rho", 1.0), row=("L", [1, 2, 3]), col=("c", [1, 3, 10])),
    "ratio": dict(title="ρ × c at L = 2", fixed=("L", 2), row=("rho", [0.5, 1, 1.5, 2]), col=("c", [1, 3, 10])),
}
HEATMAP_PANELS = ["pass@k_max", "reward", "correction_rate", "pass@1"]  # pass@1 panel: paper Figure 9

# What makes a run a plain grid run; any other value makes it a SPEC 9 variant. A missing tag (runs
# logged before the tag existed) counts as the default, so older runs stay plain grid runs.
PLAIN_BUFFERS = {"none", "age1", "age2", "age3"}
PLAIN_TAGS = {"loss": "rloo", "sampling": "standard", "behaviour": "current", "curriculum": "none"}
VARIANT_STUDY = "variants"  # the sweep whose report always has a Variants section
VARIANT_COLUMNS = ["variant", "cell", "setting", "fresh_evaluations", "gradient_steps", "effective_ratio",
                   "reward", "reward_hw", "pass@1", "pass@1_hw", "k_max", "pass@k_max", "pass@k_max_hw",
                   "protocol", "run_id"]

console = Console()


class ReportError(Exception):
    """A problem the command reports in one line (no traceback): empty store, unknown experiment."""


# --------------------------------------------------------------------------- reading MLflow


def load_runs(uri: str, experiment: str, sweeps: list[str] | None = None,
              since: datetime | None = None) -> pd.DataFrame:
    """All runs of one experiment (optionally only the given sweep tags, only those started at `since` or later)."""
    if uri.startswith("sqlite:///") and not Path(uri.removeprefix("sqlite:///")).exists():
        # Opening a missing SQLite file would silently create an empty store.
        raise ReportError(f"no MLflow store at {uri}")
    mlflow.set_tracking_uri(uri)
    client = MlflowClient(uri)
    if client.get_experiment_by_name(experiment) is None:
        known = sorted(e.name for e in client.search_experiments())
        raise ReportError(f"experiment '{experiment}' not found at {uri} "
                          f"(experiments there: {', '.join(known) or 'none'})")
    # A cell shared by two studies runs once, under the first study's `sweep` tag; the sweeper
    # adds every study that reuses it to the `sweeps` tag (",age,ratio,").
    filters = [query for sweep in sweeps for query in (f"tags.sweep = '{sweep}'", f"tags.sweeps LIKE '%,{sweep},%'")
               ] if sweeps else [""]
    if since is not None:
        started = f"attributes.start_time >= {round(since.timestamp() * 1000)}"
        filters = [f"{query} AND {started}" if query else started for query in filters]
    frames = [mlflow.search_runs(experiment_names=[experiment], filter_string=query, order_by=["start_time DESC"])
              for query in filters]
    frames = [frame for frame in frames if not frame.empty]
    if not frames:
        return pd.DataFrame()
    runs = pd.concat(frames, ignore_index=True).drop_duplicates("run_id")
    return runs.sort_values("start_time", ascending=False, kind="stable").reset_index(drop=True)


def _column(runs: pd.DataFrame, name: str, default="") -> pd.Series:
    """A column of the search_runs frame, or the default when no run logged it."""
    return runs[name].fillna(default) if name in runs else pd.Series(default, index=runs.index)


def select_cells(runs: pd.DataFrame) -> tuple[pd.DataFrame, pd.DataFrame, pd.DataFrame]:
    """Split runs into (used: newest FINISHED per cell, superseded: older FINISHED, unfinished).

    A cell is its `cell_id` tag (the whole config that decides results, `src.sweep.cell_identity`),
    or for runs logged without one, its cell name and policy.
    """
    if runs.empty:
        return runs, runs, runs
    cell = _column(runs, "tags.cell", "?")
    if "tags.cell_id" in runs:
        cell = runs["tags.cell_id"].where(runs["tags.cell_id"].notna(), cell)
    runs = runs.assign(_cell=cell, _policy=_column(runs, "tags.policy"))
    runs = runs.sort_values("start_time", ascending=False, kind="stable")
    finished = runs[runs["status"] == "FINISHED"]
    newest = ~finished.duplicated(["_cell", "_policy"], keep="first")
    used = finished[newest]
    superseded = finished[~newest].copy()
    # Name the run that replaces each superseded one, so the reader can follow the chain.
    replacement = used.set_index(["_cell", "_policy"])["run_id"]
    superseded["superseded_by"] = [replacement[(cell, policy)]
                                   for cell, policy in zip(superseded["_cell"], superseded["_policy"])]
    unfinished = runs[runs["status"] != "FINISHED"]
    drop = ["_cell", "_policy"]
    return (used.drop(columns=drop).reset_index(drop=True), superseded.drop(columns=drop).reset_index(drop=True),
            unfinished.drop(columns=drop).reset_index(drop=True))


def _metric(run: pd.Series, key: str) -> float:
    value = run.get("metrics." + key)
    return float(value) if value is not None and not pd.isna(value) else np.nan


def _pass_ks(run: pd.Series, prefix: str) -> list[int]:
    """The k values with a logged `<prefix>/pass_at_<k>` in this run, ascending."""
    pattern = re.compile(re.escape(f"metrics.{prefix}/pass_at_") + r"(\d+)$")
    return sorted(int(m.group(1)) for key in run.index if (m := pattern.match(key)) and not pd.isna(run[key]))


def run_protocol(run: pd.Series) -> str:
    """'canonical' when the run has canonical final metrics, else 'quick', else 'none'."""
    for protocol in PROTOCOL_PREFERENCE:
        if any(key.startswith(f"metrics.{protocol}/final/") and not pd.isna(value) for key, value in run.items()):
            return protocol
    return "none"


def _coordinates(run: pd.Series) -> tuple[float, float, float]:
    """(rho, L, c) from the tags (params as fallback); L and c are NaN for fresh-only runs."""
    def read(tag: str, param: str) -> float:
        for key in (f"tags.{tag}", f"params.{param}"):
            value = run.get(key)
            if value is not None and not pd.isna(value) and str(value) not in ("", "None"):
                return float(value)
        return np.nan

    rho = read("rho", "buffer.ratio")
    if rho == 0:  # fresh-only runs still carry the config's clip value: it means nothing without replay
        return 0.0, np.nan, np.nan
    return rho, read("L", "buffer.max_age"), read("c", "clip.ceiling")


def _tag(run: pd.Series, name: str, default: str = "") -> str:
    """A tag's value, or the default when the run lacks it (MLflow search gives None/NaN for absent tags)."""
    value = run.get(f"tags.{name}")
    if value is None or pd.isna(value) or str(value).strip() in ("", "None"):
        return default
    return str(value).strip()


def is_plain(run: pd.Series) -> bool:
    """True for a run of the (rho, L, c) design: age buffer or none, and every SPEC 9 option at its default."""
    return _tag(run, "buffer", "none") in PLAIN_BUFFERS and all(
        _tag(run, name, default) == default for name, default in PLAIN_TAGS.items())


def run_role(run: pd.Series) -> dict:
    """plain, setting, variant label and grid coordinates of a run; a variant has no coordinates.

    Variants get NaN (rho, L, c) on purpose: every grid consumer (heatmaps, the fresh-only baseline,
    the frontier's rho colours) selects by coordinates, so a variant can never land in a grid cell
    even when its rho/L/c tags match one (a FIFO run at rho = 1, a DAPO run at rho = 0).
    """
    rho, L, c = _coordinates(run)
    setting = "Fresh-only" if rho == 0 else "Replay"
    if is_plain(run):
        return {"plain": True, "setting": setting, "variant": _tag(run, "variant", setting),
                "rho": rho, "L": L, "c": c, "coordinates": format_cell(rho, L, c)}
    # A variant logged before the `variant` tag existed: its cell name ('popo-grpo') says what it is,
    # where the plain fallback ('Fresh-only' for a rho = 0 POPO run) would mislabel it.
    return {"plain": False, "setting": "Variant", "variant": _tag(run, "variant", _tag(run, "cell", "?")),
            "rho": np.nan, "L": np.nan, "c": np.nan, "coordinates": "-"}


def _fresh_evaluations(run: pd.Series) -> float:
    """Final fresh-evaluation count: the end-of-run tag, else the last logged cumulative metric."""
    tag = run.get("tags.fresh_evaluations")
    if tag is not None and not pd.isna(tag) and str(tag).strip():
        return float(tag)
    return _metric(run, "budget/fresh_evaluations")


def format_cell(rho: float, L: float, c: float) -> str:
    """(rho, L, c) as in the paper tables: '(0, -, -)', '(1, 2, 1)'."""
    parts = [f"{value:g}" if not pd.isna(value) else "-" for value in (rho, L, c)]
    return f"({', '.join(parts)})"


def format_value(mean: float, hw: float = np.nan, digits: int = 3) -> str:
    """'mean ± half-width' with three decimals; just the mean without a half-width, '-' without a mean."""
    return figures._mean_hw(mean, hw, digits)


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


def results_table(used: pd.DataFrame) -> pd.DataFrame:
    """One numeric row per used run (paper Tables 2/3): role, coordinates, protocol, budget, metrics ± hw.

    Plain grid rows come first (fresh-only, then by rho, L, c), then variants by label and cell.
    """
    rows = []
    for _, run in used.iterrows():
        role = run_role(run)
        protocol = run_protocol(run)
        prefix = f"{protocol}/final"
        ks = _pass_ks(run, prefix) if protocol != "none" else []
        row = {
            "run_id": run["run_id"], "sweep": run.get("tags.sweep", ""), "cell": run.get("tags.cell", "?"),
            "cell_id": _tag(run, "cell_id"), "cell_key": _cell_key(run), "seed": _seed(run),
            "policy": run.get("tags.policy", ""), "setting": role["setting"],
            "plain": role["plain"], "variant": role["variant"], "rho": role["rho"], "L": role["L"], "c": role["c"],
            "coordinates": role["coordinates"], "protocol": protocol,
            "fresh_evaluations": _fresh_evaluations(run), "gradient_steps": _metric(run, "budget/gradient_steps"),
            # The cumulative share's last value is the share over the whole run.
            "effective_ratio": _metric(run, "batch/effective_fraction_cumulative"), "k_max": ks[-1] if ks else np.nan,
        }
        for k in ks:
            row[f"pass@{k}"] = _metric(run, f"{prefix}/pass_at_{k}")
            row[f"pass@{k}_hw"] = _metric(run, f"{prefix}/pass_at_{k}_hw")
        # The largest k of the run's own protocol (16 canonical, 8 quick): the frontier/heatmap axis.
        row["pass@k_max"] = row[f"pass@{ks[-1]}"] if ks else np.nan
        row["pass@k_max_hw"] = row[f"pass@{ks[-1]}_hw"] if ks else np.nan
        for metric, name in SUMMARY_METRICS.items():
            row[name] = _metric(run, f"{prefix}/{metric}")
            row[f"{name}_hw"] = _metric(run, f"{prefix}/{metric}_hw")
        rows.append(row)
    base = ["run_id", "sweep", "cell", "cell_id", "cell_key", "seed", "policy", "setting", "plain", "variant", "rho", "L", "c",
            "coordinates", "protocol", "fresh_evaluations", "gradient_steps", "effective_ratio", "k_max"]
    table = pd.DataFrame(rows, columns=None if rows else base)
    for column in ["pass@1", "pass@1_hw", "pass@k_max", "pass@k_max_hw",
                   *[f"{n}{s}" for n in SUMMARY_METRICS.values() for s in ("", "_hw")]]:
        if column not in table:
            table[column] = np.nan
    pass_columns = sorted((col for col in table if re.fullmatch(r"pass@\d+(_hw)?", col)),
                          key=lambda col: (int(re.search(r"\d+", col).group()), col.endswith("_hw")))
    rest = [col for col in table if col not in base and col not in pass_columns]
    table = table[base + pass_columns + rest]
    if table.empty:
        return table
    return _grid_then_variants(table)


def _cell_key(run: pd.Series) -> str:
    """The cell across training seeds (`cell_key` tag); runs logged before the tag: their own cell_id or label."""
    return _tag(run, "cell_key") or _tag(run, "cell_id") or f"{_tag(run, 'cell', '?')}|{_tag(run, 'policy')}"


def _seed(run: pd.Series) -> float:
    """The training seed (`seed` tag, else the logged `trainer.seed` param, else 0, the config default)."""
    for key in ("tags.seed", "params.trainer.seed"):
        value = run.get(key)
        if value is not None and not pd.isna(value) and str(value).strip() not in ("", "None"):
            return float(value)
    return 0.0


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
                if _tag(run, "sweep") == VARIANT_STUDY or f",{VARIANT_STUDY}," in _tag(run, "sweeps")}
    plain = results["plain"].astype(bool)
    keep = ~plain | results["run_id"].isin(in_study)
    if keep.any():  # the baseline is a reference only where there is something to compare with it
        keep |= results.index.isin(results.index[plain & (results["rho"] == 0)][:1])
    return results.loc[keep, VARIANT_COLUMNS].reset_index(drop=True)


def same_label_configs(results: pd.DataFrame) -> pd.DataFrame:
    """Used runs that share a table label (variant, cell, policy) but not a config (`cell_id`).

    Such rows read like repeats of one experiment but are different experiments: a knob or the
    warm-start weights changed between them (src.sweep.cell_identity), e.g. a store holding a study
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
        for cell, status in zip(_column(plain, "tags.cell", "?")[::-1], plain["status"][::-1]):
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
                    "cell": f"rho{where['rho']:g}-L{where['L']:g}-c{where['c']:g}", "run_id": np.nan, "protocol": ""}
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


def best_of_n_table(used: pd.DataFrame) -> tuple[pd.DataFrame, list[int]]:
    """Paper Table 4: probe/final pass@k (unbiased) for each used run that has probe results, and the ks."""
    rows, ks = [], set()
    for _, run in used.iterrows():
        found = _pass_ks(run, "probe/final")
        if not found:
            continue
        ks.update(found)
        row = {"run_id": run["run_id"], "cell": run.get("tags.cell", "?"), **run_role(run)}
        for k in found:
            row[f"pass@{k}"] = _metric(run, f"probe/final/pass_at_{k}")
            row[f"pass@{k}_hw"] = _metric(run, f"probe/final/pass_at_{k}_hw")
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
        policy = _tag(run, "policy")
        if policy not in started and not pd.isna(_metric(run, f"{protocol}/start/failures/failed")):
            started.add(policy)
            stages.insert(0, ("start", "warm start"))
        for stage, method in stages:
            prefix = f"{protocol}/{stage}/failures"
            if pd.isna(_metric(run, f"{prefix}/failed")):
                continue
            row = {"method": method, "cell": _tag(run, "cell", "?"), "stage": stage, "protocol": protocol,
                   "run_id": run["run_id"], "rollouts": _metric(run, f"{prefix}/rollouts"),
                   "failed": _metric(run, f"{prefix}/failed")}
            for category in FAILURE_CATEGORIES:
                row[category] = _metric(run, f"{prefix}/{category}")
                row[f"share_{category}"] = _metric(run, f"{protocol}/{stage}/failure_share/{category}")
            rows.append(row)
    columns = ["method", "cell", "stage", "protocol", "run_id", "rollouts", "failed", *FAILURE_CATEGORIES,
               *[f"share_{c}" for c in FAILURE_CATEGORIES]]
    table = pd.DataFrame(rows, columns=columns)
    # Warm starts first, then methods by label.
    return table.sort_values(["stage", "method", "cell"], key=lambda col: col.map({"start": 0, "final": 1})
                             if col.name == "stage" else col, kind="stable").reset_index(drop=True)


def metric_histories(client: MlflowClient, results: pd.DataFrame, keys: list[str] = DYNAMICS_KEYS) -> pd.DataFrame:
    """Long table (run_id, key, step, value) of per-step metrics, last value per step (resumed runs re-log steps)."""
    rows = []
    for run_id in results["run_id"]:
        for key in keys:
            for point in client.get_metric_history(run_id, key):
                rows.append({"run_id": run_id, "key": key, "step": point.step, "value": point.value,
                             "timestamp": point.timestamp})
    if not rows:
        return pd.DataFrame(columns=["run_id", "key", "step", "value"])
    history = pd.DataFrame(rows).sort_values(["run_id", "key", "step", "timestamp"])
    history = history.drop_duplicates(["run_id", "key", "step"], keep="last")
    return history.drop(columns="timestamp").reset_index(drop=True)


# --------------------------------------------------------------------------- writing the report


def figure_lines(name: str, alt: str, caption: str) -> list[str]:
    """A figure in report.md: the PNG, then its caption line with a link to the PDF for a paper."""
    return [f"![{alt}]({name}.png)", "", f"*{caption}* ([PDF]({name}.pdf))"]


# LaTeX for the characters the tables use: escapes first, then the Unicode symbols as math.
LATEX_ESCAPES = {"\\": r"\textbackslash{}", "&": r"\&", "%": r"\%", "$": r"\$", "#": r"\#", "_": r"\_",
                 "{": r"\{", "}": r"\}", "~": r"\textasciitilde{}", "^": r"\textasciicircum{}"}
LATEX_SYMBOLS = {"±": r"$\pm$", "ρ": r"$\rho$", "≥": r"$\geq$", "δ": r"$\delta$", "τ": r"$\tau$", "×": r"$\times$"}


def latex_escape(text: str) -> str:
    """Cell text as LaTeX: special characters escaped, `code` as \\texttt, ± ρ ≥ as math."""
    out = "".join(LATEX_ESCAPES.get(char, char) for char in str(text))
    for symbol, latex in LATEX_SYMBOLS.items():
        out = out.replace(symbol, latex)
    return re.sub(r"`([^`]*)`", r"\\texttt{\1}", out)


def latex_table(headers: list[str], rows: list[list[str]], caption: str, label: str) -> str:
    """A `booktabs` table (toprule / midrule / bottomrule, no vertical rules), numbers right-aligned."""
    def numeric(column: int) -> bool:
        cells = [str(row[column]).strip("`") for row in rows]
        return bool(cells) and all(re.match(r"^[-\d.,≥ ]", cell) for cell in cells)

    spec = "".join("r" if numeric(i) else "l" for i in range(len(headers)))
    lines = [r"\begin{table}[t]", r"\centering", rf"\caption{{{latex_escape(caption)}}}", rf"\label{{{label}}}",
             r"\small", rf"\begin{{tabular}}{{{spec}}}", r"\toprule",
             " & ".join(latex_escape(h) for h in headers) + r" \\", r"\midrule"]
    lines += [" & ".join(latex_escape(cell) for cell in row) + r" \\" for row in rows]
    lines += [r"\bottomrule", r"\end{tabular}", r"\end{table}", ""]
    return "\n".join(lines)


def markdown_table(headers: list[str], rows: list[list[str]]) -> str:
    """A GitHub-flavoured markdown table ('|' inside cells escaped)."""
    def line(cells) -> str:
        return "| " + " | ".join(str(cell).replace("|", "\\|") for cell in cells) + " |"

    return "\n".join([line(headers), line(["---"] * len(headers)), *(line(row) for row in rows)])


def _when(value) -> str:
    """A run's start in local time, the clock `--since` reads."""
    if value is None or pd.isna(value):
        return "-"
    stamp = pd.Timestamp(value)
    if stamp.tzinfo is not None:
        stamp = stamp.tz_convert(datetime.now().astimezone().tzinfo)
    return stamp.strftime("%Y-%m-%d %H:%M")


def k_label(results: pd.DataFrame) -> str:
    """'pass@16' when every row has the same largest k, else a label saying that k differs by protocol."""
    ks = sorted({int(k) for k in results["k_max"].dropna()}) if not results.empty else []
    if len(ks) == 1:
        return f"pass@{ks[0]}"
    if not ks:
        return "pass@16"
    return "pass@k (largest k of each row's protocol: " + ", ".join(
        f"{p} k={int(results.loc[results['protocol'] == p, 'k_max'].max())}"
        for p in PROTOCOL_PREFERENCE if (results["protocol"] == p).any()) + ")"


def _results_markdown(results: pd.DataFrame) -> str:
    return markdown_table(*_results_cells(results))


def results_latex(results: pd.DataFrame) -> str:
    """The main results table as a LaTeX `booktabs` table (`\\usepackage{booktabs}` in the preamble)."""
    headers, rows = _results_cells(results)
    caption = (f"Held-out results: mean ± 95 % t half-width over evaluation repeats; {k_label(results)} is the "
               "largest k; rollouts are fresh verifier evaluations.")
    return latex_table(headers, rows, caption, "tab:results")


def _results_cells(results: pd.DataFrame) -> tuple[list[str], list[list[str]]]:
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
                     format_value(row["pass@1"], row["pass@1_hw"]), _top_k(row, mixed_k),
                     format_value(row["reward"], row["reward_hw"]),
                     format_value(row["correction_rate"], row["correction_rate_hw"]), f"`{row['run_id'][:8]}`"])
    return headers, rows


def _compute_markdown(cells: pd.DataFrame, label: str) -> list[str]:
    """The compute frontier section: the figure, what its absent panels lack, and each cell's costs."""
    out = ["## Compute frontier", "",
           f"{label} against three costs (seed 001 counts compute, not only samples): fresh verifier evaluations, "
           "trained tokens (`budget/trained_tokens`: response tokens that entered the loss, cumulative) and training "
           "wall time (the sum of the per-step `time/step`: training steps only, no evaluation; runs without it: end "
           "minus start). One point per cell, its mean over training seeds. Generated tokens "
           "(`budget/generated_tokens`) are listed below.", "",
           *figure_lines("compute_frontier", "compute frontier", f"{label} against fresh verifier evaluations, "
                         "trained tokens and training wall time, one point per cell."), ""]
    missing = compute.missing_axes(cells) + (
        [] if "generated_tokens" in cells and cells["generated_tokens"].notna().any()
        else ["no budget/generated_tokens logged by these runs"])
    if missing:
        out += ["Not drawn or listed: " + "; ".join(missing) + ".", ""]
    if not cells.empty:
        out.append(markdown_table(
            ["variant", "cell", "fresh evals", "generated tokens", "trained tokens", "training wall time", label],
            [[row["variant"], row["cell"], format_count(row["fresh_evaluations"]),
              format_count(row.get("generated_tokens", np.nan)), format_count(row.get("trained_tokens", np.nan)),
              _seconds(row.get("wall_time_s", np.nan)),
              format_value(row["pass@k_max"], row["pass@k_max_hw"] if row.get("n_seeds", 2) > 1 else np.nan)]
             for _, row in cells.iterrows()]))
        out.append("")
    return out


def _seconds(value: float) -> str:
    """A duration: '8.3 s' under a minute, '12.5 min' above, '-' when unknown."""
    if pd.isna(value):
        return "-"
    return f"{value:.1f} s" if value < 60 else f"{value / 60:.1f} min"


def _seeds_note(cells: pd.DataFrame) -> str:
    baseline = cells[cells["is_baseline"]]
    reference = (f"the fresh-only cell `{baseline['cell'].iloc[0]}` (seeds {baseline['seeds'].iloc[0]})"
                 if not baseline.empty else "no fresh-only cell in this report, so no differences")
    return ("One row per cell over its training seeds (runs grouped by the `cell_key` tag; the evaluation repeats "
            "are averaged within each seed first). Values are `mean ± 95 % t half-width over seeds` (just the mean "
            f"with one seed). Δ is the cell minus {reference} at the same seeds, `± half-width` of the seed-wise "
            f"differences; the verdict is a {seeds.TEST_NAME} (two-sided): `better`/`worse` where the difference's "
            "interval excludes 0, `within noise` where it does not, `one seed` where only one seed pairs up. "
            "Replay ESS is the mean over steps of the reused responses' normalised ESS. "
            "Full numbers: [seeds.csv](seeds.csv).")


def _seeds_markdown(cells: pd.DataFrame, label: str) -> str:
    """The seed table: each cell's mean over seeds, its difference to fresh-only and the verdict."""
    def over_seeds(row, metric):
        return format_value(row[metric], row[metric + "_hw"] if row["n_seeds"] > 1 else np.nan)

    def compared(row, metric):
        if row["is_baseline"] or pd.isna(row.get(metric + "_diff", np.nan)):
            return ["(reference)" if row["is_baseline"] else "-", row.get(metric + "_verdict", "-")
                    if not row["is_baseline"] and isinstance(row.get(metric + "_verdict"), str) else "-"]
        diff = f"{row[metric + '_diff']:+.3f}" + (f" ± {row[metric + '_diff_hw']:.3f}"
                                                  if not pd.isna(row[metric + "_diff_hw"]) else "")
        return [diff, row[metric + "_verdict"]]

    headers = ["variant", "(ρ, L, c)", "cell", "seeds", "rollouts (fresh evals)", "reward", "Δ reward", "verdict",
               "pass@1", "Δ pass@1", "verdict", label, f"Δ {label}", "verdict", "replay ESS"]
    rows = [[row["variant"], row["coordinates"], row["cell"], f"{row['n_seeds']} ({row['seeds']})",
             format_count(row["fresh_evaluations"]),
             over_seeds(row, "reward"), *compared(row, "reward"), over_seeds(row, "pass@1"), *compared(row, "pass@1"),
             over_seeds(row, "pass@k_max"), *compared(row, "pass@k_max"),
             format_ratio(row.get("replay_ess", np.nan))] for _, row in cells.iterrows()]
    return markdown_table(headers, rows)


def _top_k(row: pd.Series, mixed_k: bool) -> str:
    """pass@k_max ± hw, naming k when rows of the table differ in their largest k."""
    top = format_value(row["pass@k_max"], row["pass@k_max_hw"])
    if mixed_k and not pd.isna(row["k_max"]):
        top += f" (k={int(row['k_max'])})"
    return top


def _variants_markdown(variants: pd.DataFrame, label: str) -> str:
    """The Variants table: cost (rollouts, gradient steps, effective ratio) next to the result of each run."""
    mixed_k = variants["k_max"].dropna().nunique() > 1
    headers = ["variant", "cell", "rollouts generated", "gradient steps", "effective ratio", "reward", "pass@1",
               label if not mixed_k else "pass@k (largest k)", "protocol", "run"]
    rows = [[row["variant"], row["cell"], format_count(row["fresh_evaluations"]), format_integer(row["gradient_steps"]),
             format_ratio(row["effective_ratio"]), format_value(row["reward"], row["reward_hw"]),
             format_value(row["pass@1"], row["pass@1_hw"]), _top_k(row, mixed_k), row["protocol"],
             f"`{row['run_id'][:8]}`"] for _, row in variants.iterrows()]
    return markdown_table(headers, rows)


def _protocol_note(results: pd.DataFrame) -> str:
    counts = results["protocol"].value_counts()
    parts = [f"{counts[p]} run(s) from `{p}/final/*`" for p in [*PROTOCOL_PREFERENCE, "none"] if p in counts]
    note = ("Values are read from `canonical/final/*` when a run has them, else from `quick/final/*`; "
            "the `protocol` column names the source of every row. Here: " + (", ".join(parts) or "no runs") + ".")
    if counts.drop("none", errors="ignore").size > 1:
        note += ("\n\n**Protocols are mixed in this report.** quick and canonical differ in samples per prompt, "
                 "repeats and seeds, so their values are not comparable; quick values are marked in the figures "
                 "(hollow markers, hatched bars, '(quick)' in heatmap cells).")
    if "none" in counts:
        note += "\n\nRows with protocol `none` finished without a final evaluation; their metrics are blank."
    return note


def write_report(runs: pd.DataFrame, out_dir: Path, client: MlflowClient, *, title: str = "Replay-RLOO report",
                 source: str = "", sweeps: list[str] | None = None) -> Path:
    """Write report.md, the CSV tables and every PNG figure into out_dir; returns the path of report.md."""
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)

    def wrote(path: Path, what: str) -> Path:
        console.print(f"[green]wrote[/green] {path.name:<20} {what}")
        return path

    used, superseded, unfinished = select_cells(runs)
    results = results_table(used)
    history = metric_histories(client, results, DYNAMICS_KEYS + compute.HISTORY_KEYS)
    results = compute.compute_columns(results, used, history)  # tokens and wall time: the compute frontier's axes
    if not results.empty:  # how far the reused responses' weights drift, over the whole run (Figure 7's ESS panel)
        results["replay_ess"] = results["run_id"].map(seeds.mean_per_run(history, "weights/ess"))
    wrote(_write_csv(results, out_dir / "results_table.csv"), f"{len(results)} row(s)")
    (out_dir / "results_table.tex").write_text(results_latex(results))
    wrote(out_dir / "results_table.tex", "the results table in LaTeX (booktabs)")
    # Training-seed repeats: one row per cell over its seeds, compared seed by seed with fresh-only.
    cells = seeds.seed_table(results)
    wrote(_write_csv(cells, out_dir / "seeds.csv"), f"{len(cells)} cell(s) over training seeds")
    variants = variants_table(results, used)
    # Written in every report (like the figures), so a folder always has the same files.
    wrote(_write_csv(variants, out_dir / "variants.csv"),
          f"{int((variants['setting'] == 'Variant').sum())} variant run(s), {len(variants)} row(s)")
    label = k_label(results)
    baseline = baseline_values(cells.sort_values("is_baseline", ascending=False, kind="stable")
                               if not cells.empty else results)

    short = label if results["k_max"].dropna().nunique() <= 1 else "pass@k (largest k of the row's protocol)"
    wrote(figures.plot_frontier(results, out_dir / "frontier.png", short), "budget frontier (Figure 3)")
    wrote(figures.plot_compute_frontier(cells if not cells.empty else results, compute.AXES,
                                        out_dir / "compute_frontier.png", short),
          "compute frontier: fresh evaluations, trained tokens, wall time")
    panel_labels = {"pass@k_max": short, "reward": "evaluation reward", "correction_rate": "correction rate",
                    "pass@1": "pass@1"}
    grids, missing = {}, {}
    for name, figure in (("age", "Figure 4"), ("ratio", "Figures 5, 9")):
        grids[name] = heatmap_grid(cells if not cells.empty else results, name, unfinished)
        missing[name] = missing_cells(grids[name])
        spec = GRIDS[name]
        figures.plot_heatmaps(grids[name], [(m, panel_labels[m]) for m in HEATMAP_PANELS], baseline,
                              row_label="ρ" if spec["row"][0] == "rho" else spec["row"][0], col_label="c",
                              title=spec["title"], path=out_dir / f"heatmap_{name}.png")
        have = int(grids[name]["run_id"].notna().sum())
        wrote(out_dir / f"heatmap_{name}.png", f"{spec['title']} ({figure}): {have}/{len(grids[name])} cells")

    probe, probe_ks = best_of_n_table(used)
    wrote(_write_csv(probe, out_dir / "best_of_n.csv"), f"{len(probe)} probed cell(s)")
    wrote(figures.plot_best_of_n(probe, probe_ks, out_dir / "best_of_n.png", probe_hint(sweeps)),
          "best-of-N (Figure 6)")

    bands = seeds.seed_bands(history, results)  # one curve per cell: mean over seeds, min-max band
    wrote(figures.plot_dynamics(bands, cells if not cells.empty else results, out_dir / "dynamics.png"),
          f"training dynamics (Figure 7): {history['run_id'].nunique()} run(s), {bands['run_id'].nunique()} cell(s)")
    wrote(figures.plot_diversity(results, out_dir / "diversity.png"), "answer-span diversity (Figure 8)")
    failures = failure_table(used)
    wrote(_write_csv(failures, out_dir / "failures.csv"), f"{len(failures)} evaluation(s) with a failure taxonomy")
    wrote(figures.plot_failure_shares(failures, FAILURE_LABELS, out_dir / "failure_shares.png"),
          "failure categories (seed 004 Figure 3)")
    wrote(figures.plot_failure_totals(failures, out_dir / "failure_totals.png"), "failed rollouts (seed 004 Figure 4)")

    text = _markdown(results, used, superseded, unfinished, grids, missing, probe, probe_ks, baseline, variants,
                     title=title, source=source, sweeps=sweeps, cells=cells)
    text += _failures_markdown(failures)
    report = out_dir / "report.md"
    report.write_text(text)
    wrote(report, f"{len(used)} used, {len(superseded)} superseded, {len(unfinished)} unfinished run(s)")
    return report


def _write_csv(table: pd.DataFrame, path: Path) -> Path:
    table.to_csv(path, index=False)
    return path


def _markdown(results, used, superseded, unfinished, grids, missing, probe, probe_ks, baseline, variants, *,
              title: str, source: str, sweeps: list[str] | None, cells: pd.DataFrame | None = None) -> str:
    protocols = dict(zip(results["run_id"], results["protocol"]))
    label = k_label(results)
    out = [f"# {title}", "",
           f"Generated {datetime.now():%Y-%m-%d %H:%M} by `python -m analysis.report`"
           + (f" from {source}" if source else "") + ". Figures and CSV files sit next to this file.", ""]

    out += ["## Runs used", "",
            "Only FINISHED runs give numbers. When several finished runs share a cell (same `cell_id` tag: the "
            "config that decides results; older runs without one: same `cell` and `policy`), the newest is used "
            "and the others are listed as superseded.", ""]
    out.append(markdown_table(["run id", "sweep", "cell", "status", "protocol used", "started"],
                              [[f"`{run['run_id']}`", run.get("tags.sweep", ""), run.get("tags.cell", "?"),
                                run["status"], protocols.get(run["run_id"], "none"), _when(run.get("start_time"))]
                               for _, run in used.iterrows()]) if not used.empty else "_No finished runs._")
    out += ["", "### Superseded runs", ""]
    out.append(markdown_table(["run id", "sweep", "cell", "started", "superseded by"],
                              [[f"`{run['run_id']}`", run.get("tags.sweep", ""), run.get("tags.cell", "?"),
                                _when(run.get("start_time")), f"`{run['superseded_by']}`"]
                               for _, run in superseded.iterrows()]) if not superseded.empty else "_None._")
    out += ["", "### Unfinished runs (no numbers taken from them)", ""]
    out.append(markdown_table(["run id", "sweep", "cell", "status", "started"],
                              [[f"`{run['run_id']}`", run.get("tags.sweep", ""), run.get("tags.cell", "?"),
                                run["status"], _when(run.get("start_time"))]
                               for _, run in unfinished.iterrows()]) if not unfinished.empty else "_None._")
    shared = same_label_configs(results)
    if not shared.empty:
        started = dict(zip(used["run_id"], used["start_time"]))
        out += ["", "### Same label, different configuration", "",
                "**These rows share a label but are different experiments** (their `cell_id` differs: a knob or "
                "the warm-start weights changed between them), so the tables below hold each of them. To compare "
                "like with like, report only the newer runs (`--since`, `make report SINCE=2026-11-21T12:00`) "
                "or keep each study in its own experiment (`tracking.experiment=...`).", ""]
        out.append(markdown_table(["variant", "cell", "run id", "cell_id", "started"],
                                  [[row["variant"], row["cell"], f"`{row['run_id']}`", f"`{row['cell_id']}`",
                                    _when(started.get(row["run_id"]))] for _, row in shared.iterrows()]))

    out += ["", "## Results (paper Tables 2/3)", "", _protocol_note(results), "",
            f"Each value is `mean ± 95 % t half-width` over evaluation repeats (just the mean when the protocol "
            f"has one repeat). The high-k column is {label}. Full numbers: [results_table.csv](results_table.csv); "
            "the same table for a paper: [results_table.tex](results_table.tex) (LaTeX, `booktabs`).", ""]
    out.append(_results_markdown(results) if not results.empty else "_No finished runs._")
    if cells is not None and not cells.empty:
        out += ["", "## Across training seeds", "", _seeds_note(cells), "", _seeds_markdown(cells, label)]

    has_variants = (variants["setting"] == "Variant").any()
    # Also before any variant finished: the variants study's reference cells are worth a look already.
    if not variants.empty or VARIANT_STUDY in (sweeps or []):
        out += ["", "## Variants (SPEC 9)", "",
                "Each variant against its references (the fresh-only baseline and the plain cells of the "
                f"`{VARIANT_STUDY}` study). Rollouts generated = fresh verifier evaluations (every generated rollout "
                "is one); gradient steps = optimizer steps; effective ratio = share of trained groups with non-zero "
                "reward variance over the run. '-': the run did not log it. Variants never enter the heatmaps and "
                "are never the fresh-only baseline. Full numbers: [variants.csv](variants.csv).", ""]
        # With no variant finished yet, the references still show what the variants will be compared with.
        parts = [_variants_markdown(variants, label)] if not variants.empty else []
        if not has_variants:
            parts.append("_No finished variant runs yet._")
        out.append("\n\n".join(parts))

    out += ["", "## Budget frontier (Figure 3)", "",
            f"{label} against fresh verifier evaluations; colour is ρ, marker is c, the star and dashed line are the "
            "fresh-only baseline, error bars are half-widths"
            + ("; each variant has its own labelled marker (left panel legend)" if has_variants else "")
            + ". Right: the L = 2 cells, one line per c.", "",
            *figure_lines("frontier", "budget frontier", f"Figure 3. Held-out {label} against fresh verifier "
                          "evaluations; star: fresh-only; error bars: 95 % half-widths."), ""]

    out += _compute_markdown(cells if cells is not None and not cells.empty else results, label)

    for name, figure in (("age", "Figure 4"), ("ratio", "Figures 5 and 9")):
        spec = GRIDS[name]
        no_run, no_eval = missing[name]
        pending = dict(zip(grids[name]["cell"], grids[name]["unfinished"]))
        out += [f"## Heatmap: {spec['title']} ({figure})", "",
                f"Panels: {label}, evaluation reward, correction rate, pass@1; cells show mean ± half-width, the "
                "colour map is centred on the fresh-only value named in each panel title"
                + ("" if baseline else " (no fresh-only run in this report, so the map is not centred)")
                + ". Missing cells are drawn grey and hatched. A cell with several training seeds shows its mean ± "
                "half-width over seeds; where its difference to fresh-only is within noise (paired t-test over "
                "seeds, 95 %) it is outlined dotted and marked '≈ fresh-only (noise)'.", "",
                *figure_lines(f"heatmap_{name}", spec["title"], f"{figure}. {spec['title']}: held-out metrics per "
                              "grid cell, colour centred on the fresh-only value."), "",
                "Missing grid cells (no finished run): " + (", ".join(
                    f"`{c}`" + (f" ({status} run)" if (status := pending.get(c)) else "") for c in no_run) or "none")
                + "."]
        if no_eval:
            out.append("Cells with a finished run but no final evaluation: "
                       + ", ".join(f"`{c}`" for c in no_eval) + ".")
        if no_run and sweeps:
            out.append("(Studies share cells, SPEC 8. A shared cell skipped by the sweeper is found through the "
                       "`sweeps` tag; one run outside any sweep can be added with another `--sweep` option.)")
        out.append("")

    out += ["## Best-of-N probe (Table 4, Figure 6)", "",
            "Unbiased pass@k from `probe/final/*` (64 samples per prompt per repeat); a different estimator and "
            "seed namespace from the canonical table, so the two are complementary, not one scale. "
            "Full numbers: [best_of_n.csv](best_of_n.csv).", ""]
    if probe.empty:
        hint = probe_hint(sweeps).split("\n")
        out += [f"_{hint[0]}_", "", "```", hint[1], "```", "", f"_{hint[2]}_"]
    else:
        out.append(markdown_table(["variant", "(ρ, L, c)", "cell", *[f"K={k}" for k in probe_ks], "run"],
                                  [[row["variant"], row["coordinates"], row["cell"],
                                    *[format_value(row[f"pass@{k}"], row[f"pass@{k}_hw"]) for k in probe_ks],
                                    f"`{row['run_id'][:8]}`"] for _, row in probe.iterrows()]))
    out += ["", *figure_lines("best_of_n", "best-of-N probe", "Figure 6. Unbiased pass@k against the number of "
                              "samples k per prompt (log scale); fresh-only dashed."), ""]

    out += ["## Training dynamics (Figure 7)", "",
            "Per-step training reward, clip fraction and normalised ESS of the reused responses (absent for "
            "fresh-only runs and for steps without replay), and KL to the reference per token; colour is c, "
            "line style is L, fresh-only in black, variants dash-dotted in their own colour. One line per cell: with "
            "several training seeds it is the mean over seeds with the min-max range across seeds shaded.", "",
            *figure_lines("dynamics", "training dynamics", "Figure 7. Training reward, clip fraction, normalised "
                          "ESS and per-token KL against the optimizer step, one line per cell."), ""]

    out += ["## Diversity (Figure 8)", "",
            "Answer-span unique rate of the final evaluation (same protocol as the results table), error bars "
            "are half-widths.", ""]
    diversity = results[results["unique_rate"].notna()] if not results.empty else results
    if not diversity.empty:
        out.append(markdown_table(["cell", "(ρ, L, c)", "protocol", "unique rate"],
                                  [[row["cell"], row["coordinates"], row["protocol"],
                                    format_value(row["unique_rate"], row["unique_rate_hw"])]
                                   for _, row in diversity.iterrows()]))
        out.append("")
    out += [*figure_lines("diversity", "answer-span diversity", "Figure 8. Answer-span unique rate of the final "
                          "evaluation by cell; hatched: quick protocol."), ""]
    return "\n".join(out)


def _failures_markdown(failures: pd.DataFrame) -> str:
    out = ["", "## Failure taxonomy (seed 004 Figures 3-4, appendix B.4)", "",
           "Each failed rollout (score < 1.0) of an evaluation in one dominant category (`src/task/countdown_failures.py` "
           "gives the order of checks): global instability first, then format, number use, arithmetic, target. "
           "Counts are failed rollouts per evaluation repeat; the percentage is the category's share of the "
           "failed rollouts. The warm start is the start evaluation of the runs. Full numbers: "
           "[failures.csv](failures.csv).", ""]
    if failures.empty:
        out.append("_No evaluation with a failure taxonomy yet (evaluations log `failures/*` since it exists)._")
    else:
        out.append(markdown_table(
            ["method", "cell", "stage", "protocol", "failed / rollouts",
             *[FAILURE_LABELS[c] for c in FAILURE_CATEGORIES]],
            [[row["method"], row["cell"], row["stage"], row["protocol"], f"{row['failed']:g} / {row['rollouts']:g}",
              *[f"{row[c]:g} ({row[f'share_{c}']:.0%})" if row["failed"] > 0 else "0" for c in FAILURE_CATEGORIES]]
             for _, row in failures.iterrows()]))
    out += ["", *figure_lines("failure_shares", "failure categories", "Failed rollouts by dominant category, as "
                              "shares of each method's failures (seed 004 Figure 3)."), "",
            *figure_lines("failure_totals", "failed rollouts", "Failed rollouts per evaluation repeat by method "
                          "(seed 004 Figure 4)."), ""]
    return "\n".join(out)


# --------------------------------------------------------------------------- command line


def _start_time(text: str) -> datetime:
    """--since value: an ISO date or date-time in local time."""
    try:
        return datetime.fromisoformat(text)
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"{text!r} is not a date: give YYYY-MM-DD or YYYY-MM-DDTHH:MM (local time), e.g. 2026-11-21T12:00")


def main(argv: list[str] | None = None) -> int:
    """Command line: compose the tracking settings, read the runs, write the report folder."""
    from hydra import compose, initialize_config_dir
    from hydra.errors import HydraException
    from omegaconf.errors import OmegaConfBaseException

    from src.checks import composition_error
    from src.paths import CONFIG_DIR, register_root_resolver, workspace_root
    from src.tracking import StoreUnreachable, check_store

    # The ${root:} resolver from src.paths, not src.config: importing src.config would pull in torch
    # and transformers (seconds) for a command that only reads MLflow.
    register_root_resolver()

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sweep", action="append", help="only runs tagged with this sweep (repeatable)")
    parser.add_argument("--experiment", help="MLflow experiment (default: tracking.experiment of the config)")
    parser.add_argument("--since", type=_start_time, metavar="YYYY-MM-DD[THH:MM]",
                        help="only runs started at this local time or later (e.g. after rebuilding the warm start)")
    parser.add_argument("--out", type=Path, help="report folder (default: reports/<sweeps or experiment>)")
    parser.add_argument("overrides", nargs="*", help="Hydra overrides for the tracking settings")
    args = parser.parse_intermixed_args(argv)  # options and overrides in any order (make report ARGS=...)
    err = Console(stderr=True)
    try:
        with initialize_config_dir(str(CONFIG_DIR), version_base="1.3"):
            tracking = compose("config", overrides=args.overrides).tracking
    except (HydraException, OmegaConfBaseException) as error:
        err.print(f"[red]error:[/red] {composition_error(error, args.overrides)}", highlight=False, soft_wrap=True)
        return 2
    experiment = args.experiment or tracking.experiment
    searched = f"experiment '{experiment}' at {tracking.uri}" + (
        f" with sweep {' or '.join(repr(s) for s in args.sweep)}" if args.sweep else "") + (
        f" started since {args.since:%Y-%m-%d %H:%M}" if args.since else "")
    try:
        check_store(tracking.uri, experiment, None)
        runs = load_runs(tracking.uri, experiment, args.sweep, args.since)
        if runs.empty:
            raise ReportError(f"no runs found in {searched}")
    except (ReportError, StoreUnreachable) as error:
        err.print(f"[red]error:[/red] {error}", highlight=False, soft_wrap=True)
        return 1
    name = "+".join(args.sweep) if args.sweep else experiment
    out_dir = args.out or workspace_root() / "reports" / name
    console.print(f"{len(runs)} run(s) in {searched}")
    report = write_report(runs, out_dir, MlflowClient(tracking.uri), title=f"Replay-RLOO report: {name}",
                          source=searched, sweeps=args.sweep)
    console.print(f"report: {report}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
