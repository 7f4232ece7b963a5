"""The composition root: every component of the training step built from its config group.

`build_components` is the one place that reads config for the step (`src.run`, the tests and the
benchmarks all build through it): each group's YAML names its implementation with `_target_`, and
`hydra.utils.instantiate` builds it with the runtime objects it works with added. Components
validate their own arguments in their constructors; `check_settings` builds the cheap ones around
stand-ins, so `src.config.validate` reports a bad setting before any model loads.
"""

from __future__ import annotations

import inspect

import torch
from hydra.utils import get_object, instantiate
from omegaconf import DictConfig

from src.buffer.store import ReplayStore
from src.components import Components
from src.policy.forward import Forward
from src.policy.model import compile_layers, frozen_copy, load_policy
from src.rollout.engine import build_engine
from src.task.base import Task, build_task
from src.task.prompts import PromptFormat


def build_components(cfg: DictConfig, train_set, policy=None, tokenizer=None, engine=None,
                     task: Task | None = None, sampler=None) -> Components:
    """Every component of the step from its config group, with `instantiate` (`_target_` in the YAML).

    The one place that reads config for the step: components get their own group's settings plus the
    runtime objects they work with, and validate them in their constructors. A test or benchmark may
    hand in a policy with its tokenizer, or an engine, it built already; the runner hands in the task it
    loaded the training set from. A process that trains but picks no prompts (runtime=async's trainer
    actor) hands in its prompt sampler and no training set.
    """
    trainer = cfg.trainer
    if cfg.hardware.threads:
        torch.set_num_threads(cfg.hardware.threads)
    torch.manual_seed(trainer.seed)
    if cfg.hardware.dtype == "float64":
        # Every float tensor the step makes (advantages, weights, sums) in float64 too, not only the weights:
        # the numbers then agree to ~1e-12 whichever CPU kernels (AVX2, AVX-512, plain) compute them.
        torch.set_default_dtype(torch.float64)
    if policy is None:
        policy, tokenizer = load_policy(cfg.policy.name_or_path, cfg.hardware.device, cfg.hardware.dtype)
    if trainer.gradient_checkpointing:
        policy.gradient_checkpointing_enable()
    forward = Forward(tokenizer.pad_token_id, trainer.micro_batch_size, trainer.micro_batch_tokens,
                      cfg.hardware.autocast, trainer.fused_logprobs, trainer.pack_rows)
    engine = engine or build_engine(cfg.policy.engine, policy, tokenizer, cfg.policy.generation_batch_size,
                                    **cfg.policy.get("vllm", {}))
    task = task or build_task(cfg.task)
    task.check_curriculum(cfg.curriculum.name)
    if sampler is None:
        sampler = build(cfg.curriculum, instances=train_set, seed=trainer.seed, task=task)
    prompts = PromptFormat(task, tokenizer, cfg.policy.use_chat_template)
    behaviour, collection, objective = build_rollout_and_objective(cfg, policy, engine, sampler, prompts, forward,
                                                                   task)
    reference = frozen_copy(policy)
    if trainer.compile:  # after every copy of the policy (the reference, a stale behaviour's)
        compile_layers(policy)
        compile_layers(reference)
    return Components(policy=policy, reference=reference, tokenizer=tokenizer, engine=engine,
                      optimizer=build_optimizer(policy, trainer), store=build_store(cfg, task), objective=objective,
                      collection=collection, sampler=sampler, behaviour=behaviour, forward=forward,
                      groups_per_step=trainer.groups_per_step, task=task)


def build_rollout_and_objective(cfg: DictConfig, policy, engine, sampler, prompts, forward, task):
    """The behaviour policy, the fresh-rollout collection it samples for, and the objective (which takes
    the behaviour's truncation settings), each from its group with the live objects it works with."""
    trainer = cfg.trainer
    behaviour = build(cfg.behaviour, policy=policy, training_temperature=trainer.rollout.temperature)
    collection = build(cfg.sampling, engine=engine, sampler=sampler, behaviour=behaviour, forward=forward,
                       prompts=prompts, task=task, group_size=trainer.group_size, max_new_tokens=cfg.policy.max_new_tokens,
                       top_p=trainer.rollout.top_p, top_k=trainer.rollout.top_k, seed=trainer.seed)
    objective = build(cfg.loss, forward=forward, kl_coef=trainer.kl_coef, entropy_coef=trainer.entropy_coef,
                      max_grad_norm=trainer.max_grad_norm, truncation=behaviour.truncation,
                      kl_estimator=trainer.kl_estimator)
    return behaviour, collection, objective


def check_settings(cfg: DictConfig) -> None:
    """Build the runtime, replay store, behaviour, collection and objective from `cfg` as a run would, so each
    constructor checks its own settings; raises what a constructor raises.

    Their live objects are stand-ins: the collection and the objective only store the engine, prompt
    sampler, prompt format and forward helper, and a weightless module is all a stale behaviour copies.
    No model, tokenizer or engine is loaded, and the task loads no data. The prompt sampler (`curriculum`)
    is checked by `src.curriculum.sampler.check_curriculum`, which also needs B and K; here only
    whether the task can serve it.
    """
    build_runtime(cfg)
    task = build_task(cfg.task)
    build_store(cfg, task)
    task.check_curriculum(cfg.curriculum.name)
    check_takes(cfg.curriculum)
    build_rollout_and_objective(cfg, policy=torch.nn.Module(), engine=None, sampler=None, prompts=None, forward=None,
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


def build_store(cfg: DictConfig, task: Task) -> ReplayStore:
    """The replay store the buffer group names (`buffer._target_`), told B and the run's seed, and, where it takes
    `correct_reward` (the FIFO's positive bias keeps correct rollouts), what the task counts as correct. Under
    runtime=async it is buffer=none's: the pipeline's rollout queue is the runtime's (`src.runtime.runners`)."""
    live = {"groups_per_step": cfg.trainer.groups_per_step, "seed": cfg.trainer.seed}
    if "correct_reward" in inspect.signature(get_object(cfg.buffer._target_)).parameters:
        live["correct_reward"] = task.correct_reward
    return build(cfg.buffer, **live)


def build_runtime(cfg: DictConfig):
    """The runtime the runtime group names (`runtime._target_`): sync (SPEC 3's loop) or async (SPEC 11)."""
    return build(cfg.runtime, cfg=cfg)


def build_optimizer(policy, trainer) -> torch.optim.AdamW:
    """AdamW over the policy's parameters with the trainer group's settings (SPEC 4); fused on CUDA."""
    on_cuda = next(policy.parameters()).device.type == "cuda"
    return torch.optim.AdamW(policy.parameters(), lr=trainer.learning_rate, weight_decay=trainer.weight_decay,
                             betas=tuple(trainer.betas), fused=on_cuda)


def data_parallel(parts: Components, trainer, activation_checkpointing: bool = False) -> Components:
    """`parts` trained data-parallel over the default process group (torchrun's ranks): the policy sharded
    with FSDP2, the optimizer rebuilt over its shards, the objective run on each rank's share of the batch.
    The reference policy, built before sharding, stays whole on every rank."""
    from dataclasses import replace

    from src.distributed.data_parallel import DataParallelObjective
    from src.distributed.fsdp import shard_policy

    shard_policy(parts.policy, activation_checkpointing)
    return replace(parts, optimizer=build_optimizer(parts.policy, trainer),
                   objective=DataParallelObjective(parts.objective))
