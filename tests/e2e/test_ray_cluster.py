"""Seed 001's pipeline on a Ray cluster of two nodes on this machine (`src.runtime.ray_cluster`, docs/async.md):
the commands as the docs type them, a run that trains with workers on both nodes, a SIGKILL of its driver and
the same command resuming it into the same MLflow run, and a stop that leaves no process of the cluster; and the
two tasks of a SLURM job's cluster, whose head and further node end with a driver killed outright."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest

from src.paths import PROJECT_ROOT
from src.runtime.ray_cluster import _processes_naming, node_commands, without_gpu

# docs/async.md's run on a cluster: two workers ask one CPU each and two trainer ranks half a CPU each
# (num_cpus / (W + 1) = 1 a worker, and the trainer's share split over its ranks), 3 of the two nodes' 2 + 2: every
# placement Ray may choose fits, and none fits on one node, so the actors span both. The ranks meet at rank 0's
# node address, wherever Ray placed it.
TYPED = next(line for line in (PROJECT_ROOT / "docs" / "async.md").read_text().splitlines()
             if line.startswith("python -m src.run") and "runtime.address=127.0.0.1:PORT" in line)
RUN = (*[word for word in TYPED.split()[3:] if not word.startswith("runtime.address=")], "trainer.steps=4",
       "trainer.checkpoint_every=1", "evaluation.at_start=false")


def test_each_node_of_one_machine_has_its_own_worker_ports_and_resource():
    head, second, third = node_commands(3, cpus=2, port=6390, first_worker_port=20_000)
    assert "--head" in head and "--port=6390" in head and "--address=127.0.0.1:6390" in second
    assert '--resources={"node2": 1}' in second and '--resources={"node3": 1}' in third
    ranges = [[word for word in command if "worker-port" in word] for command in (head, second, third)]
    assert ranges == [["--min-worker-port=20000", "--max-worker-port=21999"],
                      ["--min-worker-port=22000", "--max-worker-port=23999"],
                      ["--min-worker-port=24000", "--max-worker-port=25999"]]


def test_the_head_offers_ray_every_gpu_of_its_node_but_the_drivers():
    assert without_gpu({"CUDA_VISIBLE_DEVICES": "4,5,6,7"}, 0)["CUDA_VISIBLE_DEVICES"] == "5,6,7"
    assert without_gpu({"CUDA_VISIBLE_DEVICES": "4,5,6,7"}, 2)["CUDA_VISIBLE_DEVICES"] == "4,5,7"
    assert without_gpu({"PATH": "/bin"}, None) == {"PATH": "/bin"}  # a CPU driver: the node's GPUs stay Ray's


def test_a_slurm_task_knows_its_node_and_its_attempts_folder(monkeypatch, tmp_path):
    """submitit's job environment: the task's node, and a folder for each attempt of a requeued job (same id)."""
    from src.runtime.ray_cluster import slurm_allocation

    assert slurm_allocation() is None or os.environ.get("SUBMITIT_EXECUTOR") == "slurm"
    job = {"SUBMITIT_EXECUTOR": "slurm", "SUBMITIT_FOLDER": f"{tmp_path}/%j", "SLURM_JOB_ID": "77",
           "SLURM_JOB_NUM_NODES": "2", "SLURM_NNODES": "2", "SLURM_NTASKS": "2", "SLURM_PROCID": "1",
           "SLURM_LOCALID": "0", "SLURM_NODEID": "1", "SLURM_JOB_NODELIST": "n[1-2]", "SLURM_RESTART_COUNT": "3"}
    for key, value in job.items():
        monkeypatch.setenv(key, value)
    allocation = slurm_allocation()
    assert (allocation.index, allocation.nodes, allocation.tasks) == (1, 2, 2)
    assert allocation.folder == tmp_path / "77" / "ray-77-3" and allocation.scratch.name == "ray-77-3"
    monkeypatch.setenv("SLURM_JOB_NUM_NODES", "1")
    monkeypatch.setenv("SLURM_NNODES", "1")
    assert slurm_allocation() is None  # one node: the run's own session


def test_a_further_node_whose_head_never_comes_up_says_where_to_look(tmp_path):
    from src.runtime.pipeline import PipelineError
    from src.runtime.ray_cluster import Allocation, serve_node

    allocation = Allocation(1, 2, 2, tmp_path / "ray-5-0", tmp_path / "scratch")
    with pytest.raises(PipelineError, match=f"node 2 of the job: no Ray head came up in 0.5 s .its log: "
                                            f"{allocation.folder}/node1.log"):
        serve_node(allocation, cpus=1, timeout_s=0.5)


NODE = """
import sys, time
from pathlib import Path
from src.runtime.ray_cluster import Allocation, lead_cluster, serve_node
folder, index = Path(sys.argv[1]), int(sys.argv[2])
allocation = Allocation(index, 2, 2, folder / "job", folder / "scratch")
if index:
    sys.exit(serve_node(allocation, cpus=1))
with lead_cluster(allocation, cpus=1) as address:
    print(address, flush=True)
    time.sleep(600)
"""


@pytest.mark.slow
def test_a_slurm_clusters_head_stops_with_its_killed_driver_and_the_further_node_leaves(tmp_path):
    """The two tasks of a job of two nodes, on this machine: the first starts the head and waits for the second to
    join. A driver killed by SIGKILL runs no `finally`: the kernel's SIGTERM to its children (PR_SET_PDEATHSIG) stops
    the head, the further node sees it gone and leaves, and nothing of the cluster stays."""
    folder = Path(tempfile.mkdtemp(prefix="rl", dir="/tmp"))  # short: Ray's socket paths live under it
    started = [subprocess.Popen([sys.executable, "-c", NODE, str(folder), str(index)], cwd=PROJECT_ROOT,
                                stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True) for index in (0, 1)]
    driver, further = started
    try:
        address = driver.stdout.readline().strip()  # printed once both nodes are up
        assert address.rpartition(":")[2].isdigit() and (folder / "job" / "head").read_text() == address
        assert further.poll() is None, "the further node serves while the run goes on"
        driver.kill()
        driver.wait(timeout=30)
        further.wait(timeout=90)
        deadline = time.time() + 60
        while _processes_naming(folder) and time.time() < deadline:
            time.sleep(0.5)
        assert _processes_naming(folder) == [], "a process of the cluster outlived its driver"
    finally:
        for process in started:
            process.kill()
        for pid in _processes_naming(folder):
            os.kill(pid, 9)
        shutil.rmtree(folder, ignore_errors=True)


def test_the_pipeline_over_nodes_outside_a_slurm_job_is_refused_in_one_line(compose_config, monkeypatch):
    from src.build import build_runtime
    from src.settings import RunSettings

    monkeypatch.delenv("SUBMITIT_EXECUTOR", raising=False)
    run = RunSettings(compose_config("runtime=async", "hardware.nodes=2"))
    runtime = build_runtime(run)
    assert not runtime.serves(run)
    with pytest.raises(ValueError, match="^hardware.nodes=2 with runtime=async outside a SLURM job of as many "
                                         "nodes: launch it with hydra/launcher=submitit_slurm") as error:
        with runtime.joined(run):
            pass
    assert "\n" not in str(error.value)


def test_a_bad_node_count_is_one_line_and_a_folder_without_a_cluster_has_nothing_to_stop(tmp_path):
    bad = subprocess.run([sys.executable, "-m", "src.runtime.ray_cluster", "start", "--dir", str(tmp_path), "--nodes",
                          "0"], cwd=PROJECT_ROOT, capture_output=True, text=True, timeout=60)
    assert bad.returncode == 2 and bad.stderr.strip().splitlines()[-1].endswith("--nodes=0 --cpus=2: each must be at "
                                                                                 "least 1")
    empty = subprocess.run([sys.executable, "-m", "src.runtime.ray_cluster", "stop", "--dir", str(tmp_path)],
                           cwd=PROJECT_ROOT, capture_output=True, text=True, timeout=60)
    assert empty.returncode == 0 and "nothing to stop" in empty.stdout


@pytest.mark.slow
def test_a_run_on_a_two_node_cluster_trains_on_both_is_killed_and_resumes_into_the_same_run(tmp_path):
    from src.runs.lifecycle import LATEST_CHECKPOINT
    from tests.conftest import kill_tree
    from tests.preemption import relaunch_resumes_the_killed_run

    cluster = Path(tempfile.mkdtemp(prefix="rc", dir="/tmp"))  # short: Ray's socket paths live under it
    started = subprocess.run([sys.executable, "-m", "src.runtime.ray_cluster", "start", "--dir", str(cluster),
                              "--nodes", "2", "--cpus", "2"], cwd=PROJECT_ROOT, capture_output=True, text=True,
                             timeout=300)
    try:
        assert started.returncode == 0, started.stderr[-2000:]
        address = started.stdout.split()[-1]
        store = f"sqlite:///{tmp_path}/mlruns.db"
        command = [sys.executable, "-m", "src.run", *RUN, f"runtime.address={address}", f"tracking.uri={store}",
                   f"tracking.artifact_location={tmp_path}/artifacts", f"hydra.run.dir={tmp_path}/run"]
        first = subprocess.Popen(command, cwd=PROJECT_ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        checkpoint, deadline = tmp_path / "run" / LATEST_CHECKPOINT, time.time() + 600
        while first.poll() is None and time.time() < deadline and not checkpoint.exists():
            time.sleep(0.2)
        assert first.poll() is None, "finished before it could be killed"
        kill_tree(first.pid)  # the driver alone: the actors are the cluster's raylets' children, which Ray then ends
        first.wait(timeout=60)
        relaunch_resumes_the_killed_run(command, store, steps=4)
        placement = json.loads((tmp_path / "run" / "ray_placement.json").read_text())
        assert placement["nodes"] == 2 and len(placement["trainer_nodes"]) == 2, placement
        assert len(set(placement["worker_nodes"] + placement["trainer_nodes"])) == 2, placement
    finally:
        stopped = subprocess.run([sys.executable, "-m", "src.runtime.ray_cluster", "stop", "--dir", str(cluster)],
                                 cwd=PROJECT_ROOT, capture_output=True, text=True, timeout=120)
        left = _processes_naming(cluster)
        shutil.rmtree(cluster, ignore_errors=True)
    assert stopped.returncode == 0 and "stopped the cluster" in stopped.stdout, stopped.stderr[-2000:]
    assert left == [], f"processes of the cluster still running: {left}"
