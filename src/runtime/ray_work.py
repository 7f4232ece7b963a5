"""The pipeline's real work on Ray (SPEC 11): rollout-worker actors, the trainer actor, and weight sync.

* `RolloutWorker` (a Ray actor, one per worker): its own policy copy and rollout engine (HF
  generate on the CPU; `policy.engine=vllm` builds the vLLM engine instead), the run's
  behaviour, sampling component and forward helper built by `src.build` from the same config. For
  a request it loads the published weights if it holds another version, generates and scores the
  group (`StandardSampling.generate_groups`) and computes log mu under those weights with the
  trainer's forward code: what the trainer reads. Where the run's queue replays rollouts and the KL
  term is on, it also computes log pi_ref, once per rollout, under a frozen copy of the start weights.
  The advantages the trainer computes itself, from the group's K rewards, which generation fixed
  (seed 001 D.2's generation-time advantage).
* `ObjectStoreSync`: the trainer publishes its weights on the object store, in chunks of up to 256 MiB
  (over T ranks each parameter gathered whole in turn, `trainer_weights`, so no process holds a second
  whole model); every worker loads them into its policy chunk by chunk and hands them to its engine
  (`engine.sync_weights`: the vLLM engine's in-place `load_weights`). Another transfer (vLLM's NCCL
  weight transfer) is another class with the same two methods.
* `TrainerActor` (Ray actors, one a trainer rank): the policy, optimizer, reference and objective, built
  by `src.build.build_components` from the same config as the driver's, updated with the step's own
  `learn` half on a `StepBatch` it makes of the drawn rollouts, which Ray hands it from the buffer
  actor; it publishes its weights itself (the free schedule: in the same call, right after the update). With
  `hardware.ranks` = T > 1 the T actors train data-parallel (FSDP2) over their own process group.
  On CUDA and one node rank r sits at `hardware.device` + r, after the workers' GPUs; on a cluster of several
  nodes each rank holds a GPU Ray gives it, on any node (`start_trainers`).
* `RayWork`: the `src.runtime.pipeline.Work` the pipelines drive, in the driver process (`src.run`'s
  loop), where the pipeline itself runs; the rollout queue it puts into and draws from is the buffer
  actor (`src.runtime.queue_actor.QueueActor`). A group goes from a worker to the buffer actor, and to
  the trainer actor, which counts it as a fresh evaluation, as an object reference: the driver reads
  only its size, its instance and its rewards (its prompt sampler hears them). A drawn batch goes from
  the buffer actor to the trainer actor as an object reference, and the driver reads only each sample's
  off-policiness and steps since its last use. It picks each request's prompt from the run's prompt
  sampler (in event order, so the lockstep schedule is reproducible), tells the sampler each group's
  rewards, starts each update on the trainer actor and takes back the step's metrics, what it adds to
  the driver's counters and the completions the run logs (picked in the actor). The driver's policy,
  optimizer and torch RNG are its copy for checkpoints and evaluation: `pull` brings them up to the
  actor's on demand (before a checkpoint, an evaluation and the run's end), not every step; the actor
  starts from the driver's (a resumed run: the checkpoint's), so the same seed gives the same metrics as
  a trainer in the driver would. A dead trainer is not restarted (its updates since the checkpoint are
  gone): the run stops with one line and resumes from its checkpoint when relaunched.

A request's sampling seed derives from (run seed, request key), so a group does not depend on
which worker generated it, and a retried request (a worker restarted by Ray's `max_restarts`)
generates the same group again.
"""

from __future__ import annotations

import logging
import math
import os
import time
import warnings
import dataclasses
from dataclasses import dataclass

import numpy as np
import ray
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy
import torch
from ray.exceptions import RayActorError

from src.batch import Batch, BatchGroup, Group, StepCounts, TrainState
from src.components import Components
from src.policy.model import trainer_names, trainer_weights
from src.runtime.pipeline import Generated, PipelineError, PipelineSettings
from src.runtime.queue_actor import Stored
from src.runtime.ray_cluster import free_port
from src.runtime.ray_session import first_line
from src.runtime.weight_board import WeightBoard
from src.buffer.rollouts import Sample
from src.sampling.collection import FreshGroups
from src.settings import RunSettings
from src.train import StepBatch, learn, picked_completions

log = logging.getLogger(__name__)


def request_seed(base_seed: int, key: int) -> int:
    """The sampling seed of request `key`: a hash of (run seed, key), the same on every worker and machine."""
    return int(np.random.SeedSequence([int(base_seed), int(key), 29]).generate_state(1)[0])


# The dtypes a published chunk may name. An index read back from the object store names its dtype as text, which is
# looked up here, never evaluated.
WEIGHT_DTYPES = {str(dtype).removeprefix("torch."): dtype for dtype in
                 (torch.float32, torch.bfloat16, torch.float16, torch.float64)}
CHUNK_ALIGN = 64  # bytes: each tensor starts at a multiple, so a view of any dtype above lines up


class ObjectStoreSync:
    """Weight sync through Ray's object store: the weights put once, in chunks, and every worker loads the same
    objects. A chunk is one flat byte array and its index (name, dtype, shape, offset a tensor): Ray puts a numpy
    array out of band and a worker reads it where it lies, where a dict of tensors is pickled one tensor at a time
    (`python -m benchmarks.weight_sync`, figures in docs/async.md, "Weight sync"). A put costs about 1 ms whatever
    its size on this project's CPU machine, so a chunk holds up to `CHUNK_BYTES` of parameters: one object for a
    small policy, and bounded memory for a large one."""

    CHUNK_BYTES = 256 << 20

    @staticmethod
    def publish(weights, lead: bool = True) -> ray.ObjectRef | None:
        """`weights` (name, tensor) one at a time (`trainer_weights`: every rank gathers each in turn), put on the
        object store by the `lead` rank a chunk of up to CHUNK_BYTES at a time; the published object lists the
        chunks."""
        chunks, named, size = [], [], 0
        for name, tensor in weights:
            if not lead:
                continue
            named.append((name, tensor.detach()))
            size += tensor.numel() * tensor.element_size()
            if size >= ObjectStoreSync.CHUNK_BYTES:
                chunks.append(ray.put(flat_chunk(named)))
                named, size = [], 0
        if named:
            chunks.append(ray.put(flat_chunk(named)))
        return ray.put(chunks) if lead else None

    @staticmethod
    def fetch(published: list) -> dict[str, torch.Tensor]:
        """The published tensors themselves, copied out of the object store (a checkpoint keeps them for workers
        that lag the trainer)."""
        return {name: tensor.clone() for ref in published for name, tensor in unflatten(ray.get(ref))}

    @staticmethod
    @torch.no_grad()
    def load(published: list, policy: torch.nn.Module, engine) -> None:
        """Into `policy` one chunk at a time (a tied head shares its embedding's), then into its engine."""
        parameters, loaded = dict(trainer_names(policy)), set()
        for ref in published:
            for name, tensor in unflatten(ray.get(ref)):
                if name not in parameters:
                    raise RuntimeError(f"published weights name {name}, which this worker's policy does not have: "
                                       "a worker of another policy?")
                parameters[name].copy_(tensor)
                loaded.add(name)
        if loaded != set(parameters):
            raise RuntimeError(f"published weights lack {sorted(set(parameters) - loaded)[:3]}...: a worker of "
                               "another policy?")
        engine.sync_weights(policy)  # HF: the same module; vLLM: in-place load_weights


def flat_chunk(named: list[tuple[str, torch.Tensor]]) -> tuple[list[tuple], np.ndarray]:
    """Tensors as one byte array on the CPU (gathered on their device, then copied over at once) and its index."""
    index, offset = [], 0
    for name, tensor in named:
        index.append((name, str(tensor.dtype).removeprefix("torch."), tuple(tensor.shape), offset))
        offset += -(-tensor.numel() * tensor.element_size() // CHUNK_ALIGN) * CHUNK_ALIGN
    flat = torch.empty(offset, dtype=torch.uint8, device=named[0][1].device)
    for (_, tensor), (_, _, _, start) in zip(named, index):
        data = tensor.reshape(-1).view(torch.uint8)
        flat[start:start + data.numel()].copy_(data)
    return index, flat.cpu().numpy()


def unflatten(chunk: tuple[list[tuple], np.ndarray]):
    """(name, tensor) of a chunk, each a view of its byte array (read-only where it lies in the object store: the
    caller copies out of it)."""
    index, flat = chunk
    with warnings.catch_warnings():  # torch warns of a read-only array once; nothing here writes to it
        warnings.filterwarnings("ignore", message="The given NumPy array is not writable")
        data = torch.from_numpy(flat)
    for name, dtype, shape, start in index:
        if dtype not in WEIGHT_DTYPES:
            raise RuntimeError(f"published weights name dtype {dtype!r} for {name}; known: {sorted(WEIGHT_DTYPES)}")
        kind = WEIGHT_DTYPES[dtype]
        yield name, data[start:start + math.prod(shape) * kind.itemsize].view(kind).view(shape)


class _Unobserved:
    """A worker's prompt sampler: the trainer chose the prompts and is told the rewards, not the worker."""

    def observe(self, instances, rewards, step) -> None:
        pass


class RolloutWorker:
    """One rollout worker: a policy copy, its engine, and the step's collection, forward and objective."""

    def __init__(self, run: RunSettings, threads: int, reference: bool = False, engine_logprobs: bool = False) -> None:
        from src.build import build_forward, build_rollout
        from src.policy.model import frozen_copy, load_policy
        from src.rollout.engine import build_engine
        from src.task.base import build_task
        from src.task.prompts import PromptFormat

        torch.set_num_threads(threads)
        hardware, policy = run.hardware, run.policy
        if hardware.dtype == "float64":
            torch.set_default_dtype(torch.float64)
        # A GPU worker sees only the GPU Ray gave it, as cuda:0; the trainer's index is the driver's.
        device = "cuda" if hardware.device.startswith("cuda") else hardware.device
        self.policy, tokenizer = load_policy(policy.name_or_path, device, hardware.dtype)
        self.engine = build_engine(policy.engine, self.policy, tokenizer, policy.generation_batch_size,
                                   max_new_tokens=policy.max_new_tokens, **policy.vllm)
        self.forward = build_forward(run, tokenizer)
        self.task = build_task(run.groups["task"])  # the verifier the worker scores with (no data is loaded)
        prompts = PromptFormat(self.task, tokenizer, policy.use_chat_template)
        self.behaviour, self.sampling = build_rollout(run, self.policy, self.engine, _Unobserved(), prompts,
                                                      self.forward, self.task)
        # pi_ref, the start checkpoint's weights, frozen: with `reference`, log pi_ref is computed here once per
        # rollout, as the synchronous store keeps it from a group's first use, where the trainer would compute it
        # again at every draw of the rollout from a buffer.
        self.reference = frozen_copy(self.policy) if reference else None
        # log mu from the engine's own logits (`runtime.behaviour_logprobs=engine`), checked against the trainer's
        # forward pass on this worker's first request (SPEC 11: where they agree).
        self.engine_logprobs, self.checked = engine_logprobs, False
        self.version = None  # the initial weights are the start checkpoint's, not a published version
        self.restarted = ray.get_runtime_context().was_current_actor_reconstructed

    def node(self) -> str:
        """The Ray node this worker runs on (`RayWork.placement`)."""
        return ray.get_runtime_context().get_node_id()

    def generate(self, key: int, instances: list, seed: int, version: int | None, weights: list) -> tuple:
        """Groups key, key + 1, ... for `instances` in one generate call, with published weights `version`
        (`weights` holds their object ref); `version=None`: the newest ones on the board (`weights` holds
        its handle) when the request starts.

        Returns 1 + len(instances) objects, a Ray return each (the caller asks for that many): what the driver
        reads of each group, then the groups, which stay in the object store for the buffer and trainer actors."""
        started = time.perf_counter()
        if version is None:
            version, weights = ray.get(weights[0].get.remote())
        if version != self.version:
            ObjectStoreSync.load(ray.get(weights[0]), self.policy, self.engine)  # [chunk refs]
            self.version = version
        collected = self.sampling.generate_groups(instances, step=version, seed=seed, logprobs=self.engine_logprobs)
        groups = collected.fresh
        if not self.engine_logprobs or not self.checked:
            forward = self.forward.with_sampled_logprobs(groups, self.policy, self.behaviour.training_temperature)
            if self.engine_logprobs:
                check_engine_logprobs(groups, forward)
                self.checked = True
            else:
                groups = forward
        if self.reference is not None:
            groups = self.forward.with_reference_logprobs(groups, self.reference)
        if len(groups) != len(instances):
            raise ValueError(f"{len(instances)} prompts gave {len(groups)} groups: the asynchronous runtime needs "
                             "one group a prompt (sampling=standard)")
        restarted, self.restarted = self.restarted, False
        busy = (time.perf_counter() - started) / len(groups)
        heads = [{"key": key + i, "request": key, "version": version, "busy_s": busy, "restarted": restarted and i == 0,
                  "size": group.size, "instance": self.task.instance_of(group), "rewards": list(group.rewards)}
                 for i, group in enumerate(groups)]
        return (heads, *groups)

    def crash(self) -> None:
        """End this actor's process (tests: Ray restarts it under max_restarts)."""
        os._exit(1)


# How far the engine's log mu may stray from the trainer's forward pass, in nats a token. In float32 on the CPU the
# two agree to about 1e-5 (tests/unit/test_engine.py); bf16 on a GPU strays further and is refused.
ENGINE_LOGPROB_TOLERANCE = 1e-3


def check_engine_logprobs(engine: list[Group], forward: list[Group]) -> None:
    """Refuse the engine's per-token log mu where it strays from the trainer's forward pass on the same tokens."""
    gap = max((abs(a - b) for e, f in zip(engine, forward)
               for e_row, f_row in zip(e.behaviour_token_logprobs, f.behaviour_token_logprobs)
               for a, b in zip(e_row, f_row)), default=0.0)
    if gap > ENGINE_LOGPROB_TOLERANCE:
        raise ValueError(f"runtime.behaviour_logprobs=engine: the engine's log mu strays {gap:.2g} nats a token from "
                         f"the trainer's forward pass (at most {ENGINE_LOGPROB_TOLERANCE:g}); use "
                         "runtime.behaviour_logprobs=forward")


class _NoEngine:
    """The trainer actor's rollout engine: the workers generate, so an update has no engine to sync."""

    def sync_weights(self, policy: torch.nn.Module) -> None:
        pass

    def sleep(self) -> None:
        pass


class _Reported:
    """The trainer actor's prompt sampler: the driver picks the prompts and hears the rewards, and sends its
    sampler's metrics with each batch, which the step's `learn` reports as its own."""

    def __init__(self) -> None:
        self.latest: dict[str, float] = {}

    def metrics(self) -> dict[str, float]:
        return self.latest


class TrainerActor:
    """One of the T trainer ranks: the policy, its optimizer and the step's objective, built by `src.build` from
    the run's config as the driver builds them, updated by the step's own `learn` half. With T > 1 ranks
    (`hardware.ranks`) the actors form a process group and train data-parallel (`src.build.data_parallel`,
    FSDP2): the driver calls every method on every rank, since the ranks' collectives must match, and reads
    rank 0's answer.

    learn(step, samples, ...) -> (metrics, counts, completions, published)   one update on a drawn batch, taken
                                         from the buffer actor; `state`: the driver's counters, which it only
                                         reads (the driver's loop counts); then a publish, when asked
    publish(version) -> [object ref]     its whole weights on the object store and the WeightBoard (rank 0)
    state() / load_state(state)          policy, optimizer and torch RNG (checkpoints)
    weights()                            the policy's whole weights (the driver's evaluation copy)
    """

    def __init__(self, run: RunSettings, threads: int, board, rank: int = 0, world: int = 1) -> None:
        self.run, self.threads, self.board, self.rank, self.sharded = run, threads, board, rank, world > 1
        self.world = world

    def rendezvous(self) -> str:
        """Where the ranks meet (asked of rank 0): a TCP port of this actor's node, whichever node Ray chose."""
        return f"tcp://{ray.util.get_node_ip_address()}:{free_port()}"

    def start(self, rendezvous: str | None, own_gpu: bool) -> None:
        """Join the ranks' process group through `rendezvous` (T > 1), then build the policy, its optimizer and the
        objective as the driver builds them (same seed, dtype and loss), on this rank's device: the GPU Ray gave it
        where `own_gpu`, else `hardware.device` (+ the rank on CUDA)."""
        from src.build import build_components, data_parallel

        run = self.run.on_device("cuda:0") if own_gpu else self.run  # Ray's CUDA_VISIBLE_DEVICES: its one GPU
        if self.sharded:
            run = run.on_device(join_trainer_ranks(run.hardware.device, self.rank, self.world, rendezvous, own_gpu))
        self.sampler = _Reported()
        parts = build_components(run, [], engine=_NoEngine(), sampler=self.sampler)
        self.parts = data_parallel(parts) if self.sharded else parts
        torch.set_num_threads(self.threads)  # the driver's count: the update's sums then add in the same order
        self.completion_counts = run.tracking.completion_counts

    def pid(self) -> int:
        return os.getpid()

    def node(self) -> str:
        """The Ray node this rank runs on (`RayWork.placement`)."""
        return ray.get_runtime_context().get_node_id()

    def learn(self, step: int, samples: list[Sample], generated: list, waited: float, sampler_metrics: dict,
              state: TrainState, publish: int | None) -> tuple[dict, StepCounts, dict, list | None]:
        """Update step `step` on the drawn `samples` (Ray hands them over from the buffer actor), with the groups
        `generated` since the last update (references to the workers' objects, or groups a checkpoint kept) counted
        as its fresh evaluations; with `publish`, publish the weights as
        that version at once. Returns the metrics, the counts, the completions the run logs, and the publish."""
        self.sampler.latest = sampler_metrics
        collected = FreshGroups(fresh=[], generated=resolved(generated), off_policy=False,
                                timings={"wait_for_rollouts": waited})
        collection = StepBatch(step, batch_of(samples), collected, gap_fill=0)
        metrics, counts = learn(self.parts, state, collection)
        published = None
        if publish is not None:
            started = time.perf_counter()
            published = self.publish(publish) + [time.perf_counter() - started]
        return metrics, counts, picked_completions(collection, self.completion_counts), published

    def publish(self, version: int) -> list:
        ref = ObjectStoreSync.publish(trainer_weights(self.parts.policy), lead=not self.rank)
        if self.rank:
            return []
        ray.get(self.board.set.remote(version, [ref]))
        return [ref]  # in a list: Ray hands back the reference, not the weights

    def weights(self) -> dict:
        return self._whole(optimizer=False)[0]

    def state(self) -> dict:
        policy, optimizer = self._whole(optimizer=True)
        return {"policy": policy, "optimizer": optimizer, "torch_rng": torch.get_rng_state()}

    def _whole(self, optimizer: bool) -> tuple[dict, dict | None]:
        """The policy's (and the optimizer's) state as one process holds it; over ranks, gathered to rank 0."""
        if self.sharded:
            from src.distributed.checkpoint import whole_state

            return whole_state(self.parts.policy, self.parts.optimizer if optimizer else None)
        return (on_cpu(self.parts.policy.state_dict()),
                on_cpu(self.parts.optimizer.state_dict()) if optimizer else None)

    def load_state(self, state: dict) -> None:
        if self.sharded:  # each rank keeps its slices of the whole tensors
            from src.distributed.checkpoint import load_whole

            load_whole(self.parts.policy, self.parts.optimizer, state["policy"], state["optimizer"])
        else:
            self.parts.policy.load_state_dict(state["policy"])
            self.parts.optimizer.load_state_dict(state["optimizer"])
        torch.set_rng_state(state["torch_rng"])

    def crash(self) -> None:
        """End this actor's process (tests: the run must stop with one line)."""
        os._exit(1)


def join_trainer_ranks(device: str, rank: int, world: int, rendezvous: str, own_gpu: bool = False) -> str:
    """Join the trainer ranks' process group (`src.distributed.group`: gloo on the CPU, NCCL beside gloo on GPUs)
    through `rendezvous`; returns this rank's device: the one GPU it sees where Ray gave it one (`own_gpu`), else
    r GPUs after `hardware.device` for rank r; CPU ranks share the CPU."""
    import torch.distributed as dist

    from src.distributed.group import group_options

    index = 0
    if device.startswith("cuda"):
        index = 0 if own_gpu else (torch.device(device).index or 0) + rank
        device = f"cuda:{index}"
        torch.cuda.set_device(device)
    dist.init_process_group(init_method=rendezvous, rank=rank, world_size=world, **group_options(device, index))
    return device


def on_cpu(value):
    """A (nested) state dict with every tensor detached on the CPU, to cross between processes."""
    if isinstance(value, torch.Tensor):
        return value.detach().cpu()
    if isinstance(value, dict):
        return {key: on_cpu(item) for key, item in value.items()}
    if isinstance(value, (list, tuple)):
        return type(value)(on_cpu(item) for item in value)
    return value


@dataclass
class Pending:
    worker: int
    key: int
    ref: ray.ObjectRef            # what the driver reads of the request's groups
    groups: list[ray.ObjectRef]   # the groups, left in the object store


class RayWork:
    """Work for `src.runtime.pipeline`: W `RolloutWorker` actors and one `TrainerActor`, driven from this
    process, whose `parts` and `state` are the driver's copy (checkpoints, evaluation, the summary)."""

    def __init__(self, run: RunSettings, parts: Components, state: TrainState, settings: PipelineSettings,
                 max_restarts: int, threads: int, cpus_per_worker: float, gpus_per_worker: float = 0.0,
                 trainer_ranks: int = 1, replays: bool = False, engine_logprobs: bool = False) -> None:
        self.parts, self.state, self.settings = parts, state, settings
        self.seed = run.trainer.seed
        actor = ray.remote(RolloutWorker).options(max_restarts=max_restarts, max_task_retries=max_restarts,
                                                  num_cpus=cpus_per_worker, num_gpus=gpus_per_worker)
        self.board = ray.remote(WeightBoard).options(num_cpus=0).remote()
        # A buffer draws a rollout again and again, and the KL term reads log pi_ref: the workers compute it once.
        reference = bool(run.trainer.kl_coef) and replays
        workers = lambda: [actor.remote(run, threads, reference, engine_logprobs) for _ in range(settings.workers)]
        # On several nodes the trainers come first, so that Ray places their ranks before the workers fill the
        # nodes. On one node all fit, and the workers load their policies while the trainers do.
        several = sum(bool(node["Alive"]) for node in ray.nodes()) > 1
        self.workers = [] if several else workers()
        self.trainers = start_trainers(run, cpus_per_worker, self.board, parts, state, trainer_ranks, several)
        self.workers = self.workers or workers()
        log.info("trainer actor(s) started at step %d (pid %s)", state.step,
                 ", ".join(str(pid) for pid in ray.get([trainer.pid.remote() for trainer in self.trainers])))
        self.trainer_dead = False
        self.pulled = (state.step, True)  # (step, with the optimizer): what the driver's copy holds
        self.pending: list[Pending] = []
        self.preloaded: dict[int, list[Generated]] = {}
        self.published: tuple[int, ray.ObjectRef] | None = None
        self.wait_s = 0.0
        self.training: tuple | None = None  # (publish, [call per rank]) of the update under way
        self.last_counts: StepCounts | None = None  # what the last update adds to the driver's counters
        self.last_completions: dict[int, list] = {}  # ... and the completions the run logs of it

    def placement(self) -> dict:
        """Where the actors run: the session's live nodes, the driver's, each worker's and each trainer rank's."""
        nodes = [node["NodeID"] for node in ray.nodes() if node["Alive"]]
        workers = ray.get([worker.node.remote() for worker in self.workers])
        return {"nodes": len(nodes), "driver_node": ray.get_runtime_context().get_node_id(), "worker_nodes": workers,
                "trainer_nodes": ray.get([trainer.node.remote() for trainer in self.trainers]),
                "workers_over_nodes": len(set(workers))}

    # ---- workers ----
    def start(self, worker: int, key: int, version: int | None) -> None:
        instances = self.parts.curriculum.sample(self.settings.groups_per_request)
        published_version, ref = self.published
        if version is not None and published_version != version:
            raise ValueError(f"request {key} wants version {version}, the published weights are {published_version}")
        weights = [self.board] if version is None else [ref]
        head, *groups = self.workers[worker].generate.options(num_returns=1 + len(instances)).remote(
            key, instances, request_seed(self.seed, key), version, weights)
        self.pending.append(Pending(worker, key, head, groups))

    def result(self, worker: int, version: int) -> list[Generated]:
        if worker in self.preloaded:
            return self._arrived(self.preloaded.pop(worker), version)
        pending = next(p for p in self.pending if p.worker == worker)
        return self._finish(pending, self._get(pending.ref), version)

    def poll(self, timeout: float | None, version: int) -> list[Generated]:
        refs = [p.ref for p in self.pending]
        started = time.perf_counter()
        ray.wait(refs, num_returns=1, timeout=timeout)
        done = set(ray.wait(refs, num_returns=len(refs), timeout=0)[0])  # every one finished by now
        self.wait_s += time.perf_counter() - started
        return [g for p in [p for p in self.pending if p.ref in done]
                for g in self._finish(p, self._get(p.ref), version)]

    def peek(self, worker: int) -> list[Generated]:
        if worker in self.preloaded:
            return self.preloaded[worker]
        pending = next(p for p in self.pending if p.worker == worker)
        return self._generated(pending, self._get(pending.ref))

    def preload(self, worker: int, groups: list[Generated]) -> None:
        self.preloaded[worker] = groups

    def _finish(self, pending: Pending, payload: list[dict], version: int) -> list[Generated]:
        self.pending.remove(pending)
        return self._arrived(self._generated(pending, payload), version)

    def _generated(self, pending: Pending, heads: list[dict]) -> list[Generated]:
        return [Generated(worker=pending.worker, group=Stored(ref, head.pop("size"), head.pop("instance"),
                                                              head.pop("rewards")), **head)
                for head, ref in zip(heads, pending.groups, strict=True)]

    def _arrived(self, generated: list[Generated], version: int) -> list[Generated]:
        """Groups that arrived while the schedule counts `version` updates done: the curriculum records them so."""
        if generated and generated[0].restarted:
            log.warning("rollout worker %d was restarted by Ray (max_restarts); its request %d was retried",
                        generated[0].worker, generated[0].request)
        groups = [g.group for g in generated]  # `Stored` but where a resumed lockstep run preloaded them
        instances = [g.instance if isinstance(g, Stored) else self.parts.task.instance_of(g) for g in groups]
        self.parts.curriculum.observe(instances, [g.rewards for g in groups], version)
        return generated

    def _get(self, ref):
        started = time.perf_counter()
        payload = ray.get(ref)
        self.wait_s += time.perf_counter() - started
        return payload

    # ---- trainer ----
    def train(self, step: int, samples, arrived: list[Generated], publish: int | None) -> None:
        """Begin an update in the trainer actor(s) with the step's `learn` half on the drawn rollouts (a rollout
        drawn twice trains twice): `samples` is the buffer actor's reference to them (`DrawnBatch`), or the
        samples themselves; the driver's loop counts the step (`last_counts`)."""
        waited, self.wait_s = self.wait_s, 0.0
        self.training = (publish, self._send(
            "learn", step, getattr(samples, "ref", samples),
            [g.group.ref if isinstance(g.group, Stored) else g.group for g in arrived], waited,
            self.parts.curriculum.metrics(), dataclasses.replace(self.state, history=[]), publish))

    def trained(self) -> tuple[dict[str, float], float | None]:
        """Wait for the update begun: its metrics, and the seconds its publish took (None: none asked)."""
        publish, refs = self.training
        metrics, self.last_counts, self.last_completions, published = self._answer(refs)
        if publish is None:
            return metrics, None
        self.published = (publish, published[0])  # the trainer actor has told the board
        return metrics, published[1]

    def publish(self, version: int) -> float:
        """The trainer actor puts its weights on the object store and the board; returns the seconds it took."""
        started = time.perf_counter()
        self.published = (version, self._trainer("publish", version)[0])
        return time.perf_counter() - started

    def pull(self, optimizer: bool = True) -> None:
        """Bring the driver's policy (with `optimizer`: its optimizer and torch RNG too) up to the trainer
        actor's, unless it holds them for this step already: before a checkpoint, an evaluation, the end."""
        step, full = self.pulled
        if step == self.state.step and (full or not optimizer):
            return
        if optimizer:
            state = self._trainer("state")
            self.parts.optimizer.load_state_dict(state["optimizer"])
            torch.set_rng_state(state["torch_rng"])
        else:
            state = {"policy": self._trainer("weights")}
        self.parts.policy.load_state_dict(state["policy"])
        self.parts.engine.sync_weights(self.parts.policy)  # the driver's engine evaluates (vLLM: load_weights)
        self.pulled = (self.state.step, optimizer)

    def _trainer(self, method: str, *args):
        """`method(*args)` on every trainer rank (their collectives must match); rank 0's answer."""
        return self._answer(self._send(method, *args))

    def _send(self, method: str, *args) -> list:
        return [getattr(trainer, method).remote(*args) for trainer in self.trainers]

    def _answer(self, refs: list):
        try:
            waiting = refs
            while waiting:  # a dead rank is seen at once, not after the others give up on a collective
                done, waiting = ray.wait(waiting, num_returns=1)
                ray.get(done)
            return ray.get(refs[0])
        except RayActorError as error:
            self.trainer_dead = True
            cause = first_line(error).split(". ")[0]  # Ray's guesses at why follow the first sentence
            raise PipelineError(f"the trainer actor died ({cause}); the run stops at step "
                                f"{self.state.step}: run the same command again to resume from its last "
                                "checkpoint") from None

    def crash_trainer(self) -> None:
        self.trainers[0].crash.remote()

    def publish_weights(self, version: int, weights: dict) -> None:
        """Publish saved weights (a resumed run whose workers lagged the trainer at the checkpoint)."""
        names = dict(trainer_names(self.parts.policy))  # a checkpoint of an older release kept the state dict
        self._published(version, ObjectStoreSync.publish((n, t) for n, t in weights.items() if n in names))

    def _published(self, version: int, ref) -> None:
        self.published = (version, ref)
        ray.get(self.board.set.remote(version, [ref]))

    def published_state(self) -> dict:
        return ObjectStoreSync.fetch(ray.get(self.published[1]))

    def crash_worker(self, worker: int) -> None:
        # Not retried: a retry would run on the restarted actor and kill it again, up to max_restarts.
        self.workers[worker].crash.options(max_task_retries=0).remote()

    def close(self) -> None:
        for pending in self.pending:  # the free schedule's queued requests: not retried on a killed actor
            ray.cancel(pending.ref)
        for actor in (*self.workers, *self.trainers, self.board):
            ray.kill(actor, no_restart=True)


def start_trainers(run: RunSettings, cpus: float, board, parts: Components, state: TrainState, ranks: int,
                   several: bool = False) -> list:
    """The `ranks` trainer actors, started from the driver's trainer state (a resumed run's: the checkpoint's).

    Not restarted by Ray: a new trainer would have lost its updates since the checkpoint. Rank 0 names the
    rendezvous, a port of its own node. On one node they run on the driver's and, on CUDA, hold no Ray GPU slot:
    rank r sits at `hardware.device` + r, after the workers' slots (`worker_gpus`), where it sees the driver's
    devices (Ray 2.60 leaves CUDA_VISIBLE_DEVICES alone for an actor without GPUs). On a cluster of several nodes
    Ray places each rank, on CUDA with a GPU of its own on any node: the driver's GPU is not among the cluster's
    (`src.runtime.ray_cluster.lead_cluster`).
    """
    own_gpu = several and run.hardware.device.startswith("cuda")
    options = {"max_restarts": 0, "num_cpus": cpus / ranks, "num_gpus": 1 if own_gpu else 0}
    if not several:  # the GPUs past the workers' slots are this node's
        options["scheduling_strategy"] = NodeAffinitySchedulingStrategy(
            node_id=ray.get_runtime_context().get_node_id(), soft=False)
    actor = ray.remote(TrainerActor).options(**options)
    trainers = [actor.remote(run, torch.get_num_threads(), board, rank, ranks) for rank in range(ranks)]
    rendezvous = ray.get(trainers[0].rendezvous.remote()) if ranks > 1 else None
    ray.get([trainer.start.remote(rendezvous, own_gpu) for trainer in trainers])
    whole = {"policy": on_cpu(parts.policy.state_dict()), "optimizer": on_cpu(parts.optimizer.state_dict()),
             "torch_rng": torch.get_rng_state()}
    ray.get([trainer.load_state.remote(whole) for trainer in trainers])
    return trainers


def resolved(items: list) -> list:
    """`items` with each object reference among them replaced by its object, fetched in one call."""
    objects = iter(ray.get([item for item in items if isinstance(item, ray.ObjectRef)]))
    return [next(objects) if isinstance(item, ray.ObjectRef) else item for item in items]


def batch_of(samples: list[Sample]) -> Batch:
    """The drawn rollouts as an update batch: one entry per group, its drawn responses in draw order, its age
    the off-policiness. Every entry carries the group's log mu from generation, so the objective weighs it
    against the current policy (no entry is 'fresh' with mu = pi_theta)."""
    entries: dict[int, list[Sample]] = {}
    for sample in samples:
        entries.setdefault(sample.rollout.group_key, []).append(sample)
    return Batch([BatchGroup(drawn[0].group, "replay", drawn[0].off_policiness,
                             tuple(s.rollout.index for s in drawn)) for drawn in entries.values()])
