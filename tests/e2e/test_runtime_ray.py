"""The asynchronous runtime on Ray (SPEC 11), on the tiny policy with tiny settings, in one shared Ray session.

Every run here is a few trainer steps of 8 rollouts (2 groups of K = 4): the time goes into starting
the worker actors (each imports torch and loads the policy), so the runs are few and shared.
"""

from __future__ import annotations

import json
import math
import os
import signal
import time
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from tests.conftest import wall_clock

ray = pytest.importorskip("ray")
import torch  # noqa: E402

from src.settings import RunSettings  # noqa: E402
from src.build import build_components, build_runtime  # noqa: E402
from src.runs.completions import completion_rows  # noqa: E402
from src.runtime.base import RunContext  # noqa: E402
from src.runtime.ray_session import ray_session  # noqa: E402
from src.batch import TrainState  # noqa: E402
from src.task import countdown  # noqa: E402

pytestmark = pytest.mark.slow

FIFO = ("buffer=fifo", "buffer.mode=without_replacement", "buffer.capacity=32")  # seed 001's, distinct draws
TINY = ("runtime=async", "trainer.groups_per_step=2", "trainer.group_size=4", "policy.max_new_tokens=16",
        "task.train_size=200", "runtime.mu=4.0", "trainer.steps=5", "hardware.threads=1",
        "runtime.groups_per_request=1", "runtime.sync_every=2")
WITHOUT_STEPS = tuple(word for word in TINY + FIFO if not word.startswith("trainer.steps="))  # a key is given once


@dataclass
class Recorder:
    """The tracker and the loop's calls, recorded instead of logged to MLflow."""

    run_id: str = "test"
    steps: list = field(default_factory=list)
    artifacts: list = field(default_factory=list)
    completions: list = field(default_factory=list)
    saves: int = 0
    parts: object = None  # the driver's components once the session closed (policy, optimizer pulled)
    pipeline: dict | None = None  # the runtime's state once the session closed (`run`)

    def log_step(self, metrics, step):
        self.steps.append((step, metrics))

    def log_completions(self, rows, step):
        self.completions.append((step, rows))

    def has_metric_at(self, key, step):
        return False


class NoStop:
    requested = None


@pytest.fixture(scope="module")
def ray_cpus():
    with ray_session(2):  # the session `src.run` starts, shared by the module's runs
        yield


def make_run(compose_config, tmp_path: Path, *overrides: str, recorder: Recorder | None = None,
             train_size: int | None = None):
    """A run's runtime and what its session gets, as `src.run` builds them (without MLflow). `train_size`: that
    many training prompts of the configured task (else countdown's configured set)."""
    store = () if any(word.startswith("buffer=") for word in overrides) else FIFO  # one buffer, named once
    keys = {word.split("=", 1)[0] for word in overrides}
    cfg = compose_config(*(word for word in TINY if word.split("=", 1)[0] not in keys), *store, *overrides)
    if train_size is None:
        train_set, _ = countdown.train_and_heldout(cfg.task)
    else:
        from src.task.base import build_task

        train_set, _ = build_task(cfg.task).splits(train_size=train_size)
    recorder = recorder or Recorder()
    recorder.parts = build_components(RunSettings(cfg), train_set)
    run = RunSettings(cfg)
    context = RunContext(run, recorder.parts, TrainState(), tmp_path, log_artifact=recorder.artifacts.append)
    return build_runtime(run), context, recorder


def drive(session, recorder: Recorder, until: int | None = None) -> None:
    """The runtime's steps until `until`, logged as `src.run`'s loop logs them (the loop itself, with its
    checkpoints and evaluations, is tested through `CellRun` below)."""
    context = session.context
    run, state = context.run, context.state
    while state.step < (run.trainer.steps if until is None else until):
        outcome = session.next()
        state.advance(outcome.counts)  # as the loop counts each step
        recorder.log_step(outcome.metrics, state.step - 1)
        picked = outcome.completions.get(run.tracking.completions_per_step, [])
        recorder.log_completions(completion_rows(picked, context.parts.task, run.policy.max_new_tokens), state.step - 1)


def run(compose_config, tmp_path, *overrides, crash_after: int | None = None, train_size: int | None = None):
    runtime, context, recorder = make_run(compose_config, tmp_path, *overrides, train_size=train_size)
    with runtime.session(context) as session:
        if crash_after is not None:
            drive(session, recorder, until=crash_after)
            session.work.crash_worker(0)
        drive(session, recorder)
    recorder.pipeline = runtime.state_dict()
    events = [json.loads(line) for line in (tmp_path / "events.jsonl").read_text().splitlines()]
    return recorder, events


def machine_free(recorder: Recorder) -> str:
    """The logged metrics without wall-clock ones (`time/`) or the restart count, as text (nan == nan)."""
    return repr([(step, {k: v for k, v in m.items() if not wall_clock(k) and k != "runtime/worker_restarts"})
                 for step, m in recorder.steps])


@pytest.fixture(scope="module")
def lockstep_w2(compose_config_module, tmp_path_factory, ray_cpus):
    return run(compose_config_module, tmp_path_factory.mktemp("lockstep"))


@pytest.fixture(scope="module")
def compose_config_module():
    from hydra import compose, initialize_config_dir

    from src.paths import CONFIG_DIR

    def _compose(*overrides):
        with initialize_config_dir(str(CONFIG_DIR), version_base="1.3"):
            return compose("config", overrides=list(overrides))

    return _compose


def queue_history(queue) -> list:
    """Seeded draws, evictions and statistics of one sequence of calls, as plain data (a queue or its actor)."""
    from tests.unit.test_runtime_pure import group

    seen = []
    for key in range(6):
        queue.put(key, group(key, correct=(key % 3,)), key // 2, float(key), float(key))
        seen.append(queue.ready(8))
        samples = queue.take_ready(8, key)
        if samples is not None:
            measures = [(s.off_policiness, s.since_last_use) for s in samples]  # what the driver reads
            samples = ray.get(samples.ref) if hasattr(samples, "ref") else samples  # the trainer's copy
            assert measures == [(s.off_policiness, s.since_last_use) for s in samples]
            seen.append([(s.rollout.uid, s.off_policiness, s.since_last_use, s.group.prompt) for s in samples])
        if key == 4:  # a put after a draw: its events still come in the order things happened
            queue.put(10, group(10, correct=(1,)), 2, 4.5, 4.5)
        seen.append(queue.drain_events())
        queue.drop_stale(key, 2)
        seen += [queue.age(key), queue.size(), queue.room(4, 4), queue.drain_events()]
    return seen + [queue.replay_count_distribution(), queue.distributions(), queue.state_dict()]


def test_the_sessions_workers_run_at_the_drivers_priority(ray_cpus):
    """Ray would start its workers at niceness 15: beside any busy process they got a few percent of a core."""
    assert ray.get(ray.remote(lambda: os.nice(0)).remote()) == os.nice(0)


def test_the_buffer_actor_answers_as_the_queue_in_this_process_and_its_death_is_one_line(ray_cpus):
    """The pipeline's queue is an actor under runtime=async: the same calls give the same draws, events, Figure 2
    distributions and checkpoint state as the local queue; a dead buffer actor stops the run in one line."""
    from src.runtime.pipeline import PipelineError
    from src.runtime.queue_actor import QueueActor
    from src.buffer.rollouts import LifoQueue, RolloutQueue

    for kind, options in ((RolloutQueue, {"mode": "with_replacement", "positive_bias": 0.5}),
                          (RolloutQueue, {"shards": 2}), (LifoQueue, {})):
        local, remote = kind(capacity=16, seed=7, **options), QueueActor(kind, {"capacity": 16, "seed": 7, **options})
        try:
            assert (remote.name, remote.replays, remote.capacity) == (local.name, local.replays, local.capacity)
            assert repr(queue_history(remote)) == repr(queue_history(local))  # repr: nan == nan
            restored = QueueActor(kind, {"capacity": 16, "seed": 0, **options})
            restored.load_state_dict(local.state_dict())
            assert restored.state_dict() == local.state_dict()
            restored.close()
        finally:
            remote.close()
    doomed = QueueActor(LifoQueue, {"capacity": 16, "seed": 0})
    pid = ray.get(doomed.actor.__ray_call__.remote(lambda queue: os.getpid()))
    os.kill(pid, signal.SIGKILL)
    while os.path.exists(f"/proc/{pid}"):  # gone once Ray's raylet has reaped it
        time.sleep(0.05)
    with pytest.raises(PipelineError, match="the buffer actor died") as died:
        doomed.size()
    assert "\n" not in str(died.value) and "resume from its last checkpoint" in str(died.value)


def test_lockstep_w2_consumes_no_sample_newer_than_the_trainer_and_meets_footnote5(lockstep_w2):
    recorder, events = lockstep_w2
    assert [step for step, _ in recorder.steps] == [0, 1, 2, 3, 4]
    assert [step for step, _ in recorder.completions] == [0, 1, 2, 3, 4]  # a sample of each step's rows
    assert all(len(rows) == 4 and {row["source"] for row in rows} == {"replay"} for _, rows in recorder.completions)
    samples = [event for event in events if event["event"] == "sample"]
    assert len(samples) == 5 and all(max(e["versions"]) <= e["step"] for e in samples)
    last = recorder.steps[-1][1]
    # W = 2, T = 1, mu = 4: each worker makes a group of 4 every 2 steps, R = 4 rollouts a step, B/R = 2
    publishes = [e["version"] for e in events if e["event"] == "publish"]
    assert publishes == [2, 4]  # runtime.sync_every=2
    assert last["replay/ratio_measured"] == pytest.approx(2.0) == last["replay/ratio_predicted"]
    assert last["budget/fresh_evaluations"] == last["runtime/generated_rollouts"]  # every group that reached the queue
    assert last["budget/fresh_evaluations"] == 24  # as src.runtime.plan.async_budget_plan plans it
    assert {Path(p).name for p in recorder.artifacts} == {"events.jsonl", "runtime_distributions.json",
                                                          "ray_placement.json"}
    placement = json.loads(next(Path(p) for p in recorder.artifacts if Path(p).name == "ray_placement.json").read_text())
    assert (placement["nodes"], len(placement["worker_nodes"]), placement["workers_over_nodes"]) == (1, 2, 1)


@pytest.mark.long  # make test-long (docs/testing.md): golden numbers pin a seed's steps
def test_two_lockstep_runs_with_one_seed_log_equal_metrics_and_event_logs(lockstep_w2, compose_config_module,
                                                                            tmp_path):
    recorder, events = lockstep_w2
    again, again_events = run(compose_config_module, tmp_path)
    assert machine_free(again) == machine_free(recorder) and again_events == events
    # Golden: the lockstep schedule and the queue's seeded draws do not depend on the machine.
    assert [e["ids"] for e in events if e["event"] == "sample"] == [
        [6, 7, 3, 0, 2, 5, 1, 4], [4, 3, 2, 7, 1, 5, 0, 6], [4, 12, 1, 9, 15, 8, 14, 2], [9, 1, 11, 14, 10, 5, 7, 8],
        [3, 11, 13, 10, 19, 6, 17, 15]]


def test_a_killed_worker_is_restarted_and_the_lockstep_run_is_unchanged(lockstep_w2, compose_config_module, tmp_path):
    recorder, _ = lockstep_w2
    crashed, events = run(compose_config_module, tmp_path, crash_after=2)
    assert crashed.steps[-1][1]["runtime/worker_restarts"] == 1
    assert any(e["event"] == "restart" for e in events)
    assert machine_free(crashed) == machine_free(recorder)  # the retried request regenerated the same group


LIFO_W1 = ("buffer=none", "buffer.capacity=32", "runtime.workers=1", "runtime.groups_per_request=2")


@pytest.fixture(scope="module")
def lifo_w1(compose_config_module, tmp_path_factory, ray_cpus):
    return run(compose_config_module, tmp_path_factory.mktemp("lifo"), *LIFO_W1)


def test_lifo_w1_with_two_groups_a_request_uses_every_rollout_once(lifo_w1):
    recorder, events = lifo_w1
    used = [uid for e in events if e["event"] == "sample" for uid in e["ids"]]
    assert len(used) == len(set(used)) == 5 * 8
    assert all(m["reuse/new_fraction"] == 1.0 for _, m in recorder.steps)


def test_a_store_written_outside_src_runs_the_pipeline_as_its_original(compose_config_module, tmp_path, lifo_w1):
    """buffer=lifocopy (tests/outside_variants/rollouts.py) names its own rollout form, a copy of the LIFO pipe:
    under runtime=async it logs buffer=none's metrics and event log, step for step (lockstep)."""
    from src.paths import PROJECT_ROOT

    outside = f"hydra.searchpath=[file://{PROJECT_ROOT / 'tests' / 'outside_variants' / 'conf'}]"
    copy, copy_events = run(compose_config_module, tmp_path, outside, "buffer=lifocopy",
                            *(word for word in LIFO_W1 if word != "buffer=none"))
    original, events = lifo_w1
    assert machine_free(copy) == machine_free(original) and len(copy.steps) == 5
    assert copy_events == events and any(e["event"] == "consume" for e in events)  # each rollout used once


def test_rlep_under_the_pipeline_appends_earlier_successes_to_arriving_groups(compose_config_module, tmp_path,
                                                                             ray_cpus):
    """buffer=rlep under runtime=async on two prompts the tiny math policy often solves: groups that arrive once
    their prompt has two successes in the pool get them appended (more rollouts trained than generated), each
    rollout trains once, and no appended success costs a verifier call."""
    recorder, events = run(compose_config_module, tmp_path, "task=math", "policy.max_new_tokens=80", "buffer=rlep",
                           "buffer.queue=64", "loss=grpo", "trainer.kl_coef=0", "trainer.entropy_coef=0",
                           "runtime.workers=1", "trainer.steps=3", train_size=2)
    last = recorder.steps[-1][1]
    assert last["rlep/merged_groups_total"] > 0 and last["rlep/pool"] > 0, last
    used = [uid for e in events if e["event"] == "sample" for uid in e["ids"]]
    assert len(used) == len(set(used)) == 3 * 8  # every rollout once, the appended ones included
    put = sum(len(e["ids"]) for e in events if e["event"] == "put")
    assert put > last["runtime/generated_rollouts"] and all(m["reuse/new_fraction"] == 1.0 for _, m in recorder.steps)
    assert all(math.isfinite(m["train/loss"]) for _, m in recorder.steps)


def test_ipo_under_the_pipeline_pairs_the_drawn_rollouts_of_each_group(compose_config_module, tmp_path, ray_cpus):
    """The pipeline hands the trainer drawn rollouts, not whole groups as sampled: loss=ipo pairs those of each
    group (`src.loss.ipo.batch_pairs`) and trains on them."""
    recorder, _ = run(compose_config_module, tmp_path, "loss=ipo", "runtime.workers=1", "trainer.steps=2")
    assert [step for step, _ in recorder.steps] == [0, 1]
    assert all(m["ipo/pairs"] >= 0 and m["ipo/target_margin"] == 5.0 for _, m in recorder.steps), recorder.steps


def test_free_schedule_w1_with_two_groups_a_request_finishes(compose_config_module, tmp_path, ray_cpus):
    recorder, events = run(compose_config_module, tmp_path, "runtime.schedule=free", "runtime.workers=1",
                           "trainer.steps=3", "runtime.groups_per_request=2")
    assert [step for step, _ in recorder.steps] == [0, 1, 2]
    assert all(max(e["versions"]) <= e["step"] for e in events if e["event"] == "sample")


def weights_equal(one: dict, other: dict) -> bool:
    return one.keys() == other.keys() and all(torch.equal(one[name], other[name].to(one[name].device))
                                              for name in one)


def resume(compose_config, tmp_path: Path, saved: dict, recorder: Recorder, *overrides: str):
    """New components from a checkpoint, as a restarted run builds them: the runtime and its session's context."""
    from src.runs.checkpoint import restore_checkpoint

    runtime, context, _ = make_run(compose_config, tmp_path, *overrides, recorder=recorder)
    context.state = restore_checkpoint(saved, context.parts)
    runtime.load_state_dict(saved["runtime"])
    return runtime, context


@pytest.mark.long  # make test-long (docs/testing.md): the suite resumes a SIGKILLed Ray run
def test_the_trainer_actor_updates_and_a_resumed_run_continues_exactly_from_its_state(
        lockstep_w2, compose_config_module, tmp_path):
    """The update runs in the trainer actor, not in the driver: the driver's policy moves only when it pulls
    (before a checkpoint); a run resumed from that checkpoint starts its trainer actor from it, exactly."""
    from src.runs.checkpoint import read_checkpoint, save_checkpoint

    recorder, events = lockstep_w2
    path = tmp_path / "checkpoint.pt"
    runtime, context, got = make_run(compose_config_module, tmp_path)
    driver = context.parts
    initial = {name: tensor.clone() for name, tensor in driver.policy.state_dict().items()}
    with runtime.session(context) as first:
        drive(first, got, until=3)  # 3 updates, weights published at 2: the checkpoint keeps the workers' weights
        assert ray.get(first.work.trainers[0].pid.remote()) != os.getpid()
        trained = ray.get(first.work.trainers[0].weights.remote())
        assert weights_equal(driver.policy.state_dict(), initial) and not weights_equal(trained, initial)
        assert context.state.step == 3 and context.state.gradient_steps == 3  # the actor's counts, counted here
        first.before_checkpoint()  # as src.run's loop does
        assert weights_equal(driver.policy.state_dict(), trained) and driver.optimizer.state
        assert runtime.state_dict()["published_weights"] is not None
        save_checkpoint(path, driver, context.state, "test", "cell", runtime=runtime.state_dict())
    saved = read_checkpoint(path)
    runtime, context = resume(compose_config_module, tmp_path, saved, got)
    with runtime.session(context) as resumed:
        actor = ray.get(resumed.work.trainers[0].state.remote())
        assert weights_equal(actor["policy"], saved["policy"]) and context.state.step == 3
        assert torch.equal(actor["optimizer"]["state"][0]["exp_avg"], saved["optimizer"]["state"][0]["exp_avg"])
        drive(resumed, got)
    assert machine_free(got) == machine_free(recorder)
    resumed_events = [json.loads(line) for line in (tmp_path / "events.jsonl").read_text().splitlines()]
    assert resumed_events == events


def test_the_one_loop_pulls_before_it_saves_or_evaluates_and_a_dead_trainer_stops_it_in_one_line(
        lockstep_w2, compose_config_module, tmp_path):
    """`src.run`'s loop (`CellRun.train_steps`) drives the pipeline: the driver's copy is the trainer actor's
    whenever it checkpoints or evaluates; a trainer that dies mid-run stops the run in one line, with no
    snapshot of the pipeline, and the last checkpoint resumes it to the numbers of an unbroken run."""
    from src.run import CellRun
    from src.runs.cells import Cell
    from src.runs.checkpoint import read_checkpoint
    from src.runs.lifecycle import LATEST_CHECKPOINT
    from src.runtime.pipeline import PipelineError

    recorder, _ = lockstep_w2
    overrides = ("trainer.checkpoint_every=2", "evaluation.every=1")
    runtime, context, got = make_run(compose_config_module, tmp_path, *overrides)
    cell = CellRun(context.run, Cell("cell", "cell", None), context.parts, runtime, context.state, [], got, tmp_path,
                   NoStop())
    seen, checkpoint = [], cell.checkpoint
    trained = lambda: weights_equal(context.parts.policy.state_dict(),  # noqa: E731
                                    ray.get(cell.steps.work.trainers[0].weights.remote()))

    def evaluate(stage, step):
        seen.append(("evaluate", step, trained()))
        if step == 2:
            cell.steps.work.crash_trainer()

    def save():
        checkpoint()
        seen.append(("save", context.state.step, trained()))

    cell.evaluate, cell.checkpoint = evaluate, save
    with pytest.raises(PipelineError, match="the trainer actor died") as stopped:
        cell.train_steps()
    assert seen == [("evaluate", 1, True), ("save", 2, True), ("evaluate", 2, True)]
    assert "\n" not in str(stopped.value) and "resume from its last checkpoint" in str(stopped.value)
    assert runtime.state_dict() is None and cell.steps is None  # no snapshot of a run whose trainer is gone
    assert [step for step, _ in got.steps] == [0, 1]  # the step the trainer died in was not logged
    runtime, context = resume(compose_config_module, tmp_path, read_checkpoint(tmp_path / LATEST_CHECKPOINT), got)
    with runtime.session(context) as resumed:
        drive(resumed, got)
    assert machine_free(got) == machine_free(recorder)


@pytest.mark.long  # make test-long (docs/testing.md): the suite SIGKILLs the driver and Ray (test_sigkill_to_the_driver...)
def test_sigterm_to_the_whole_process_group_checkpoints_and_resumes_into_the_same_run(tmp_path):
    """`timeout` and SLURM signal every process of the job: Ray's own processes must not die before the
    trainer has finished its step and checkpointed. The relaunch continues the same MLflow run."""
    import subprocess
    import sys

    import mlflow
    from mlflow.tracking import MlflowClient

    from src.paths import PROJECT_ROOT

    store = f"sqlite:///{tmp_path}/mlruns.db"
    command = [sys.executable, "-m", "src.run", *WITHOUT_STEPS, "runtime.workers=1", "trainer.steps=100",
               "trainer.checkpoint_every=100", "evaluation.at_start=false", "evaluation.prompts=2",
               "evaluation.samples_per_prompt=2", "evaluation.ks=[1]", f"tracking.uri={store}",
               f"tracking.artifact_location={tmp_path}/artifacts", f"hydra.run.dir={tmp_path}/run"]
    # GNU timeout passes a SIGTERM it receives to its command and to the command's process group.
    first = subprocess.Popen(["timeout", "900", *command], cwd=PROJECT_ROOT, stdout=subprocess.PIPE,
                             stderr=subprocess.STDOUT, text=True)
    events, deadline = tmp_path / "run" / "events.jsonl", time.time() + 300
    while first.poll() is None and time.time() < deadline and \
            not (events.exists() and '"event": "sample"' in events.read_text(errors="replace")):
        time.sleep(0.1)  # the pipeline trains: workers and the raylet are up
    first.send_signal(signal.SIGTERM)
    output, _ = first.communicate(timeout=300)
    assert "marked KILLED" in output, output[-3000:]
    again = subprocess.run(command, cwd=PROJECT_ROOT, capture_output=True, text=True, timeout=600)
    assert again.returncode == 0, (again.stdout + again.stderr)[-3000:]
    mlflow.set_tracking_uri(store)
    runs = mlflow.search_runs(experiment_names=["replay-rloo"])
    assert list(runs["status"]) == ["FINISHED"]
    history = MlflowClient(store).get_metric_history(runs.run_id[0], "train/reward")
    assert sorted(m.step for m in history) == list(range(100))  # every step once: none lost, none twice


def test_sigkill_to_the_driver_and_ray_then_relaunch_resumes_the_same_run(tmp_path):
    """A node failure under runtime=async: the driver, the raylet, the workers and the trainer actor die by
    SIGKILL at once, after a checkpoint. The same command continues the run from that checkpoint (pipeline
    state included) into the same MLflow run: every step logged once, and each redone step's metrics equal
    to those logged before the kill (the tracker compares them, else "RESUME MISMATCH")."""
    import subprocess
    import sys

    import mlflow
    from mlflow.tracking import MlflowClient

    from src.paths import PROJECT_ROOT
    from src.runs.lifecycle import LATEST_CHECKPOINT
    from tests.conftest import kill_tree
    from tests.preemption import relaunch_resumes_the_killed_run

    store = f"sqlite:///{tmp_path}/mlruns.db"
    command = [sys.executable, "-m", "src.run", *WITHOUT_STEPS, "runtime.workers=1", "trainer.steps=8",
               "trainer.checkpoint_every=2", "evaluation.at_start=false", "evaluation.prompts=2",
               "evaluation.samples_per_prompt=2", "evaluation.ks=[1]", f"tracking.uri={store}",
               f"tracking.artifact_location={tmp_path}/artifacts", f"hydra.run.dir={tmp_path}/run"]
    first = subprocess.Popen(command, cwd=PROJECT_ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    checkpoint, deadline = tmp_path / "run" / LATEST_CHECKPOINT, time.time() + 600

    def logged() -> int:  # steps in the store: a third one is past the checkpoint of step 2, redone on resume
        try:
            runs = mlflow.search_runs(experiment_names=["replay-rloo"]) if checkpoint.exists() else []
            return len(MlflowClient(store).get_metric_history(runs.run_id[0], "train/reward")) if len(runs) else 0
        except Exception:  # noqa: BLE001  (the store may be locked by the run's own write: ask again)
            return 0

    mlflow.set_tracking_uri(store)
    while first.poll() is None and time.time() < deadline and logged() < 3:
        time.sleep(0.2)
    assert first.poll() is None, "finished before it could be killed"
    kill_tree(first.pid)
    first.wait(timeout=60)
    relaunch_resumes_the_killed_run(command, store, steps=8)



@pytest.mark.long  # make test-long (docs/testing.md): torchrun's two ranks stay
def test_two_fsdp_trainer_actors_log_the_one_trainer_numbers(compose_config_module, tmp_path, ray_cpus):
    """hardware.ranks=2 under runtime=async: the T = 2 trainer actors train data-parallel (FSDP2, gloo) and log,
    step for step, the metrics and the event log of one trainer actor at T = 2's lockstep rates (float64)."""
    overrides = ("runtime.trainers=2", "trainer.groups_per_step=4", "hardware.dtype=float64")
    (tmp_path / "one").mkdir()
    (tmp_path / "two").mkdir()
    one, one_events = run(compose_config_module, tmp_path / "one", *overrides)
    two, two_events = run(compose_config_module, tmp_path / "two", *overrides, "hardware.ranks=2")
    assert two_events == one_events and len(two.steps) == len(one.steps) == 5
    compared = 0
    for (step, want), (seen_step, got) in zip(one.steps, two.steps):
        assert seen_step == step and got.keys() == want.keys()
        for key, value in want.items():
            if wall_clock(key) or key == "runtime/worker_restarts":
                continue
            assert got[key] == pytest.approx(value, rel=1e-9, abs=1e-12, nan_ok=True), (step, key)
            compared += 1
    assert compared > 100 and len({m["train/loss"] for _, m in one.steps}) == 5
    # the driver's copy, pulled from the ranks' shards at the end (whole weights, AdamW's moments by position)
    want, got = one.parts.optimizer.state_dict(), two.parts.optimizer.state_dict()
    assert got["state"].keys() == want["state"].keys() and int(got["state"][0]["step"]) == 5
    for position, moments in want["state"].items():
        for key in ("step", "exp_avg", "exp_avg_sq"):
            torch.testing.assert_close(got["state"][position][key], moments[key], rtol=1e-9, atol=1e-12)
    for name, tensor in one.parts.policy.state_dict().items():
        torch.testing.assert_close(two.parts.policy.state_dict()[name], tensor, rtol=1e-9, atol=1e-12)


def test_workers_compute_log_pi_ref_once_where_a_buffer_replays_rollouts(compose_config_module, lockstep_w2):
    """With a buffer (a rollout drawn again and again) and the KL term on, a worker computes log pi_ref of its
    rollouts at generation, with the frozen start weights, as the trainer would; the trainer then reads it from the
    group (`Forward.reference_tokens` skips cached rows)."""
    from src.build import build_forward
    from src.batch import Group
    from src.settings import RunSettings

    recorder, _ = lockstep_w2
    groups = [Group(**g) for _, g in recorder.pipeline["pipeline"]["queue"]["groups"]]
    assert groups and all(g.reference_logprobs is not None for g in groups)
    parts = recorder.parts
    forward = build_forward(RunSettings(compose_config_module(*TINY, *FIFO)), parts.tokenizer)
    chunk = [(g.prompt_ids, ids) for g in groups for ids in g.response_ids]

    def under(model) -> torch.Tensor:  # every response token's log-prob under `model`, in this process
        return torch.tensor([value for tokens in forward.sampled_token_logprobs(model, chunk, 1.0) for value in tokens])

    workers = torch.tensor([value for g in groups for tokens in g.reference_logprobs for value in tokens])
    assert torch.allclose(workers, under(parts.reference), atol=1e-5)  # pi_ref's, the start weights
    assert not torch.allclose(workers, under(parts.policy), atol=1e-5)  # not the trained policy's


def test_a_workers_groups_reach_the_buffer_and_trainer_actors_without_the_driver_reading_them(
        compose_config_module, tmp_path, ray_cpus, monkeypatch):
    """The driver reads a group's size, instance and rewards; the group itself goes from the worker's return to the
    buffer actor and the trainer actor by reference: no group is unpickled in this process while the steps run
    (the completions table would bring some: it is off here)."""
    from src.batch import Group

    unpickled = []

    def counted(group, state):  # pickle calls it when it rebuilds a Group in this process (not in the actors)
        unpickled.append(state.get("prompt"))
        group.__dict__.update(state)

    runtime, context, recorder = make_run(compose_config_module, tmp_path, "trainer.steps=3",
                                          "tracking.completions_per_step=0")
    with runtime.session(context) as session:
        monkeypatch.setattr(Group, "__setstate__", counted, raising=False)
        drive(session, recorder)
        assert unpickled == []
        counters = session.pipeline.counters
        assert counters.generated_rollouts > 0 and counters.trained_samples > 0  # groups went through
        monkeypatch.undo()
    # The trainer counted, as fresh evaluations, the workers' groups it read by reference.
    evaluations = [m["budget/fresh_evaluations"] for _, m in recorder.steps]
    assert evaluations == sorted(evaluations) and 0 < evaluations[-1] <= counters.generated_rollouts


def test_log_mu_from_the_engine_trains_as_log_mu_from_the_forward_pass(compose_config_module, tmp_path, lockstep_w2):
    """runtime.behaviour_logprobs=engine: the workers take log mu from generate's own logits, with no second
    forward pass; on the lockstep clock the run draws the same rollouts and logs the same metrics as the forward
    pass's log mu gives, to float32's rounding of the two computations."""
    recorder, events = run(compose_config_module, tmp_path, "runtime.behaviour_logprobs=engine")
    forward, forward_events = lockstep_w2
    assert events == forward_events
    assert [step for step, _ in recorder.steps] == [step for step, _ in forward.steps] == [0, 1, 2, 3, 4]
    for (_, got), (_, expected) in zip(recorder.steps, forward.steps):
        assert got.keys() == expected.keys()
        for key in (key for key in got if not wall_clock(key)):
            assert (math.isnan(got[key]) and math.isnan(expected[key])) or math.isclose(
                got[key], expected[key], rel_tol=1e-3, abs_tol=1e-5), (key, got[key], expected[key])


def test_log_mu_from_the_engine_is_refused_where_it_strays_from_the_forward_pass():
    from src.batch import Group
    from src.runtime.ray_work import check_engine_logprobs

    def group(token_logprobs):
        made = Group(prompt="p", prompt_ids=(1,), truth=None, responses=("a", "b"), response_ids=((2, 3), (4,)),
                     rewards=(1.0, 0.0), step=0)
        return made.with_behaviour_logprobs([sum(t) for t in token_logprobs], None, token_logprobs)

    forward = group([(-1.0, -2.0), (-0.5,)])
    check_engine_logprobs([group([(-1.0 + 1e-5, -2.0), (-0.5,)])], [forward])  # float32's rounding: accepted
    with pytest.raises(ValueError, match=r"runtime.behaviour_logprobs=engine: .* strays 0.01 nats a token .* "
                                         r"use runtime.behaviour_logprobs=forward"):
        check_engine_logprobs([group([(-1.0, -2.0), (-0.49,)])], [forward])


class _Mixed(torch.nn.Module):
    """Parameters of three dtypes, one of an odd byte count, so that a flat chunk must align each tensor."""

    def __init__(self) -> None:
        super().__init__()
        self.dense = torch.nn.Linear(3, 5)
        self.scale = torch.nn.Parameter(torch.randn(3, dtype=torch.bfloat16))  # 6 bytes
        self.table = torch.nn.Parameter(torch.randn(2, 2, dtype=torch.float64))


def test_published_weights_load_bit_for_bit_over_several_chunks_and_dtypes(ray_cpus, monkeypatch):
    from src.policy.model import trainer_weights
    from src.runtime.ray_work import ObjectStoreSync, _NoEngine, unflatten

    torch.manual_seed(0)
    sent, received = _Mixed(), _Mixed()
    monkeypatch.setattr(ObjectStoreSync, "CHUNK_BYTES", 40)
    published = ray.get(ObjectStoreSync.publish(trainer_weights(sent)))
    assert len(published) == 2  # the 6-byte scale, the table at byte 64 and the weight matrix; then the bias
    ObjectStoreSync.load(published, received, _NoEngine())
    for (name, mine), (_, theirs) in zip(sent.named_parameters(), received.named_parameters(), strict=True):
        assert theirs.dtype == mine.dtype and torch.equal(theirs, mine), name
    fetched = ObjectStoreSync.fetch(published)  # a checkpoint's copy: its own memory, which may be written
    fetched["scale"].zero_()
    assert torch.equal(received.scale, sent.scale) and sorted(fetched) == sorted(dict(sent.named_parameters()))

    class Smaller(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.dense = torch.nn.Linear(3, 5)

    with pytest.raises(RuntimeError, match="name scale, which this worker's policy does not have"):
        ObjectStoreSync.load(published, Smaller(), _NoEngine())
    index, flat = ray.get(published[0])
    with pytest.raises(RuntimeError, match="dtype 'os.system' for scale"):
        list(unflatten(([(index[0][0], "os.system", *index[0][2:])], flat)))
