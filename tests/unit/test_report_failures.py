"""The report's failure-taxonomy table and figures (seed 004 Figures 3-4), from metrics as the evaluation logs them."""

from __future__ import annotations

import time

import mlflow
import pytest
from mlflow.entities import Metric

from analysis import report, tables
from analysis.runs import load_runs, select_cells
from src.task.countdown_failures import CATEGORIES
from tests.unit.test_report import _assert_png, _log_run, _new_store


def _failures(prefix: str, rollouts: int, counts: dict[str, int]) -> list[tuple[str, float]]:
    failed = sum(counts.values())
    out = [(f"{prefix}/failures/rollouts", rollouts), (f"{prefix}/failures/failed", failed)]
    for category in CATEGORIES:
        out.append((f"{prefix}/failures/{category}", counts.get(category, 0)))
        out.append((f"{prefix}/failure_share/{category}", counts.get(category, 0) / failed))
    return out


@pytest.fixture(scope="module")
def store(tmp_path_factory):
    folder, uri, client, experiment_id = _new_store(tmp_path_factory, "failures")
    previous = mlflow.get_tracking_uri()
    t0 = int(time.time() * 1000)
    fresh = _log_run(client, experiment_id, started=t0, sweep="variants", rho=0, L=0, c=1,
                     final={"quick": {"pass_at_1": 0.2, "mean_reward": 0.3}})
    ipo = _log_run(client, experiment_id, started=t0 + 1000, sweep="variants", rho=0, L=0, c=1, cell="rho0-ipo",
                   tags={"loss": "ipo", "variant": "Fresh-only (IPO loss)"},
                   final={"quick": {"pass_at_1": 0.15, "mean_reward": 0.25}})
    metrics = {fresh: _failures("quick/start", 400, {"format_error": 200, "wrong_target": 100, "other": 20})
               + _failures("quick/final", 400, {"format_error": 100, "wrong_target": 150, "invalid_number_use": 50}),
               ipo: _failures("quick/start", 400, {"format_error": 200, "wrong_target": 100, "other": 20})
               + _failures("quick/final", 400, {"wrong_target": 300, "repetitive_or_incoherent": 20})}
    for run_id, values in metrics.items():
        client.log_batch(run_id, metrics=[Metric(key, float(value), t0, 4 if "final" in key else 0)
                                          for key, value in values])
    runs = load_runs(uri, "report-test")
    out = folder / "report"
    path = report.write_report(runs, out, client, sweeps=["variants"])
    yield {"runs": runs, "out": out, "text": path.read_text(), "ids": (fresh, ipo)}
    mlflow.set_tracking_uri(previous)


def test_failure_table_has_one_warm_start_and_each_method(store):
    used, _, _ = select_cells(store["runs"])
    table = tables.failure_table(used)
    assert table["method"].tolist() == ["warm start", "Fresh-only", "Fresh-only (IPO loss)"]
    assert table["stage"].tolist() == ["start", "final", "final"]
    assert table["failed"].tolist() == [320, 300, 320]
    ipo = table.iloc[2]
    assert ipo["wrong_target"] == 300 and ipo["share_wrong_target"] == pytest.approx(300 / 320)
    assert ipo["repetitive_or_incoherent"] == 20 and ipo["format_error"] == 0
    fresh = table.iloc[1]
    assert fresh["share_invalid_number_use"] == pytest.approx(50 / 300)


def test_report_draws_both_failure_figures_and_the_table(store):
    for name in ("failure_shares.png", "failure_totals.png"):
        _assert_png(store["out"] / name)
    assert (store["out"] / "failures.csv").exists()
    text = store["text"]
    assert "## Failure taxonomy (seed 004 Figures 3-4, appendix B.4)" in text
    assert "| Fresh-only (IPO loss) | rho0-ipo | final | quick | 320 / 400 | 0 (0%) | 300 (94%) |" in text


def test_a_math_study_shows_the_math_categories_and_no_countdown_column(tmp_path_factory):
    from src.task.math.failures import CATEGORIES as MATH, LABELS

    folder, uri, client, experiment_id = _new_store(tmp_path_factory, "math-failures")
    t0 = int(time.time() * 1000)
    run = _log_run(client, experiment_id, started=t0, sweep="math", rho=0, L=0, c=1, cell="rho0-math",
                   final={"quick": {"pass_at_1": 0.1, "mean_reward": 0.1}})
    counts = {"no_boxed_answer": 10, "wrong_answer": 300, "truncated": 30}
    values = [("quick/final/failures/rollouts", 400), ("quick/final/failures/failed", 340)]
    values += [(f"quick/final/failures/{c}", counts.get(c, 0)) for c in MATH]
    values += [(f"quick/final/failure_share/{c}", counts.get(c, 0) / 340) for c in MATH]
    client.log_batch(run, metrics=[Metric(key, float(value), t0, 4) for key, value in values])
    used, _, _ = select_cells(load_runs(uri, "report-test"))
    table = tables.failure_table(used)
    assert "wrong_answer" in table and "wrong_target" not in table  # Countdown's categories were never logged
    text = report.write_report(load_runs(uri, "report-test"), folder / "report", client, sweeps=["math"]).read_text()
    assert f"| {LABELS['wrong_answer']} |" in text and "wrong target" not in text
    _assert_png(folder / "report" / "failure_shares.png")
