"""The two runtimes of the `runtime` config group: each supplies the steps of `src.run`'s one loop (SPEC 11).

`src.run` owns the loop: progress, logging, history, checkpoints, evaluation, stop signals and the
final save. A runtime opens a session for it (`runtime.session(context)`) and hands back `Steps`:

* `SyncRuntime`: SPEC 3's step in this process (`src.train.collect` then `learn`), or in each rank's
  process over data-parallel ranks, which run the same loop.
* `AsyncRuntime`: a Ray session with W rollout-worker actors, the trainer actor, the buffer actor (the
  rollout queue, `src.runtime.queue_actor.QueueActor`) and the pipeline of the configured schedule,
  which runs in this process and calls the queue through its actor; each `next()` is one trainer step.

The async update runs in the trainer actor (`src.runtime.ray_work.TrainerActor`); this process keeps the
driver's copy of the policy, optimizer and TrainState. The counters come back with every step; the
weights, optimizer state and torch RNG are pulled before a checkpoint (`before_checkpoint`), before an
evaluation (the weights) and when the session closes, so the run's final checkpoint, evaluation and
saved policy are the trained ones. A dead trainer actor or buffer actor raises a PipelineError and
leaves no checkpoint behind.

A runtime's own state rides in the checkpoint under "runtime" (`state_dict`, `load_state_dict`): for
async, the rollout queue (its state, taken from the buffer actor) with every rollout's metadata, the
pipeline's counters, the lockstep clock and the groups in flight, with the settings it must resume
under; the trainer, optimizer, sampler and RNG states are the checkpoint's own (`src.runs.checkpoint`).
"""

from __future__ import annotations

import inspect
import json
import logging
import math
from contextlib import contextmanager
from typing import Iterator

from src.buffer.store import age_window, batch_rollouts
from src.validate.checks import check_choice, check_int
from src.runtime.pipeline import (SCHEDULES, FreePipeline, LockstepPipeline, Pipeline, PipelineError,
                                  PipelineSettings)
from src.settings import RunSettings
from src.runtime.base import RunContext, Runtime, StepOutcome, Steps
from src.variant import Knob, described, float_knob, int_knob

log = logging.getLogger(__name__)
EVENT_LOG = "events.jsonl"
# conf/config.yaml's default `clip: loose` (conf/clip/loose.yaml): the ceiling version-1 async cell ids assumed.
DEFAULT_CLIP_CEILING = 10.0


class SyncSteps(Steps):
    """SPEC 3's steps in this process: collect, then learn (`src.train`)."""

    def __init__(self, context: RunContext) -> None:
        self.parts, self.state = context.parts, context.state
        self.completion_counts = context.run.tracking.completion_counts

    def next(self) -> StepOutcome:
        from src.train import collect, learn, picked_completions

        collection = collect(self.parts, self.state.step)
        metrics, counts = learn(self.parts, self.state, collection)  # = train_step, counted by the loop
        return StepOutcome(metrics, counts, picked_completions(collection, self.completion_counts))



class SyncRuntime(Runtime):
    """`runtime=sync`: SPEC 3's step in the process of the loop (or of each rank); no state of its own."""

    ranks_run_the_loop = True

    @classmethod
    def plain(cls, node) -> bool:
        return True

    def __init__(self, name: str = "sync", run: RunSettings | None = None) -> None:
        self.name = name

    @contextmanager
    def session(self, context: RunContext) -> Iterator[SyncSteps]:
        yield SyncSteps(context)

    def state_dict(self) -> dict | None:
        return None

    def load_state_dict(self, saved: dict | None) -> None:
        if saved is not None:
            raise ValueError("runtime=sync: this checkpoint holds an asynchronous pipeline's state; resume it with "
                             f"runtime=async ({saved.get('signature', '?')})")


def check_address(address: str | None) -> str | None:
    """`runtime.address`: a running Ray cluster's head as host:port, or None (a session of this node's own)."""
    if address is None:
        return None
    host, _, port = str(address).rpartition(":")
    if not host or not port.isdigit():
        raise ValueError(f"runtime.address={address}: give the Ray cluster head's host:port (e.g. 10.1.2.3:6379, "
                         "as `python -m src.runtime.ray_cluster start` prints it), or null for a session on this node")
    return str(address)


def worker_gpus(workers: int, per_worker: float, device: str) -> int:
    """The GPUs Ray hands the W workers (0 on the CPU), refused with the fix unless the trainer keeps its own.

    `ray.init(num_gpus=n)` makes Ray's GPU slots the first n devices this process sees, and gives each
    worker actor its slot as CUDA_VISIBLE_DEVICES (ray/_private/worker.py:1158-1161 in Ray 2.60), so
    the workers hold cuda:0..n-1 and the trainer must sit at cuda:n or above: the trainer actor, which
    holds no Ray GPU slot and so sees this process's devices (Ray 2.60 sets no CUDA_VISIBLE_DEVICES for
    an actor without GPUs, ray/_private/utils.py set_visible_accelerator_ids), and this process's
    evaluation copy of the policy.
    """
    if per_worker < 0 or per_worker > 8:
        raise ValueError(f"runtime.gpus_per_worker={per_worker:g}: a worker's GPU share must lie in [0, 8] "
                         "(1: one GPU each; 0: workers on the CPU)")
    on_cuda = device.startswith("cuda")
    if not on_cuda:
        if per_worker:
            raise ValueError(f"runtime.gpus_per_worker={per_worker:g} with hardware.device={device}: GPU workers need a "
                             "CUDA trainer; set runtime.gpus_per_worker=0, or hardware=h100x8 on a GPU node")
        return 0
    if not per_worker:
        raise ValueError(f"runtime=async with hardware.device={device} and runtime.gpus_per_worker=0: each worker "
                         "needs a GPU of its own; set runtime.gpus_per_worker=1 (hardware=h100x8: W <= 7)")
    needed = math.ceil(workers * per_worker - 1e-9)
    written = device.partition(":")[2]  # `cuda:K` names device K; a bare `cuda` none
    index = int(written) if written else None
    if index is not None and index < needed:  # a bare `cuda` is placed after them (`AsyncRuntime.trainer_device`)
        raise ValueError(f"hardware.device={device} with runtime.workers={workers} x runtime.gpus_per_worker="
                         f"{per_worker:g}: the workers hold cuda:0..{needed - 1}; put the trainer after them "
                         f"(hardware.device=cuda:{needed}) or run fewer workers")
    return needed


# Where a worker's log mu comes from (SPEC 11): the trainer's forward code, or the engine's sampled-token log-probs,
# checked against it on each worker's first request.
MU_SOURCES = ("forward", "engine")


def bounds_as_version_1(eta: int | None, window: int | None) -> dict:
    """The workers' bound eta and the age window as version 1 spelled them: the window as staleness=L with
    staleness_mode=drop, exclusive of eta (staleness_mode=block); both at once name the window apart."""
    if window is None:
        return {"staleness": eta, "staleness_mode": "block"}
    if eta is None:
        return {"staleness": window, "staleness_mode": "drop"}
    return {"staleness": eta, "staleness_mode": "block", "max_age": window}


def staleness_text(settings: PipelineSettings) -> str:
    """The bounds in a checkpoint's signature, as version 1 wrote them (`eta=2 drop`: a window of 2)."""
    spelled = bounds_as_version_1(settings.staleness, settings.max_age)
    window = f" max_age={spelled['max_age']}" if "max_age" in spelled else ""
    return f"eta={spelled['staleness']} {spelled['staleness_mode']}{window}"


class AsyncRuntime(Runtime):
    """`runtime=async`: seed 001's pipeline of W workers, one queue and the trainer, on Ray."""

    step_replays = False  # the buffer option's rollout queue replays; the trainer's step keeps nothing

    @classmethod
    def gpus_needed(cls, node, ranks: int, device: str, nodes: int = 1) -> int:
        """On one node the workers' Ray GPU slots come first (`worker_gpus`), the trainer's ranks after them; over
        several, one GPU for the driver's copy beside the workers' and the ranks' (`trainer_device`)."""
        if not device.startswith("cuda"):
            return ranks
        index = device.partition(":")[2]
        workers = math.ceil(node.workers * node.gpus_per_worker - 1e-9)
        if nodes > 1:
            return 1 + workers + ranks
        return (int(index) if index else workers) + ranks

    knobs = {"workers": int_knob(1, 1_024, "2"), "trainers": int_knob(1, 1_024, "1"),
             "sync_every": int_knob(1, 100_000, "1"), "mu": float_knob(0, 1e6, "5.28", low_open=True),
             "worker_cost": float_knob(0, 1e6, "2.0 or null", low_open=True, nullable=True),
             "trainer_cost": float_knob(0, 1e6, "1.0", low_open=True),
             "staleness": int_knob(0, 100_000, "4 or null", nullable=True), "depth": int_knob(1, 64, "8"),
             "groups_per_request": int_knob(1, 65_536, "4"), "num_cpus": int_knob(1, 4_096, "2"),
             "worker_threads": int_knob(1, 1_024, "1"), "max_restarts": int_knob(-1, 1_000, "3 (-1: without limit)"),
             "gpus_per_worker": float_knob(0, 8, "1 (0: workers on the CPU)"),
             "behaviour_logprobs": Knob("text", example="forward (or engine)", id_omitted_at=("forward",)),
             "address": Knob("text", nullable=True, example="10.1.2.3:6379 (a running cluster's head) or null")}

    @classmethod
    def cell_label(cls, node, cfg) -> str:
        """Seed 001's pipeline: e.g. -W6T2-N252 (buffer=fifo), -W1T1-lifo (buffer=none); -c1 where the clip
        ceiling names the cell (`names_clip`)."""
        kind, arguments = cls.rollout_queue(cfg, node)
        clip = f"-c{cfg.clip.ceiling:g}" if cls.names_clip(cfg) else ""
        return f"-W{node.workers}T{node.trainers}-{kind.label(arguments)}{clip}"

    @staticmethod
    def names_clip(cfg) -> bool:
        """Whether the clip ceiling enters the cell's id and name: where the loss reads it (eq. 2 weighs every stale
        rollout, LIFO's too) at a ceiling other than the default one, at which version-1 ids left it out."""
        reads = getattr(described(cfg.loss), "reads_clip", False)
        return reads and float(cfg.clip.ceiling) != DEFAULT_CLIP_CEILING

    @classmethod
    def reader_label(cls, node, cfg) -> str:
        return f"async {cls.rollout_queue(cfg, node)[0].name} W={node.workers} T={node.trainers}"

    @staticmethod
    def rollout_queue(cfg, node) -> tuple[type, dict]:
        """The run's rollout queue: the `buffer` option's form under this runtime (`ReplayStore.rollout_queue`)."""
        return described(cfg.buffer).rollout_queue(cfg.buffer, int(node.trainers))

    @classmethod
    def store_label(cls, node, cfg, reader: bool = False) -> str:
        """The store's part of the cell name: none of its own, as the runtime's label names the queue (-N252, -lifo)
        and the pipeline's schedule, not rho, sets the reuse; for readers, the pipeline."""
        return "Seed 001 pipeline" if reader else "rho0"

    @classmethod
    def identity(cls, resolved: dict, cfg) -> dict:
        """The cell's config as cell ids of version 1 spelled it: the queue's settings under `runtime` (queue,
        capacity, independent, positive_bias, sharded, batch_rollouts, and the age window as
        `staleness_mode=drop`) and no buffer, so every async cell keeps its id; and no clip but where it names the
        cell (`names_clip`), so cells that differ in what eq. 2 weighs differ in id."""
        kind, arguments = cls.rollout_queue(cfg, cfg.runtime)
        runtime = dict(resolved["runtime"])
        runtime.update(queue=kind.name, capacity=arguments["capacity"],
                       independent=arguments.get("mode") == "with_replacement",
                       positive_bias=arguments.get("positive_bias", 0.0),
                       sharded=bool(cfg.buffer.get("sharded", False)),
                       batch_rollouts=cfg.buffer.get("batch_rollouts"),
                       **bounds_as_version_1(cfg.runtime.staleness, age_window(cfg.buffer)))
        # A queue's further settings (buffer=rlep's pool, a FIFO's at_least_once) name its cells too; `sharded`
        # already gives shards, `independent` the two modes version 1 had.
        version_1 = ("shards",) + (("mode",) if arguments.get("mode") != "at_least_once" else ())
        runtime.update({key: value for key, value in arguments.items() if key not in (*runtime, *version_1)})
        dropped = ("buffer",) if cls.names_clip(cfg) else ("buffer", "clip")
        return {**{key: value for key, value in resolved.items() if key not in dropped}, "runtime": runtime}

    @classmethod
    def trainer_device(cls, node, run: RunSettings) -> str:
        """A bare `hardware.device=cuda` puts the trainer (its rank 0) on the first GPU after the workers' Ray
        slots (`worker_gpus`), so one node preset (hardware=h100x8) serves both runtimes; `cuda:K` stays K. Over
        several nodes the driver's copy alone holds the first node's GPU 0, which the cluster leaves out, and
        every worker and trainer rank a GPU Ray gives it (`src.runtime.ray_work.start_trainers`)."""
        device = run.hardware.device
        if device != "cuda":
            return device
        if run.hardware.nodes > 1:
            return "cuda:0"
        return f"cuda:{worker_gpus(int(node.workers), float(node.gpus_per_worker), device)}"

    @classmethod
    def budget_plan(cls, node, run: RunSettings):
        from src.runtime.plan import async_budget_plan  # its lockstep schedule decides the fresh budget

        return async_budget_plan(run)

    def __init__(self, run: RunSettings, name: str = "async", workers: int = 2, trainers: int = 1,
                 sync_every: int = 1, schedule: str = "lockstep", mu: float = 4.0, worker_cost: float | None = None,
                 trainer_cost: float = 1.0, staleness: int | None = None, depth: int = 8, groups_per_request: int = 1,
                 num_cpus: int = 2, worker_threads: int = 1,
                 max_restarts: int = 3, gpus_per_worker: float = 0.0, behaviour_logprobs: str = "forward",
                 address: str | None = None) -> None:
        self.run, self.name = run, name
        self.address = check_address(address)
        self.saved: dict | None = None     # the pipeline's state from a checkpoint, or when its session closed
        self.live: AsyncSession | None = None
        self.schedule = check_choice("runtime.schedule", schedule, SCHEDULES)
        buffer = run.groups["buffer"]
        self.settings = PipelineSettings(
            workers=check_int("runtime.workers", workers, 1), trainers=check_int("runtime.trainers", trainers, 1),
            batch=batch_rollouts(buffer, run.trainer), group_size=run.trainer.group_size,
            sync_every=check_int("runtime.sync_every", sync_every, 1),
            staleness=None if staleness is None else check_int("runtime.staleness", staleness, 0),
            max_age=age_window(buffer), mu=float(mu), worker_cost=worker_cost, trainer_cost=float(trainer_cost),
            depth=check_int("runtime.depth", depth, 1),
            groups_per_request=check_int("runtime.groups_per_request", groups_per_request, 1))
        self.queue_kind, self.queue_arguments = described(buffer).rollout_queue(buffer, self.settings.trainers)
        self.num_cpus = check_int("runtime.num_cpus", num_cpus, 1, "Ray's CPU slots (e.g. 2).")
        self.worker_threads = check_int("runtime.worker_threads", worker_threads, 1)
        self.max_restarts = check_int("runtime.max_restarts", max_restarts, -1)
        self.gpus_per_worker = float(gpus_per_worker)
        self.engine_logprobs = check_choice("runtime.behaviour_logprobs", behaviour_logprobs, MU_SOURCES) == "engine"
        if self.engine_logprobs and run.policy.engine != "hf":
            raise ValueError(f"runtime.behaviour_logprobs=engine with policy.engine={run.policy.engine}: log mu from the "
                             "engine reads the HF engine's logits; use runtime.behaviour_logprobs=forward")
        self.worker_gpus = worker_gpus(self.settings.workers, self.gpus_per_worker, run.hardware.device)
        self.trainer_ranks = run.hardware.ranks  # T trainer actors training data-parallel, or one
        self._check(run.groups)
        # The queue checks its own settings; `ready` refuses a batch that does not split over the shards.
        self.build_queue(seed=0).ready(self.settings.batch)

    def _check(self, groups: dict) -> None:
        s = self.settings
        if self.trainer_ranks > 1 and self.trainer_ranks != s.trainers:
            raise ValueError(f"hardware.ranks={self.trainer_ranks} with runtime.trainers={s.trainers}: under "
                             "runtime=async the ranks are the T trainer actors; set runtime.trainers="
                             f"{self.trainer_ranks}, or hardware.ranks=1 for one trainer at T's lockstep rates")
        if s.trainers > 1 and self.schedule != "lockstep":
            raise ValueError(f"runtime.trainers={s.trainers} with runtime.schedule={self.schedule}: T > 1 runs on the "
                             "lockstep clock only (its rates count T; T trainer actors are untested without it); use "
                             "runtime.schedule=lockstep or trainers=1")
        capacity, replays, bound = self.queue_arguments["capacity"], self.queue_kind.replays, self.queue_kind.bound
        if capacity < s.batch:
            raise ValueError(f"{bound} N={capacity} < B = {s.batch} rollouts a batch (buffer.batch_rollouts, "
                             "or trainer.groups_per_step x trainer.group_size): the trainer would wait forever; raise "
                             f"{bound} to >= {s.batch}")
        if not replays and capacity < s.batch + s.request_rollouts:
            raise ValueError(f"buffer={groups['buffer'].get('name')} with {bound} N={capacity} under runtime=async: "
                             "workers wait while the LIFO queue holds N, so N must fit a batch and a request in "
                             f"flight (>= {s.batch + s.request_rollouts})")
        if replays and s.staleness is not None and s.max_age is None:
            raise ValueError(f"runtime.staleness={s.staleness} with buffer=fifo: eta only bounds how far generation "
                             "runs ahead of the trainer, not the age of what the trainer reads from a buffer (which "
                             f"keeps rollouts N/R steps); bound that with buffer.max_age={s.staleness} (rollouts "
                             "older are dropped), or use buffer=none")
        # The components say whether they fit the pipeline; their YAML names only label the message.
        sampling, behaviour = groups["sampling"], groups["behaviour"]
        if not (described(sampling).plain(sampling) and described(behaviour).plain(behaviour)):
            raise ValueError(f"sampling={sampling.get('name')}, behaviour={behaviour.get('name')} with "
                             "runtime=async: workers generate each request's groups once, with the published weights; "
                             "use sampling=standard and behaviour=current")

    def signature(self) -> str:
        """The settings a checkpoint must agree on to resume."""
        s, queue = self.settings, self.queue_arguments
        mode = queue.get("mode")
        independent = f"independent={mode == 'with_replacement'}" + (f" mode={mode}" if mode == "at_least_once" else "")
        return (f"{self.queue_kind.name} N={queue['capacity']} delta={queue.get('positive_bias', 0.0):g} "
                f"{independent} shards={queue.get('shards', 1)} "
                f"{self.schedule} W={s.workers} T={s.trainers} B={s.batch} sync_every={s.sync_every} mu={s.mu:g} "
                f"worker_cost={s.worker_cost} trainer_cost={s.trainer_cost:g} {staleness_text(s)} "
                f"g={s.groups_per_request}")

    def queue_arguments_for(self, task) -> dict:
        """The queue's arguments, with what `task` counts as correct where the queue keeps correct rollouts (the
        FIFO's positive bias), as the synchronous store gets it (`src.build.build_store`)."""
        takes = task is not None and "correct_reward" in inspect.signature(self.queue_kind).parameters
        return {**self.queue_arguments, **({"correct_reward": task.correct_reward} if takes else {})}

    def build_queue(self, seed: int | None = None, task=None):
        """The run's rollout queue in this process (default seed: the run's)."""
        return self.queue_kind(**self.queue_arguments_for(task), seed=self.run.trainer.seed if seed is None else seed)

    def build_pipeline(self, work, queue=None) -> Pipeline:
        """The pipeline of the configured schedule around `queue` (default: the run's queue in this process;
        on Ray, `AsyncSession` hands it the queue's actor)."""
        queue = self.build_queue() if queue is None else queue
        kind = LockstepPipeline if self.schedule == "lockstep" else FreePipeline
        return kind(self.settings, queue, work)

    def state_dict(self) -> dict | None:
        """The pipeline's state for the checkpoint: the running session's, or the last one's."""
        saved = self.live.snapshot() if self.live is not None else self.saved
        return None if saved is None else {"signature": self.signature(), **saved}

    def load_state_dict(self, saved: dict | None) -> None:
        """A checkpoint's pipeline state, which the next session resumes; refused under other settings."""
        if saved is None:
            raise ValueError("runtime=async: this checkpoint holds no pipeline state (a synchronous run's, or one "
                             "whose trainer died); resume it with the runtime it started with")
        if saved["signature"] != self.signature():
            raise ValueError(f"the checkpoint's pipeline ran with {saved['signature']!r}, this run's is "
                             f"{self.signature()!r}; resume with the same runtime settings")
        self.saved = {key: value for key, value in saved.items() if key != "signature"}

    def serves(self, run, error=ValueError) -> bool:
        """In a SLURM job over several nodes (`hardware.nodes`), a task on a further node joins the Ray cluster the
        first node's task starts (`src.runtime.ray_cluster.serve_node`) and serves until the run ends there."""
        from src.runtime.ray_cluster import serve_node, slurm_allocation

        allocation = slurm_allocation()
        if allocation is None or allocation.index == 0:
            return False
        self._check_allocation(allocation, run, error)
        serve_node(allocation, self.node_cpus(allocation.nodes))
        return True

    @contextmanager
    def joined(self, run, error=ValueError) -> Iterator["AsyncRuntime"]:
        """One driver; in a SLURM job over several nodes, the driver of a Ray cluster over them, started here on the
        first node and stopped with the run (the pipeline then joins it by address, as `runtime.address` does)."""
        from src.runtime.ray_cluster import lead_cluster, slurm_allocation

        allocation = slurm_allocation()
        if allocation is None:
            if run.hardware.nodes > 1:
                raise error(f"hardware.nodes={run.hardware.nodes} with runtime=async outside a SLURM job of as many "
                            "nodes: launch it with hydra/launcher=submitit_slurm hydra.launcher.nodes="
                            f"{run.hardware.nodes} hydra.launcher.tasks_per_node=1, or join a running cluster with "
                            "runtime.address and hardware.nodes=1 (docs/async.md)")
            with super().joined(run, error):
                yield self
            return
        self._check_allocation(allocation, run, error)
        device = run.hardware.device  # the driver's copy's GPU (`trainer_device`): the cluster leaves it out
        driver_gpu = int(device.partition(":")[2] or 0) if device.startswith("cuda") else None
        with lead_cluster(allocation, self.node_cpus(allocation.nodes), driver_gpu) as self.address:
            yield self

    def node_cpus(self, nodes: int) -> int:
        """The CPU slots each node of a cluster offers: `runtime.num_cpus` counts the cluster's, as the actors'
        shares do (a worker or trainer asks num_cpus / (W + 1))."""
        return max(1, self.num_cpus // nodes)

    def _check_allocation(self, allocation, run, error=ValueError) -> None:
        if (allocation.nodes, allocation.tasks) != (run.hardware.nodes, run.hardware.nodes) or self.address:
            raise error(f"hardware.nodes={run.hardware.nodes} with runtime=async in a SLURM job of "
                        f"{allocation.nodes} nodes and {allocation.tasks} tasks: the run starts a Ray cluster with "
                        "one task a node; set hydra.launcher.nodes=hardware.nodes, hydra.launcher.tasks_per_node=1 "
                        "and no runtime.address")

    @contextmanager
    def session(self, context: RunContext) -> Iterator["AsyncSession | SyncSteps"]:
        """A Ray session for the run's remaining trainer steps; none is started when no step remains."""
        import torch  # here, so that describing the runtime (the config checks) loads no model library

        from src.runtime.ray_session import ray_session

        if context.state.step >= context.run.trainer.steps:
            yield SyncSteps(context)  # never asked for a step
            return
        device = torch.device(context.run.hardware.device)
        last = (device.index or 0) + self.trainer_ranks - 1  # the last trainer rank's GPU, on one node
        if self.worker_gpus and not self.address and last >= torch.cuda.device_count():
            raise PipelineError(f"hardware.device={device} with {self.worker_gpus} GPU workers and "
                                f"{self.trainer_ranks} trainer rank(s): this node shows {torch.cuda.device_count()} "
                                f"GPUs; ask SLURM for {last + 1} (hardware=h100x8) or run fewer workers")
        with ray_session(self.num_cpus, self.worker_gpus, self.address):
            session = AsyncSession(self, context)
            try:
                yield session
            finally:
                session.close()


class AsyncSession(Steps):
    """One run of the pipeline within a Ray session: workers, trainer, buffer actor, pipeline and event log,
    handing the loop one trainer step at a time."""

    def __init__(self, runtime: AsyncRuntime, context: RunContext) -> None:
        from src.runtime.queue_actor import QueueActor
        from src.runtime.ray_work import RayWork

        self.runtime, self.context = runtime, context
        settings = runtime.settings
        cpus = runtime.num_cpus / (settings.workers + 1)  # a share for each worker and the trainer actor
        self.work = RayWork(context.run, context.parts, context.state, settings, runtime.max_restarts,
                            runtime.worker_threads, cpus, runtime.gpus_per_worker, runtime.trainer_ranks,
                            runtime.queue_kind.replays, runtime.engine_logprobs)
        self.queue = QueueActor(runtime.queue_kind, {**runtime.queue_arguments_for(context.parts.task),
                                                     "seed": context.run.trainer.seed})
        self.pipeline = runtime.build_pipeline(self.work, self.queue)
        self.events_path = context.output_dir / EVENT_LOG
        self.placement_path = context.output_dir / "ray_placement.json"  # where the actors run, this session
        placement = self.work.placement()
        self.placement_path.write_text(json.dumps(placement, indent=1))
        log.info("Ray session of %d node(s): %d worker(s) on %d of them", placement["nodes"],
                 len(placement["worker_nodes"]), placement["workers_over_nodes"])
        self._restore(runtime.saved)
        runtime.live = self

    def _restore(self, saved: dict | None) -> None:
        state, counters = self.context.state, self.pipeline.counters
        if saved is None:  # a new run: the workers start from the trainer's weights as its current version
            counters.version = counters.published = state.step
            self.work.publish(state.step)
            self.events_written = 0
            self.events_path.write_text("")
            return
        self.pipeline.load_state_dict(saved["pipeline"])
        counters = self.pipeline.counters
        if saved.get("published_weights") is not None:
            self.work.publish_weights(counters.published, saved["published_weights"])
        else:
            self.work.publish(counters.published)
        self.events_written = int(saved["events_written"])
        self._truncate_event_log(self.events_written)
        if isinstance(self.pipeline, FreePipeline):
            self.pipeline.resume_in_flight()

    def _truncate_event_log(self, lines: int) -> None:
        kept = self.events_path.read_text().splitlines()[:lines] if self.events_path.exists() else []
        self.events_path.write_text("".join(line + "\n" for line in kept))

    def snapshot(self) -> dict:
        """The pipeline's state for the checkpoint (the weights the workers load too, while they lag)."""
        self._write_events()
        counters = self.pipeline.counters
        lagging = counters.published != counters.version
        return {"pipeline": self.pipeline.state_dict(), "events_written": self.events_written,
                "published_weights": self.work.published_state() if lagging else None}

    def next(self) -> StepOutcome:
        """One trainer step of the pipeline; after the run's last one, the run's artifacts."""
        metrics = self.pipeline.next_step()
        self._write_events()
        if self.context.state.step + 1 >= self.context.run.trainer.steps:  # the loop counts this step on return
            self.log_artifacts()
        return StepOutcome(metrics, self.work.last_counts, self.work.last_completions)

    def before_checkpoint(self) -> None:
        self.work.pull()  # the checkpoint's policy and optimizer are the trainer actor's

    def before_evaluation(self) -> None:
        self.work.pull(optimizer=False)

    def _write_events(self) -> None:
        events = self.pipeline.take_events()
        with open(self.events_path, "a") as handle:
            for event in events:
                handle.write(json.dumps(event, sort_keys=True) + "\n")
        self.events_written += len(events)

    def log_artifacts(self) -> None:
        """The event log and Figure 2's distributions over the whole run, as artifacts of the MLflow run."""
        counters = self.pipeline.counters
        # Rollouts still queued at the end count their uses so far as final.
        distributions = {
            "settings": self.runtime.signature(), **self.pipeline.queue.distributions(),
            "generated_rollouts": counters.generated_rollouts, "trained_samples": counters.trained_samples,
            "steps": counters.version}
        path = self.context.output_dir / "runtime_distributions.json"
        path.write_text(json.dumps(distributions, indent=1, default=_json_number))
        for artifact in (self.events_path, path, self.placement_path):
            self.context.log_artifact(artifact)

    def close(self) -> None:
        """Bring the driver's policy, optimizer and RNG up to the trainer actor's and keep the last snapshot: the
        run's final (or stop) checkpoint and evaluation come after Ray stops.

        A dead trainer leaves the driver's copy stale: its PipelineError ends the run without a checkpoint."""
        runtime = self.runtime
        try:
            runtime.live = None
            if self.work.trainer_dead:
                runtime.saved = None
            else:
                self.work.pull()
                runtime.saved = self.snapshot()
        except PipelineError:  # the buffer actor died: no snapshot of a queue that is gone
            runtime.saved = None
            raise
        except Exception as error:  # noqa: BLE001  (a failed run still ends; its last checkpoint stands)
            log.warning("could not snapshot the pipeline at the end (%s); the last checkpoint stands", error)
            runtime.saved = None
        finally:
            self.work.close()
            self.queue.close()


def _json_number(value):
    return None if isinstance(value, float) and math.isnan(value) else str(value)


__all__ = ["AsyncRuntime", "PipelineError", "RunContext", "StepOutcome", "SyncRuntime"]
