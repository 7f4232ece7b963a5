"""The replay-store interface every `buffer` option implements (SPEC 3 steps 3 and 5, SPEC 9 variants).

A training step asks its store five things, in this order:

    replayed = store.draw(count, step)                     # reused groups for this step's batch
    batch = store.compose(fresh, replayed, step, measure)  # the update batch (POPO refills here)
    extra = store.extra_batches(step)                      # further update batches (seed 002's R - 1)
    store.store(groups, step)                              # keep this step's fresh groups, drop old ones
    store.metrics(step)                                    # what to log about the store

and saves and restores it with `state_dict` / `load_state_dict` (written once, here: a store lists
its settings, counters and random generator, and turns its contents into plain data). A store is
built from its YAML by `hydra.utils.instantiate` with `groups_per_step` and `seed` added, so a
store written anywhere plugs in with `buffer._target_=module.Class`.

A store class also describes itself (`src.variant.Variant`): its cell and reader labels, its
cross-group checks, its settings' ranges, and what the budget planner (`src.study.budget`) simulates: the
store itself, built from its group's settings and driven through `draw` and `store` with placeholder
groups, plus the age window that decides when the simulated schedule repeats.
"""

from __future__ import annotations

import dataclasses
import random
from typing import Callable, ClassVar, Iterable

from hydra.errors import InstantiationException
from hydra.utils import instantiate

from src.batch import Batch, BatchGroup, Group
from src.buffer.rollouts import LifoQueue
from src.validate.checks import check_int
from src.variant import Variant, described, float_knob, int_knob

_STATE_VERSION = 2

# Groups that carry no log mu yet -> the same groups with it (a no-grad forward pass of the current policy).
Measure = Callable[[list[Group]], list[Group]]


# What a store's rollout form reads under runtime=async only (`Knob.queue_only`): the rollouts a batch draws and
# the age window, past which the pipeline drops rollouts before a draw.
QUEUE_KNOBS = {
    "batch_rollouts": int_knob(1, 100_000_000, "60 or null", nullable=True, queue_only=True,
                               why="B, rollouts an update draws (null: trainer.groups_per_step x group_size)"),
    "max_age": int_knob(0, 100_000, "2 (0: none)", queue_only=True,
                        why="L: rollouts more than L updates old are dropped before a draw"),
}


def batch_rollouts(node, trainer) -> int:
    """B under runtime=async: `buffer.batch_rollouts` (seed 001 D.2 trains on 60 rollouts from the buffer, each
    keeping the advantage its group gave it at generation), or by default the synchronous step's work,
    trainer.groups_per_step x trainer.group_size."""
    value = node.get("batch_rollouts")
    if value is None:
        return int(trainer.groups_per_step) * int(trainer.group_size)
    return check_int("buffer.batch_rollouts", value, 1, "60 (seed 001), or null for trainer.groups_per_step x "
                     "trainer.group_size.")


def age_window(node) -> int | None:
    """L under runtime=async: rollouts more than `buffer.max_age` updates old are dropped before a draw; None
    where it is 0 (no window: the capacity N bounds staleness)."""
    return int(node.get("max_age", 0)) or None


class ReplayStore(Variant):
    """Base of every store: no replay at all unless a subclass draws, composes or stores something."""

    ratio: float = 0.0                 # rho: planned replayed groups per fresh group
    settings: tuple[str, ...] = ()     # attributes a checkpoint must agree on
    counters: tuple[str, ...] = ()     # attributes restored from a checkpoint as ints
    knobs = {"ratio": float_knob(0, 64, "1", why="rho: replayed groups per fresh group; 0 is fresh-only"),
             "max_age": int_knob(0, 1_000, "2", why="L: the oldest step a replayed group may come from"),
             "capacity": int_knob(1, 10_000_000, "4096")}

    # ---- what the store says about itself (class methods on the group's config node) ----
    @classmethod
    def fresh_only(cls, node) -> bool:
        """These settings replay nothing, so the cell is fresh-only: no buffer or clip enters its identity
        or name (`src.study.sweep`). False by default: a store's settings then always name its cell."""
        return False

    # False for a store that never replays by plan (rho is 0 by its settings): the budget table's rows at rho > 0
    # then plan the age buffer with L = 1 (`age_stand_in`), so they show what replay would cost.
    plans_replay: ClassVar[bool] = True

    @classmethod
    def plan_window(cls, node, steps: int) -> int | None:
        """The age window L the budget plan simulates (groups of age 1..L are drawn), or None for a store that
        draws from every stored group of age >= 1, whose next draw then depends on how many it holds."""
        return None if cls.plans_replay else 1

    @classmethod
    def plan_store(cls, node, ratio: float, groups_per_step: int) -> "ReplayStore":
        """The store the budget planner drives through `draw` and `store`: this one, with the group's settings
        at the planned rho (placeholder groups carry rewards 0 and the run's K)."""
        if not cls.plans_replay:
            return age_stand_in(node)
        try:
            return instantiate(node, ratio=float(ratio), groups_per_step=int(groups_per_step), seed=0)
        except InstantiationException as error:  # a bad setting: the constructor's own one-line message
            raise (error.__cause__ or error) from None

    @classmethod
    def rollout_queue(cls, node, trainers: int) -> tuple[type, dict]:
        """The store's form under `runtime=async`: the rollout queue class (`src.buffer.rollouts`) and its
        arguments but the seed (`trainers`: T, for a store that keeps one FIFO per trainer (D.4)).
        Seed 001's pipeline keeps rollouts, not groups (D.2), and draws its batches from the queue instead of
        the step's plan, so a store has this form only where the paper gives one: the FIFO
        (`buffer=fifo`) and no buffer at all, the LIFO pipe (`buffer=none`). Others are refused in one line."""
        raise ValueError(f"buffer={node.get('name', cls.__name__)} with runtime=async: seed 001's pipeline keeps "
                         "rollouts and has a FIFO of them (buffer=fifo) or none, each rollout used once (buffer=none); "
                         f"{cls.__name__} keeps groups for the synchronous step only; use buffer=fifo or buffer=none "
                         "(or buffer=rlep, whose pool joins the pipe), or runtime=sync")

    @classmethod
    def reward_dependent(cls, node) -> bool:
        """True when what the store keeps depends on rewards, so a plan from all-zero placeholder rewards is
        an upper bound once its pool runs short (seed 001's positive-bias FIFO with distinct draws)."""
        return False

    # True for a store whose `buffer.capacity` cell ids of version 1 hashed in groups (it counts rollouts now).
    capacity_counted_groups: ClassVar[bool] = False

    @classmethod
    def identity(cls, node, resolved: dict, cfg) -> dict:
        """The store's part of the config a cell id hashes (`src.study.sweep.cell_identity`): its resolved settings,
        with N in the groups it keeps (floor(N / K)) where cell ids of version 1 hashed N in groups, so every cell
        keeps its id (N = 256 groups then is N = 4096 rollouts at K = 16). Under a runtime whose step replays, the
        settings of the store's rollout form alone (`Knob.queue_only`) change nothing and name nothing."""
        if getattr(described(cfg.runtime), "step_replays", True):
            resolved = {key: value for key, value in resolved.items()
                        if not (key in cls.knobs and cls.knobs[key].queue_only)}
        if not cls.capacity_counted_groups:
            return resolved
        return {**resolved, "capacity": int(node.capacity) // int(cfg.trainer.group_size)}

    @classmethod
    def short_pool(cls, node, b_replay: int, gap_fill: str, group_size: int) -> str:
        """Why the store's pool holds fewer than B_replay groups, for a plan without an age window."""
        return (f"formula does not hold: buffer={node.get('name', cls.__name__)} keeps fewer groups than "
                f"B_replay={b_replay}: {gap_fill}")

    def __init__(self, seed: int = 0) -> None:
        self.seed = int(seed)
        self._rng = random.Random(self.seed)
        self._occupancy: dict[int, int] = {}
        self._groups: list[Group] = []  # insertion order == step order

    def __len__(self) -> int:
        return len(self.groups)

    @property
    def groups(self) -> tuple[Group, ...]:
        """All stored groups, oldest first (read-only view)."""
        return tuple(self._groups)

    # ---- the step's five calls ----
    def draw(self, count: int, step: int) -> list[BatchGroup]:
        """Up to `count` reused groups for step `step`; the step fills any gap with fresh ones."""
        self._occupancy = self.age_histogram(step)
        return self._draw(count, step)

    def compose(self, fresh: list[BatchGroup], replayed: list[BatchGroup], step: int, measure: Measure) -> Batch:
        """The update batch: fresh groups first, then the replayed ones."""
        return Batch(fresh + replayed)

    def extra_batches(self, step: int) -> list[Batch]:
        """Batches of further updates after the main one, before `store` (none by default)."""
        return []

    def store(self, groups: list[Group], step: int) -> None:
        """Keep this step's fresh groups (each with log mu) and drop what can no longer be drawn."""

    def metrics(self, step: int) -> dict[str, float]:
        """Stored groups by age when the step drew, plus the store's own statistics."""
        return {"buffer/size": sum(self._occupancy.values()),
                **{f"buffer/age{age}": count for age, count in self._occupancy.items()}}

    # ---- what subclasses fill in ----
    def _draw(self, count: int, step: int) -> list[BatchGroup]:
        return []

    def age_histogram(self, step: int) -> dict[int, int]:
        return {}

    def _contents(self) -> object:
        return [dataclasses.asdict(group) for group in self._groups]

    def _restore(self, contents: object) -> None:
        self._groups = [Group(**group) for group in contents]

    # ---- persistence, once for every store ----
    def state_dict(self) -> dict:
        """Plain data only (a checkpoint is loaded with weights_only=True): settings, RNG, counters, contents."""
        version, internal, gauss_next = self._rng.getstate()
        return {"version": _STATE_VERSION, "store": type(self).__name__,
                "settings": {name: getattr(self, name) for name in self.settings}, "seed": self.seed,
                "rng_state": [version, list(internal), gauss_next],
                "counters": {name: getattr(self, name) for name in self.counters},
                "contents": self._contents()}

    def load_state_dict(self, state: dict) -> None:
        """Restore `state_dict()`'s snapshot; refuses one written by another store or other settings."""
        if state.get("version") != _STATE_VERSION or state.get("store") != type(self).__name__:
            raise ValueError(f"the checkpoint's replay store is {state.get('store')!r} (state version "
                             f"{state.get('version')!r}), this run's is {type(self).__name__!r} (version "
                             f"{_STATE_VERSION}); resume with the buffer settings the run started with")
        for name, value in state["settings"].items():
            if value != getattr(self, name):
                raise ValueError(f"the checkpoint's replay store has {name}={value!r}, this run's has "
                                 f"{name}={getattr(self, name)!r}; resume with the same buffer settings")
        self.seed = int(state["seed"])
        version, internal, gauss_next = state["rng_state"]
        self._rng.setstate((int(version), tuple(int(x) for x in internal), gauss_next))
        for name, value in state["counters"].items():
            setattr(self, name, int(value))
        self._restore(state["contents"])


class NoReplay(ReplayStore):
    """`buffer=none`: fresh-only training; nothing is drawn or kept, and the buffer metrics stay empty."""

    plans_replay = False

    # Under runtime=sync no age window and no capacity: `buffer=none buffer.max_age=2` is refused there as a
    # setting with no effect.
    knobs = {"ratio": ReplayStore.knobs["ratio"], "max_age": QUEUE_KNOBS["max_age"],
             "batch_rollouts": QUEUE_KNOBS["batch_rollouts"],
             "capacity": int_knob(1, 100_000_000, "1024", queue_only=True, why="the LIFO queue's bound in "
                                  "rollouts, queued plus in flight (workers wait above it)")}

    @classmethod
    def rollout_queue(cls, node, trainers: int) -> tuple[type, dict]:
        """Seed 001's on-policy streaming baseline (B.1): no buffer, the newest rollouts first, each used once."""
        return LifoQueue, {"capacity": node.capacity}

    @classmethod
    def fresh_only(cls, node) -> bool:
        return True

    cell_tag = "rho0"

    reader_tag = "Fresh-only"

    def __init__(self, name: str = "none", ratio: float = 0.0, max_age: int = 0, capacity: int = 0,
                 allow_infeasible: bool = False, groups_per_step: int = 0, seed: int = 0,
                 batch_rollouts: int | None = None) -> None:
        if ratio != 0:
            raise ValueError(f"buffer.ratio rho={ratio}: buffer=none replays nothing; choose buffer=age1 (or another "
                             "store) to reuse groups")
        super().__init__(seed)

    def metrics(self, step: int) -> dict[str, float]:
        return {"buffer/size": 0}


def age_stand_in(node) -> ReplayStore:
    """The age buffer with L = 1 that the budget table plans at rho > 0 for a store that never replays by plan
    (buffer=none, buffer=popo: rho is 0 by their settings), so its rows show what replay would cost."""
    # Named, not imported: the age store builds on this module.
    return instantiate({"_target_": "src.buffer.age.ReplayBuffer", "max_age": 1,
                        "capacity": int(node.get("capacity", 4096))})


def checked_for_storing(groups: Iterable[Group], store: str) -> list[Group]:
    """`groups` as a list, each a Group that carries log mu (a replayed group is weighted against it)."""
    new = list(groups)
    for group in new:
        if not isinstance(group, Group):
            raise TypeError(f"{store}.add expects Group objects, got {type(group).__name__}.")
        if group.behaviour_logprobs is None:
            raise ValueError(f"Group sampled at step {group.step} has no behaviour_logprobs; call "
                             "group.with_behaviour_logprobs(...) with the trainer's log mu(y|x) before add().")
    return new


def replayed(groups: list[Group], step: int) -> list[BatchGroup]:
    """Whole stored groups as replayed batch entries, with their age at `step`."""
    return [BatchGroup(group, "replay", group.age(step)) for group in groups]
