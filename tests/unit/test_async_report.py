"""analysis.async_report: Figure 2, the gamma table and the curves from logged runtime=async runs."""

from __future__ import annotations

import json
import time

import mlflow
import pytest
from mlflow.entities import Metric, Param
from mlflow.tracking import MlflowClient

from analysis import async_report


def _async_run(client, experiment_id, folder, cell, workers, trainers, queue, mu_counts, started):
    run = client.create_run(experiment_id, start_time=started, tags={"sweep": "async", "cell": cell})
    run_id = run.info.run_id
    params = [Param("runtime.name", "async"), Param("runtime.workers", str(workers)),
              Param("runtime.trainers", str(trainers)), Param("buffer.name", "none" if queue == "lifo" else "fifo"),
              Param("buffer.capacity", "1024"), Param("runtime.mu", "4.0")]
    metrics = [Metric("train/reward", 0.1 * step, started + 1000 * step, step) for step in range(3)]
    metrics += [Metric("runtime/mu_counts", mu_counts, started, 2), Metric("replay/count_mean", 1.5, started, 2)]
    client.log_batch(run_id, metrics=metrics, params=params)
    path = folder / cell / "runtime_distributions.json"  # the artifact's name, as a run logs it
    path.parent.mkdir()
    path.write_text(json.dumps({"off_policiness": {"0": 8, "1": 16}, "replay_count": {"1": 4, "2": 2},
                                "since_last_use": {"1": 3}}))
    client.log_artifact(run_id, str(path), artifact_path="runtime")
    client.set_terminated(run_id, "FINISHED")
    return run_id


@pytest.fixture
def store(tmp_path):
    uri = f"sqlite:///{tmp_path}/mlruns.db"
    client = MlflowClient(uri)
    experiment_id = client.create_experiment("replay-rloo", artifact_location=(tmp_path / "artifacts").as_uri())
    previous = mlflow.get_tracking_uri()
    now = int(time.time() * 1000)
    for i, (cell, w, t, queue, mu) in enumerate((("rho0-W3T1-N1024", 3, 1, "buffer", 4.0),
                                                 ("rho0-W1T3-N1024", 1, 3, "buffer", 12.0),
                                                 ("rho0-W3T1-lifo", 3, 1, "lifo", 1.0))):
        _async_run(client, experiment_id, tmp_path, cell, w, t, queue, mu, now + i)
    yield uri, tmp_path
    mlflow.set_tracking_uri(previous)


def test_report_writes_figure2_gamma_table_and_curves(store):
    uri, folder = store
    path = async_report.write_report(uri, "replay-rloo", ["async"], folder / "out")
    gamma = (folder / "out" / "gamma.csv").read_text().splitlines()
    assert len(gamma) == 4 and gamma[0].startswith("cell,W,T,queue,N,mu_counts,gamma_counts")
    row = next(line for line in gamma if line.startswith("rho0-W3T1-N1024")).split(",")
    assert float(row[6]) == pytest.approx((1 + 3) / (1 + 4.0))        # eq. 2 at the measured mu
    assert float(row[9]) == pytest.approx((1 + 3) / (1 + 5.28))       # eq. 2 at Table 1's mu = 5.28
    assert (folder / "out" / "figure2.png").stat().st_size > 1000 and (folder / "out" / "curves.png").exists()
    assert "figure2.png" in path.read_text()


def test_report_without_async_runs_says_so(tmp_path):
    uri = f"sqlite:///{tmp_path}/mlruns.db"
    MlflowClient(uri).create_experiment("replay-rloo", artifact_location=(tmp_path / "a").as_uri())
    with pytest.raises(async_report.ReportError, match="make sweep-async"):
        async_report.write_report(uri, "replay-rloo", ["async"], tmp_path / "out")


def test_make_report_adds_the_async_section_for_a_study_with_async_runs(store):
    from analysis import report

    uri, folder = store
    assert report.main(["--sweep", "async", "--out", str(folder / "study"), f"tracking.uri={uri}"]) == 0
    text = (folder / "study" / "report.md").read_text()
    assert "## Asynchronous runs (seed 001)" in text and "[async/report.md](async/report.md)" in text
    assert (folder / "study" / "async" / "figure2.png").stat().st_size > 1000
    assert (folder / "study" / "async" / "gamma.csv").exists()


def test_a_study_of_synchronous_runs_has_no_async_cells():
    import pandas as pd

    runs = pd.DataFrame({"status": ["FINISHED"], "params.runtime.name": ["sync"], "tags.cell": ["rho0"],
                         "run_id": ["x"]})
    assert async_report.async_cells(runs).empty
