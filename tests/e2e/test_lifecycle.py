"""Never lose a run: dead runs resume, live ones are left alone, checkpoints are safe, stores are shared safely."""

from __future__ import annotations

import json
import logging
import os
import random
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import mlflow
import pytest

from tests.conftest import wall_clock
import torch
from mlflow.tracking import MlflowClient

from src.settings import RunSettings
from src.study.labels import cell_of
from src.runs.lifecycle import HEARTBEAT_FILE, Heartbeat, read_heartbeat, run_liveness, write_heartbeat
from src.paths import PROJECT_ROOT
from src.study.sweep import cell_identity
from src.buffer.store import NoReplay
from src.rollout.behaviour import CurrentBehaviour
from src.runs.checkpoint import CheckpointError, read_checkpoint, read_latest_checkpoint, save_checkpoint
from src.batch import TrainState
from tests.e2e.test_sweep import store, tiny_cli


# --------------------------------------------------------------------------- liveness
def a_dead_pid() -> int:
    process = subprocess.Popen([sys.executable, "-c", "pass"])
    process.wait()
    return process.pid


def test_a_run_whose_process_is_gone_is_dead_at_once(tmp_path):
    beat = {"run_id": "r1", "host": socket.gethostname(), "pid": a_dead_pid(), "time": time.time()}
    (tmp_path / HEARTBEAT_FILE).write_text(json.dumps(beat))
    liveness = run_liveness("r1", tmp_path, started_s=time.time(), slurm_job=None, timeout_s=120)
    assert not liveness.alive and f"process {beat['pid']}" in liveness.reason


def test_a_fresh_heartbeat_is_alive_and_a_stale_one_dead(tmp_path):
    write_heartbeat(tmp_path, "r1")  # this very process: alive
    alive = run_liveness("r1", tmp_path, started_s=0, slurm_job=None, timeout_s=120)
    assert alive.alive and 100 < alive.wait_s <= 120
    later = run_liveness("r1", tmp_path, started_s=0, slurm_job=None, timeout_s=120, now=time.time() + 121)
    assert not later.alive and "heartbeat_timeout_s=120" in later.reason


def test_without_a_heartbeat_the_start_time_decides(tmp_path):
    assert run_liveness("r1", tmp_path, started_s=time.time() - 10, slurm_job=None, timeout_s=120).alive
    assert not run_liveness("r1", tmp_path, started_s=time.time() - 300, slurm_job=None, timeout_s=120).alive
    write_heartbeat(tmp_path, "another-run")  # a heartbeat of another run in the folder does not count
    assert not run_liveness("r1", tmp_path, started_s=time.time() - 300, slurm_job=None, timeout_s=120).alive


def test_the_heartbeat_thread_renews_the_file(tmp_path):
    with Heartbeat(tmp_path, "r1", every_s=0.05):
        first = read_heartbeat(tmp_path)["time"]
        time.sleep(0.3)
        assert read_heartbeat(tmp_path)["time"] > first
    assert read_heartbeat(tmp_path)["pid"] == os.getpid()


# --------------------------------------------------------------------------- checkpoints
def fake_parts(seed: int):
    torch.manual_seed(seed)
    policy = torch.nn.Linear(3, 2)
    return SimpleNamespace(policy=policy, optimizer=torch.optim.AdamW(policy.parameters()), buffer=NoReplay(),
                           curriculum=SimpleNamespace(state_dict=lambda: {"rng": [3, list(range(5)), None]}),
                           behaviour=CurrentBehaviour())


def test_a_new_checkpoint_keeps_the_previous_generation(tmp_path):
    path = tmp_path / "checkpoint.pt"
    save_checkpoint(path, fake_parts(1), TrainState(step=2), "run-1", "cell-1")
    save_checkpoint(path, fake_parts(2), TrainState(step=4), "run-1", "cell-1")
    assert read_checkpoint(path)["state"]["step"] == 4
    assert read_checkpoint(tmp_path / "checkpoint.prev.pt")["state"]["step"] == 2
    assert sorted(p.name for p in tmp_path.iterdir()) == ["checkpoint.prev.pt", "checkpoint.pt"]  # no temporaries


def test_a_corrupt_latest_checkpoint_falls_back_to_the_previous_one(tmp_path, caplog):
    path = tmp_path / "checkpoint.pt"
    save_checkpoint(path, fake_parts(1), TrainState(step=2), "run-1", "cell-1")
    save_checkpoint(path, fake_parts(2), TrainState(step=4), "run-1", "cell-1")
    path.write_bytes(path.read_bytes()[:200])  # truncated, as by a full disk
    with caplog.at_level(logging.WARNING):
        payload, used = read_latest_checkpoint(tmp_path)
    assert used == tmp_path / "checkpoint.prev.pt" and payload["state"]["step"] == 2
    assert str(path) in caplog.text and str(used) in caplog.text

    used.write_bytes(b"")  # both damaged: one error naming both files and the fix
    with pytest.raises(CheckpointError) as error:
        read_latest_checkpoint(tmp_path)
    assert str(path) in str(error.value) and str(used) in str(error.value)
    assert "trainer.auto_resume=false" in str(error.value)


class RunsCode:
    """A pickle that runs a command when unpickled with weights_only=False."""

    def __init__(self, marker: Path):
        self.marker = marker

    def __reduce__(self):
        return os.system, (f"touch {self.marker}",)


def test_a_crafted_checkpoint_is_never_executed(tmp_path):
    marker = tmp_path / "pwned"
    torch.save({"policy": RunsCode(marker), "state": {}, "run_id": "x"}, tmp_path / "checkpoint.pt")
    with pytest.raises(CheckpointError) as error:
        read_checkpoint(tmp_path / "checkpoint.pt")
    assert str(tmp_path / "checkpoint.pt") in str(error.value)
    assert not marker.exists()


def test_a_checkpoint_of_another_format_is_refused_in_one_line(tmp_path):
    # Format 1 kept Countdown's numbers and target in every stored group and the async pipeline as a store.
    torch.save({"policy": {}, "state": {}, "run_id": "x", "buffer": {}}, tmp_path / "checkpoint.pt")
    with pytest.raises(CheckpointError) as error:
        read_checkpoint(tmp_path / "checkpoint.pt")
    assert str(error.value) == (f"{tmp_path / 'checkpoint.pt'} has checkpoint format 1, written by another version "
                                "of this project (this one reads format 2); resume it with that version, or start "
                                "the cell afresh")


def make_run(uri: str, cfg, status: str, output_dir: Path, **tags) -> str:
    """An MLflow run of the cell `cfg`, as a job would have left it."""
    from src.runs.store import ensure_experiment

    experiment = ensure_experiment(uri, "replay-rloo", cfg.tracking.artifact_location)
    client = MlflowClient(uri)
    run = client.create_run(experiment, tags={"cell_id": cell_identity(cfg), "output_dir": str(output_dir),
                                              "slurm_job": "-", **tags})
    if status != "RUNNING":
        client.set_terminated(run.info.run_id, status)
    return run.info.run_id


def tiny_cfg(compose_config, tmp_path, *overrides):
    """A 3-step cell whose store and artifacts are under tmp_path (the default artifact folder is the checkout's)."""
    return compose_config(f"tracking.uri={store(tmp_path)}", f"tracking.artifact_location={tmp_path}/artifacts",
                          "trainer.steps=3", *overrides)


def test_a_checkpoint_path_from_a_shared_store_cannot_run_code(tmp_path, compose_config):
    """Anyone who can write tags could point `output_dir` at a crafted pickle: resuming refuses it, unexecuted."""
    from src.runs.resume import choose_start

    cfg = tiny_cfg(compose_config, tmp_path)
    crafted = tmp_path / "crafted"
    crafted.mkdir()
    marker = tmp_path / "pwned"
    torch.save({"policy": RunsCode(marker), "state": {}, "run_id": "x"}, crafted / "checkpoint.pt")
    crafted_run = make_run(store(tmp_path), cfg, "KILLED", crafted)
    start = choose_start(RunSettings(cfg), cell_of(cfg, cell_identity(cfg)), tmp_path / "new")  # not loadable: a new run, the cell afresh
    assert not marker.exists()
    assert start.checkpoint is None and start.folder == tmp_path / "new" and start.run_id != crafted_run
    refused = MlflowClient(store(tmp_path)).get_run(crafted_run)
    assert refused.info.status == "FAILED" and str(crafted / "checkpoint.pt") in refused.data.tags["failure_reason"]


def test_a_checkpoint_of_another_cell_or_run_is_refused_naming_both(tmp_path, compose_config):
    from src.runs.resume import choose_start

    cfg = tiny_cfg(compose_config, tmp_path)
    folder = tmp_path / "shared"
    run_id = make_run(store(tmp_path), cfg, "FAILED", folder)
    save_checkpoint(folder / "checkpoint.pt", fake_parts(1), TrainState(step=2), "someone-else", cell_identity(cfg))
    with pytest.raises(CheckpointError) as error:
        choose_start(RunSettings(cfg), cell_of(cfg, cell_identity(cfg)), tmp_path / "new")
    assert run_id in str(error.value) and "someone-else" in str(error.value)

    other = tiny_cfg(compose_config, tmp_path, "trainer.seed=7")
    save_checkpoint(folder / "mine.pt", fake_parts(1), TrainState(step=2), run_id, cell_identity(other))
    hand = tiny_cfg(compose_config, tmp_path, f"trainer.resume_from={folder / 'mine.pt'}")
    with pytest.raises(CheckpointError) as error:
        choose_start(RunSettings(hand), cell_of(hand, cell_identity(hand)), tmp_path / "new")
    assert cell_identity(other) in str(error.value) and cell_identity(hand) in str(error.value)


def test_a_live_run_is_never_resumed_and_a_dead_one_without_checkpoint_is_marked_failed(tmp_path, compose_config):
    from src.runs.resume import RunAlive, choose_start

    cfg = tiny_cfg(compose_config, tmp_path)
    alive_folder = tmp_path / "alive"
    alive = make_run(store(tmp_path), cfg, "RUNNING", alive_folder)
    write_heartbeat(alive_folder, alive)  # this test process: alive
    with pytest.raises(RunAlive) as error:
        choose_start(RunSettings(cfg), cell_of(cfg, cell_identity(cfg)), tmp_path / "new")
    assert alive in str(error.value) and "wait" in str(error.value)

    beat = json.loads((alive_folder / HEARTBEAT_FILE).read_text())
    (alive_folder / HEARTBEAT_FILE).write_text(json.dumps({**beat, "pid": a_dead_pid()}))  # it died, no checkpoint
    start = choose_start(RunSettings(cfg), cell_of(cfg, cell_identity(cfg)), tmp_path / "new")
    assert start.checkpoint is None and start.folder == tmp_path / "new"  # afresh, into a new (claimed) run
    assert start.run_id not in (None, alive)
    dead = MlflowClient(store(tmp_path)).get_run(alive)
    assert dead.info.status == "FAILED" and "no checkpoint" in dead.data.tags["failure_reason"]


def test_sweeper_timeouts_are_scoped_to_its_own_queries(monkeypatch):
    from hydra_plugins.replay_rloo_sweeper import PLANNING_TIMEOUTS, planning_timeouts

    monkeypatch.delenv("MLFLOW_HTTP_REQUEST_MAX_RETRIES", raising=False)
    monkeypatch.setenv("MLFLOW_HTTP_REQUEST_TIMEOUT", "300")
    with planning_timeouts():
        assert os.environ["MLFLOW_HTTP_REQUEST_MAX_RETRIES"] == PLANNING_TIMEOUTS["MLFLOW_HTTP_REQUEST_MAX_RETRIES"]
        assert os.environ["MLFLOW_HTTP_REQUEST_TIMEOUT"] == PLANNING_TIMEOUTS["MLFLOW_HTTP_REQUEST_TIMEOUT"]
    assert "MLFLOW_HTTP_REQUEST_MAX_RETRIES" not in os.environ  # the launched jobs get MLflow's patient defaults
    assert os.environ["MLFLOW_HTTP_REQUEST_TIMEOUT"] == "300"


# --------------------------------------------------------------------------- end to end: SIGKILL and relaunch
CELL = ["buffer=age1", "clip=tight", "trainer.steps=12", "trainer.checkpoint_every=2", "trainer.groups_per_step=2",
        "tracking.sweep=kill"]


def metric_histories(uri: str, run_id: str) -> dict[str, list[tuple[int, float]]]:
    client = MlflowClient(uri)
    return {key: sorted((m.step, m.value) for m in client.get_metric_history(run_id, key))
            for key in client.get_run(run_id).data.metrics if not wall_clock(key)}


@pytest.fixture(scope="module")
def reference_run(tmp_path_factory, random_policy_dir):
    """(store, run id) of the replay cell trained without interruption, for both SIGKILL tests."""
    folder = tmp_path_factory.mktemp("reference")
    subprocess.run([*tiny_cli(folder, random_policy_dir, *CELL), f"hydra.run.dir={folder}/ref"], cwd=PROJECT_ROOT,
                   check=True, capture_output=True)
    mlflow.set_tracking_uri(store(folder))
    return store(folder), mlflow.search_runs(experiment_names=["replay-rloo"]).run_id[0]


def assert_same_metrics_no_duplicates(uri: str, run_id: str, reference_run: tuple[str, str]) -> None:
    resumed, reference = metric_histories(uri, run_id), metric_histories(*reference_run)
    assert resumed.keys() == reference.keys()
    assert "train/reward" in resumed and "quick/final/mean_reward" in resumed
    for key, history in resumed.items():
        steps = [step for step, _ in history]
        assert len(steps) == len(set(steps)), f"{key} logged twice at a step: {steps}"
        assert steps == [step for step, _ in reference[key]], key
        assert [v for _, v in history] == pytest.approx([v for _, v in reference[key]], rel=1e-6), key


def kill_after(process: subprocess.Popen, ready, timeout_s: float = 300) -> None:
    """SIGKILL `process` as soon as `ready()` holds: no signal handler runs, no checkpoint is written."""
    deadline = time.time() + timeout_s
    while not ready() and process.poll() is None and time.time() < deadline:
        time.sleep(0.02)
    assert process.poll() is None, "finished before it could be killed"
    process.kill()
    process.wait()


def logged_steps(uri: str, experiment: str) -> int:
    try:
        runs = MlflowClient(uri).search_runs([MlflowClient(uri).get_experiment_by_name(experiment).experiment_id])
        return max((len(MlflowClient(uri).get_metric_history(r.info.run_id, "train/reward")) for r in runs
                    if r.info.status == "RUNNING"), default=0)
    except Exception:  # noqa: BLE001  (the store may not exist yet)
        return 0


@pytest.mark.slow
def test_sigkill_at_a_random_step_then_relaunch_resumes_the_same_run(tmp_path, random_policy_dir, reference_run):
    uri = store(tmp_path)
    kill_at = random.Random().randint(3, 5)  # steps logged at the kill; the checkpoint is at step 2 or 4
    command = [*tiny_cli(tmp_path, random_policy_dir, *CELL), f"hydra.run.dir={tmp_path}/first"]
    process = subprocess.Popen(command, cwd=PROJECT_ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    kill_after(process, lambda: logged_steps(uri, "replay-rloo") >= kill_at)
    mlflow.set_tracking_uri(uri)
    killed = mlflow.search_runs(experiment_names=["replay-rloo"])
    assert list(killed.status) == ["RUNNING"]  # as SIGKILL leaves it

    relaunch = subprocess.run([*tiny_cli(tmp_path, random_policy_dir, *CELL), f"hydra.run.dir={tmp_path}/second"],
                              cwd=PROJECT_ROOT, capture_output=True, text=True, timeout=600)
    assert relaunch.returncode == 0, relaunch.stderr[-3000:]
    log = relaunch.stdout + relaunch.stderr
    assert f"resuming run {killed.run_id[0]}" in log and "RESUME MISMATCH" not in log
    after = mlflow.search_runs(experiment_names=["replay-rloo"])
    assert list(after.status) == ["FINISHED"] and after.run_id[0] == killed.run_id[0], f"killed at step {kill_at}"
    assert_same_metrics_no_duplicates(uri, after.run_id[0], reference_run)


@pytest.mark.slow
@pytest.mark.long  # make test-long (docs/testing.md): the suite SIGKILLs a single run (test_sigkill_at_a_random_step...)
def test_sigkill_inside_a_multirun_then_relaunch_resumes_the_killed_cell(tmp_path, random_policy_dir, reference_run):
    uri = store(tmp_path)
    grid = [arg if arg != "buffer=age1" else "buffer=none,age1" for arg in CELL]
    sweep = tiny_cli(tmp_path, random_policy_dir, *grid, multirun=True)
    process = subprocess.Popen(sweep, cwd=PROJECT_ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    kill_at = random.Random().randint(3, 5)

    def second_cell_past_its_checkpoint() -> bool:
        return (tmp_path / "multirun" / "1" / "checkpoint.pt").exists() and logged_steps(uri, "replay-rloo") >= kill_at

    kill_after(process, second_cell_past_its_checkpoint)
    relaunch = subprocess.run(sweep, cwd=PROJECT_ROOT, capture_output=True, text=True, timeout=600)
    assert relaunch.returncode == 0, relaunch.stderr[-3000:]
    assert "1 to resume" in relaunch.stdout + relaunch.stderr and "1 finished" in relaunch.stdout + relaunch.stderr
    mlflow.set_tracking_uri(uri)
    runs = mlflow.search_runs(experiment_names=["replay-rloo"])
    assert sorted(runs.status) == ["FINISHED", "FINISHED"]  # one run per cell, both finished
    replay = runs[runs["tags.cell"] == "rho1-L1-c1"].run_id.iloc[0]
    assert_same_metrics_no_duplicates(uri, replay, reference_run)


@pytest.mark.slow
@pytest.mark.long  # make test-long (docs/testing.md): test_run_e2e starts runs together on a new store
def test_runs_started_at_once_on_a_new_store_all_finish_in_their_own_folders(tmp_path, random_policy_dir):
    """Four runs in the same second on a SQLite file none of them has created: no migration race, no shared folder."""
    starts = 4
    commands = [[*tiny_cli(tmp_path, random_policy_dir, "trainer.steps=2", "trainer.groups_per_step=2", "hardware.threads=1",
                           f"trainer.seed={seed}", "tracking.sweep=together"),
                 f"hydra.run.dir={tmp_path}/runs/${{now:%H-%M-%S}}-${{unique:}}"] for seed in range(starts)]
    processes = [subprocess.Popen(command, cwd=PROJECT_ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                                  text=True) for command in commands]
    errors = [process.communicate(timeout=600)[1] for process in processes]
    assert [process.returncode for process in processes] == [0] * starts, [e[-1500:] for e in errors]
    mlflow.set_tracking_uri(store(tmp_path))
    runs = mlflow.search_runs(experiment_names=["replay-rloo"])
    assert list(runs.status) == ["FINISHED"] * starts
    assert runs["tags.output_dir"].nunique() == starts and runs["tags.final_policy"].nunique() == starts
