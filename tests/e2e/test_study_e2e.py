"""End to end: train two tiny cells, evaluate them again standalone, draw the report, read the numbers back."""

from __future__ import annotations

import subprocess
import sys

import mlflow
import pandas as pd
import pytest
from mlflow.tracking import MlflowClient

from analysis import report
from src.eval import standalone as evaluate
from src.paths import PROJECT_ROOT
from tests.unit.test_report import FIGURES, _assert_png

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def study(tmp_path_factory, random_policy_dir):
    """Two FINISHED tiny cells (fresh-only and rho=1, L=1, c=1) in a fresh store, plus the overrides to reach it."""
    folder = tmp_path_factory.mktemp("study")
    tracking = [f"tracking.uri=sqlite:///{folder}/mlruns.db", f"tracking.artifact_location={folder}/artifacts"]
    command = [sys.executable, "-m", "src.run", "-m", f"policy.name_or_path={random_policy_dir}",
               "buffer=none,age1", "clip=tight", "trainer.steps=2", "trainer.groups_per_step=4",
               "trainer.group_size=2", "policy.max_new_tokens=6", "evaluation.at_start=false",
               "evaluation.prompts=3", "evaluation.samples_per_prompt=2", "evaluation.ks=[1,2]",
               "tracking.sweep=e2e", f"hydra.sweep.dir={folder}/multirun", *tracking]
    result = subprocess.run(command, cwd=PROJECT_ROOT, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]
    mlflow.set_tracking_uri(f"sqlite:///{folder}/mlruns.db")
    runs = mlflow.search_runs(experiment_names=["replay-rloo"])
    assert sorted(runs["status"]) == ["FINISHED", "FINISHED"]
    return {"folder": folder, "tracking": tracking, "runs": runs.set_index("tags.cell")}


SMALL_PROBE = ["evaluation=probe", "evaluation.prompts=3", "evaluation.samples_per_prompt=4",
               "evaluation.ks=[1,2,4]", "evaluation.repeats=2"]


def test_probe_added_to_finished_runs_without_retraining(study):
    client = MlflowClient(study["tracking"][0].removeprefix("tracking.uri="))
    assert evaluate.main(["--sweep", "e2e", *SMALL_PROBE, *study["tracking"]]) == 0
    for run_id in study["runs"]["run_id"]:
        run = client.get_run(run_id)
        assert run.info.status == "FINISHED"  # evaluating never reopens the run
        for key in ("probe/final/pass_at_4", "probe/final/pass_at_4_hw", "probe/final/mean_reward",
                    "probe/final/unique_rate"):
            assert key in run.data.metrics, key
        assert run.data.tags["eval.probe.seeds"] == "300000-300001"  # the probe's own namespace
        assert run.data.tags["eval.quick.seeds"] == "100000-100000"
        artifacts = {a.path for a in client.list_artifacts(run_id, "evaluation")}
        assert "evaluation/probe_final_per_repeat.csv" in artifacts
        per_repeat = pd.read_csv(client.download_artifacts(run_id, "evaluation/probe_final_per_repeat.csv"))
        # The logged mean is the mean of the per-repeat rows, so intervals can be recomputed later.
        assert per_repeat["pass@4"].mean() == pytest.approx(run.data.metrics["probe/final/pass_at_4"])
    before = len(client.get_metric_history(run_id, "probe/final/pass_at_4"))
    assert evaluate.main(["--sweep", "e2e", *SMALL_PROBE, *study["tracking"]]) == 0  # already there: skipped
    assert len(client.get_metric_history(run_id, "probe/final/pass_at_4")) == before


def test_checkpoint_evaluation_and_report_hold_the_logged_numbers(study, tmp_path):
    uri = study["tracking"][0].removeprefix("tracking.uri=")
    client = MlflowClient(uri)
    replay = study["runs"].loc["rho1-L1-c1"]
    checkpoint = f"{replay['tags.output_dir']}/checkpoint.pt"
    canonical = ["evaluation=canonical", "evaluation.prompts=3", "evaluation.samples_per_prompt=4",
                 "evaluation.ks=[1,2,4]", "evaluation.repeats=2"]
    assert evaluate.main(["--checkpoint", checkpoint, *canonical, *study["tracking"]]) == 0
    logged = client.get_run(replay["run_id"]).data.metrics
    assert "canonical/final/pass_at_4" in logged  # the checkpoint at the last step is the final policy

    assert report.main(["--sweep", "e2e", "--out", str(tmp_path), *study["tracking"]]) == 0
    table = pd.read_csv(tmp_path / "results_table.csv").set_index("cell")
    assert set(table.index) == {"rho0", "rho1-L1-c1"}
    assert table.loc["rho1-L1-c1", "protocol"] == "canonical"  # canonical preferred over quick
    assert table.loc["rho1-L1-c1", "reward"] == pytest.approx(logged["canonical/final/mean_reward"])
    assert table.loc["rho1-L1-c1", "pass@4"] == pytest.approx(logged["canonical/final/pass_at_4"])
    fresh_only = client.get_run(study["runs"].loc["rho0", "run_id"]).data.metrics
    assert table.loc["rho0", "protocol"] == "quick"
    assert table.loc["rho0", "reward"] == pytest.approx(fresh_only["quick/final/mean_reward"])
    assert table.loc["rho0", "fresh_evaluations"] == 16  # 2 steps x 4 groups x 2 responses
    for name in FIGURES:
        _assert_png(tmp_path / name)
    text = (tmp_path / "report.md").read_text()
    assert all(run_id in text for run_id in study["runs"]["run_id"])


@pytest.mark.long  # make test-long (docs/testing.md): seed000's reproduction draws curves
def test_evaluation_every_n_steps_gives_a_learning_curve(tmp_path, random_policy_dir):
    store = f"sqlite:///{tmp_path}/mlruns.db"
    command = [sys.executable, "-m", "src.run", f"policy.name_or_path={random_policy_dir}", "trainer.steps=4",
               "trainer.groups_per_step=2", "trainer.group_size=2", "policy.max_new_tokens=6",
               "evaluation.every=2", "evaluation.prompts=2", "evaluation.samples_per_prompt=2", "evaluation.ks=[1]",
               f"tracking.uri={store}", f"tracking.artifact_location={tmp_path}/artifacts",
               f"hydra.run.dir={tmp_path}/run"]
    result = subprocess.run(command, cwd=PROJECT_ROOT, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]
    mlflow.set_tracking_uri(store)
    run_id = mlflow.search_runs(experiment_names=["replay-rloo"]).run_id[0]
    client = MlflowClient(store)
    steps = {stage: [m.step for m in client.get_metric_history(run_id, f"quick/{stage}/mean_reward")]
             for stage in ("start", "during", "final")}
    assert steps == {"start": [0], "during": [2], "final": [4]}
    artifacts = {a.path for a in client.list_artifacts(run_id, "evaluation")}
    assert "evaluation/quick_during_step2_per_prompt.csv" in artifacts
