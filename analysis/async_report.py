"""Seed 001's figures for the asynchronous runs of a study (SPEC 11): Figure 2's distributions, the gamma table
from measured mu beside Table 1, and reward against steps, compute and wall time.

    python -m analysis.async_report --sweep async                      # after make sweep-async
    python -m analysis.async_report --sweep async --out reports/async --uri sqlite:////tmp/x/mlruns.db

Reads the newest FINISHED `runtime=async` run of each cell: its `runtime/runtime_distributions.json`
artifact (off-policiness and steps since last use of every sample, replay count of every rollout) and
its logged metrics. Writes report.md, gamma.csv, figure2.png and curves.png into the output folder.

Compute per update follows eq. 1 in units of one trainer step: 1 + W/T with a buffer, 1 + mu for the
LIFO queue (no reuse: the workers must make a batch for every update), with the run's configured mu.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

from src.paths import PROJECT_ROOT


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m analysis.async_report", description=__doc__.split("\n\n")[0])
    parser.add_argument("--version", action="store_true", help="print the project's version and exit")
    parser.add_argument("--sweep", action="append", help="study tag (repeatable); default: async")
    parser.add_argument("--uri", default=f"sqlite:///{PROJECT_ROOT}/mlruns.db")
    parser.add_argument("--experiment", default="replay-rloo")
    parser.add_argument("--out", type=Path, default=PROJECT_ROOT / "reports" / "async")
    return parser.parse_args(argv)


if __name__ == "__main__":  # --help, --version, a store or sweep that is not there: one line before MLflow loads
    from src.command.entry import answer_version, check_store, refuse_on_error

    answer_version(sys.argv[1:], "python -m analysis.async_report")
    _args = parse_args(sys.argv[1:])
    refuse_on_error(check_store, _args.uri, _args.experiment, _args.sweep or ["async"])

import matplotlib  # noqa: E402

matplotlib.use("Agg")

import matplotlib.pyplot as plt  # noqa: E402
from matplotlib.ticker import MaxNLocator  # noqa: E402
import pandas as pd  # noqa: E402
from mlflow.tracking import MlflowClient  # noqa: E402

from analysis.markdown import markdown_table  # noqa: E402
from analysis.runs import ReportError, load_runs  # noqa: E402
from src.runtime import formulas  # noqa: E402

PANELS = (("off_policiness", "off-policiness t - v"), ("replay_count", "replay count of a rollout"),
          ("since_last_use", "steps since last use (repeat uses)"))


def async_cells(runs: pd.DataFrame) -> pd.DataFrame:
    """The newest FINISHED runtime=async run of each cell, with its W, T, queue, N and mu as columns."""
    if runs.empty or "params.runtime.name" not in runs:
        return pd.DataFrame()
    done = runs[(runs["status"] == "FINISHED") & (runs["params.runtime.name"] == "async")]
    done = done.drop_duplicates("tags.cell")  # load_runs sorts newest first
    if done.empty:  # a study of synchronous runs: no runtime.workers column to read
        return pd.DataFrame()
    return pd.DataFrame({
        "cell": done["tags.cell"], "run_id": done["run_id"],
        "W": done["params.runtime.workers"].astype(int), "T": done["params.runtime.trainers"].astype(int),
        "queue": _queue(done), "N": _param(done, "buffer.capacity", "runtime.capacity").astype(int),
        "mu": done["params.runtime.mu"].astype(float)}).reset_index(drop=True)


def _param(runs: pd.DataFrame, key: str, earlier: str) -> pd.Series:
    """A setting as the runs logged it: `earlier` (the `runtime.*` spelling of the queue's settings, which stored
    runs may carry) where a run has it, else `key`."""
    value = runs[f"params.{key}"]
    return runs[f"params.{earlier}"].fillna(value) if f"params.{earlier}" in runs else value


def _queue(runs: pd.DataFrame) -> pd.Series:
    """The pipeline's queue: 'buffer' (buffer=fifo, seed 001's FIFO) or 'lifo' (buffer=none, its baseline)."""
    named = runs["params.buffer.name"].map(lambda name: "lifo" if name == "none" else "buffer")
    return runs["params.runtime.queue"].fillna(named) if "params.runtime.queue" in runs else named


def gamma_table(cells: pd.DataFrame, runs: pd.DataFrame) -> pd.DataFrame:
    """Per cell: mu measured from counts (D.4) and busy times, gamma from each (eq. 2), eq. 2 at Table 1's mu."""
    metrics = runs.set_index("run_id")
    rows = []
    for cell in cells.itertuples():
        run = metrics.loc[cell.run_id]
        mu_counts, mu_busy = run.get("metrics.runtime/mu_counts"), run.get("metrics.time/mu_busy")
        rows.append({"cell": cell.cell, "W": cell.W, "T": cell.T, "queue": cell.queue, "N": cell.N,
                     "mu_counts": mu_counts, "gamma_counts": _gamma(cell.W, cell.T, mu_counts),
                     "mu_busy": mu_busy, "gamma_busy": _gamma(cell.W, cell.T, mu_busy),
                     "gamma_table1": formulas.compute_ratio(cell.W, cell.T, 5.28),
                     "replay_predicted": formulas.expected_replay_count_from_rates(cell.W, cell.T, cell.mu),
                     "replay_measured": run.get("metrics.replay/count_mean")})
    return pd.DataFrame(rows)


def _gamma(workers: int, trainers: int, mu) -> float:
    return formulas.compute_ratio(workers, trainers, float(mu)) if mu is not None and mu == mu and mu > 0 else float("nan")


def distributions(client: MlflowClient, run_id: str) -> dict:
    with tempfile.TemporaryDirectory() as folder:
        path = client.download_artifacts(run_id, "runtime/runtime_distributions.json", folder)
        return json.loads(Path(path).read_text())


def figure2(cells: pd.DataFrame, found: dict[str, dict], path: Path) -> None:
    """Figure 2: each distribution as the share of samples (or rollouts) per value, one line per cell."""
    fig, axes = plt.subplots(1, len(PANELS), figsize=(5 * len(PANELS), 3.6))
    for axis, (key, title) in zip(axes, PANELS):
        for cell in cells.itertuples():
            counts = {int(k): v for k, v in found[cell.run_id][key].items()}
            total = sum(counts.values())
            if total:
                xs = sorted(counts)
                axis.plot(xs, [counts[x] / total for x in xs], marker="o", markersize=3, label=cell.cell)
        axis.set_title(title)
        axis.set_ylabel("share")
        axis.xaxis.set_major_locator(MaxNLocator(integer=True))
    axes[0].legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=200)
    plt.close(fig)


def curves(client: MlflowClient, cells: pd.DataFrame, path: Path) -> None:
    """Training reward against trainer steps, compute (eq. 1, in trainer steps) and wall time."""
    fig, axes = plt.subplots(1, 3, figsize=(15, 3.6))
    for cell in cells.itertuples():
        history = sorted(client.get_metric_history(cell.run_id, "train/reward"), key=lambda m: m.step)
        if not history:
            continue
        steps = [m.step for m in history]
        rewards = [m.value for m in history]
        per_update = formulas.compute_per_update(cell.W, cell.T, cell.mu, buffer=cell.queue == "buffer")
        start = history[0].timestamp
        for axis, xs in zip(axes, (steps, [(s + 1) * per_update for s in steps],
                                   [(m.timestamp - start) / 1000 for m in history])):
            axis.plot(xs, rewards, label=cell.cell)
    for axis, label in zip(axes, ("trainer steps", "compute (trainer-step units, eq. 1)", "wall seconds")):
        axis.set_xlabel(label)
        axis.set_ylabel("train/reward")
    axes[0].legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=200)
    plt.close(fig)


def write_report(uri: str, experiment: str, sweeps: list[str], out: Path) -> Path:
    runs = load_runs(uri, experiment, sweeps)
    if async_cells(runs).empty:
        raise ReportError(f"no finished runtime=async run in sweep(s) {', '.join(sweeps)} at {uri}; "
                          "run make sweep-async first")
    return write_async(runs, MlflowClient(uri), out)


def write_async(runs: pd.DataFrame, client: MlflowClient, out: Path) -> Path:
    """report.md, gamma.csv, figure2.png and curves.png of the study's async cells (some must exist) into `out`."""
    cells = async_cells(runs)
    out.mkdir(parents=True, exist_ok=True)
    found = {run_id: distributions(client, run_id) for run_id in cells["run_id"]}
    figure2(cells, found, out / "figure2.png")
    curves(client, cells, out / "curves.png")
    gamma = gamma_table(cells, runs)
    gamma.to_csv(out / "gamma.csv", index=False)
    lines = ["# Asynchronous runs (seed 001)", "", "## gamma from measured mu (eq. 2) beside Table 1 (mu = 5.28)", "",
             markdown_table(list(gamma.columns), [[_show(v) for v in row] for row in gamma.itertuples(index=False)]),
             "",
             "## Figure 2: off-policiness, replay count, steps since last use", "", "![figure 2](figure2.png)", "",
             "## Reward against steps, compute and wall time", "", "![curves](curves.png)", ""]
    (out / "report.md").write_text("\n".join(lines))
    return out / "report.md"


def _show(value) -> str:
    return f"{value:.3g}" if isinstance(value, float) else str(value)


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    try:
        print(write_report(args.uri, args.experiment, args.sweep or ["async"], args.out))
    except ReportError as error:
        sys.stderr.write(f"error: {error}\n")
        sys.exit(2)


if __name__ == "__main__":
    main()
