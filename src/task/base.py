"""The task interface (`task` config group; SPEC 12): what the trainer, the evaluation and the SFT warm
start need from a task, and nothing else.

A task supplies its data (training and held-out instances), the prompt text of an instance (the
policy's chat template is applied by `src.task.prompts.PromptFormat`), answer extraction, the
verifier (reward and reason), the failure categories of an evaluated response, the ground truth a
stored group keeps (one opaque JSON value, and the instance rebuilt from it), a one-line brief of an
instance for the completions tables, and whether (and how) the frontier curricula (seed 004) can embed
its prompts. Its YAML names the implementation with `_target_`, so adding a task is one module plus one YAML:

    conf/task/<name>.yaml:  _target_: src.task.<module>.<Class>, then the class's settings

An implementation validates its settings in its constructor (one line naming the key, the value and
the fix, raised as ValueError) and loads no data there: `src.command.config.validate` builds it before any
compute. Instances are whatever the task needs (frozen dataclasses with a `key` for disjointness);
outside the task they are opaque: code there reads only their `key`, and asks the task everything else.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Mapping, Sequence
from types import MappingProxyType
from typing import Any, ClassVar, Protocol

from src.variant import Knob, Variant


class TaskDataError(ValueError):
    """The task's data cannot give what the config asks (too few problems, no usable rows): one line."""


class Verdict(Protocol):
    """What a verifier returns: the reward and why (a short reason, one of the task's reasons)."""

    reward: float
    reason: str


class Task(Variant, ABC):
    """One task: data, prompts, extraction, verifier, failure categories (see the module docstring).

    A Variant so that it describes itself: `knobs` declares the settings of its own (beyond the keys every task
    shares, conf/task/*.yaml), which the config checks then accept and bound as a buffer's."""

    knobs: ClassVar[dict[str, Knob]] = {}
    name: str = "task"
    correct_reward: float = 1.0            # a response is correct when its reward equals this (SPEC 2, 12)
    failure_categories: tuple[str, ...] = ()
    # The frontier, failure and goldilocks curricula retrieve prompts by a task-specific embedding
    # (src/curriculum/frontier.py, seed 004 app. B.2); a task without one refuses them in one line.
    supports_curriculum: bool = False
    # Its part of a cell's name and of the reader's label: the default task (Countdown) adds nothing, so
    # the studies' cell names read as the paper's grid.
    cell_suffix: str = ""
    reader_name: str = ""
    # The tiny policy's warm start (src/policy/sft.py) where this task's differs from the defaults there,
    # e.g. {"steps": 1000}: what `python -m src.policy.sft task=<name>` trains with unless told otherwise.
    warm_start: Mapping[str, int] = MappingProxyType({})

    @abstractmethod
    def splits(self, train_size: int | None = None) -> tuple[list, list]:
        """Training and held-out instances, disjoint (`train_size` overrides the configured size)."""

    def heldout(self) -> list:
        """The held-out instances only (the evaluation needs no training data)."""
        return self.splits()[1]

    @abstractmethod
    def prompt(self, instance: Any) -> str:
        """The prompt text of an instance, before any chat template."""

    @abstractmethod
    def extract(self, response: str) -> str | None:
        """The final answer a response gives (the diversity metric's key), None without one."""

    @abstractmethod
    def verify(self, response: str, instance: Any) -> Verdict:
        """The verifier on one untrusted response: reward and reason."""

    def verify_all(self, responses: Sequence[str], instance: Any) -> list[Verdict]:
        """The verifier on a group of responses to one instance (a task may run them in parallel)."""
        return [self.verify(response, instance) for response in responses]

    @abstractmethod
    def classify_failure(self, response: str, verdict: Verdict, truncated: bool) -> str:
        """The dominant failure category (one of `failure_categories`) of a failed response."""

    @abstractmethod
    def truth(self, instance: Any) -> Any:
        """The ground truth a stored `src.batch.Group` keeps for this instance: one plain JSON value (lists, dicts,
        strings, numbers) that only this task reads back (`instance_of`); the rest of the code passes it on."""

    @abstractmethod
    def describe(self, instance: Any) -> dict[str, Any]:
        """Columns that identify the instance in the evaluation's per-prompt table."""

    @abstractmethod
    def brief(self, instance: Any) -> str:
        """The instance in the task's own words, in one short line (Countdown: the numbers and the target; math:
        the problem): what a researcher reads beside a completion, where the prompt opens with instructions."""

    @abstractmethod
    def instance_of(self, group: Any) -> Any:
        """The instance a stored `src.batch.Group` answers, rebuilt from what the group keeps (its prompt and
        the ground truth `truth` gave it): a replayed group carries no instance."""

    def features(self, instance: Any, width: int) -> list[float]:
        """phi(x), the numbers a frontier curriculum embeds a prompt by (seed 004 app. B.2), their count fixed
        by `width` (curriculum.max_numbers); only a task with `supports_curriculum` has them."""
        raise NotImplementedError(f"task={self.name} has no prompt embedding for the frontier curricula")

    def instance_from_truth(self, truth: Any) -> Any:
        """The instance whose `truth` this is, where the truth alone says it: a curriculum's checkpoint and
        ZIP-RC's rollout files keep their prompts as the truth of each."""
        raise NotImplementedError(f"task={self.name} cannot rebuild an instance from its truth alone")

    def demonstrations(self, count: int, seed: int) -> list[tuple[str, str]]:
        """(prompt, response) pairs for a supervised warm start, outside the held-out set."""
        raise NotImplementedError(f"task={self.name} has no demonstrations for a supervised warm start")

    def check_curriculum(self, name: str) -> None:
        """Refuse, in one line, a prompt curriculum this task cannot serve."""
        if name != "none" and not self.supports_curriculum:
            raise ValueError(f"curriculum={name} retrieves prompts by a task-specific embedding, which task="
                             f"{self.name} does not have; use curriculum=none with task={self.name}")

    def close(self) -> None:
        """Release what the task holds (worker processes); the default holds nothing."""


def settings_of(node: Mapping) -> dict[str, Any]:
    """A task config node as plain keyword arguments (without `_target_`)."""
    from omegaconf import OmegaConf

    if OmegaConf.is_config(node):
        node = OmegaConf.to_container(node, resolve=True)
    return {key: value for key, value in dict(node).items() if key != "_target_"}


def task_class(node: Mapping | None) -> type[Task]:
    """The task class a config node names with `_target_`."""
    from hydra.utils import get_class

    return get_class(str(node["_target_"]))


def build_task(node: Mapping) -> Task:
    """The task a config node names with `_target_`."""
    return task_class(node)(**settings_of(node))
