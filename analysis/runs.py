"""Reading a study's runs back from MLflow, and what each run is: its cell, protocol, role and coordinates.

Only FINISHED runs give numbers; the newest finished run of a cell is used and older ones are listed
as superseded. A run is a grid run (a (rho, L, c) point of SPEC 8) when its `cell` tag is the grid
cell its rho, L and c tags name ('rho0', 'rho1-L2-c1'): every other component (store, loss, sampling,
behaviour, curriculum, runtime) writes itself into the cell label (`src.study.sweep.cell_name`), so a label
with anything more is a SPEC 9 variant. Variants get no coordinates.
"""

from __future__ import annotations

import re
from datetime import datetime
from pathlib import Path

import mlflow
import numpy as np
import pandas as pd
from mlflow.tracking import MlflowClient

PROTOCOL_PREFERENCE = ["canonical", "quick"]  # results-table protocol, first one a run has
# Protocols never read for the results table: the best-of-N probe has its own section (Table 4).
NOT_RESULTS_PROTOCOLS = ("probe",)


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


def known_sweeps(uri: str, experiment: str) -> dict[str, int]:
    """Each study of the experiment with its number of runs (a run counts in every study its `sweeps` tag names)."""
    runs = mlflow.search_runs(experiment_names=[experiment], output_format="list")
    counts: dict[str, int] = {}
    for run in runs:
        tags = run.data.tags
        names = {name for name in [tags.get("sweep", ""), *tags.get("sweeps", "").split(",")] if name}
        for name in names:
            counts[name] = counts.get(name, 0) + 1
    return dict(sorted(counts.items()))


def tag_column(runs: pd.DataFrame, name: str, default="") -> pd.Series:
    """A column of the search_runs frame, or the default when no run logged it."""
    return runs[name].fillna(default) if name in runs else pd.Series(default, index=runs.index)


def select_cells(runs: pd.DataFrame) -> tuple[pd.DataFrame, pd.DataFrame, pd.DataFrame]:
    """Split runs into (used: newest FINISHED per cell, superseded: older FINISHED, unfinished).

    A cell is its `cell_id` tag (the whole config that decides results, `src.study.sweep.cell_identity`),
    else its cell label; two policies never share a cell.
    """
    if runs.empty:
        return runs, runs, runs
    cell = tag_column(runs, "tags.cell", "?")
    if "tags.cell_id" in runs:
        cell = runs["tags.cell_id"].where(runs["tags.cell_id"].notna(), cell)
    runs = runs.assign(_cell=cell, _policy=tag_column(runs, "tags.policy"))
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


def run_metric(run: pd.Series, key: str) -> float:
    value = run.get("metrics." + key)
    return float(value) if value is not None and not pd.isna(value) else np.nan


def run_pass_ks(run: pd.Series, prefix: str) -> list[int]:
    """The k values with a logged `<prefix>/pass_at_<k>` in this run, ascending."""
    pattern = re.compile(re.escape(f"metrics.{prefix}/pass_at_") + r"(\d+)$")
    return sorted(int(m.group(1)) for key in run.index if (m := pattern.match(key)) and not pd.isna(run[key]))


# `<protocol>/final/mean_reward`: every evaluation protocol logs it (src.runs.tracking.log_evaluation).
FINAL_METRIC = re.compile(r"^metrics\.([^/]+)/final/mean_reward$")


def run_protocol(run: pd.Series) -> str:
    """'canonical' when the run has canonical final metrics, else 'quick', else the first (by name) other
    protocol it logged a final evaluation under (evaluation=smoke of the quick check, a math protocol), else 'none'."""
    for protocol in PROTOCOL_PREFERENCE:
        if any(key.startswith(f"metrics.{protocol}/final/") and not pd.isna(value) for key, value in run.items()):
            return protocol
    others = sorted({match.group(1) for key, value in run.items()
                     if (match := FINAL_METRIC.match(key)) and not pd.isna(value)} - set(NOT_RESULTS_PROTOCOLS))
    return others[0] if others else "none"


def protocol_order(protocols) -> list[str]:
    """The protocols of a report in the order the results table prefers them, 'none' last."""
    present = set(protocols)
    return ([p for p in PROTOCOL_PREFERENCE if p in present] + sorted(present - {*PROTOCOL_PREFERENCE, "none"})
            + (["none"] if "none" in present else []))


def run_tag(run: pd.Series, name: str, default: str = "") -> str:
    """A tag's value, or the default when the run lacks it (MLflow search gives None/NaN for absent tags)."""
    value = run.get(f"tags.{name}")
    if value is None or pd.isna(value) or str(value).strip() in ("", "None"):
        return default
    return str(value).strip()


def _coordinates(run: pd.Series) -> tuple[float, float, float]:
    """(rho, L, c) from the run's tags; L and c are NaN for fresh-only runs, all three NaN without a rho tag."""
    def read(name: str) -> float:
        value = run_tag(run, name)
        return float(value) if value else np.nan

    rho = read("rho")
    if rho == 0:  # fresh-only runs still carry the config's clip value: it means nothing without replay
        return 0.0, np.nan, np.nan
    return rho, read("L"), read("c")


def format_cell(rho: float, L: float, c: float) -> str:
    """(rho, L, c) as in the paper tables: '(0, -, -)', '(1, 2, 1)'."""
    parts = [f"{value:g}" if not pd.isna(value) else "-" for value in (rho, L, c)]
    return f"({', '.join(parts)})"


def grid_cell(rho: float, L: float, c: float) -> str:
    """The cell label a grid run logs for these coordinates: 'rho0', 'rho1-L2-c1'."""
    return "rho0" if rho == 0 else f"rho{rho:g}-L{L:g}-c{c:g}"


def is_plain(run: pd.Series) -> bool:
    """True for a run of the (rho, L, c) design: its cell label is exactly the grid cell its coordinates name
    (with its task's suffix, e.g. '-math')."""
    rho, L, c = _coordinates(run)
    return not pd.isna(rho) and run_tag(run, "cell") == grid_cell(rho, L, c) + run_tag(run, "task_suffix", "")


def run_role(run: pd.Series) -> dict:
    """plain, setting, variant label and grid coordinates of a run; a variant has no coordinates.

    Variants get NaN (rho, L, c) on purpose: every grid consumer (heatmaps, the fresh-only baseline,
    the frontier's rho colours) selects by coordinates, so a variant can never land in a grid cell
    even when its rho/L/c tags match one (a FIFO run at rho = 1, a DAPO run at rho = 0).
    A run without a `variant` label is named by its setting (grid runs) or its cell (variants).
    """
    rho, L, c = _coordinates(run)
    setting = "Fresh-only" if rho == 0 else "Replay"
    if is_plain(run):
        return {"plain": True, "setting": setting, "variant": run_tag(run, "variant", setting),
                "rho": rho, "L": L, "c": c, "coordinates": format_cell(rho, L, c)}
    return {"plain": False, "setting": "Variant", "variant": run_tag(run, "variant", run_tag(run, "cell", "?")),
            "rho": np.nan, "L": np.nan, "c": np.nan, "coordinates": "-"}


def run_fresh_evaluations(run: pd.Series) -> float:
    """Final fresh-evaluation count: the end-of-run tag, else the last logged cumulative metric."""
    tag = run.get("tags.fresh_evaluations")
    if tag is not None and not pd.isna(tag) and str(tag).strip():
        return float(tag)
    return run_metric(run, "budget/fresh_evaluations")


def run_seed(run: pd.Series) -> float:
    """The training seed (`seed` tag; 0, every trainer preset's seed, when the run has none)."""
    return float(run_tag(run, "seed", "0"))


def run_cell_key(run: pd.Series) -> str:
    """The cell across training seeds: its `cell_key` tag, else its `cell_id`, else its label and policy."""
    return (run_tag(run, "cell_key") or run_tag(run, "cell_id")
            or f"{run_tag(run, 'cell', '?')}|{run_tag(run, 'policy')}")


def metric_histories(client: MlflowClient, results: pd.DataFrame, keys: list[str]) -> pd.DataFrame:
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


