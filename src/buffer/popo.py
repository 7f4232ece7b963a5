"""POPO batch composition: drop ineffective online groups, refill from recent effective ones (SPEC 9 "POPO").

Source: seed 003 (docs/papers.md), "RLVR without Ineffective Samples:
Group Prioritized Off-Policy Optimization", section 4.1 (prioritized group replay) and
section 5.3 (ablations). The equations did not survive the text conversion; the rules below are
read from the prose.

* Definition 3.1: a group is *ineffective* when its rewards have zero variance (all equal);
  its leave-one-out advantages are all zero, so it carries no learning signal.
* Eq. 5-6: of the B online groups of a step keep the effective ones, in their online order, and
  fill the remaining ``B - #effective`` slots from a replay memory of effective groups.
* Eq. 7: the memory is a FIFO queue and POPO "deterministically selects groups from the tail":
  the most recently stored ones. Since at most B groups are replayed per step, its capacity is B.
* After the batch is built the memory takes in the step's effective online groups. Callers
  ``add`` after the update, so, as in :mod:`src.buffer.age`, a group is never replayed at the
  step that sampled it; the selection also skips any group of the current step.
* Replayed groups stay in the memory; they leave only when newer groups push them out.

Ablations (section 5.3), each a ``variant``:

* ``"popo"``: the method above.
* ``"popo-ineff"``: ineffective online groups are still dropped, but the refill comes from the
  most recent groups "regardless of their effectiveness": the memory takes in every online group.
* ``"popo-stale"``: POPO-stale(n) "randomly replays historical effective groups from a larger
  buffer", regardless of staleness. The buffer size is lost with the equations; we read it as
  n times POPO's capacity (``stale_factor=n``) and draw uniformly without replacement, so
  POPO-stale(1) differs from POPO only by drawing at random instead of from the tail.

If the memory holds too few eligible groups (the first steps) the batch is smaller than B
(``PopoBatch.shortfall``); POPO generates no extra rollouts to fill it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Iterable, Sequence

from src.batch import Batch, BatchGroup, Group, is_effective
from src.buffer.store import Measure, ReplayStore, replayed
from src.validate.checks import check_choice, check_int
from src.variant import check_recipe, described, int_knob

POPO_VARIANTS = ("popo", "popo-ineff", "popo-stale")


def _check_variant(variant: str) -> str:
    return check_choice("buffer.variant", variant, POPO_VARIANTS)


def _check_stale_factor(stale_factor: int, variant: str) -> int:
    """n of POPO-stale(n): an integer >= 1, above 1 only for the popo-stale variant."""
    stale_factor = int(stale_factor)
    if variant != "popo-stale" and stale_factor != 1:
        raise ValueError(f"buffer.stale_factor={stale_factor}: above 1 only with buffer.variant=popo-stale, "
                         f"not {variant!r}")
    return stale_factor


class EffectiveGroupMemory(ReplayStore):
    """FIFO memory of recent (effective) groups for POPO refills; oldest dropped first."""

    settings = ("capacity", "effective_only")
    counters = ("added", "rejected", "dropped")

    def __init__(self, capacity: int, effective_only: bool = True, seed: int = 0) -> None:
        super().__init__(seed)
        self.capacity = check_int("capacity", capacity, 1, "POPO uses the batch size B.")
        self.effective_only = bool(effective_only)  # False only for the POPO-ineff ablation
        self.added = 0
        self.rejected = 0  # ineffective groups refused by an effective-only memory
        self.dropped = 0  # groups pushed out by newer ones

    def eligible(self, step: int) -> list[Group]:
        """Stored groups that may be replayed at `step` (sampled before it), oldest first."""
        return [g for g in self._groups if g.age(step) >= 1]

    def add(self, groups: Iterable[Group]) -> int:
        """Take in this step's online groups (call after the update); returns how many were stored."""
        new = list(groups)
        newest = self._groups[-1].step if self._groups else None
        for g in new:
            if not isinstance(g, Group):
                raise TypeError(f"EffectiveGroupMemory.add expects Group objects, got {type(g).__name__}.")
            if newest is not None and g.step < newest:
                raise ValueError(
                    f"Group sampled at step {g.step} added after a group of step {newest}; "
                    "add each step's online groups once, in step order."
                )
            newest = g.step
        admitted = [g for g in new if is_effective(g)] if self.effective_only else new
        for g in admitted:
            # The replayed part of the loss is weighted by pi_prox / mu (seed 003 section 4.2), so mu is needed.
            if g.behaviour_logprobs is None:
                raise ValueError(
                    f"Group sampled at step {g.step} has no behaviour_logprobs; "
                    "call group.with_behaviour_logprobs(...) with the trainer's log mu(y|x) before add()."
                )
        self.rejected += len(new) - len(admitted)
        self._groups.extend(admitted)
        self.added += len(admitted)
        overflow = len(self._groups) - self.capacity
        if overflow > 0:
            del self._groups[:overflow]
            self.dropped += overflow
        return len(admitted)

    def most_recent(self, count: int, step: int) -> list[Group]:
        """The `count` most recently stored eligible groups (the FIFO tail, seed 003 Eq. 7), oldest first."""
        count = check_int("count", count, 0)
        pool = self.eligible(step)
        return pool[len(pool) - min(count, len(pool)):]

    def random(self, count: int, step: int) -> list[Group]:
        """min(count, #eligible) eligible groups drawn uniformly without replacement (POPO-stale)."""
        count = check_int("count", count, 0)
        pool = self.eligible(step)
        k = min(count, len(pool))
        if k == 0:
            return []  # consume no randomness, so empty draws do not shift the RNG stream
        return self._rng.sample(pool, k)


def make_memory(variant: str, batch_size: int, stale_factor: int = 1, seed: int = 0) -> EffectiveGroupMemory:
    """The memory a variant needs: capacity B (n*B for popo-stale), effective-only except for popo-ineff."""
    variant = _check_variant(variant)
    batch_size = check_int("batch_size", batch_size, 1)
    capacity = batch_size * _check_stale_factor(stale_factor, variant)
    return EffectiveGroupMemory(capacity=capacity, effective_only=variant != "popo-ineff", seed=seed)


@dataclass(frozen=True)
class PopoBatch:
    """Which groups form a POPO training batch, and why."""

    online: tuple[Group, ...]  # effective online groups kept, in online order (on-policy)
    replayed: tuple[Group, ...]  # refill from the memory (off-policy)
    dropped: tuple[Group, ...]  # ineffective online groups left out
    batch_size: int

    @property
    def groups(self) -> tuple[Group, ...]:
        """The training batch: online groups first, then replayed ones."""
        return self.online + self.replayed

    @property
    def shortfall(self) -> int:
        """Slots left empty because the memory held too few eligible groups."""
        return self.batch_size - len(self.groups)

    @property
    def effective_sample_ratio(self) -> float:
        """Share of effective groups in the training batch (seed 003 Fig. 3); 0.0 for an empty batch."""
        batch = self.groups
        return sum(is_effective(g) for g in batch) / len(batch) if batch else 0.0

    @property
    def on_policy_share(self) -> float:
        """Share of the training batch that is online, i.e. on-policy (seed 003 Fig. 8); 0.0 for an empty batch."""
        batch = self.groups
        return len(self.online) / len(batch) if batch else 0.0

    @property
    def online_effective_ratio(self) -> float:
        """Share of the online groups that were effective (the ratio plain GRPO/RLOO would train on)."""
        n_online = len(self.online) + len(self.dropped)
        return len(self.online) / n_online if n_online else 0.0

    def metrics(self, prefix: str = "popo/") -> dict[str, float]:
        """Flat float metrics for logging."""
        return {
            f"{prefix}effective_sample_ratio": self.effective_sample_ratio,
            f"{prefix}on_policy_share": self.on_policy_share,
            f"{prefix}online_effective_ratio": self.online_effective_ratio,
            f"{prefix}online_groups": float(len(self.online)),
            f"{prefix}replayed_groups": float(len(self.replayed)),
            f"{prefix}dropped_groups": float(len(self.dropped)),
            f"{prefix}shortfall": float(self.shortfall),
        }


def compose_batch(online_groups: Sequence[Group], memory: EffectiveGroupMemory, batch_size: int,
                  variant: str = "popo", *, step: int) -> PopoBatch:
    """Keep the effective online groups of `step`, then refill up to `batch_size` from `memory` as `variant` says.

    Does not add anything to the memory: call ``memory.add(online_groups)`` after the update.
    """
    variant = _check_variant(variant)
    batch_size = check_int("batch_size", batch_size, 1)
    online_groups = list(online_groups)
    if len(online_groups) > batch_size:
        raise ValueError(
            f"Got {len(online_groups)} online groups for batch_size={batch_size}; POPO samples B prompts "
            "per step, so pass at most batch_size online groups."
        )
    # popo-ineff needs a memory that also stores ineffective groups; the others must not store them.
    wants_effective_only = variant != "popo-ineff"
    if memory.effective_only != wants_effective_only:
        raise ValueError(
            f"variant {variant!r} needs a memory with effective_only={wants_effective_only}, got "
            f"effective_only={memory.effective_only}; build it with make_memory({variant!r}, batch_size)."
        )
    online = tuple(g for g in online_groups if is_effective(g))
    dropped = tuple(g for g in online_groups if not is_effective(g))
    missing = batch_size - len(online)
    if variant == "popo-stale":
        replayed = memory.random(missing, step)
    else:
        replayed = memory.most_recent(missing, step)
    return PopoBatch(online=online, replayed=tuple(replayed), dropped=dropped, batch_size=batch_size)


class PopoStore(EffectiveGroupMemory):
    """`buffer=popo`: the batch keeps the step's effective online groups and refills from the memory (seed 003)."""

    knobs = {**ReplayStore.knobs, "stale_factor": int_knob(1, 1_000, "2", why="n of POPO-stale(n)")}
    plans_replay = False  # rho = 0: the memory refills the batch, no replay is planned
    STALE = "popo-stale"

    @classmethod
    def cell_label(cls, node, cfg) -> str:
        """popo, popo-ineff (its own name) or popo-stale<n>."""
        return node.variant + (f"{node.stale_factor}" if node.variant == cls.STALE else "")

    @classmethod
    def reader_label(cls, node, cfg) -> str:
        base = {"popo": "POPO", "popo-ineff": "POPO-ineff", cls.STALE: f"POPO-stale({node.stale_factor})"}[node.variant]
        # POPO is a GRPO method (seed 003): say so when it runs on the plain RLOO loss instead.
        return base + (" (RLOO loss)" if described(cfg.loss).plain(cfg.loss) else "")

    @classmethod
    def check(cls, node, run) -> None:
        check_recipe("buffer", "POPO", "drop-and-refill", node, run)

    def __init__(self, variant: str = "popo", stale_factor: int = 1, groups_per_step: int = 1, seed: int = 0,
                 name: str = "popo", ratio: float = 0.0, max_age: int = 0, allow_infeasible: bool = False,
                 mechanism_only: bool = False) -> None:
        # mechanism_only only lifts src/command/config.py's check that the loss and KL are POPO's: the store is the same.
        self.variant = _check_variant(variant)
        stale_factor = _check_stale_factor(stale_factor, self.variant)
        if ratio != 0 or max_age != 0:
            raise ValueError(f"buffer=popo with buffer.ratio={ratio}, buffer.max_age={max_age}: POPO samples all B "
                             "groups online and refills only what it drops; leave ratio=0 and max_age=0")
        self.groups_per_step = int(groups_per_step)
        super().__init__(capacity=self.groups_per_step * stale_factor, effective_only=self.variant != "popo-ineff",
                         seed=seed)
        self._composed: PopoBatch | None = None

    def compose(self, fresh: list[BatchGroup], replayed_groups: list[BatchGroup], step: int,
                measure: Measure) -> Batch:
        composed = compose_batch([entry.group for entry in fresh], self, self.groups_per_step, self.variant,
                                 step=step)
        self._composed = composed
        kept = [entry for entry in fresh if is_effective(entry.group)]
        dropped = list(composed.dropped)
        if not self.effective_only:  # POPO-ineff keeps the dropped groups too: they need log mu now
            unmeasured = [group for group in dropped if group.behaviour_logprobs is None]
            measured = iter(measure(unmeasured) if unmeasured else [])
            dropped = [next(measured) if group.behaviour_logprobs is None else group for group in dropped]
        return Batch(kept + replayed(list(composed.replayed), step), dropped)

    def store(self, groups: list[Group], step: int) -> None:
        self.add(groups)  # the memory filters (effective only, unless POPO-ineff) and drops its oldest

    def metrics(self, step: int) -> dict[str, float]:
        """Seed 003's effective-sample ratio and on-policy share."""
        return {"buffer/size": 0, **(self._composed.metrics() if self._composed else {})}
