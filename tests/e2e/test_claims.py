"""Concurrent sweeps, reruns and SLURM input: a cell is trained once, the newest run decides, SLURM refuses cleanly."""

from __future__ import annotations

import json
import logging
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import mlflow
import pytest
from hydra.core.utils import JobReturn, JobStatus
from mlflow.tracking import MlflowClient

from src.settings import RunSettings
from src.runs.checkpoint import save_checkpoint
from src.runs.lifecycle import HEARTBEAT_FILE
from src.paths import PROJECT_ROOT
from src.batch import TrainState
from src.runs.cells import CellRuns, cell_runs
from src.study.labels import cell_of, run_labels
from src.study.sweep import Skipped, cell_identity, plan_cells
from tests.e2e.test_lifecycle import a_dead_pid, fake_parts, make_run, tiny_cfg
from tests.e2e.test_sweep import run, store, tiny_cli


# --------------------------------------------------------------------------- the same cell twice in one sweep
def test_identical_cells_of_one_sweep_are_reported_as_the_same_cell_and_trained_once(compose_config):
    from hydra_plugins.replay_rloo_sweeper import SweepTally, plan_status

    jobs = [(overrides, compose_config(*overrides)) for overrides in
            (["buffer=none", "clip=tight"], ["buffer=none", "clip=loose"], ["buffer=age1", "clip=tight"])]
    planned = plan_cells(jobs, CellRuns({}, {}))  # an empty store: nothing was done before
    assert [(cell.status, cell.same_as) for cell in planned] == [("launch", None), ("duplicate", 0), ("launch", None)]
    shown = ["clip=tight", "clip=loose", "buffer=age1 clip=tight"]
    assert plan_status(planned[1], shown) == "same cell as #0 (clip=tight), skip"

    tally = SweepTally(total=2, skipped=0, same=1)
    assert "0 skipped (done before), 1 same cell as another job" in tally.before(0, "rho0")


# --------------------------------------------------------------------------- reruns of finished cells
def test_rerun_keeps_the_cell_identity_and_relaunches_a_finished_cell_in_a_sweep(compose_config):
    from hydra_plugins.replay_rloo_sweeper import launch_overrides

    cfg = compose_config("buffer=age1", "clip=tight")
    assert cell_identity(compose_config("buffer=age1", "clip=tight", "trainer.rerun=true")) == cell_identity(cfg)
    known = CellRuns({cell_identity(cfg): "run-done"}, {})
    assert plan_cells([(["buffer=age1"], cfg)], known)[0].status == "finished"
    again = plan_cells([(["buffer=age1"], cfg)], known, rerun=True)[0]  # hydra.sweeper.skip_finished=false
    assert (again.status, again.rerun, again.previous) == ("launch", True, "run-done")
    assert launch_overrides(again, rerun_all=True) == ["buffer=age1", "trainer.rerun=true"]
    asked = plan_cells([(["trainer.rerun=true"], compose_config("buffer=age1", "clip=tight", "trainer.rerun=true"))],
                       known)[0]
    assert asked.status == "launch" and launch_overrides(asked, rerun_all=False) == ["trainer.rerun=true"]


def test_a_finished_cell_is_not_trained_again_unless_rerun_is_asked(tmp_path, compose_config):
    from src.runs.resume import CellFinished, choose_start

    cfg = tiny_cfg(compose_config, tmp_path, "tracking.sweep=first")
    done = make_run(store(tmp_path), cfg, "FINISHED", tmp_path / "done")
    with pytest.raises(CellFinished) as finished:
        choose_start(RunSettings(cfg), cell_of(cfg, cell_identity(cfg)), tmp_path / "again")
    assert done in str(finished.value) and "trainer.rerun=true" in str(finished.value)

    rerun = tiny_cfg(compose_config, tmp_path, "trainer.rerun=true", "tracking.sweep=second")
    start = choose_start(RunSettings(rerun), cell_of(rerun, cell_identity(rerun)), tmp_path / "again")
    assert start.run_id not in (None, done) and start.checkpoint is None and start.folder == tmp_path / "again"
    claimed = MlflowClient(store(tmp_path)).get_run(start.run_id)  # the new run, as start_run would have made it
    assert claimed.info.status == "RUNNING" and claimed.data.tags["cell_id"] == cell_identity(cfg)
    assert claimed.data.tags["output_dir"] == str(tmp_path / "again") and claimed.info.run_name == "second/rho0"
    assert claimed.data.params["trainer.steps"] == "3" and "tracking.uri" not in claimed.data.params
    assert (tmp_path / "again" / HEARTBEAT_FILE).exists()


# --------------------------------------------------------------------------- the newest run decides
@pytest.mark.parametrize("status", ["KILLED", "RUNNING"])  # RUNNING: SIGKILLed, its heartbeat's process gone
def test_a_killed_rerun_of_a_finished_cell_resumes(tmp_path, compose_config, caplog, status):
    from src.runs.resume import choose_start

    cfg = tiny_cfg(compose_config, tmp_path)
    uri, identity = store(tmp_path), cell_identity(cfg)
    make_run(uri, cfg, "FINISHED", tmp_path / "first")
    time.sleep(0.01)  # start times order the runs
    killed = make_run(uri, cfg, status, tmp_path / "rerun")
    save_checkpoint(tmp_path / "rerun" / "checkpoint.pt", fake_parts(1), TrainState(step=2), killed, identity)
    beat = {"run_id": killed, "host": socket.gethostname(), "pid": a_dead_pid(), "time": time.time()}
    (tmp_path / "rerun" / HEARTBEAT_FILE).write_text(json.dumps(beat))
    known = cell_runs(uri, "replay-rloo", identity)
    assert known.resumable_runs == {identity: killed}  # not hidden behind the older FINISHED run
    with caplog.at_level(logging.WARNING):
        start = choose_start(RunSettings(cfg), cell_of(cfg, identity), tmp_path / "new")
    assert (start.run_id, start.folder, start.checkpoint["state"]["step"]) == (killed, tmp_path / "rerun", 2)
    assert f"resuming run {killed}" in caplog.text

    time.sleep(0.01)
    make_run(uri, cfg, "FINISHED", tmp_path / "third")  # a newer FINISHED run: nothing to resume any more
    assert identity not in cell_runs(uri, "replay-rloo", identity).resumable


def test_a_dead_running_run_without_a_loadable_checkpoint_is_marked_failed_once_and_a_new_run_starts(
        tmp_path, compose_config, caplog):
    from src.runs.resume import choose_start

    cfg = tiny_cfg(compose_config, tmp_path)
    uri, identity = store(tmp_path), cell_identity(cfg)
    folder = tmp_path / "dead"
    dead = make_run(uri, cfg, "RUNNING", folder)
    save_checkpoint(folder / "checkpoint.pt", fake_parts(1), TrainState(step=2), dead, identity)
    (folder / "checkpoint.pt").write_bytes(b"truncated")  # damaged, no previous generation
    beat = {"run_id": dead, "host": socket.gethostname(), "pid": a_dead_pid(), "time": time.time()}
    (folder / HEARTBEAT_FILE).write_text(json.dumps(beat))
    with caplog.at_level(logging.WARNING, logger="src.runs.resume"):
        start = choose_start(RunSettings(cfg), cell_of(cfg, identity), tmp_path / "new")
    assert start.run_id not in (None, dead) and start.checkpoint is None
    failed = MlflowClient(uri).get_run(dead)
    assert failed.info.status == "FAILED" and str(folder / "checkpoint.pt") in failed.data.tags["failure_reason"]
    lines = [record.getMessage() for record in caplog.records if record.name == "src.runs.resume"]
    assert len(lines) == 1 and dead in lines[0] and "marked FAILED" in lines[0]


def test_a_claim_whose_job_fails_before_opening_it_ends_failed(tmp_path, compose_config):
    from src.runs.claim import create_claim_run, fail_unopened_claim

    cfg = tiny_cfg(compose_config, tmp_path)
    run_id = create_claim_run(RunSettings(cfg).tracking, tmp_path / "claimed", run_labels(cfg))
    fail_unopened_claim(OSError("policy folder missing"))
    failed = MlflowClient(store(tmp_path)).get_run(run_id)
    assert failed.info.status == "FAILED" and failed.data.tags["failure_reason"] == "OSError: policy folder missing"


def test_a_sweep_job_that_trained_nothing_is_counted_as_skipped():
    from hydra_plugins.replay_rloo_sweeper import SweepTally

    def job(value) -> JobReturn:
        result = JobReturn(_return_value=value)
        result.status = JobStatus.COMPLETED
        return result

    tally = SweepTally(total=3, skipped=0)
    tally.finished([job(0.5), job(Skipped("busy", "running")), job(Skipped("done", "finished"))])
    assert tally.counts() == "1 finished, 1 skipped (done before), 1 running elsewhere (skipped), 0 failed"


# --------------------------------------------------------------------------- two jobs claim one cell at once
@pytest.mark.parametrize("mode", ["lock", pytest.param("nolock", marks=pytest.mark.slow)])
def test_two_processes_started_together_claim_one_cell_and_exactly_one_trains(tmp_path, mode):
    """`lock`: a SQLite store (file lock around lookup and claim); `nolock`: a tracking server's case (claim,
    settle, earliest claim wins), exercised on the same SQLite file without the lock."""
    from src.runs.store import ensure_experiment

    uri = store(tmp_path)
    ensure_experiment(uri, "replay-rloo", str(tmp_path / "artifacts"))  # tests/claim_race.py's
    contenders = [subprocess.Popen([sys.executable, "-m", "tests.claim_race", uri, str(tmp_path), f"c{index}", "2",
                                    mode], cwd=PROJECT_ROOT, stderr=subprocess.PIPE, text=True) for index in range(2)]
    errors = [process.communicate(timeout=300)[1] for process in contenders]
    assert [process.returncode for process in contenders] == [0, 0], [error[-2000:] for error in errors]
    answers = sorted((tmp_path / f"c{index}.out").read_text() for index in range(2))
    assert answers[0].startswith("SKIPS") and answers[1].startswith("TRAINS"), answers
    winner = answers[1].split()[1]
    assert f"run {winner} (process" in answers[0]  # the skip names the job that trains the cell
    client = MlflowClient(uri)
    runs = client.search_runs([client.get_experiment_by_name("replay-rloo").experiment_id])
    assert [run.info.run_id for run in runs] == [winner]  # the loser's claim is gone (never made, or withdrawn)


# --------------------------------------------------------------------------- SLURM from a machine without it
def test_slurm_without_sbatch_is_one_line_naming_the_launcher_and_the_local_alternative(compose_config):
    from src.study.slurm import missing_slurm

    cfg = compose_config("hardware=h100", hydra=True)
    message = missing_slurm(cfg, which=lambda command: None)
    assert message.startswith("hardware=h100 (hydra/launcher=slurm_h100)") and "sbatch and srun" in message
    assert "hydra/launcher=basic" in message and "\n" not in message
    assert missing_slurm(cfg, which=lambda command: f"/usr/bin/{command}") is None
    assert missing_slurm(compose_config(hydra=True), which=lambda command: None) is None  # the basic launcher
    local = compose_config("hardware=h100", "hydra/launcher=basic", hydra=True)  # the advice composes
    assert local.hydra.launcher._target_.endswith("BasicLauncher") and local.hardware.name == "h100"


def test_slurm_plan_names_the_request_warns_on_unset_site_settings_and_counts_gpu_hours(compose_config, tmp_path):
    from src.study.slurm import slurm_plan_lines

    cfg = compose_config("hardware=h100", "policy=qwen-sft-countdown", "buffer=none", hydra=True)
    lines = slurm_plan_lines(cfg, [cfg, cfg])
    assert "1 GPU, 8 CPUs, 64 GB, 300 min" in lines[0] and "partition (unset), account (unset)" in lines[0]
    assert sum(line.startswith("warning: hydra.launcher.partition is unset") for line in lines) == 1
    assert sum(line.startswith("warning: hydra.launcher.account is unset") for line in lines) == 1
    committed = PROJECT_ROOT / "benchmarks" / "results" / "gpu_step_NVIDIA_H100_80GB_HBM3_1024.json"
    step_s = json.loads(committed.read_text())["rows"][0]["step_s"]
    hours = next(line for line in lines if line.startswith("GPU-hours"))
    assert f"about {2 * 100 * step_s / 3600:,.1f} for 2 job(s)" in hours and committed.name in hours
    spread = compose_config("hardware=h100", "hardware.nodes=2", "hardware.ranks=2", "policy=qwen-sft-countdown",
                            "buffer=none", hydra=True)  # one GPU on each of two nodes: twice the GPU-hours a job
    lines = slurm_plan_lines(spread, [spread])
    assert "each asks for 2 nodes x 1 task, 2 GPUs in all, 8 CPUs and 64 GB a node" in lines[0]
    hours = next(line for line in lines if line.startswith("GPU-hours"))
    assert f"about {2 * 100 * step_s / 3600:,.1f} for 1 job(s) x 2 GPU (2 nodes)" in hours

    sited = compose_config("hardware=h100", "hydra.launcher.partition=gpu", "hydra.launcher.account=lab", hydra=True)
    lines = slurm_plan_lines(sited, [sited])
    assert not any(line.startswith("warning") for line in lines)
    assert lines[-1].startswith("GPU-hours: no benchmark committed for B=32, K=16, 52-token responses")

    results = tmp_path / "results"  # two measured ratios: a cell in between is interpolated
    results.mkdir()
    (results / "gpu_step_x.json").write_text(json.dumps({
        "device": "NVIDIA H100", "args": {"groups": "128", "group_size": "8", "response_tokens": "1024"},
        "rows": [{"rho": 0.0, "step_s": 100.0}, {"rho": 2.0, "step_s": 60.0}]}))
    replay = compose_config("hardware=h100", "policy=qwen-sft-countdown", "buffer=age1", hydra=True)  # rho = 1
    hours = next(line for line in slurm_plan_lines(replay, [replay], results) if line.startswith("GPU-hours"))
    assert f"about {100 * 80 / 3600:,.1f} for 1 job(s)" in hours and "gpu_step_x.json" in hours


def test_a_cell_over_two_nodes_asks_sbatch_for_two_nodes_of_eight_tasks(compose_config, tmp_path):
    """The sbatch script submitit writes for hardware=h100x8 hardware.nodes=2 hardware.ranks=16, the launcher's
    settings passed as hydra-submitit-launcher's `launch` passes them: 2 nodes, 8 tasks and 8 GPUs a node, and
    one srun that starts all 16 tasks."""
    import submitit
    from hydra_plugins.hydra_submitit_launcher.config import BaseQueueConf
    from omegaconf import OmegaConf

    cfg = compose_config("hardware=h100x8", "hardware.nodes=2", "hardware.ranks=16", hydra=True)
    launcher = OmegaConf.to_container(cfg.hydra.launcher, resolve=True)
    executor = submitit.AutoExecutor(cluster="slurm", folder=tmp_path,
                                     slurm_max_num_timeout=launcher["max_num_timeout"])
    queue = set(OmegaConf.structured(BaseQueueConf).keys())
    executor.update_parameters(**{key if key in queue else f"slurm_{key}": value for key, value in launcher.items()
                                  if key not in ("_target_", "submitit_folder", "max_num_timeout")})
    lines = executor._executor._make_submission_file_text("python -m src.run", "uid").splitlines()
    for line in ("#SBATCH --nodes=2", "#SBATCH --ntasks-per-node=8", "#SBATCH --gpus-per-node=8",
                 "#SBATCH --cpus-per-task=8", "#SBATCH --mem=512GB"):
        assert line in lines, "\n".join(lines)
    assert [line.split()[0] for line in lines if line.startswith("srun")] == ["srun"]  # one srun: every task


def test_the_sweeper_refuses_slurm_without_sbatch_before_composing_any_cell(compose_config, monkeypatch, capsys):
    import shutil

    from hydra_plugins.replay_rloo_sweeper import SkipFinishedSweeper

    monkeypatch.setattr(shutil, "which", lambda command: None)
    sweeper = SkipFinishedSweeper()
    sweeper.config = compose_config("hardware=h100", hydra=True)  # no hydra_context: composing a cell would fail
    with pytest.raises(SystemExit) as stopped:
        sweeper.sweep(["buffer=none,age1"])
    assert stopped.value.code == 2
    said = capsys.readouterr().err.strip()
    assert said.startswith("error: hardware=h100") and "hydra/launcher=basic" in said and "\n" not in said


@pytest.mark.slow
def test_slurm_sweep_without_slurm_exits_2_in_one_line_and_its_dry_run_works(tmp_path):
    environment = {**os.environ, "PATH": str(tmp_path)}  # an empty PATH: no sbatch, no srun
    command = [sys.executable, "-m", "src.run", "-m", "hardware=h100", "buffer=none",
               f"tracking.uri={store(tmp_path)}", f"hydra.sweep.dir={tmp_path}/multirun"]
    refused = subprocess.run(command, cwd=PROJECT_ROOT, env=environment, capture_output=True, text=True, timeout=300)
    output = (refused.stdout + refused.stderr).strip()
    assert refused.returncode == 2 and "Traceback" not in output and len(output.splitlines()) == 1, output
    assert "hardware=h100" in output and "sbatch" in output and "hydra/launcher=basic" in output
    assert not Path(store(tmp_path).removeprefix("sqlite:///")).exists()  # refused before anything was read

    dry = subprocess.run([*command, "hydra.sweeper.dry_run=true"], cwd=PROJECT_ROOT, env=environment,
                         capture_output=True, text=True, timeout=300)
    output = dry.stdout + dry.stderr
    assert dry.returncode == 0 and "DRY RUN" in output and "SLURM: 1 job(s)" in output, output[-3000:]
    assert "GPU-hours: no benchmark committed" in output


# --------------------------------------------------------------------------- end to end: two sweeps at once
@pytest.mark.slow
@pytest.mark.long  # make test-long (docs/testing.md): the suite races two processes for one cell (above)
def test_two_identical_sweeps_started_together_train_each_cell_once(tmp_path, random_policy_dir):
    cell = ["buffer=none", "clip=tight,loose", "trainer.steps=1", "hardware.threads=1"]
    processes = [subprocess.Popen(tiny_cli(tmp_path, random_policy_dir, *cell, f"hydra.sweep.dir={tmp_path}/sweep{index}",
                                           multirun=True), cwd=PROJECT_ROOT,
                                  stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True) for index in range(2)]
    outputs = [process.communicate(timeout=600)[0] for process in processes]
    assert [process.returncode for process in processes] == [0, 0], [output[-3000:] for output in outputs]
    mlflow.set_tracking_uri(store(tmp_path))
    runs = mlflow.search_runs(experiment_names=["replay-rloo"])
    assert list(runs.status) == ["FINISHED"]  # one cell (clip does nothing without replay), trained once
    assert all("same cell as #0" in output and "1 skipped (done before)" not in output for output in outputs)
    assert sum("running elsewhere" in output or "1 finished (skipped)" in output for output in outputs) == 1

    alone = run([*tiny_cli(tmp_path, random_policy_dir, "buffer=none", "clip=loose", "trainer.steps=1"),
                 f"hydra.run.dir={tmp_path}/alone"])  # a single relaunch of the finished cell: exit 0, says so
    assert f"already has FINISHED run {runs.run_id[0]}" in alone and "trainer.rerun=true" in alone
    assert len(mlflow.search_runs(experiment_names=["replay-rloo"])) == 1
