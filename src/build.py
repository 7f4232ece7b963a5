"""The composition root: every component of the training step built from its config group.

`build_components` is the one place that builds the step (`src.run`, the tests and the benchmarks all
build through it), from the run's typed settings (`src.settings.RunSettings`): each component group's
YAML names its implementation with `_target_`, and `hydra.utils.instantiate` builds it from its node
with the runtime objects it works with added. Components
validate their own arguments in their constructors; `check_settings` builds the cheap ones around
stand-ins, so `src.command.config.validate` reports a bad setting before any model loads.
"""

from __future__ import annotations

import inspect
import logging
import os

import torch
from hydra.utils import get_object, instantiate
from omegaconf import DictConfig

from src.buffer.store import NoReplay, ReplayStore
from src.components import Components
from src.loss.trainer import Trainer
from src.policy.forward import Forward
from src.policy.model import compile_layers, frozen_copy, load_policy
from src.rollout.engine import build_engine
from src.settings import RunSettings, TrainerSettings
from src.task.base import Task, build_task
from src.task.prompts import PromptFormat
from src.variant import described

log = logging.getLogger(__name__)


def build_components(run: RunSettings, train_set, policy=None, tokenizer=None, engine=None,
                     task: Task | None = None, sampler=None) -> Components:
    """Every component of the step: the policy and its engine from the run's typed settings, each variant from
    its group's node with `instantiate` (`_target_` in the YAML).

    Components get their own group's settings plus the runtime objects they work with, and validate them in
    their constructors. A test or benchmark may hand in a policy with its tokenizer, or an engine, it built
    already; the runner hands in the task it loaded the training set from. A process that trains but picks no
    prompts (runtime=async's trainer actor) hands in its prompt sampler and no training set.
    """
    trainer, hardware = run.trainer, run.hardware
    if hardware.threads:
        torch.set_num_threads(hardware.threads)
    elif hardware.device == "cpu" and (hint := busy_cpu_hint()):
        log.warning("%s", hint)
    torch.manual_seed(trainer.seed)
    if hardware.dtype == "float64":
        # Every float tensor the step makes (advantages, weights, sums) in float64 too, not only the weights:
        # the numbers then agree to ~1e-12 whichever CPU kernels (AVX2, AVX-512, plain) compute them.
        torch.set_default_dtype(torch.float64)
    ranked = under_ranks() or hardware.ranked  # hardware.ranked: the ranked path in a group of one
    if policy is None:  # under ranks on the host: sharding moves it to the GPU a unit at a time (`shard_policy`)
        policy, tokenizer = load_policy(run.policy.name_or_path, "cpu" if ranked else hardware.device, hardware.dtype)
    if trainer.gradient_checkpointing:
        policy.gradient_checkpointing_enable()
    reference = sharded_with_reference(policy, hardware) if ranked else frozen_copy(policy)
    forward = build_forward(run, tokenizer)
    ranked_engine = {"ranked": True} if hardware.ranked and run.policy.engine == "vllm" else {}
    engine = engine or build_engine(run.policy.engine, policy, tokenizer, run.policy.generation_batch_size,
                                    max_new_tokens=run.policy.max_new_tokens, **run.policy.vllm, **ranked_engine)
    task = task or build_task(run.groups["task"])
    task.check_curriculum(run.groups["curriculum"].name)
    if sampler is None:
        sampler = build(run.groups["curriculum"], instances=train_set, seed=trainer.seed, task=task)
    prompts = PromptFormat(task, tokenizer, run.policy.use_chat_template)
    behaviour, sampling, learner = build_rollout_and_trainer(run, policy, engine, sampler, prompts, forward, task)
    if trainer.compile:  # after every copy of the policy (the reference, a stale behaviour's)
        compile_layers(policy)
        compile_layers(reference)
    return Components(policy=policy, reference=reference, tokenizer=tokenizer, engine=engine,
                      optimizer=build_optimizer(policy, trainer), buffer=build_store(run, task),
                      loss=learner.objective, trainer=learner, sampling=sampling, curriculum=sampler,
                      behaviour=behaviour, forward=forward, groups_per_step=trainer.groups_per_step, task=task)


def under_ranks() -> bool:
    """Whether this process is one of several data-parallel ranks (torchrun's, or runtime=async's trainer actors):
    their process group is up before the components are built."""
    return torch.distributed.is_available() and torch.distributed.is_initialized() and \
        torch.distributed.get_world_size() > 1


def sharded_with_reference(policy: torch.nn.Module, hardware) -> torch.nn.Module:
    """Under ranks, before the engine wakes beside them: pi_ref (`reference_policy`) from the whole policy, then
    the policy sharded onto the rank's device (FSDP2, `hardware.activation_checkpointing`); returns pi_ref."""
    from src.distributed.fsdp import compute_dtype, shard_policy

    device_type = torch.device(hardware.device).type
    reference = reference_policy(policy, hardware.device, compute_dtype(device_type))
    shard_policy(policy, hardware.activation_checkpointing, device_type=device_type)
    return reference


def reference_policy(policy: torch.nn.Module, device: str, dtype: torch.dtype | None) -> torch.nn.Module:
    """pi_ref under ranks, frozen: made before the policy is sharded, one parameter at a time onto `device` (the
    rank's GPU) in `dtype`, the one the sharded policy computes in (bf16 on a GPU, `src.distributed.fsdp.
    compute_dtype`; None: the policy's own). No second whole fp32 copy of the policy on the host or the GPU, and
    pi_ref's forward is the sharded policy's (bf16 weights). Tied weights stay tied: the deep copy takes each
    parameter's copy from the memo."""
    import copy

    memo = {id(p): torch.nn.Parameter(p.detach().to(device=device, dtype=dtype or p.dtype, copy=True),
                                      requires_grad=False) for p in policy.parameters()}
    return copy.deepcopy(policy, memo).to(device).eval()


def build_forward(run: RunSettings, tokenizer) -> Forward:
    """The forward helper every log-prob goes through, with the trainer's micro-batching and the hardware's autocast."""
    trainer = run.trainer
    return Forward(tokenizer.pad_token_id, trainer.micro_batch_size, trainer.micro_batch_tokens,
                   run.hardware.autocast, trainer.fused_logprobs, trainer.pack_rows)


def build_rollout(run: RunSettings, policy, engine, sampler, prompts, forward, task):
    """The behaviour policy and the sampling component that draws fresh groups with it, each from its group with
    the live objects it works with (a rollout worker of runtime=async builds these alone)."""
    settings, groups = run.trainer, run.groups
    behaviour = build(groups["behaviour"], policy=policy, training_temperature=settings.rollout.temperature)
    sampling = build(groups["sampling"], engine=engine, sampler=sampler, behaviour=behaviour, forward=forward,
                     prompts=prompts, task=task, group_size=settings.group_size,
                     max_new_tokens=run.policy.max_new_tokens, top_p=settings.rollout.top_p,
                     top_k=settings.rollout.top_k, seed=settings.seed)
    return behaviour, sampling


def build_rollout_and_trainer(run: RunSettings, policy, engine, sampler, prompts, forward, task):
    """`build_rollout`'s two and the trainer that trains the policy with the objective's loss (which takes the
    behaviour's truncation settings)."""
    settings = run.trainer
    behaviour, sampling = build_rollout(run, policy, engine, sampler, prompts, forward, task)
    objective = build(run.groups["loss"], truncation=behaviour.truncation)
    trainer = Trainer(objective, forward, kl_coef=settings.kl_coef, entropy_coef=settings.entropy_coef,
                      kl_estimator=settings.kl_estimator, max_grad_norm=settings.max_grad_norm)
    return behaviour, sampling, trainer


def check_settings(run: RunSettings) -> None:
    """Build the runtime, replay store, behaviour, collection and objective of `run` as a run would, so each
    constructor checks its own settings; raises what a constructor raises.

    Their live objects are stand-ins: the collection and the objective only store the engine, prompt
    sampler, prompt format and forward helper, and a weightless module is all a stale behaviour copies.
    No model, tokenizer or engine is loaded, and the task loads no data. The prompt sampler (`curriculum`)
    is checked by `src.curriculum.sampler.check_curriculum`, which also needs B and K; here only
    whether the task can serve it.
    """
    build_runtime(run)
    task = build_task(run.groups["task"])
    build_store(run, task)
    task.check_curriculum(run.groups["curriculum"].name)
    check_takes(run.groups["curriculum"])
    build_rollout_and_trainer(run, policy=torch.nn.Module(), engine=None, sampler=None, prompts=None, forward=None,
                              task=task)


def check_takes(node: DictConfig) -> None:
    """Raise the TypeError a build would raise for a setting the node's `_target_` does not take: the prompt sampler
    is built only once the training set is loaded, and a study that sets `curriculum.fraction` beside a
    `curriculum: frontier,none` grid must be refused at planning, not in its none cell's job."""
    settings = {key: value for key, value in node.items() if key != "_target_"}
    inspect.signature(get_object(node._target_)).bind_partial(**settings)


def build(node: DictConfig, **live):
    """The component `node` names with `_target_`, from its YAML settings plus the run's live objects.

    The live objects reach the constructor as they are: given to `instantiate` itself, a list of
    dataclasses (the training instances) would be turned into an OmegaConf config first.
    """
    return instantiate(node, _partial_=True)(**live)


def build_store(run: RunSettings, task: Task) -> ReplayStore:
    """The replay store the buffer group names (`buffer._target_`), told B and the run's seed, and, where it takes
    `correct_reward` (the FIFO's positive bias keeps correct rollouts), what the task counts as correct. Under
    runtime=async it keeps nothing (buffer=none's): the option's rollout form replays there, in the pipeline's
    queue (`src.buffer.store.ReplayStore.rollout_queue`), and the trainer's step only updates."""
    node = run.groups["buffer"]
    if not described(run.groups["runtime"]).step_replays:
        return NoReplay(seed=run.trainer.seed)
    live = {"groups_per_step": run.trainer.groups_per_step, "seed": run.trainer.seed}
    if "correct_reward" in inspect.signature(get_object(node._target_)).parameters:
        live["correct_reward"] = task.correct_reward
    return build(node, **live)


def build_runtime(run: RunSettings):
    """The runtime the runtime group names (`runtime._target_`): sync (SPEC 3's loop) or async (SPEC 11)."""
    return build(run.groups["runtime"], run=run)


def build_optimizer(policy, trainer: TrainerSettings) -> torch.optim.AdamW:
    """AdamW over the policy's parameters with the trainer group's settings (SPEC 4); fused on CUDA."""
    on_cuda = next(policy.parameters()).device.type == "cuda"
    return torch.optim.AdamW(policy.parameters(), lr=trainer.learning_rate, weight_decay=trainer.weight_decay,
                             betas=tuple(trainer.betas), fused=on_cuda)


def data_parallel(parts: Components, activation_checkpointing: bool = False) -> Components:
    """`parts` trained data-parallel over the default process group (torchrun's ranks): the policy sharded
    with FSDP2, the optimizer rebuilt over its shards with its own settings, the objective run on each rank's
    share of the batch, and an engine with its own weights (vLLM) sampling each rank's share of a step. The
    reference policy, built before sharding, stays whole on every rank (`reference_policy`).
    `activation_checkpointing`: `hardware.activation_checkpointing`, for a policy not sharded yet."""
    from dataclasses import replace

    from src.distributed.data_parallel import DataParallelTrainer
    from src.distributed.fsdp import is_sharded, shard_policy

    if not is_sharded(parts.policy):  # `build_components` shards it under ranks; a policy handed in may not be
        shard_policy(parts.policy, activation_checkpointing)
    engine = parts.engine
    if getattr(engine, "own_weights", False):  # vLLM: each rank's engine samples its share of every call
        from src.distributed.generation import RankShare

        engine = parts.sampling.engine = RankShare(engine)
    settings = parts.optimizer.defaults  # build_optimizer's, for the sharded parameters
    optimizer = torch.optim.AdamW(parts.policy.parameters(), lr=settings["lr"], betas=settings["betas"],
                                  weight_decay=settings["weight_decay"], fused=settings["fused"])
    return replace(parts, optimizer=optimizer, trainer=DataParallelTrainer(parts.trainer), engine=engine)


def busy_cpu_hint() -> str | None:
    """A line for a CPU run whose `hardware.threads` is null (torch takes every core) on a machine that other
    work keeps busy: torch's threads then wait on each other, and one thread is often several times faster.
    The thread count is not picked from the load: a resumed run would then compute with another count."""
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    load = os.getloadavg()[0] if hasattr(os, "getloadavg") else 0.0
    if cores == 1 or load < cores - 0.5:
        return None
    return (f"this machine is busy (load {load:.1f} on {cores} cores) and torch uses all {cores}: "
            "hardware.threads=1 is often several times faster here")
