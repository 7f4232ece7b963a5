"""analysis.compute: tokens and wall time read back from runs, and the report's compute frontier."""

from __future__ import annotations

import time

import numpy as np
import pandas as pd
import pytest

from analysis import compute, report
from analysis.runs import load_runs
from tests.unit.test_report import _log_run, _new_store

QUICK = {"pass_at_1": 0.2, "pass_at_8": 0.4, "mean_reward": 0.3, "correction_rate": 0.2, "unique_rate": 0.3}


def test_wall_time_sums_step_times_and_falls_back_to_start_end():
    history = pd.DataFrame({"run_id": ["a", "a", "a", "b"], "key": ["time/step", "time/step", "train/reward", "x"],
                            "step": [0, 1, 0, 0], "value": [1.25, 2.5, 0.3, 9.0]})
    runs = pd.DataFrame({"run_id": ["a", "b", "c"],
                         "start_time": pd.to_datetime(["2026-01-01 10:00:00"] * 3, utc=True),
                         "end_time": pd.to_datetime(["2026-01-01 10:05:00", "2026-01-01 10:01:30", None], utc=True)})
    seconds = compute.wall_time_seconds(history, runs)
    assert seconds["a"] == pytest.approx(3.75)  # the step times, not the 300 s between start and end
    assert seconds["b"] == pytest.approx(90.0)  # no time/step: end - start
    assert np.isnan(seconds["c"])  # still running: neither


def test_compute_columns_take_the_last_cumulative_value_or_nan():
    results = pd.DataFrame({"run_id": ["a", "b"], "cell": ["x", "y"]})
    used = pd.DataFrame({"run_id": ["a", "b"], "metrics.budget/trained_tokens": [1234.0, np.nan],
                         "start_time": pd.to_datetime(["2026-01-01"] * 2), "end_time": pd.to_datetime(["2026-01-01"] * 2)})
    out = compute.compute_columns(results, used, pd.DataFrame(columns=["run_id", "key", "step", "value"]))
    assert out.loc[0, "trained_tokens"] == 1234.0 and np.isnan(out.loc[1, "trained_tokens"])
    assert out["generated_tokens"].isna().all()  # never logged by any run: a column of NaN, not an error
    assert out["wall_time_s"].tolist() == [0.0, 0.0]  # start == end, no time/step
    assert compute.missing_axes(out.assign(fresh_evaluations=[1.0, 2.0])) == []
    no_tokens = out.assign(fresh_evaluations=[1.0, 2.0], trained_tokens=np.nan)
    assert compute.missing_axes(no_tokens) == [compute.AXES[1][2]] and "budget/trained_tokens" in compute.AXES[1][2]


def test_report_draws_the_compute_frontier_from_logged_tokens_and_step_times(tmp_path_factory, tmp_path):
    _, uri, client, experiment_id = _new_store(tmp_path_factory, "compute")
    started = int(time.time() * 1000) - 3_600_000
    for offset, (rho, L, c, tokens, step_s) in enumerate([(0.0, 0, 1.0, 800.0, 2.0), (1.0, 1, 1.0, 600.0, 1.5)]):
        _log_run(client, experiment_id, started=started + 1000 * offset, sweep="s", rho=rho, L=L, c=c, fresh=1000,
                 final={"quick": QUICK},
                 per_step={"budget/trained_tokens": [tokens * (s + 1) / 4 for s in range(4)],
                           "budget/generated_tokens": [2 * tokens * (s + 1) / 4 for s in range(4)],
                           "time/step": [step_s] * 4})
    runs = load_runs(uri, "report-test")
    text = report.write_report(runs, tmp_path, client).read_text()
    assert (tmp_path / "compute_frontier.png").stat().st_size > 0
    section = text[text.index("## Compute frontier"):]
    assert "Not drawn" not in section.split("## ")[1]
    fresh_row = next(line for line in section.splitlines() if "| rho0 |" in line)
    assert "| 1600 | 800 | 8.0 s |" in fresh_row  # generated, trained tokens (last cumulative value), 4 x 2.0 s
    replay_row = next(line for line in section.splitlines() if "| rho1-L1-c1 |" in line)
    assert "| 1200 | 600 | 6.0 s |" in replay_row
    results = pd.read_csv(tmp_path / "results_table.csv").set_index("cell")
    assert results.loc["rho1-L1-c1", "trained_tokens"] == 600.0 and results.loc["rho0", "wall_time_s"] == 8.0


def test_report_without_token_metrics_says_which_panel_is_missing(tmp_path_factory, tmp_path):
    _, uri, client, experiment_id = _new_store(tmp_path_factory, "notokens")
    _log_run(client, experiment_id, started=int(time.time() * 1000) - 60_000, sweep="s", rho=0.0, L=0, c=1.0,
             fresh=1000, final={"quick": QUICK})
    text = report.write_report(load_runs(uri, "report-test"), tmp_path, client).read_text()
    section = text[text.index("## Compute frontier"):].split("\n## ")[0]
    assert "no budget/trained_tokens logged by these runs" in section
    assert "no budget/generated_tokens logged" in section
    assert "5.0 s" in section  # wall time from the run's start and end (the store's runs last 5 s)
