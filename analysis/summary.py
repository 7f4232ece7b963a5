"""A short table of finished runs, read back from MLflow (`make demo` prints it at the end).

    python -m analysis.summary --sweep demo --latest 2
"""

from __future__ import annotations

import argparse
import sys


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m analysis.summary", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--version", action="store_true", help="print the project's version and exit")
    parser.add_argument("--sweep", help="only runs tagged with this sweep name")
    parser.add_argument("--latest", type=int, help="only the N newest runs")
    parser.add_argument("overrides", nargs="*", help="Hydra overrides for the tracking settings")
    return parser.parse_args(argv)


if __name__ == "__main__":  # --help, --version, a store or sweep that is not there: one line before MLflow loads
    from src.command.entry import answer_version, check_runs_there

    answer_version(sys.argv[1:], "python -m analysis.summary")
    _args = parse_args(sys.argv[1:])
    check_runs_there(_args.overrides, [_args.sweep] if _args.sweep else [])

import mlflow  # noqa: E402  (the summary's own imports)
import pandas as pd  # noqa: E402
from rich.console import Console  # noqa: E402
from rich.table import Table  # noqa: E402

from src.runs.links import ui_command  # noqa: E402
from src.runs.tracking import metric_key  # noqa: E402

COLUMNS = {  # metric -> column heading
    "fresh_evaluations": "fresh evals",
    "{protocol}/start/mean_reward": "reward before",
    "{protocol}/final/mean_reward": "reward after",
    "{protocol}/start/pass@1": "pass@1 before",
    "{protocol}/final/pass@1": "pass@1 after",
    "{protocol}/final/correction_rate": "correct after",
}


def load_runs(uri: str, experiment: str, sweep: str | None, latest: int | None) -> pd.DataFrame:
    """Runs of one experiment (optionally one sweep), newest first."""
    mlflow.set_tracking_uri(uri)
    query = f"tags.sweep = '{sweep}'" if sweep else ""
    runs = mlflow.search_runs(experiment_names=[experiment], filter_string=query, order_by=["start_time DESC"])
    return runs.head(latest) if latest else runs


def summary_table(runs: pd.DataFrame) -> Table:
    """One row per run: cell, status, fresh evaluations, held-out reward and pass@1 before/after RL."""
    table = Table(title="Runs (held-out evaluation before and after RL)")
    for heading in ["run", "cell", "status", *COLUMNS.values()]:
        table.add_column(heading, justify="right", no_wrap=heading in ("run", "cell", "status"))
    for _, run in runs.iloc[::-1].iterrows():
        protocol = run.get("tags.evaluation", "quick")
        values = []
        for metric in COLUMNS:
            if metric == "fresh_evaluations":
                values.append(str(run.get("tags.fresh_evaluations", "-")))
                continue
            value = run.get("metrics." + metric_key(metric.format(protocol=protocol)))
            values.append("-" if value is None or pd.isna(value) else f"{value:.3f}")
        table.add_row(run["run_id"][:8], str(run.get("tags.cell", "?")), run["status"], *values)
    return table


def main() -> None:
    import src.command.config  # noqa: F401  (the ${root:} resolver)
    from hydra import compose, initialize_config_dir

    from src.paths import CONFIG_DIR

    args = parse_args()
    with initialize_config_dir(str(CONFIG_DIR), version_base="1.3"):
        composed = compose("config", overrides=args.overrides)
    tracking = composed.tracking
    runs = load_runs(tracking.uri, tracking.experiment, args.sweep, args.latest)
    console = Console(width=max(Console().width, 110))  # logs and pipes default to 80 columns
    if runs.empty:  # a warning, not a result: stderr
        Console(stderr=True).print(f"no runs found in experiment '{tracking.experiment}' at {tracking.uri}"
                                   + (f" with sweep '{args.sweep}'" if args.sweep else ""))
        return
    console.print(summary_table(runs))
    opener = ui_command(tracking.uri, tracking.artifact_location, composed.out)
    console.print(f"MLflow store: {tracking.uri}  (browse {f'with `{opener}`' if opener else 'at that address'})",
                  soft_wrap=True, highlight=False)


if __name__ == "__main__":
    main()
