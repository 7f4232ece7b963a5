"""The run's typed settings: the config groups without a component, read once from the composed config.

`src.command.config.validate` checks every knob; `RunSettings(cfg)` then reads the groups that configure the
run itself (trainer, policy, hardware, evaluation, tracking) into frozen dataclasses, and keeps each
component group's node (the ones with a `_target_`) for `src.build` to instantiate. From there on the
loop (`src.run`), the builder and the runtimes take these, never the config: a field read here is a
field the code uses, with its type.
"""

from __future__ import annotations

import copy
import dataclasses
import typing
from dataclasses import dataclass, field

from omegaconf import DictConfig, OmegaConf

from src.variant import VARIANT_GROUPS

COMPONENT_GROUPS = (*VARIANT_GROUPS, "task")  # each names its class in `_target_`: `src.build` instantiates it


@dataclass(frozen=True)
class RolloutSettings:
    """SPEC 3's training rollouts: the sampling the behaviour policy generates with."""

    temperature: float
    top_p: float
    top_k: int | None


@dataclass(frozen=True)
class TrainerSettings:
    """The trainer group (conf/trainer/): sizes, optimizer, the loss's shared terms, checkpoints and resumes."""

    steps: int
    groups_per_step: int                # B
    group_size: int                     # K
    learning_rate: float
    weight_decay: float
    betas: tuple[float, float]
    kl_coef: float
    kl_estimator: str
    entropy_coef: float
    max_grad_norm: float | None
    micro_batch_size: int
    micro_batch_tokens: int | None
    fused_logprobs: bool
    pack_rows: bool
    compile: bool
    gradient_checkpointing: bool
    rollout: RolloutSettings
    seed: int
    checkpoint_every: int
    resume_from: str | None
    auto_resume: bool
    rerun: bool
    heartbeat_every_s: float
    heartbeat_timeout_s: float
    extend: bool = False  # continue the cell's FINISHED run at fewer steps (src/runs/resume.py)


@dataclass(frozen=True)
class PolicySettings:
    """The policy group (conf/policy/): the weights to start from and the engine that samples them."""

    name_or_path: str
    engine: str
    generation_batch_size: int
    max_new_tokens: int
    use_chat_template: bool
    vllm: dict = field(default_factory=dict)  # the vLLM engine's own options (src/rollout/vllm_engine.py)


@dataclass(frozen=True)
class HardwareSettings:
    """The hardware group (conf/hardware/): where and in which precision the step runs."""

    name: str
    device: str
    dtype: str
    autocast: str | None
    threads: int | None
    ranks: int
    activation_checkpointing: bool = False
    ranked: bool = False  # one torchrun process on the ranked path (a group of one: src/runs/ranks.py)
    nodes: int = 1  # the nodes the ranks span (SLURM's nodes, torchrun's --nnodes): src/runs/ranks.py checks it


@dataclass(frozen=True)
class EvaluationSettings:
    """The evaluation group (conf/evaluation/): SPEC 7's held-out protocol and when the run applies it."""

    name: str
    prompts: int
    samples_per_prompt: int
    repeats: int
    ks: tuple[int, ...]
    estimator: str
    temperature: float
    top_p: float
    top_k: int | None
    seed: int
    at_start: bool
    every: int


@dataclass(frozen=True)
class TrackingSettings:
    """Where the run is logged (config.yaml's tracking block): the MLflow store and what goes into it."""

    uri: str
    artifact_location: str | None
    experiment: str
    # A run logged before these keys existed still reads back (`python -m src.eval`): they default.
    sweep: str = "adhoc"
    run_name: str | None = None
    policy_artifact_max_mb: float = 200.0
    completions_per_step: int = 0
    print_completions: int = 0

    @property
    def completion_counts(self) -> tuple[int, int]:
        """The completions a step logs and prints: each its own draw (`src.train.picked_completions`)."""
        return self.completions_per_step, self.print_completions


class RunSettings:
    """A validated config's typed settings: one frozen dataclass per group without a component, the nodes of
    the component groups (`COMPONENT_GROUPS`) for `src.build`, and `out`, the folder the run writes under."""

    def __init__(self, cfg: DictConfig) -> None:
        self.trainer: TrainerSettings = typed(TrainerSettings, cfg.trainer)
        self.policy: PolicySettings = typed(PolicySettings, cfg.policy)
        self.hardware: HardwareSettings = typed(HardwareSettings, cfg.hardware)
        self.evaluation: EvaluationSettings = typed(EvaluationSettings, cfg.evaluation)
        self.tracking: TrackingSettings = typed(TrackingSettings, cfg.tracking)
        self.out: str = str(cfg.out)
        # Resolved and detached from `cfg`: a Ray actor unpickles them without the resolvers of this process.
        self.groups: DictConfig = OmegaConf.create({group: OmegaConf.to_container(cfg[group], resolve=True)
                                                    for group in COMPONENT_GROUPS if group in cfg})

    def on_device(self, device: str) -> RunSettings:
        """These settings with the trainer on `device` (a Ray worker's own GPU, a trainer rank's)."""
        moved = copy.copy(self)
        moved.hardware = dataclasses.replace(self.hardware, device=device)
        return moved


def typed(cls, node):
    """An instance of the frozen dataclass `cls` from a config node: its declared fields, resolved, nested
    dataclasses built from their sub-nodes and lists made tuples; keys the class does not declare are left
    to the components that read them (they are checked by `src.command.config.validate`)."""
    values = OmegaConf.to_container(node, resolve=True) if OmegaConf.is_config(node) else dict(node)
    hints = typing.get_type_hints(cls)
    kwargs = {}
    for spec in dataclasses.fields(cls):
        if spec.name not in values:
            continue  # a field with a default that a config written before its key existed leaves out
        value, kind = values[spec.name], hints[spec.name]
        if dataclasses.is_dataclass(kind):
            value = typed(kind, value)
        elif isinstance(value, list):
            value = tuple(value)
        kwargs[spec.name] = value
    return cls(**kwargs)
