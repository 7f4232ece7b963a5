"""What a training step works with: the components `src.build` builds from the config groups."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from src.batch import Group
from src.buffer.store import ReplayStore
from src.loss.base import Objective
from src.loss.trainer import Trainer
from src.policy.forward import Forward
from src.rollout.interface import RolloutEngine
from src.sampling.collection import StandardSampling
from src.task.base import Task


@dataclass
class Components:
    """What the step works with, built from config by `src.build.build_components`."""

    policy: torch.nn.Module
    reference: torch.nn.Module
    tokenizer: object
    engine: RolloutEngine
    optimizer: torch.optim.Optimizer
    buffer: ReplayStore                    # buffer group: the replay store
    loss: Objective                        # loss group: the loss of a micro-batch
    trainer: Trainer                       # trainer group: the update that runs it (over ranks: its data-parallel twin)
    sampling: StandardSampling              # the sampling group, with the behaviour policy
    curriculum: object                     # curriculum group: PromptSampler or CurriculumSampler
    behaviour: object                      # behaviour group: CurrentBehaviour or BehaviourPolicy
    forward: Forward
    groups_per_step: int                   # B
    task: Task                             # task group: data, prompts, verifier (src/task/base.py)

    def measure_behaviour(self, groups: list[Group]) -> list[Group]:
        """`groups` with log mu of the current policy at the training temperature (no-grad forward)."""
        return self.forward.with_sampled_logprobs(groups, self.policy, self.behaviour.training_temperature)
