"""`python -m src.run` over torchrun's ranks (hardware.ranks, src/runs/ranks.py): the numbers one process logs."""

from __future__ import annotations

import math
import os
import signal
import subprocess
import sys
import time

import pytest
from mlflow.tracking import MlflowClient

from src.paths import PROJECT_ROOT
from tests.conftest import kill_tree, wall_clock
from tests.ports import free_port

# float64: the ranks sum the same terms in other orders, which float32 would round apart (~1e-5)
SETTINGS = ("trainer.steps=5", "trainer.groups_per_step=4", "trainer.group_size=4", "policy.max_new_tokens=16",
            "trainer.micro_batch_size=3", "trainer.learning_rate=1e-3", "trainer.kl_coef=0.05", "buffer=age1",
            "hardware.dtype=float64", "hardware.threads=1", "trainer.checkpoint_every=1", "evaluation.prompts=4",
            "evaluation.samples_per_prompt=2", "evaluation.ks=[1,2]")


def launch(tmp_path, store: str, folder: str, *prefix: str, extra=(), group: bool = False,
           env: dict | None = None) -> subprocess.Popen:
    """`python -m src.run` (under `prefix`: torchrun); `group`: in a process group of its own, to kill it whole."""
    command = [*prefix, "-m", "src.run", *SETTINGS, *extra, f"tracking.uri={store}",
               f"tracking.artifact_location={tmp_path}/artifacts", f"hydra.run.dir={tmp_path}/{folder}"]
    return subprocess.Popen(command, cwd=PROJECT_ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=group, env=env)


def slurm_node(node: int, nodes: int, port: int) -> dict[str, str]:
    """The environment SLURM's srun gives the one task of node `node` in a job of `nodes` nodes, as submitit's job
    sees it (SUBMITIT_EXECUTOR=slurm): every node is this machine, so the ranks meet at localhost."""
    env = {name: value for name, value in os.environ.items()
           if name not in ("WORLD_SIZE", "RANK", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR")}
    return {**env, "SUBMITIT_EXECUTOR": "slurm", "SLURM_JOB_ID": "4242", "SLURM_NTASKS": str(nodes),
            "SLURM_JOB_NUM_NODES": str(nodes), "SLURM_NODEID": str(node), "SLURM_PROCID": str(node),
            "SLURM_LOCALID": "0", "SLURM_JOB_NODELIST": ",".join(["localhost"] * nodes), "MASTER_PORT": str(port)}


def finished(process: subprocess.Popen, timeout: float = 300) -> str:
    out, _ = process.communicate(timeout=timeout)
    assert process.returncode == 0, out[-3000:]
    return out


def histories(store: str) -> tuple[list, dict[str, list[tuple[int, float]]]]:
    client = MlflowClient(store)
    runs = client.search_runs([client.get_experiment_by_name("replay-rloo").experiment_id])
    run = runs[0]
    return runs, {key: sorted((m.step, m.value) for m in client.get_metric_history(run.info.run_id, key))
                  for key in run.data.metrics}


TORCHRUN = (sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2")


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory) -> dict[str, list[tuple[int, float]]]:
    """The metrics of an uninterrupted one-process run, which every stopped-and-resumed run must log."""
    tmp_path = tmp_path_factory.mktemp("uninterrupted")
    store = f"sqlite:///{tmp_path}/one.db"
    finished(launch(tmp_path, store, "one", sys.executable))
    return histories(store)[1]


def stopped(tmp_path, store: str, *prefix: str, extra=()) -> str:
    """Launch a run, SIGTERM it once it has saved two checkpoints, and return its (KILLED) run's id."""
    process = launch(tmp_path, store, "first", *prefix, extra=extra)
    second = tmp_path / "first" / "checkpoint.prev.pt"  # two checkpoints: it trained at least two steps
    while not second.exists() and process.poll() is None:
        time.sleep(0.05)
    process.send_signal(signal.SIGTERM)  # torchrun hands it to its ranks: they finish the step and checkpoint
    out, _ = process.communicate(timeout=120)
    assert process.returncode != 0 and "marked KILLED" in out, out[-3000:]
    killed, logged = histories(store)
    assert [run.info.status for run in killed] == ["KILLED"]
    assert 2 <= len(logged["train/reward"]) < 5
    return killed[0].info.run_id


def assert_resumed_as_uninterrupted(store: str, run_id: str, out: str, want: dict) -> None:
    """The resumed run is the stopped one, and holds every metric of the uninterrupted run, each step once."""
    assert f"resuming run {run_id}" in out and "RESUME MISMATCH" not in out
    (resumed,), got = histories(store)
    assert resumed.info.run_id == run_id and resumed.info.status == "FINISHED"
    assert got.keys() == want.keys()
    compared = 0
    for key, values in want.items():
        if wall_clock(key):
            continue
        assert [step for step, _ in got[key]] == [step for step, _ in values], key  # each step once
        for (_, value), (_, seen) in zip(values, got[key]):
            assert (math.isnan(value) and math.isnan(seen)) or seen == pytest.approx(value, rel=1e-9, abs=1e-12), key
            compared += 1
    assert compared > 100 and len(want["train/loss"]) == 5 and len(set(v for _, v in want["train/loss"])) == 5


@pytest.mark.slow  # two launches of the tiny policy, one under torchrun (+ the shared one-process run): ~40 s
@pytest.mark.long  # make test-long (docs/testing.md): the suite kills two ranks and resumes on two
def test_two_ranks_killed_and_resumed_on_one_log_the_one_process_run(tmp_path, uninterrupted):
    """A 2-rank torchrun run (gloo) is stopped by SIGTERM after some steps and resumed by one process: its MLflow run
    holds every metric of an uninterrupted one-process run, each step once, to float64 rounding."""
    store = f"sqlite:///{tmp_path}/two.db"
    run_id = stopped(tmp_path, store, *TORCHRUN, extra=("hardware.ranks=2",))
    assert (tmp_path / "first" / "shards").is_dir()
    out = finished(launch(tmp_path, store, "resumed", sys.executable))  # one process resumes the ranks' shards
    assert_resumed_as_uninterrupted(store, run_id, out, uninterrupted)


@pytest.mark.slow  # as above
@pytest.mark.long  # make test-long (docs/testing.md): as above
def test_one_process_killed_and_resumed_on_two_ranks_logs_the_one_process_run(tmp_path, uninterrupted):
    """The reverse: a one-process run (whole weights in its checkpoint) resumed by 2 torchrun ranks, each keeping
    its slices of the weights and AdamW's moments."""
    store = f"sqlite:///{tmp_path}/one.db"
    run_id = stopped(tmp_path, store, sys.executable)
    assert not (tmp_path / "first" / "shards").exists()
    out = finished(launch(tmp_path, store, "resumed", *TORCHRUN, extra=("hardware.ranks=2",)))
    assert_resumed_as_uninterrupted(store, run_id, out, uninterrupted)


@pytest.mark.slow  # as above
def test_two_nodes_sigkilled_together_resume_on_two_torchrun_ranks_into_the_one_process_run(tmp_path, uninterrupted):
    """A cell over two nodes (hardware.nodes=2), each node's task started as SLURM's srun starts it: the two ranks
    meet through the rendezvous a SLURM job uses (submitit's environment, src/runs/ranks.py), train on gloo and
    checkpoint. A node failure then kills both at once by SIGKILL (no handler runs, no checkpoint is written then),
    after the second checkpoint. Relaunched on one node as two torchrun ranks, the run continues from its last
    checkpoint into the same MLflow run, and logs every metric of the one-process run, each step once."""
    store, port = f"sqlite:///{tmp_path}/two.db", free_port()
    nodes = [launch(tmp_path, store, "first", sys.executable, extra=("hardware.ranks=2", "hardware.nodes=2"),
                    group=True, env=slurm_node(node, 2, port)) for node in range(2)]
    second = tmp_path / "first" / "checkpoint.prev.pt"
    deadline = time.time() + 300
    while not second.exists() and all(node.poll() is None for node in nodes) and time.time() < deadline:
        time.sleep(0.05)
    assert all(node.poll() is None for node in nodes), "finished before it could be killed"
    for node in nodes:
        kill_tree(node.pid)
    outs = [node.communicate(timeout=60)[0] for node in nodes]
    killed, logged = histories(store)
    assert [run.info.status for run in killed] == ["RUNNING"], outs[0][-3000:]  # as SIGKILL leaves it
    assert 1 <= len(logged["train/reward"]) < 5
    assert "hardware.nodes" in killed[0].data.params and killed[0].data.params["hardware.nodes"] == "2"
    out = finished(launch(tmp_path, store, "resumed", *TORCHRUN, extra=("hardware.ranks=2",)))
    assert_resumed_as_uninterrupted(store, killed[0].info.run_id, out, uninterrupted)


@pytest.mark.slow  # one launch under torchrun (+ the shared one-process run)
def test_one_process_on_the_ranked_path_logs_the_one_process_run(tmp_path, uninterrupted):
    """`torchrun --nproc_per_node 1 -m src.run hardware.ranked=true`: a process group of one, FSDP2 over a mesh of
    one, DCP shards (the GPU lease's form of the ranked path on one GPU), with every metric of one process."""
    store = f"sqlite:///{tmp_path}/ranked.db"
    one = (sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "1")
    finished(launch(tmp_path, store, "ranked", *one, extra=("hardware.ranked=true",)))
    assert list((tmp_path / "ranked" / "shards").glob("step-*"))  # the ranked path's checkpoint
    (run,), got = histories(store)
    assert run.info.status == "FINISHED" and got.keys() == uninterrupted.keys()
    for key, values in uninterrupted.items():
        if not wall_clock(key):
            assert [v for _, v in got[key]] == pytest.approx([v for _, v in values], rel=1e-9, abs=1e-12,
                                                             nan_ok=True), key


@pytest.mark.slow  # one launch of the tiny policy, one under torchrun
@pytest.mark.long  # make test-long (docs/testing.md): test_data_parallel trains the fused head over two ranks
def test_the_fused_head_over_two_ranks_logs_the_one_process_run(tmp_path):
    """`torchrun ... -m src.run hardware.ranks=2 trainer.fused_logprobs=true`, as typed: every metric of the same
    command in one process (the fused head reads the sharded model's own forward)."""
    fused = ("trainer.fused_logprobs=true",)
    one, two = f"sqlite:///{tmp_path}/one.db", f"sqlite:///{tmp_path}/two.db"
    finished(launch(tmp_path, one, "one", sys.executable, extra=fused))
    finished(launch(tmp_path, two, "two", *TORCHRUN, extra=("hardware.ranks=2", *fused)))
    (want_run,), want = histories(one)
    (got_run,), got = histories(two)
    assert got_run.data.params["trainer.fused_logprobs"] == "True" and got.keys() == want.keys()
    for key, values in want.items():
        if not wall_clock(key):
            assert [step for step, _ in got[key]] == [step for step, _ in values], key
            assert [v for _, v in got[key]] == pytest.approx([v for _, v in values], rel=1e-9, abs=1e-12,
                                                             nan_ok=True), key


def test_ranks_that_torchrun_did_not_start_are_refused_in_one_line(compose_config):
    from src.runs.ranks import join, mismatch, processes

    cfg = compose_config("hardware.ranks=2")
    want = processes(cfg.hardware.ranks, cfg.runtime)
    assert processes(2, compose_config("runtime=async").runtime) == 1  # async's trainer ranks are Ray actors
    assert mismatch(processes(1, cfg.runtime), 1) is None and mismatch(want, 2) is None
    assert "hardware.ranks=2 but this process was not started by torchrun" in mismatch(want, 1)
    assert "set hardware.ranks=3, or start torchrun with --nproc_per_node 2" in mismatch(want, 3)
    with pytest.raises(ValueError, match="torchrun --standalone --nproc_per_node 2 -m src.run"):
        join(want, cfg.hardware.device)  # this test's process has no WORLD_SIZE
    with pytest.raises(ValueError, match="hardware.ranked=true but this process was not started by torchrun"):
        join(1, cfg.hardware.device, ranked=True)


@pytest.mark.parametrize("overrides, named", [
    (("runtime=async", "buffer=none"), "hardware.ranks=2 with runtime.trainers=1: under runtime=async the ranks are "
     "the T trainer actors; set runtime.trainers=2"),
    (("loss=grpo", "loss.updates_per_step=9", "trainer.groups_per_step=4", "trainer.group_size=4"),
     "a rank may hold only 8 responses .4 groups of 4 over 2 ranks., fewer than one per mini-batch; lower "
     "loss.updates_per_step to 8"),
    (("trainer.compile=true",), "trainer.compile=false"),
    (("hardware.device=cuda:1",), "each rank takes GPU LOCAL_RANK; set hardware.device=cuda"),
    (("trainer.groups_per_step=1",), "raise trainer.groups_per_step to at least 2"),
    (("hardware.ranked=true",), "hardware.ranked=true with hardware.ranks=2: 2 ranks take the ranked path already"),
    (("hardware.nodes=3",), r"hardware.nodes=3 with hardware.ranks=2: every node runs the same number of ranks \(one "
     r"a GPU\); set hardware.ranks to a multiple of 3 \(hardware=h100x8: hardware.ranks=24\)"),
    (("hardware.nodes=2", "policy.engine=vllm", "policy.vllm.tensor_parallel_size=2"),
     "policy.vllm.tensor_parallel_size=2 with hardware.ranks=2 over hardware.nodes=2: an engine takes 2 consecutive "
     "ranks, which must sit on one node of 1; set tensor_parallel_size to a divisor of 1"),
    (("hardware.nodes=2", "runtime=async", "runtime.trainers=2", "buffer=none", "runtime.address=10.1.2.3:6379"),
     "hardware.nodes=2 with runtime.address=10.1.2.3:6379: over a SLURM job's nodes the run starts its own Ray "
     "cluster; drop runtime.address, or set hardware.nodes=1 to join that cluster"),
])
def test_what_ranks_cannot_run_is_refused_before_any_model_loads(compose_config, overrides, named):
    from src.command.config import ConfigError, validate

    validate(compose_config("hardware.ranks=2"))
    with pytest.raises(ConfigError, match=named):
        validate(compose_config("hardware.ranks=2", *overrides), check_device=False)


def test_the_ranked_path_of_one_process_is_refused_where_it_cannot_act(compose_config):
    from src.command.config import ConfigError, validate

    validate(compose_config("hardware.ranked=true"), check_device=False)
    with pytest.raises(ConfigError, match="hardware.ranked=true under a runtime whose ranks are not the loop's"):
        validate(compose_config("hardware.ranked=true", "runtime=async"), check_device=False)


def test_every_loss_trains_over_ranks_a_new_one_included(compose_config):
    """The shared trainer splits every loss over ranks: no loss opts in, so a loss outside src/ runs too."""
    from src.command.config import validate
    from tests.e2e.test_outside_variant import OUTSIDE

    for loss in ("rloo", "rloo-tis", "asymre", "grpo", "grpo-coupled", "ipo"):
        validate(compose_config("hardware.ranks=2", f"loss={loss}"), check_device=False)
    validate(compose_config(OUTSIDE, "hardware.ranks=2", "loss=rloocopy"), check_device=False)


def test_a_slurm_job_of_several_tasks_joins_as_torchrun_ranks(monkeypatch, compose_config):
    """submitit's tasks (hydra.launcher.tasks_per_node = hardware.ranks) get torchrun's variables from SLURM's."""
    import os

    from src.runs.ranks import export_slurm_tasks, mismatch, processes

    for name in ("WORLD_SIZE", "RANK", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT", "LOCAL_WORLD_SIZE"):
        monkeypatch.setenv(name, "")  # recorded, so the undo removes what export_slurm_tasks sets
        monkeypatch.delenv(name)
    slurm = {"SUBMITIT_EXECUTOR": "slurm", "SLURM_JOB_ID": "42", "SLURM_NTASKS": "4", "SLURM_JOB_NUM_NODES": "1",
             "SLURM_NODEID": "0", "SLURM_JOB_NODELIST": "gpu-node7", "SLURM_PROCID": "3", "SLURM_LOCALID": "3"}
    for name, value in slurm.items():
        monkeypatch.setenv(name, value)
    export_slurm_tasks()
    assert (os.environ["WORLD_SIZE"], os.environ["RANK"], os.environ["LOCAL_RANK"]) == ("4", "3", "3")
    assert os.environ["MASTER_ADDR"] == "gpu-node7"
    h100x4 = compose_config("hardware=h100x4")
    assert mismatch(processes(h100x4.hardware.ranks, h100x4.runtime), int(os.environ["WORLD_SIZE"])) is None


def test_a_slurm_job_over_two_nodes_joins_as_one_group_of_all_their_tasks(monkeypatch, compose_config):
    """hardware=h100x8 hardware.nodes=2: SLURM starts 8 tasks a node; task 3 of the second node is rank 11 of 16,
    every rank meets at the first node (a MASTER_PORT the site fixed is kept), and a job whose ranks span other
    than hardware.nodes nodes is refused in one line."""
    import os

    from src.runs.ranks import export_slurm_tasks, node_mismatch

    for name in ("WORLD_SIZE", "RANK", "LOCAL_RANK", "MASTER_ADDR", "LOCAL_WORLD_SIZE"):
        monkeypatch.setenv(name, "")
        monkeypatch.delenv(name)
    slurm = {"SUBMITIT_EXECUTOR": "slurm", "SLURM_JOB_ID": "43", "SLURM_NTASKS": "16", "SLURM_JOB_NUM_NODES": "2",
             "SLURM_NODEID": "1", "SLURM_JOB_NODELIST": "gpu-node[7-8]", "SLURM_PROCID": "11", "SLURM_LOCALID": "3",
             "MASTER_PORT": "29555"}
    for name, value in slurm.items():
        monkeypatch.setenv(name, value)
    export_slurm_tasks()
    exported = {name: os.environ[name] for name in ("WORLD_SIZE", "RANK", "LOCAL_RANK", "LOCAL_WORLD_SIZE",
                                                    "MASTER_ADDR", "MASTER_PORT")}
    assert exported == {"WORLD_SIZE": "16", "RANK": "11", "LOCAL_RANK": "3", "LOCAL_WORLD_SIZE": "8",
                        "MASTER_ADDR": "gpu-node7", "MASTER_PORT": "29555"}
    cell = compose_config("hardware=h100x8", "hardware.nodes=2", "hardware.ranks=16")
    assert node_mismatch(cell.hardware.nodes, 16, 8) is None
    assert node_mismatch(1, 16, 8) == (
        "hardware.nodes=1 but the 16 ranks run 8 a node, on 2 node(s) (WORLD_SIZE=16, LOCAL_WORLD_SIZE=8): set "
        "hardware.nodes=2, or start 1 node(s) of 16 rank(s) (SLURM: hydra.launcher.nodes; torchrun --nnodes 1 "
        "--nproc_per_node 16)")
    assert node_mismatch(2, 2, None) is None  # a launcher that does not say how many ranks a node runs
