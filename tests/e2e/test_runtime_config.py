"""The runtime config group: sync stays the default and the same cells; async settings are checked before any compute."""

from __future__ import annotations

import pytest
from omegaconf import OmegaConf

from src.settings import RunSettings
from src.build import build_runtime, build_store
from src.task.base import build_task
from src.command.config import ConfigError, validate
from src.runtime.runners import AsyncRuntime, SyncRuntime
from src.eval.standalone import with_components_named
from src.study.sweep import cell_identity, cell_name


def test_sync_is_the_default_and_keeps_the_cell_ids_and_no_state_of_its_own(compose_config):
    cfg = compose_config()
    runtime = build_runtime(RunSettings(cfg))
    assert isinstance(runtime, SyncRuntime) and runtime.state_dict() is None
    with pytest.raises(ValueError, match="resume it with runtime=async"):
        runtime.load_state_dict({"signature": "buffer N=32"})
    assert cell_identity(cfg) == cell_identity(compose_config("runtime=sync"))
    without = OmegaConf.create(OmegaConf.to_container(cfg))
    del without["runtime"]  # a run's config saved before the group existed, as standalone evaluation reads it
    read_back = with_components_named(without, compose_config())
    assert cell_identity(read_back) == cell_identity(cfg) and isinstance(build_runtime(RunSettings(read_back)), SyncRuntime)


# Seed 001's FIFO of N rollouts with distinct draws (Listing 5), as `runtime=async buffer=fifo` runs it.
FIFO = ("buffer=fifo", "buffer.mode=without_replacement")


def test_the_async_queue_counts_as_correct_what_the_task_does_as_the_sync_store(compose_config):
    """buffer=fifo's positive bias keeps correct rollouts: under both runtimes by the task's own correct_reward."""
    cfg = compose_config("runtime=async", *FIFO, "buffer.positive_bias=0.5", "buffer.capacity=1024")
    task = build_task(cfg.task)
    task.correct_reward = 0.75  # a task whose full reward is not 1.0
    queue = build_runtime(RunSettings(cfg)).build_queue(task=task)
    store = build_store(RunSettings(compose_config(*FIFO, "buffer.positive_bias=0.5", "buffer.capacity=256")), task)
    assert queue.correct_reward == store.correct_reward == 0.75


def test_async_keeps_the_pipeline_state_under_its_own_name_and_names_its_own_cells(compose_config):
    cfg = compose_config("runtime=async", *FIFO, "runtime.workers=6", "runtime.trainers=2", "buffer.capacity=768")
    validate(cfg, check_device=False)
    runtime = build_runtime(RunSettings(cfg))
    assert isinstance(runtime, AsyncRuntime) and runtime.settings.batch == 32 * 16
    assert runtime.queue_kind.replays and runtime.queue_arguments["capacity"] == 768  # buffer=fifo's rollout form
    assert runtime.state_dict() is None  # no session yet, nothing restored
    runtime.load_state_dict({"signature": runtime.signature(), "pipeline": {}, "events_written": 0})
    assert runtime.state_dict() == {"signature": runtime.signature(), "pipeline": {}, "events_written": 0}
    other = build_runtime(RunSettings(compose_config("runtime=async", *FIFO, "runtime.workers=4", "runtime.trainers=4",
                                                     "buffer.capacity=768")))
    with pytest.raises(ValueError, match="resume with the same runtime settings"):
        other.load_state_dict(runtime.state_dict())
    with pytest.raises(ValueError, match="holds no pipeline state"):
        other.load_state_dict(None)
    assert cell_name(cfg).endswith("-W6T2-N768")
    assert cell_name(compose_config("runtime=async")).endswith("-W2T1-lifo")  # buffer=none: the LIFO pipe
    launch_only = compose_config("runtime=async", *FIFO, "runtime.workers=6", "runtime.trainers=2",
                                 "buffer.capacity=768", "runtime.num_cpus=8")
    assert cell_identity(launch_only) == cell_identity(cfg) != cell_identity(compose_config())


@pytest.mark.parametrize("overrides, words", [
    (("buffer.capacity=100",), "buffer.capacity N=100 < B"),
    (FIFO + ("buffer.capacity=100",), "buffer.capacity N=100 < B"),
    (("runtime.schedule=free", "runtime.trainers=2"), "runtime.trainers=2 with runtime.schedule=free"),
    (("buffer=age2",), "buffer=age2 with runtime=async"),
    (("buffer=popo",), "buffer=popo with runtime=async"),
    (("buffer=fifo", "buffer.extra_updates=1"), "extra_updates=1"),
    (("sampling=dynamic",), "sampling=dynamic"),
    (("runtime.workers=0",), "runtime.workers"),
    (("buffer.max_age=-1",), "buffer.max_age=-1"),
    # eta bounds how far generation runs ahead, not the age of a buffer's rollouts (2 -> 8 in test_runtime_pure)
    (FIFO + ("buffer.capacity=1024", "runtime.staleness=2"), "bound that with buffer.max_age=2"),
    (("runtime.mu=0",), "runtime.mu=0"),
    (("runtime.address=headnode",), "runtime.address=headnode: give the Ray cluster head's host:port"),
    (("buffer.batch_rollouts=0",), "buffer.batch_rollouts=0"),
    (FIFO + ("buffer.capacity=1024", "buffer.batch_rollouts=2000"), "buffer.capacity N=1024 < B = 2000"),
    (FIFO + ("buffer.batch_rollouts=60", "buffer.sharded=true", "runtime.trainers=7", "buffer.capacity=252"),
     "cannot be split over 7 shards"),  # seed 001 D.2: 63 when T = 7
    (FIFO + ("buffer.sharded=true", "runtime.trainers=3", "buffer.capacity=1536"), "cannot be split over 3 shards"),
    (("runtime.gpus_per_worker=1",), "runtime.gpus_per_worker=1 with hardware.device=cpu"),
    (("hardware.device=cuda",), "each worker needs a GPU of its own"),
    (("hardware.device=cuda:7", "runtime.workers=8", "runtime.gpus_per_worker=1"), "hardware.device=cuda:8"),
    (("hardware.device=cuda:1", "runtime.workers=3", "runtime.gpus_per_worker=0.5"), "hold cuda:0..1"),
])
def test_bad_async_settings_are_one_line_naming_the_key(compose_config, overrides, words):
    cfg = compose_config("runtime=async", *overrides)
    with pytest.raises(ConfigError) as error:
        validate(cfg, check_device=False)
    assert words in str(error.value) and "\n" not in str(error.value)


def test_gpu_workers_take_the_first_gpus_and_leave_the_trainer_its_own(compose_config):
    full = compose_config("runtime=async", "hardware=h100x8", "runtime.workers=7", "runtime.gpus_per_worker=1")
    validate(full, check_device=False)
    assert build_runtime(RunSettings(full)).worker_gpus == 7 and full.hardware.device == "cuda"
    # The node preset's bare `cuda` puts the trainer after the workers; an explicit GPU stays where it is told.
    assert AsyncRuntime.trainer_device(full.runtime, RunSettings(full)) == "cuda:7"
    pinned = compose_config("runtime=async", "hardware=h100x8", "runtime.workers=3", "runtime.gpus_per_worker=1",
                            "hardware.device=cuda:5")
    assert AsyncRuntime.trainer_device(pinned.runtime, RunSettings(pinned)) == "cuda:5"
    assert SyncRuntime.trainer_device(None, RunSettings(compose_config("hardware=h100x8"))) == "cuda"
    # Over two nodes the driver's copy alone holds GPU 0 of the first (the cluster leaves it out), and Ray gives every
    # worker and trainer rank a GPU on any node: 14 workers and 1 rank fill the 16 GPUs with it.
    spread = compose_config("runtime=async", "hardware=h100x8", "hardware.nodes=2", "runtime.workers=14",
                            "runtime.gpus_per_worker=1")
    assert AsyncRuntime.trainer_device(spread.runtime, RunSettings(spread)) == "cuda:0"
    assert AsyncRuntime.gpus_needed(spread.runtime, 1, "cuda", nodes=2) == 16
    halves = compose_config("runtime=async", "hardware=h100x8", "runtime.workers=7", "runtime.gpus_per_worker=0.5")
    assert build_runtime(RunSettings(halves)).worker_gpus == 4  # ceil(7 x 0.5): Ray packs two workers on a GPU
    assert cell_identity(halves) == cell_identity(full)  # placement is launch-only: the same cell
    assert build_runtime(RunSettings(compose_config("runtime=async"))).worker_gpus == 0  # CPU workers: no GPU asked of Ray


@pytest.mark.slow
def test_the_dry_run_of_an_8_gpu_async_job_prints_its_slurm_request(tmp_path):
    import subprocess
    import sys

    from src.paths import PROJECT_ROOT

    done = subprocess.run([sys.executable, "-m", "src.run", "-m", "hardware=h100x8", "runtime=async", "buffer=fifo",
                           "buffer.capacity=1024", "runtime.workers=7", "runtime.gpus_per_worker=1",
                           "hydra.sweeper.dry_run=true", f"tracking.uri=sqlite:///{tmp_path}/mlruns.db",
                           f"hydra.sweep.dir={tmp_path}/multirun"],
                          cwd=PROJECT_ROOT, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    printed = " ".join((done.stdout + done.stderr).split())
    assert "each asks for 1 node x 1 task, 8 GPU, 64 CPUs, 512 GB" in printed
    assert "-W7T1-N1024" in done.stdout and "nothing launched" in done.stdout


@pytest.mark.slow
def test_buffer_fifo_plans_under_both_runtimes_with_the_defaults(tmp_path):
    """`buffer.capacity` counts rollouts under both runtimes: the default N = 4096 is 256 groups of the tiny K = 16 to
    the synchronous step and at least the pipeline's batch of B = 512 rollouts, so neither command is refused."""
    import subprocess
    import sys

    from src.paths import PROJECT_ROOT

    done = subprocess.run([sys.executable, "-m", "src.run", "-m", "runtime=sync,async", "buffer=fifo",
                           "hydra.sweeper.dry_run=true", f"out={tmp_path}"],
                          cwd=PROJECT_ROOT, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    printed = " ".join(done.stdout.split())
    assert "2 jobs, 2 to launch" in printed
    assert "fifo-rho1-N4096-with_replacement-c10" in printed and "rho0-W2T1-N4096" in printed


def test_the_budget_plan_of_an_async_run_follows_its_lockstep_schedule(compose_config):
    from src.study.budget import plan_for_config

    cfg = compose_config("runtime=async", *FIFO, "trainer.groups_per_step=2", "trainer.group_size=4", "trainer.steps=5",
                         "buffer.capacity=32", "runtime.groups_per_request=1")
    plan = plan_for_config(cfg)
    # W = 2, mu = 4: each worker makes a group every 2 steps; step 0 waits for the first two (the Ray tests' run)
    assert plan.fresh_groups_per_step == (2, 0, 2, 0, 2) and plan.fresh_evaluations == 24


def test_a_batch_of_rollouts_is_not_tied_to_whole_groups_and_the_plan_counts_it(compose_config):
    # Seed 001 D.2 (001_c87e0ce01a0f00be.txt lines 2287-2288, 2332-2333): 60 rollouts an update with G = 16.
    from src.build import build_runtime
    from src.study.budget import plan_for_config

    seed001 = compose_config("runtime=async", "trainer.group_size=16", "trainer.groups_per_step=4",
                             "buffer.batch_rollouts=60")
    assert build_runtime(RunSettings(seed001)).settings.batch == 60 != 4 * 16
    sizes = (*FIFO, "trainer.groups_per_step=2", "trainer.group_size=4", "trainer.steps=5", "buffer.capacity=32",
             "runtime.groups_per_request=1")
    whole = plan_for_config(compose_config("runtime=async", *sizes))
    rollouts = plan_for_config(compose_config("runtime=async", *sizes, "buffer.batch_rollouts=6"))
    # W = 2, mu = 4: a group of 4 takes mu T K / B = 8/3 steps at B = 6, so the workers add R = B W / mu = 3
    # rollouts a step against 4 at B = 8; step 0 waits for the first two groups either way.
    assert whole.fresh_groups_per_step == (2, 0, 2, 0, 2) and whole.fresh_evaluations == 24
    assert rollouts.fresh_groups_per_step == (2, 0, 0, 2, 0) and rollouts.fresh_evaluations == 16


def test_the_buffer_groups_replay_settings_reach_the_pipeline(compose_config):
    """B, sharding and the age window are the buffer's settings; runtime.staleness is the workers' bound alone."""
    from src.build import build_runtime

    runtime = build_runtime(RunSettings(compose_config("runtime=async", *FIFO, "buffer.capacity=1536",
                                                       "buffer.sharded=true", "runtime.trainers=3",
                                                       "buffer.batch_rollouts=48", "buffer.max_age=2")))
    assert (runtime.settings.batch, runtime.settings.max_age, runtime.settings.staleness) == (48, 2, None)
    assert runtime.queue_arguments["shards"] == 3 and "eta=2 drop" in runtime.signature()
    lifo = build_runtime(RunSettings(compose_config("runtime=async", "runtime.staleness=1")))
    assert (lifo.settings.max_age, lifo.settings.staleness) == (None, 1) and "eta=1 block" in lifo.signature()


def test_every_runtime_is_a_runtime_and_one_without_a_session_cannot_be_built():
    from src.runtime.base import Runtime, Steps

    assert issubclass(SyncRuntime, Runtime) and issubclass(AsyncRuntime, Runtime)
    assert SyncRuntime.processes(None, 4) == 4 and AsyncRuntime.processes(None, 4) == 1  # ranks: torchrun's, or Ray's

    class Stepless(Runtime):
        def state_dict(self):
            return None

        def load_state_dict(self, saved):
            pass

    with pytest.raises(TypeError, match="session"):
        Stepless()
    with pytest.raises(TypeError, match="next"):
        type("Idle", (Steps,), {})()
