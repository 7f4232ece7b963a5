"""The runtime interface: what every option of the `runtime` group gives `src.run`'s one loop (SPEC 11).

A runtime answers four things, and the loop asks nothing else of it:

* placement, before anything is built (class methods, from the group's node): where the trainer sits
  (`trainer_device`) and in how many processes the cell runs (`processes`: torchrun's ranks each run the
  loop, or one driver process whose trainer ranks live elsewhere);
* the processes that run the loop, for the run's length (`joined`): what only the lead process does
  (`lead`, `lead_only`, `lead_context`), the parts placed over them and restored from a checkpoint (`place`),
  one tracker for all (`tracking`), a checkpoint (`save`), one stop for all (`agreed_stop`) and the whole policy
  (`whole_policy`). In one process each call does its one-process part; over torchrun's ranks `src.runs.ranks`
  does the rest. The loop never asks how many processes there are;
* steps: `session(context)` opens what supplies the loop's steps and yields `Steps`, whose `next()` trains
  one step; the session closes when the loop leaves it, however it leaves;
* its own state for the checkpoint (`state_dict`, `load_state_dict`), beside the trainer's.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from contextlib import AbstractContextManager, contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, ClassVar, Iterator

from src.variant import Variant


@dataclass
class RunContext:
    """What a runtime's session gets from `src.run`: the run's parts, its state and where its files go."""

    run: object                        # src.settings.RunSettings
    parts: object                      # src.components.Components
    state: object                      # src.batch.TrainState: read by the steps, advanced by the loop alone
    output_dir: Path
    log_artifact: Callable[[Path], None]  # a file for the MLflow run, under runtime/


@dataclass
class StepOutcome:
    """One trained step: its metrics, what it adds to the run's counters, which the loop adds
    (`TrainState.advance`), and the responses it picked for the run's completions table, by count
    (`src.train.picked_completions`: picked where the step trained, so its batch need not travel)."""

    metrics: dict[str, float]
    counts: object                     # src.batch.StepCounts
    completions: dict[int, list]       # count -> [src.train.Completion]


class Steps(ABC):
    """A runtime's open session, as the loop drives it."""

    @abstractmethod
    def next(self) -> StepOutcome:
        """Train step `state.step`; the loop counts it (`TrainState.advance`) once this returns."""

    def before_checkpoint(self) -> None:
        """Bring the policy, optimizer and RNG the checkpoint saves into this process (default: they are here)."""

    def before_evaluation(self) -> None:
        """Bring the policy the evaluation samples into this process (default: it is here)."""


class Runtime(Variant, ABC):
    """What supplies the steps of the loop: placement, a session of steps, and its own checkpointed state."""

    # Whether `hardware.ranks` are processes that each run the loop (torchrun's, or SLURM's tasks); otherwise the
    # cell runs in one process and the runtime places its trainer ranks itself.
    ranks_run_the_loop: ClassVar[bool] = False
    # Whether the step replays from the `buffer` option's store of groups; otherwise the runtime keeps the replay
    # itself (seed 001's pipeline: the option's rollout form, `ReplayStore.rollout_queue`) and the step's store
    # keeps nothing.
    step_replays: ClassVar[bool] = True

    @classmethod
    def trainer_device(cls, node, run) -> str:
        """Where the run's trainer sits (`run`: `src.settings.RunSettings`): `hardware.device` unless the runtime
        places a bare `cuda` itself."""
        return run.hardware.device

    @classmethod
    def gpus_needed(cls, node, ranks: int, device: str, nodes: int = 1) -> int:
        """The GPUs a cell occupies on `device` with `ranks` trainer ranks over `nodes` nodes: one a rank, unless
        the runtime places more on GPUs of their own."""
        return ranks

    @classmethod
    def processes(cls, node, ranks: int | None, nodes: int = 1) -> int:
        """How many processes run the cell for `hardware.ranks=ranks` over `nodes` nodes: the ranks where they run
        the loop; else one driver and one process for each further node (its Ray cluster's, `serves`)."""
        return int(ranks or 1) if cls.ranks_run_the_loop else int(nodes or 1)

    @classmethod
    def store_label(cls, node, cfg, reader: bool = False) -> str | None:
        """The replay store's part of the cell name (or, `reader`, of its reader's name) when the runtime gives
        it (None: the store's own label)."""
        return None

    @classmethod
    def identity(cls, resolved: dict, cfg) -> dict:
        """The resolved config a cell id hashes (`src.study.sweep.cell_identity`), as this runtime spells it."""
        return resolved

    # ---- the processes that run the loop (src.runs.ranks: torchrun's ranks, or this one process)
    _ranks = None  # set by `joined`; one process until then

    @property
    def ranks(self):
        """This process's place among the processes that run the loop (`src.runs.ranks.Ranks`)."""
        if self._ranks is None:
            from src.runs.ranks import Ranks  # here: describing a runtime (the config checks) loads no torch

            self._ranks = Ranks()
        return self._ranks

    def serves(self, run, error=ValueError) -> bool:
        """Whether this process serves the run from a further node (SLURM's task on a node of the run's Ray
        cluster) and runs no loop: it returns once the run, which the first node drives, has ended."""
        return False

    @contextmanager
    def joined(self, run, error=ValueError) -> Iterator["Runtime"]:
        """The run's processes (`processes`: torchrun's ranks where they run the loop, else this one) joined for
        the run's length; `error` with one line when torchrun started other processes than the run wants."""
        from src.runs.ranks import joined

        wanted = self.processes(run.groups["runtime"], run.hardware.ranks)  # the processes torchrun started
        with joined(wanted, run.hardware.device, error, run.hardware.ranked, run.hardware.nodes) as ranks:
            self._ranks = ranks
            yield self

    @property
    def lead(self) -> bool:
        """Whether this process leads: it alone talks to MLflow, writes the run's files and prints its results."""
        return self.ranks.lead

    def lead_only(self, work, *args, **kwargs):
        """`work(*args, **kwargs)` in the lead process, its result (or the exception it raised) in every one."""
        return self.ranks.lead_only(work, *args, **kwargs)

    def lead_context(self, context, elsewhere=None):
        """`context` entered in the lead process only (the heartbeat); `elsewhere` in the others."""
        return self.ranks.lead_context(context, elsewhere)

    def place(self, parts, checkpoint: dict | None):
        """`parts` placed over the processes (FSDP2 shards over ranks), a checkpoint's state restored into them and
        into this runtime; returns the parts and the run's `src.batch.TrainState` (a fresh one without a checkpoint)."""
        parts = self.ranks.shard(parts)
        if not checkpoint:
            from src.batch import TrainState

            return parts, TrainState()
        state = self.ranks.restore(checkpoint, parts)
        self.load_state_dict(checkpoint.get("runtime"))
        return parts, state

    def tracking(self, opened):
        """The lead process's MLflow run (`opened`, a context giving its Tracker) as every process's tracker."""
        return self.ranks.tracking(opened)

    def save(self, folder: Path, parts, step: int, write: Callable) -> None:
        """A checkpoint at `step`: each rank's shards first, then the lead's checkpoint file (`write(shards)`)."""
        self.ranks.save(folder, parts, step, write)

    def agreed_stop(self, requested: int) -> int:
        """The stop signal any process got (0: none), the same in every process, so they stop after one step."""
        return self.ranks.most(requested)

    def whole_policy(self, policy) -> dict | None:
        """The whole policy's weights where its shards lie over ranks (every rank calls it); None in one process."""
        return self.ranks.gathered_state(policy)

    @abstractmethod
    def session(self, context: RunContext) -> AbstractContextManager[Steps]:
        """Open what supplies the steps; closing it leaves the trained policy in this process."""

    @abstractmethod
    def state_dict(self) -> dict | None:
        """The runtime's own state for the checkpoint (None: it has none)."""

    @abstractmethod
    def load_state_dict(self, saved: dict | None) -> None:
        """Take a checkpoint's runtime state back, or refuse one this runtime cannot resume, in one line."""
