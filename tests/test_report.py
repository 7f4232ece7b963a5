"""analysis.report on a synthetic MLflow store: run selection, exact numbers, missing cells, figures, CLI errors."""

from __future__ import annotations

import time
from pathlib import Path

import matplotlib.pyplot as plt
import mlflow
import pandas as pd
import pytest
from mlflow.entities import Metric, Param
from mlflow.tracking import MlflowClient
from PIL import Image

from analysis import report

PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"
FIGURES = ["frontier.png", "heatmap_age.png", "heatmap_ratio.png", "best_of_n.png", "dynamics.png", "diversity.png"]
EXPERIMENT = "report-test"

BASELINE_CANONICAL = {"pass_at_1": 0.576, "pass_at_1_hw": 0.051, "pass_at_2": 0.62, "pass_at_2_hw": 0.02,
                      "pass_at_4": 0.68, "pass_at_4_hw": 0.02, "pass_at_8": 0.72, "pass_at_8_hw": 0.015,
                      "pass_at_16": 0.756, "pass_at_16_hw": 0.011, "mean_reward": 0.622, "mean_reward_hw": 0.005,
                      "correction_rate": 0.594, "correction_rate_hw": 0.005, "unique_rate": 0.429,
                      "unique_rate_hw": 0.012}
OLD_C1_CANONICAL = {"pass_at_1": 0.5, "pass_at_16": 0.7, "mean_reward": 0.5, "correction_rate": 0.5}
NEW_C1_QUICK = {"pass_at_1": 0.32, "pass_at_4": 0.38, "pass_at_8": 0.42, "mean_reward": 0.39,
                "correction_rate": 0.323, "unique_rate": 0.217}  # one repeat: no half-widths
AGGRESSIVE_CANONICAL = {"pass_at_1": 0.6, "pass_at_1_hw": 0.058, "pass_at_16": 0.832, "pass_at_16_hw": 0.014,
                        "mean_reward": 0.629, "mean_reward_hw": 0.006, "correction_rate": 0.614,
                        "correction_rate_hw": 0.006, "unique_rate": 0.3, "unique_rate_hw": 0.01}
PROBE = {"pass_at_1": 0.609, "pass_at_4": 0.76, "pass_at_8": 0.798, "pass_at_16": 0.819, "pass_at_32": 0.831,
         "pass_at_64": 0.844, "pass_at_64_hw": 0.01}


def _log_run(client: MlflowClient, experiment_id: str, *, started: int, sweep: str, rho: float, L: int, c: float,
             status: str = "FINISHED", final: dict[str, dict[str, float]] | None = None,
             fresh: int | None = None, steps: int = 4) -> str:
    """One run as src.run logs it: tags, a few params, per-step metrics, final evaluation metrics."""
    cell = "rho0" if rho == 0 else f"rho{rho:g}-L{L}-c{c:g}"
    tags = {"sweep": sweep, "cell": cell, "rho": f"{rho:g}", "L": str(L if rho else 0), "c": f"{c:g}",
            "policy": "tiny", "evaluation": "canonical", "mlflow.runName": cell}
    if fresh is not None:
        tags["fresh_evaluations"] = str(fresh)
    run = client.create_run(experiment_id, start_time=started, tags=tags)
    stamp = started + 1000
    metrics = []
    for step in range(steps):
        metrics += [Metric("train/reward", 0.3 + 0.01 * step, stamp, step),
                    Metric("train/kl_per_token", 0.001 * step, stamp, step),
                    Metric("budget/fresh_evaluations", 64.0 * (step + 1), stamp, step)]
        if rho > 0 and step > 0:  # importance weights exist only on steps that reused groups
            metrics += [Metric("weights/clip_fraction", 0.4, stamp, step), Metric("weights/ess", 0.9, stamp, step)]
    for protocol, values in (final or {}).items():
        metrics += [Metric(f"{protocol}/final/{key}", value, stamp, steps) for key, value in values.items()]
    params = [Param("buffer.ratio", str(rho)), Param("buffer.max_age", str(L)), Param("clip.ceiling", str(c))]
    client.log_batch(run.info.run_id, metrics=metrics, params=params)
    client.set_terminated(run.info.run_id, status=status, end_time=started + 5000)
    return run.info.run_id


@pytest.fixture(scope="module")
def store(tmp_path_factory):
    """A SQLite store: baseline, two runs of one cell, a FAILED and a KILLED run, a probed rho = 2 run."""
    folder = tmp_path_factory.mktemp("store")
    uri = f"sqlite:///{folder}/mlruns.db"
    previous = mlflow.get_tracking_uri()
    client = MlflowClient(uri)
    experiment_id = client.create_experiment(EXPERIMENT, artifact_location=(folder / "artifacts").as_uri())
    client.create_experiment("empty", artifact_location=(folder / "empty").as_uri())
    t0 = int(time.time() * 1000)
    ids = {
        "baseline": _log_run(client, experiment_id, started=t0, sweep="baseline", rho=0, L=0, c=10, fresh=102400,
                             final={"canonical": BASELINE_CANONICAL, "quick": {"pass_at_1": 0.1, "pass_at_8": 0.2},
                                    "probe": {k: v if k.endswith("_hw") else v - 0.02 for k, v in PROBE.items()}}),
        "old_c1": _log_run(client, experiment_id, started=t0 + 10_000, sweep="age", rho=1, L=1, c=1, fresh=51712,
                           final={"canonical": OLD_C1_CANONICAL}),
        "new_c1": _log_run(client, experiment_id, started=t0 + 20_000, sweep="age", rho=1, L=1, c=1,
                           final={"quick": NEW_C1_QUICK}),  # no fresh_evaluations tag: falls back to the metric
        "failed": _log_run(client, experiment_id, started=t0 + 30_000, sweep="age", rho=1, L=2, c=10,
                           status="FAILED", final={"canonical": BASELINE_CANONICAL}),
        "aggressive": _log_run(client, experiment_id, started=t0 + 40_000, sweep="ratio", rho=2, L=2, c=1,
                               fresh=35100, final={"canonical": AGGRESSIVE_CANONICAL, "probe": PROBE}),
        "killed": _log_run(client, experiment_id, started=t0 + 50_000, sweep="stress", rho=1, L=1, c=1000,
                           status="KILLED"),
    }
    runs = report.load_runs(uri, EXPERIMENT)
    out = folder / "report"
    path = report.write_report(runs, out, client, sweeps=None)
    yield {"uri": uri, "client": client, "ids": ids, "runs": runs, "out": out, "report": path,
           "text": path.read_text(), "folder": folder}
    mlflow.set_tracking_uri(previous)


def test_select_cells_newest_finished_per_cell(store):
    ids = store["ids"]
    used, superseded, unfinished = report.select_cells(store["runs"])
    assert set(used["run_id"]) == {ids["baseline"], ids["new_c1"], ids["aggressive"]}
    assert superseded["run_id"].tolist() == [ids["old_c1"]]
    assert superseded["superseded_by"].tolist() == [ids["new_c1"]]
    assert unfinished["run_id"].tolist() == [ids["killed"], ids["failed"]]  # newest first
    assert unfinished["status"].tolist() == ["KILLED", "FAILED"]


def test_results_table_has_the_logged_numbers(store):
    ids = store["ids"]
    used, _, _ = report.select_cells(store["runs"])
    table = report.results_table(used)
    # Baseline first, then by rho, L, c.
    assert table["run_id"].tolist() == [ids["baseline"], ids["new_c1"], ids["aggressive"]]
    base, quick, aggressive = (table.iloc[i] for i in range(3))
    # canonical is preferred over quick when a run has both; the quick-only run says so.
    assert table["protocol"].tolist() == ["canonical", "quick", "canonical"]
    assert base["setting"] == "Fresh-only" and base["coordinates"] == "(0, -, -)"
    assert pd.isna(base["L"]) and pd.isna(base["c"])  # the clip tag of a fresh-only run is ignored
    assert aggressive["setting"] == "Replay" and aggressive["coordinates"] == "(2, 2, 1)"
    assert (aggressive["rho"], aggressive["L"], aggressive["c"]) == (2.0, 2.0, 1.0)
    for name, key in [("pass@1", "pass_at_1"), ("pass@16", "pass_at_16"), ("reward", "mean_reward"),
                      ("correction_rate", "correction_rate"), ("unique_rate", "unique_rate")]:
        assert base[name] == BASELINE_CANONICAL[key]
        assert base[name + "_hw"] == BASELINE_CANONICAL[key + "_hw"]
        assert aggressive[name] == AGGRESSIVE_CANONICAL[key]
    assert base["pass@k_max"] == 0.756 and base["k_max"] == 16 and base["pass@k_max_hw"] == 0.011
    assert quick["pass@k_max"] == 0.42 and quick["k_max"] == 8 and pd.isna(quick["pass@k_max_hw"])
    assert quick["pass@1"] == 0.32 and pd.isna(quick["pass@1_hw"]) and pd.isna(quick["pass@16"])
    assert base["fresh_evaluations"] == 102400 and aggressive["fresh_evaluations"] == 35100
    assert quick["fresh_evaluations"] == 64 * 4  # last logged budget/fresh_evaluations

    csv = pd.read_csv(store["out"] / "results_table.csv")
    assert csv["run_id"].tolist() == table["run_id"].tolist()
    assert csv["pass@16"].iloc[0] == 0.756 and csv["protocol"].tolist() == table["protocol"].tolist()


def test_value_formatting():
    assert report.format_value(0.576, 0.051) == "0.576 ± 0.051"
    assert report.format_value(0.32) == "0.320"
    assert report.format_value(float("nan"), 0.1) == "-"
    assert report.format_cell(0, float("nan"), float("nan")) == "(0, -, -)"
    assert report.format_cell(1.5, 2, 10) == "(1.5, 2, 10)"
    assert report.format_count(51712) == "51.7K" and report.format_count(256) == "256"


def test_report_markdown(store):
    text, ids = store["text"], store["ids"]
    for run_id in ids.values():  # used, superseded and unfinished runs are all named in full
        assert f"`{run_id}`" in text
    # Table rows: mean ± hw for canonical, bare mean for the one-repeat quick run, the protocol per row.
    assert "| Fresh-only | (0, -, -) | rho0 | canonical | 102.4K | 0.576 ± 0.051 | 0.756 ± 0.011 (k=16) | " \
           "0.622 ± 0.005 | 0.594 ± 0.005 |" in text
    assert "| Replay | (1, 1, 1) | rho1-L1-c1 | quick | 256 | 0.320 | 0.420 (k=8) | 0.390 | 0.323 |" in text
    assert "Protocols are mixed in this report" in text
    # Best-of-N table from the probe metrics.
    assert "| Replay | (2, 2, 1) | rho2-L2-c1 | 0.609 | 0.760 | 0.798 | 0.819 | 0.831 | 0.844 ± 0.010 |" in text
    for name in [*FIGURES, "results_table.csv"]:
        assert f"({name})" in text  # embedded / linked with relative paths


def test_missing_heatmap_cells(store):
    used, _, unfinished = report.select_cells(store["runs"])
    results = report.results_table(used)
    age = report.heatmap_grid(results, "age", unfinished)
    age_missing, age_no_eval = report.missing_cells(age)
    assert len(age) == 9 and age.loc[age["cell"] == "rho1-L2-c10", "unfinished"].item() == "FAILED"
    assert "rho1-L1-c1" not in age_missing and len(age_missing) == 8
    assert "rho1-L2-c10" in age_missing  # its only run FAILED: missing, never filled
    ratio = report.heatmap_grid(results, "ratio")
    ratio_missing, _ = report.missing_cells(ratio)
    assert len(ratio) == 12 and len(ratio_missing) == 11 and "rho2-L2-c1" not in ratio_missing
    assert ratio.loc[ratio["cell"] == "rho2-L2-c1", "pass@k_max"].item() == 0.832
    assert age_no_eval == []
    assert "Missing grid cells (no finished run): `rho1-L1-c3`" in store["text"]
    assert "`rho1-L2-c10` (FAILED run)" in store["text"].split("## Heatmap: L × c")[1]


def _assert_png(path: Path) -> None:
    assert path.exists(), path
    assert path.read_bytes()[:8] == PNG_SIGNATURE
    with Image.open(path) as image:
        image.verify()
    assert plt.imread(path).ndim == 3


def test_every_figure_is_a_png(store):
    for name in FIGURES:
        _assert_png(store["out"] / name)


def test_cli_report_without_finished_runs(store, tmp_path, capsys):
    """A sweep whose only run was killed still gets every file; the figures say what is missing."""
    code = report.main(["--experiment", EXPERIMENT, "--sweep", "stress", "--out", str(tmp_path),
                        f"tracking.uri={store['uri']}"])
    assert code == 0
    assert str(tmp_path / "report.md") in capsys.readouterr().out
    for name in FIGURES:
        _assert_png(tmp_path / name)
    text = (tmp_path / "report.md").read_text()
    assert "_No finished runs._" in text and f"`{store['ids']['killed']}`" in text
    assert store["ids"]["baseline"] not in text  # the sweep filter
    assert "no probe results yet" in text and "found through the `sweeps` tag" in text


@pytest.mark.parametrize("experiment, message", [
    ("empty", "no runs found in experiment 'empty'"),
    ("nope", "experiment 'nope' not found"),
])
def test_cli_errors_exit_nonzero(store, capsys, experiment, message):
    code = report.main(["--experiment", experiment, f"tracking.uri={store['uri']}"])
    err = capsys.readouterr().err
    assert code != 0
    assert message in err and store["uri"] in err  # names what was searched
    assert "Traceback" not in err
