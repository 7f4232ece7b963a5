"""A self-contained report folder (report.md, CSV tables, LaTeX table, PNG/PDF figures) for the runs of a study.

    python -m analysis.report --sweep age --sweep ratio --sweep baseline
    python -m analysis.report --experiment replay-rloo --out reports/all tracking.uri=sqlite:////tmp/x/mlruns.db

Runs are read from MLflow (analysis.runs), turned into tables (analysis.tables), and written as CSV,
LaTeX (analysis.latex), figures (analysis.figures) and report.md (analysis.markdown). Figures follow
the paper: budget frontier (Fig. 3), L x c and rho x c heatmaps (Figs. 4, 5, 9), best-of-N probe
(Table 4, Fig. 6), training dynamics (Fig. 7), diversity (Fig. 8). A figure the runs cannot fill (a
heatmap of a grid the study did not run, a probe nobody ran) is left out, and report.md says which
cells or logs it needs.
"""

from __future__ import annotations

import argparse
import os
import sys
from datetime import datetime
from pathlib import Path


def _start_time(text: str) -> datetime:
    """--since value: an ISO date or date-time in local time."""
    try:
        return datetime.fromisoformat(text)
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"{text!r} is not a date: give YYYY-MM-DD or YYYY-MM-DDTHH:MM (local time), e.g. 2026-11-21T12:00")


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m analysis.report", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--version", action="store_true", help="print the project's version and exit")
    parser.add_argument("--sweep", action="append", help="only runs tagged with this sweep (repeatable)")
    parser.add_argument("--experiment", help="MLflow experiment (default: tracking.experiment of the config)")
    parser.add_argument("--since", type=_start_time, metavar="YYYY-MM-DD[THH:MM]",
                        help="only runs started at this local time or later (e.g. after rebuilding the warm start)")
    parser.add_argument("--out", type=Path, help="report folder (default: reports/<sweeps or experiment> in the `out` folder)")
    parser.add_argument("overrides", nargs="*", help="Hydra overrides for the tracking settings")
    return parser.parse_intermixed_args(argv)  # options and overrides in any order (make report ARGS=...)


if __name__ == "__main__":  # --help, --version, a store or sweep that is not there: one line before MLflow loads
    from src.command.entry import answer_version, check_runs_there

    answer_version(sys.argv[1:], "python -m analysis.report")
    _args = parse_args(sys.argv[1:])
    check_runs_there(_args.overrides, _args.sweep, _args.experiment)

import pandas as pd  # noqa: E402  (the report's own imports)
from mlflow.tracking import MlflowClient  # noqa: E402
from rich.console import Console  # noqa: E402

from analysis import compute, figures, seeds  # noqa: E402
from analysis.async_report import async_cells, write_async  # noqa: E402
from analysis.completions import quote_table  # noqa: E402
from analysis.latex import results_latex  # noqa: E402
from analysis.markdown import probe_hint, report_markdown  # noqa: E402
from analysis.runs import ReportError, known_sweeps, load_runs, metric_histories, select_cells  # noqa: E402
from analysis.tables import (FAILURE_LABELS, GRIDS, HEATMAP_PANELS, MIN_HEATMAP_CELLS, ReportData, baseline_values,
                             best_of_n_table, drawable_grid, failure_table, heatmap_grid, results_table,
                             variants_table)  # noqa: E402

DYNAMICS_KEYS = [key for key, _ in figures.DYNAMICS_PANELS]
FIGURES = ["frontier", "compute_frontier", "heatmap_age", "heatmap_ratio", "best_of_n", "dynamics", "diversity",
           "failure_shares", "failure_totals"]

console = Console(soft_wrap=True)  # a path or store URI stays whole on one line, however narrow the terminal or log


def read_report_data(runs: pd.DataFrame, client: MlflowClient) -> ReportData:
    """Every table of the report from the searched runs (and, through the client, their histories and artifacts)."""
    used, superseded, unfinished = select_cells(runs)
    results = results_table(used)
    history = metric_histories(client, results, DYNAMICS_KEYS + compute.HISTORY_KEYS)
    results = compute.compute_columns(results, used, history)  # tokens and wall time: the compute frontier's axes
    if not results.empty:  # how far the reused responses' weights drift, over the whole run (Figure 7's ESS panel)
        results["replay_ess"] = results["run_id"].map(seeds.mean_per_run(history, "weights/ess"))
    # Training-seed repeats: one row per cell over its seeds, compared seed by seed with fresh-only.
    cells = seeds.seed_table(results)
    probe, probe_ks = best_of_n_table(used)
    data = ReportData(used=used, superseded=superseded, unfinished=unfinished, results=results, cells=cells,
                      history=history, variants=variants_table(results, used), probe=probe, probe_ks=probe_ks,
                      failures=failure_table(used), completions=quote_table(client, used))
    data.grids = {name: heatmap_grid(data.per_cell, name, unfinished) for name in GRIDS}
    data.baseline = baseline_values(cells.sort_values("is_baseline", ascending=False, kind="stable")
                                    if not cells.empty else results)
    return data


def compute_axes(cells: pd.DataFrame) -> list[tuple[str, str, str]]:
    """The compute frontier's cost axes that some cell logged (compute.AXES); the others get no panel."""
    return [spec for spec in compute.AXES if spec[0] in cells and cells[spec[0]].notna().any()]


def left_out_figures(data: ReportData, sweeps: list[str] | None) -> dict[str, str]:
    """The figures (and panels) these runs cannot fill, each with the one line report.md prints instead."""
    evaluated = data.results[data.results["pass@k_max"].notna()] if not data.results.empty else data.results
    out = {}
    if evaluated.empty:
        out["frontier"] = out["compute_frontier"] = "no finished run with a final evaluation yet"
    elif not compute_axes(data.per_cell):
        out["compute_frontier"] = "no cost (fresh evaluations, tokens, wall time) logged by these runs"
    if not evaluated.empty and len(figures.frontier_sweep(data.results)) < 2:
        out["frontier_sweep"] = ("the right panel (the clip ceiling across replay ratios) needs two or more "
                                 "L = 2 cells, "
                                 "e.g. " + ", ".join(f"`{c}`" for c in data.grids["ratio"]["cell"][:3])
                                 + " (`make sweep-ratio`)")
    for name, grid in data.grids.items():
        have = int(grid["run_id"].notna().sum())
        if have < MIN_HEATMAP_CELLS:
            out[f"heatmap_{name}"] = (f"{have} of its {len(grid)} cells ran, and a heatmap needs at least "
                                      f"{MIN_HEATMAP_CELLS}; the cells it lacks are listed below "
                                      f"(`make sweep-{name}` runs them all)")
    if data.probe.empty:
        out["best_of_n"] = probe_hint(sweeps).split("\n")[0]
    panels = figures.dynamics_panels(data.history)
    if not panels:
        out["dynamics"] = "no per-step metrics logged by these runs"
    elif len(panels) < len(figures.DYNAMICS_PANELS):
        out["dynamics_panels"] = ", ".join(f"{label} (no run logged `{key}`)" for key, label in figures.DYNAMICS_PANELS
                                           if (key, label) not in panels)
    if data.results.empty or data.results["unique_rate"].isna().all():
        out["diversity"] = "no final evaluation logged `unique_rate`"
    if data.failures.empty:
        out["failure_shares"] = out["failure_totals"] = "no evaluation logged a failure taxonomy"
    return out


def write_figures(data: ReportData, out_dir: Path, left_out: dict[str, str]) -> list[Path]:
    """Draw every figure not left out (PNG and PDF); remove the files of left-out ones a previous report wrote."""
    for name in FIGURES:
        if name in left_out:
            for suffix in figures.FORMATS:
                (out_dir / f"{name}.{suffix}").unlink(missing_ok=True)
    short = data.short_label
    cells = data.per_cell
    axes = compute_axes(cells)
    panel_labels = {"pass@k_max": short, "reward": "evaluation reward", "correction_rate": "correction rate",
                    "pass@1": "pass@1"}
    draw = {
        "frontier": lambda path: figures.plot_frontier(data.results, path, short),
        "compute_frontier": lambda path: figures.plot_compute_frontier(cells, axes, path, short),
        "best_of_n": lambda path: figures.plot_best_of_n(data.probe, data.probe_ks, path, ""),
        "dynamics": lambda path: figures.plot_dynamics(seeds.seed_bands(data.history, data.results), cells, path),
        "diversity": lambda path: figures.plot_diversity(data.results, path),
        "failure_shares": lambda path: figures.plot_failure_shares(data.failures, FAILURE_LABELS, path),
        "failure_totals": lambda path: figures.plot_failure_totals(data.failures, path),
    }
    for name, spec in GRIDS.items():
        draw[f"heatmap_{name}"] = lambda path, name=name, spec=spec: figures.plot_heatmaps(
            drawable_grid(data.grids[name]), [(m, panel_labels[m]) for m in HEATMAP_PANELS], data.baseline,
            row_label="ρ" if spec["row"][0] == "rho" else spec["row"][0], col_label="c", title=spec["title"],
            path=path)
    return [draw[name](out_dir / f"{name}.png") for name in FIGURES if name not in left_out]


def write_report(runs: pd.DataFrame, out_dir: Path, client: MlflowClient, *, title: str = "Replay-RLOO report",
                 source: str = "", sweeps: list[str] | None = None) -> Path:
    """Write report.md, the CSV and LaTeX tables and the figures the runs can fill into out_dir; returns report.md."""
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    data = read_report_data(runs, client)
    tables = {"results_table": data.results, "seeds": data.cells, "variants": data.variants,
              "best_of_n": data.probe, "failures": data.failures}
    for name, table in tables.items():  # every table in every report, so a folder always has the same files
        table.to_csv(out_dir / f"{name}.csv", index=False)
    (out_dir / "results_table.tex").write_text(results_latex(data.results))
    left_out = left_out_figures(data, sweeps)
    drawn = write_figures(data, out_dir, left_out)
    report = out_dir / "report.md"
    report.write_text(report_markdown(data, left_out, title=title, source=source, sweeps=sweeps))
    console.print(f"[green]wrote[/green] {len(tables)} CSV tables, results_table.tex, {len(drawn)} figure(s) "
                  f"({len([n for n in FIGURES if n in left_out])} left out, see report.md) into {out_dir}")
    console.print(f"  {len(data.used)} used, {len(data.superseded)} superseded, "
                  f"{len(data.unfinished)} unfinished run(s)")
    return report


ASYNC_SECTION = """
## Asynchronous runs (seed 001)

Figure 2's distributions (off-policiness, replay count, steps since last use), the gamma table from
measured mu beside Table 1, and reward against steps, compute and wall time of this study's
`runtime=async` cells: [async/report.md](async/report.md).
"""


def sweeps_there(uri: str, experiment: str) -> str:
    """What a mistyped --sweep could have meant: the studies the experiment holds, with their run counts."""
    known = known_sweeps(uri, experiment)
    listed = ", ".join(f"{name} ({count} run{'s' if count > 1 else ''})" for name, count in known.items())
    return f"; the sweeps there: {listed}" if known else "; it holds no runs yet"


def main(argv: list[str] | None = None) -> int:
    """Command line: compose the tracking settings, read the runs, write the report folder."""
    from hydra import compose, initialize_config_dir
    from hydra.errors import HydraException
    from omegaconf.errors import OmegaConfBaseException

    from src.validate.checks import composition_error
    from src.paths import CONFIG_DIR, register_root_resolver
    from src.runs.store_check import StoreUnreachable, check_store

    # The ${root:} resolver from src.paths, not src.command.config: importing src.command.config would pull in torch
    # and transformers (seconds) for a command that only reads MLflow.
    register_root_resolver()
    # MLflow draws a "Downloading artifacts" bar for each completions table the report reads; it reads this
    # variable at each download (mlflow/environment_variables.py, MLFLOW_ENABLE_ARTIFACTS_PROGRESS_BAR).
    os.environ.setdefault("MLFLOW_ENABLE_ARTIFACTS_PROGRESS_BAR", "false")
    args = parse_args(argv)
    err = Console(stderr=True)
    try:
        with initialize_config_dir(str(CONFIG_DIR), version_base="1.3"):
            composed = compose("config", overrides=args.overrides)
    except (HydraException, OmegaConfBaseException) as error:
        err.print(f"[red]error:[/red] {composition_error(error, args.overrides)}", highlight=False, soft_wrap=True)
        return 2
    tracking = composed.tracking
    experiment = args.experiment or tracking.experiment
    searched = f"experiment '{experiment}' at {tracking.uri}" + (
        f" with sweep {' or '.join(repr(s) for s in args.sweep)}" if args.sweep else "") + (
        f" started since {args.since:%Y-%m-%d %H:%M}" if args.since else "")
    try:
        check_store(tracking.uri, experiment, None)
        runs = load_runs(tracking.uri, experiment, args.sweep, args.since)
        if runs.empty:
            raise ReportError(f"no runs found in {searched}" + (sweeps_there(tracking.uri, experiment)
                                                                 if args.sweep else ""))
    except (ReportError, StoreUnreachable) as error:
        err.print(f"[red]error:[/red] {error}", highlight=False, soft_wrap=True)
        return 1
    name = "+".join(args.sweep) if args.sweep else experiment
    out_dir = args.out or Path(composed.out) / "reports" / name
    console.print(f"{len(runs)} run(s) in {searched}")
    client = MlflowClient(tracking.uri)
    report = write_report(runs, out_dir, client, title=f"Replay-RLOO report: {name}", source=searched,
                          sweeps=args.sweep)
    if not async_cells(runs).empty:  # seed 001's own figures for the study's runtime=async cells
        write_async(runs, client, out_dir / "async")
        report.write_text(report.read_text() + ASYNC_SECTION)
    console.print(f"report: {report.resolve()}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
