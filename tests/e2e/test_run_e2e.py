"""End to end: `python -m src.run` trains, evaluates and logs; the run reads back from MLflow."""

from __future__ import annotations

import json
import logging
import subprocess
import sys

import mlflow
import pytest
from mlflow.tracking import MlflowClient

from src.paths import PROJECT_ROOT

pytestmark = pytest.mark.slow


def run_cli(tmp_path, *overrides, check=True):
    store = f"sqlite:///{tmp_path}/mlruns.db"
    command = [sys.executable, "-m", "src.run", f"tracking.uri={store}",
               f"tracking.artifact_location={tmp_path}/artifacts", f"hydra.run.dir={tmp_path}/run",
               f"hydra.sweep.dir={tmp_path}/multirun", *overrides]
    result = subprocess.run(command, cwd=PROJECT_ROOT, capture_output=True, text=True, timeout=600)
    if check:
        assert result.returncode == 0, result.stderr[-3000:]
    return result, store


def runs(store, sweep):
    mlflow.set_tracking_uri(store)
    return mlflow.search_runs(experiment_names=["replay-rloo"], filter_string=f"tags.sweep = '{sweep}'")


def test_two_step_replay_run_logs_everything_to_mlflow(tmp_path, random_policy_dir):
    _, store = run_cli(tmp_path, f"policy.name_or_path={random_policy_dir}", "buffer=age1", "clip=tight",
                       "trainer.steps=2", "trainer.groups_per_step=4", "trainer.group_size=2",
                       "policy.max_new_tokens=8", "evaluation.prompts=3", "evaluation.samples_per_prompt=2",
                       "evaluation.ks=[1,2]", "tracking.sweep=e2e")
    table = runs(store, "e2e")
    assert len(table) == 1
    run = MlflowClient(store).get_run(table.run_id[0])
    assert run.info.status == "FINISHED"
    assert run.data.tags["cell"] == "rho1-L1-c1"
    assert (run.data.tags["rho"], run.data.tags["L"], run.data.tags["c"]) == ("1", "1", "1")
    assert run.data.params["buffer.max_age"] == "1" and run.data.params["clip.ceiling"] == "1"
    history = MlflowClient(store).get_metric_history(run.info.run_id, "budget/fresh_evaluations")
    assert [m.value for m in sorted(history, key=lambda m: m.step)] == [8, 12]  # step 0: 4 groups, step 1: 2 fresh
    for key in ("train/reward", "train/kl", "weights/clip_fraction", "weights/ess", "batch/replay_ratio",
                "train/reward/fresh", "train/reward/replay", "train/reward/age1", "buffer/age1", "time/generate",
                "quick/start/mean_reward", "quick/final/pass_at_1", "quick/final/correction_rate"):
        assert key in run.data.metrics, key
    artifacts = {a.path for a in MlflowClient(store).list_artifacts(run.info.run_id)}
    assert "config.yaml" in artifacts and "evaluation" in artifacts
    tables = {a.path for a in MlflowClient(store).list_artifacts(run.info.run_id, "evaluation")}
    assert "evaluation/quick_final_per_prompt.csv" in tables


def test_config_mistakes_fail_before_any_run_is_created(tmp_path):
    result, store = run_cli(tmp_path, "buffer=age1", "buffer.ratio=2", "tracking.sweep=bad", check=False)
    assert result.returncode != 0
    assert "rho=2" in result.stderr and "L=1" in result.stderr
    assert not (tmp_path / "mlruns.db").exists()  # nothing was logged, nothing was loaded


def test_a_crashing_run_is_marked_failed_and_resumes_by_hand_without_logging_a_step_twice(
        tmp_path, random_policy_dir, compose_config, monkeypatch, caplog):
    """A crash mid-training closes the MLflow run as FAILED (not RUNNING) and keeps the last two checkpoints;
    resuming by hand from the older one redoes a logged step, which is compared, not logged again."""
    from hydra.core.hydra_config import HydraConfig
    from omegaconf import open_dict

    import src.run
    import src.train

    store = f"sqlite:///{tmp_path}/mlruns.db"
    cfg = compose_config(f"policy.name_or_path={random_policy_dir}", "trainer.steps=3", "trainer.groups_per_step=2",
                         "trainer.group_size=2", "policy.max_new_tokens=4", "evaluation.at_start=false",
                         "trainer.checkpoint_every=1", f"tracking.uri={store}", "tracking.sweep=crash",
                         f"tracking.artifact_location={tmp_path}/artifacts", f"hydra.run.dir={tmp_path}/run",
                         hydra=True)
    cfg.hydra.runtime.output_dir = str(tmp_path / "run")
    HydraConfig.instance().set_config(cfg)
    with open_dict(cfg):
        del cfg["hydra"]  # as under @hydra.main: the job sees its config without the hydra node
    real_learn, calls = src.train.learn, []

    def crash_on_second_step(*args):
        calls.append(1)
        if len(calls) == 3:
            raise RuntimeError("simulated crash")
        return real_learn(*args)

    monkeypatch.setattr(src.train, "learn", crash_on_second_step)
    with pytest.raises(RuntimeError, match="simulated crash"):
        src.run.train(cfg)
    table = runs(store, "crash")
    assert len(table) == 1 and table.status[0] == "FAILED"
    assert table["tags.failure_reason"][0] == "RuntimeError: simulated crash"
    assert (tmp_path / "run" / "checkpoint.pt").exists()  # written after step 2, ready to resume

    monkeypatch.setattr(src.train, "learn", real_learn)
    with open_dict(cfg):
        cfg.trainer.resume_from = str(tmp_path / "run" / "checkpoint.prev.pt")  # step 1: step 1 is redone
    with caplog.at_level(logging.WARNING):
        src.run.train(cfg)
    assert "RESUME MISMATCH" not in caplog.text
    table = runs(store, "crash")
    assert len(table) == 1 and table.status[0] == "FINISHED"
    assert "failure_reason" not in MlflowClient(store).get_run(table.run_id[0]).data.tags  # it continued
    client = MlflowClient(store)
    for key in ("train/reward", "budget/fresh_evaluations", "time/step", "train/kl"):
        assert sorted(m.step for m in client.get_metric_history(table.run_id[0], key)) == [0, 1, 2], key
    with open(client.download_artifacts(table.run_id[0], "completions/train.json", str(tmp_path))) as handle:
        steps = [row[0] for row in json.load(handle)["data"]]  # the first column is the step
    assert steps == sorted(steps) and set(steps) == {0, 1, 2} and len(steps) == 3 * steps.count(0)  # none twice


def test_runs_started_together_on_a_new_store_do_not_race(tmp_path):
    """Two processes creating the same SQLite store at once both get the one experiment."""
    code = ("import sys, src.runs.store as store; "
            "print(store.ensure_experiment(sys.argv[1], 'replay-rloo', sys.argv[2]))")
    store = f"sqlite:///{tmp_path}/mlruns.db"
    processes = [subprocess.Popen([sys.executable, "-c", code, store, str(tmp_path / "artifacts")], cwd=PROJECT_ROOT,
                                  stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for _ in range(3)]
    results = [process.communicate(timeout=120) for process in processes]
    assert all(process.returncode == 0 for process in processes), [err[-500:] for _, err in results]
    assert len({out.strip() for out, _ in results}) == 1
