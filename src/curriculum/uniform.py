"""Uniform prompt sampling for training (curriculum=none), with a state that survives a checkpoint.

The prompt samplers live together here: this uniform one and the curricula of `sampler.py`, which wrap it."""

from __future__ import annotations

import random
from collections.abc import Sequence
from typing import Any

from src.variant import Variant

Instance = Any  # a task's training instance, opaque to the sampler


class PromptSampler(Variant):
    """Draws distinct training instances within a step, independently across steps."""

    @classmethod
    def plain(cls, node) -> bool:
        return True

    def __init__(self, instances: Sequence[Instance], seed: int, name: str = "none", task=None):
        # `name` is the YAML's label for people (MLflow tags): uniform sampling has no setting, and asks the
        # `task` nothing about its prompts.
        if not instances:
            raise ValueError("the training set is empty: check task.train_size and task.source")
        self.instances = list(instances)
        self.rng = random.Random(seed)

    def sample(self, count: int) -> list[Instance]:
        """`count` instances without replacement (with replacement only if count exceeds the set)."""
        if count <= len(self.instances):
            return self.rng.sample(self.instances, count)
        return self.rng.choices(self.instances, k=count)

    def observe(self, instances: Sequence[Instance], rewards: Sequence[Sequence[float]], step: int) -> None:
        """No-op: uniform sampling ignores outcomes (same interface as src.curriculum.sampler.CurriculumSampler)."""

    def metrics(self) -> dict[str, float]:
        """No curriculum metrics for uniform sampling."""
        return {}

    def state_dict(self) -> dict:
        return {"rng": self.rng.getstate()}

    def load_state_dict(self, state: dict) -> None:
        version, internal, gauss = state["rng"]
        self.rng.setstate((version, tuple(internal), gauss))
