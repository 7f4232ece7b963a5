"""Sweeps through Hydra's submitit SLURM launcher on a real SLURM of this machine: launch, then skip when finished;
a cell over two of its nodes."""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

import mlflow
import pytest

from tests.conftest import wall_clock

from src.paths import PROJECT_ROOT

pytestmark = [pytest.mark.slow, pytest.mark.slurm]


def test_two_cell_sweep_runs_on_slurm_then_is_skipped(tmp_path, slurm_cluster, random_policy_dir):
    store = f"sqlite:///{tmp_path}/mlruns.db"
    command = [sys.executable, "-m", "src.run", "-m", "hydra/launcher=submitit_slurm",
               f"hydra.launcher.partition={slurm_cluster.partition}", "hydra.launcher.timeout_min=10",
               "hydra.launcher.cpus_per_task=1", f"hydra.sweep.dir={tmp_path}/multirun",
               f"policy.name_or_path={random_policy_dir}", "buffer=none,age1", "clip=tight", "trainer.steps=2",
               "trainer.groups_per_step=4", "trainer.group_size=2", "policy.max_new_tokens=6",
               "evaluation.at_start=false", "evaluation.prompts=2", "evaluation.samples_per_prompt=2",
               "evaluation.ks=[1]", "hardware.threads=1", f"tracking.uri={store}",
               f"tracking.artifact_location={tmp_path}/artifacts", "tracking.sweep=slurm"]

    # A tracking server's credentials as MLflow's client reads them from the environment (docs/mlflow.md, "A server
    # behind a password"): the jobs inherit them, and no file the sweep, submitit or a run writes holds them.
    password = "sentinel-" + "x" * 24
    signed_in = {**slurm_cluster.env, "MLFLOW_TRACKING_USERNAME": "ada", "MLFLOW_TRACKING_PASSWORD": password}
    first = subprocess.run(command, cwd=PROJECT_ROOT, env=signed_in, capture_output=True, text=True, timeout=900)
    assert first.returncode == 0, (first.stdout + first.stderr)[-4000:]
    written = [path for path in tmp_path.rglob("*") if path.is_file()]
    assert any(path.name.endswith("_submitted.pkl") for path in written) and any(p.suffix == ".sh" for p in written)
    for path in written:
        assert password.encode() not in path.read_bytes(), path
    assert "2 to launch" in first.stdout
    submitted = list((tmp_path / "multirun" / ".submitit").glob("*/*_submitted.pkl"))
    assert len(submitted) == 2  # both cells went out as SLURM jobs (one array)
    mlflow.set_tracking_uri(store)
    runs = mlflow.search_runs(experiment_names=["replay-rloo"])
    assert sorted(runs["status"]) == ["FINISHED", "FINISHED"]
    assert sorted(runs["tags.slurm_job"]) != ["-", "-"]  # each ran inside a SLURM job

    started = time.perf_counter()
    again = subprocess.run(command, cwd=PROJECT_ROOT, env=slurm_cluster.env, capture_output=True, text=True,
                           timeout=300)
    seconds = time.perf_counter() - started
    assert again.returncode == 0, (again.stdout + again.stderr)[-4000:]
    assert "2 finished (skipped)" in again.stdout and "0 to launch" in again.stdout
    assert len(mlflow.search_runs(experiment_names=["replay-rloo"])) == 2
    print(f"relaunch of a finished 2-cell sweep: {seconds:.1f} s")


def test_a_cell_over_two_nodes_is_one_slurm_job_on_both_nodes(tmp_path, slurm_cluster, random_policy_dir):
    """hardware.nodes=2 as launch/README.md types it on the local cluster's two nodes: the job asks SLURM for two
    nodes of one task, srun starts a rank on each, the ranks meet through SLURM's environment (submitit's: the first
    node's address, global and local ranks; src/runs/ranks.py), train on gloo and log one MLflow run, each step
    once."""
    assert slurm_cluster.nodes == 2 and slurm_cluster.partition == "debug"
    readme = " ".join((PROJECT_ROOT / "launch" / "README.md").read_text().replace("\\\n", " ").split())
    typed = next(line for line in readme.split("python -m src.run")[1:] if "hardware.nodes=2" in line).split(" ```")[0]
    assert typed.split() == ["-m", "hydra/launcher=submitit_slurm", "hydra.launcher.partition=debug",
                             "hydra.launcher.nodes=2", "hydra.launcher.tasks_per_node=1", "hardware.ranks=2",
                             "hardware.nodes=2", "hardware.threads=1", "trainer.steps=2"]
    store = f"sqlite:///{tmp_path}/mlruns.db"
    command = [sys.executable, "-m", "src.run", *typed.split(),  # the tiny settings and this test's folders after it
               "hydra.launcher.timeout_min=10", "hydra.launcher.cpus_per_task=1",
               f"hydra.sweep.dir={tmp_path}/multirun", f"policy.name_or_path={random_policy_dir}",
               "trainer.groups_per_step=4", "trainer.group_size=2",
               "policy.max_new_tokens=6", "evaluation.at_start=false", "evaluation.prompts=2",
               "evaluation.samples_per_prompt=2", "evaluation.ks=[1]", f"tracking.uri={store}",
               f"tracking.artifact_location={tmp_path}/artifacts", "tracking.sweep=nodes"]
    done = subprocess.run(command, cwd=PROJECT_ROOT, env=slurm_cluster.env, capture_output=True, text=True,
                          timeout=900)
    said = done.stdout + done.stderr
    assert done.returncode == 0 and "1 cell(s) run: 1 finished" in said, said[-4000:]
    [script] = (tmp_path / "multirun" / ".submitit").glob("*/*_submission.sh")
    assert "#SBATCH --nodes=2" in script.read_text() and "#SBATCH --ntasks-per-node=1" in script.read_text()
    job = script.name.split("_")[0]
    shown = slurm_cluster.run("scontrol", "show", "job", job).stdout  # the finished job, kept for MinJobAge
    assert "NumNodes=2 " in shown and "JobState=COMPLETED" in shown, shown
    assert len(list(script.parent.glob(f"{job}_*_log.out"))) == 2  # a task on each node
    mlflow.set_tracking_uri(store)
    [run] = mlflow.MlflowClient().search_runs(
        [mlflow.get_experiment_by_name("replay-rloo").experiment_id])
    assert (run.info.status, run.data.params["hardware.nodes"], run.data.tags["slurm_job"]) == ("FINISHED", "2", job)
    losses = mlflow.MlflowClient().get_metric_history(run.info.run_id, "train/loss")
    assert sorted(m.step for m in losses) == [0, 1]


def test_the_async_pipeline_over_two_slurm_nodes_starts_its_ray_cluster_and_leaves_nothing(tmp_path, slurm_cluster):
    """docs/async.md's command on the local cluster's two nodes: one job, a task on each; the first starts Ray's head
    and drives the run, the second joins it and serves; the worker runs on the second node, the trainer actor on the
    first; the job COMPLETES (the second task leaves when the run ends) and no process of the cluster is left."""
    import json

    from pathlib import Path

    from src.runtime.ray_cluster import _processes_naming

    docs = " ".join((PROJECT_ROOT / "docs" / "async.md").read_text().split())
    typed = next(line for line in docs.split("python -m src.run")[1:]
                 if "hardware.nodes=2" in line and "submitit_slurm" in line).split(" ```")[0]
    store = f"sqlite:///{tmp_path}/mlruns.db"
    command = [sys.executable, "-m", "src.run", *typed.split(), "trainer.steps=1", "evaluation.at_start=false",
               "hydra.launcher.timeout_min=10", "hydra.launcher.cpus_per_task=1", f"hydra.sweep.dir={tmp_path}/multirun",
               f"tracking.uri={store}", f"tracking.artifact_location={tmp_path}/artifacts", "tracking.sweep=nodes"]
    done = subprocess.run(command, cwd=PROJECT_ROOT, env=slurm_cluster.env, capture_output=True, text=True,
                          timeout=900)
    said = done.stdout + done.stderr
    [script] = (tmp_path / "multirun" / ".submitit").glob("*/*_submission.sh")
    logs = "".join(path.read_text()[-1500:] for path in sorted(script.parent.glob("*_log.*")))
    assert done.returncode == 0 and "1 cell(s) run: 1 finished" in said, said[-3000:] + logs
    job, deadline = script.name.split("_")[0], time.time() + 120
    shown = slurm_cluster.run("scontrol", "show", "job", job).stdout
    while ("JobState=RUNNING" in shown or "JobState=COMPLETING" in shown) and time.time() < deadline:
        time.sleep(1.0)  # the sweep has task 0's result; SLURM ends the job once every task and its step are done
        shown = slurm_cluster.run("scontrol", "show", "job", job).stdout
    assert "NumNodes=2 " in shown and "JobState=COMPLETED" in shown, shown
    [placement] = (tmp_path / "multirun").rglob("ray_placement.json")
    placement = json.loads(placement.read_text())
    assert placement["nodes"] == 2 and placement["worker_nodes"] != placement["trainer_nodes"], placement
    [cluster] = script.parent.glob(f"ray-{job}-*")  # the job's nodes' logs and the head's address
    assert sorted(path.name for path in cluster.glob("node*.log")) == ["node1.log", "node2.log"]
    assert _processes_naming(Path(f"ray-{job}-")) == [], "processes of the job's cluster still running"
    mlflow.set_tracking_uri(store)
    [run] = mlflow.MlflowClient().search_runs([mlflow.get_experiment_by_name("replay-rloo").experiment_id])
    assert (run.info.status, run.data.params["hardware.nodes"]) == ("FINISHED", "2")
    assert [m.step for m in mlflow.MlflowClient().get_metric_history(run.info.run_id, "train/loss")] == [0]


@pytest.mark.long  # make test-long (docs/testing.md): two runs of the two-node job, about three minutes
def test_the_async_pipeline_over_two_slurm_nodes_resumes_after_its_driver_is_killed(tmp_path, slurm_cluster):
    """docs/async.md's two-node command with a checkpoint every step: SIGKILL to the driver (task 0) once a
    checkpoint is written ends the job with no process of its Ray cluster left; the same command again resumes the
    run from its checkpoint into the same MLflow run, each step logged once."""
    import os
    import signal

    from src.runtime.ray_cluster import _processes_naming

    docs = " ".join((PROJECT_ROOT / "docs" / "async.md").read_text().split())
    typed = next(line for line in docs.split("python -m src.run")[1:]
                 if "hardware.nodes=2" in line and "submitit_slurm" in line).split(" ```")[0]
    store = f"sqlite:///{tmp_path}/mlruns.db"
    command = [sys.executable, "-m", "src.run", *typed.split(), "trainer.steps=6", "trainer.checkpoint_every=1",
               "evaluation.at_start=false", "hydra.launcher.timeout_min=10", "hydra.launcher.cpus_per_task=1",
               f"hydra.sweep.dir={tmp_path}/multirun", f"tracking.uri={store}",
               f"tracking.artifact_location={tmp_path}/artifacts", "tracking.sweep=nodes"]
    first = subprocess.Popen(command, cwd=PROJECT_ROOT, env=slurm_cluster.env, stdout=subprocess.PIPE,
                             stderr=subprocess.STDOUT, text=True)
    deadline, checkpoints = time.time() + 600, []
    while not checkpoints and first.poll() is None and time.time() < deadline:
        checkpoints = list((tmp_path / "multirun").rglob("checkpoint.pt"))
        time.sleep(0.2)
    assert checkpoints, "no checkpoint was written"
    drivers = [pid for pid in task_processes(tmp_path / "multirun") if pid[1] == "0"]
    assert len(drivers) == 1, drivers
    os.kill(drivers[0][0], signal.SIGKILL)
    [script] = (tmp_path / "multirun" / ".submitit").glob("*/*_submission.sh")
    job, deadline = script.name.split("_")[0], time.time() + 120
    shown = slurm_cluster.run("scontrol", "show", "job", job).stdout
    while ("JobState=RUNNING" in shown or "JobState=COMPLETING" in shown) and time.time() < deadline:
        time.sleep(1.0)  # the further node leaves once the head is gone (HEAD_GONE_S), and the job ends
        shown = slurm_cluster.run("scontrol", "show", "job", job).stdout
    assert "JobState=FAILED" in shown and "NumNodes=2 " in shown, shown
    assert not task_processes(tmp_path / "multirun") and _processes_naming(Path(f"ray-{job}-")) == []
    # The local SLURM keeps no accounting (no sacct), so submitit never learns that the job failed: the launcher
    # waiting on it is stopped here, as its user would stop it, once SLURM shows the job ended.
    first.terminate()
    output, _ = first.communicate(timeout=60)
    assert "1 finished" not in output, output[-3000:]

    again = subprocess.run(command, cwd=PROJECT_ROOT, env=slurm_cluster.env, capture_output=True, text=True,
                           timeout=900)
    said = again.stdout + again.stderr
    assert again.returncode == 0 and "1 finished" in said, said[-3000:]
    mlflow.set_tracking_uri(store)
    client = mlflow.MlflowClient()
    [run] = client.search_runs([mlflow.get_experiment_by_name("replay-rloo").experiment_id])
    assert run.info.status == "FINISHED"
    assert [m.step for m in sorted(client.get_metric_history(run.info.run_id, "train/loss"),
                                   key=lambda m: m.step)] == list(range(6))


def task_processes(sweep: Path) -> list[tuple[int, str]]:
    """(pid, SLURM_PROCID) of the python processes running a task of a job launched from `sweep` (submitit's)."""
    found = []
    for entry in Path("/proc").iterdir():
        try:
            argv = (entry / "cmdline").read_bytes().decode().split("\0")
            if not Path(argv[0]).name.startswith("python") or "submitit.core._submit" not in argv or \
                    not any(str(sweep) in arg for arg in argv):
                continue  # srun, the batch script, SLURM's own: not the task's python
            environ = dict(item.split("=", 1) for item in (entry / "environ").read_bytes().decode().split("\0")
                           if "=" in item)
        except (OSError, ValueError):
            continue
        found.append((int(entry.name), environ.get("SLURM_PROCID", "")))
    return found


@pytest.mark.long  # make test-long (docs/testing.md): test_sweep's preempted run resumes in the suite
def test_requeued_slurm_job_resumes_into_the_same_run_with_identical_metrics(tmp_path, slurm_cluster,
                                                                           random_policy_dir):
    """`scontrol requeue` mid-run: SIGTERM, checkpoint, KILLED; the requeued job resumes the same MLflow run.

    A tiny step takes about 0.1 s and the requeue lands some 5 steps after the first checkpoint is seen, so the
    run is 40 steps long: with 8, a fast machine finished the run before SIGTERM arrived.
    """
    from mlflow.tracking import MlflowClient

    store = f"sqlite:///{tmp_path}/mlruns.db"
    cell = [f"policy.name_or_path={random_policy_dir}", "buffer=age1", "clip=tight", "trainer.steps=40",
            "trainer.checkpoint_every=1", "trainer.groups_per_step=4", "trainer.group_size=2",
            "policy.max_new_tokens=6", "evaluation.at_start=false", "evaluation.prompts=2",
            "evaluation.samples_per_prompt=2", "evaluation.ks=[1]", "hardware.threads=1", f"tracking.uri={store}",
            f"tracking.artifact_location={tmp_path}/artifacts"]
    reference = subprocess.run([sys.executable, "-m", "src.run", *cell, "tracking.experiment=reference",
                                f"hydra.run.dir={tmp_path}/reference"], cwd=PROJECT_ROOT, capture_output=True,
                               text=True, timeout=600)
    assert reference.returncode == 0, reference.stderr[-3000:]

    sweep = subprocess.Popen(
        [sys.executable, "-m", "src.run", "-m", "hydra/launcher=submitit_slurm",
         f"hydra.launcher.partition={slurm_cluster.partition}", "hydra.launcher.timeout_min=10",
         "hydra.launcher.cpus_per_task=1", f"hydra.sweep.dir={tmp_path}/multirun", *cell],
        cwd=PROJECT_ROOT, env=slurm_cluster.env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    deadline = time.time() + 300
    checkpoints = []
    while not checkpoints and sweep.poll() is None and time.time() < deadline:
        checkpoints = list((tmp_path / "multirun").glob("*/checkpoint.pt"))
        time.sleep(0.1)
    assert checkpoints, "no checkpoint was written"
    job_ids = slurm_cluster.run("squeue", "--noheader", "--format=%i").stdout.split()
    assert len(job_ids) == 1
    slurm_cluster.run("scontrol", "requeue", job_ids[0])
    output, _ = sweep.communicate(timeout=600)
    assert sweep.returncode == 0, output[-4000:]

    mlflow.set_tracking_uri(store)
    runs = mlflow.search_runs(experiment_names=["replay-rloo"])
    assert list(runs["status"]) == ["FINISHED"]  # one run: the requeued job continued it
    # The run's log lines go to the job's stderr (*_log.err), its results to stdout (*_log.out).
    logs = "".join(path.read_text() for path in (tmp_path / "multirun").glob(".submitit/*/*_log.*"))
    assert "marked KILLED" in logs and "resuming run" in logs
    client = MlflowClient(store)
    expected_run = mlflow.search_runs(experiment_names=["reference"]).run_id[0]
    keys = [key for key in client.get_run(expected_run).data.metrics if not wall_clock(key)]
    for key in keys:
        expected = sorted(client.get_metric_history(expected_run, key), key=lambda m: m.step)
        actual = sorted(client.get_metric_history(runs.run_id[0], key), key=lambda m: m.step)
        assert [m.step for m in actual] == [m.step for m in expected], key
        assert [m.value for m in actual] == pytest.approx([m.value for m in expected], rel=1e-5), key
