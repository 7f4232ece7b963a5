"""POPO batch composition: drop ineffective online groups, refill from recent effective ones (SPEC 9 "POPO").

Source: seed 003 (``shared/seeds/003_5925ea7b638ef659.txt``), "RLVR without Ineffective Samples:
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
  ``add`` after the update, so, as in :mod:`src.replay.buffer`, a group is never replayed at the
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

import dataclasses
import json
import os
import random
from dataclasses import dataclass
from typing import Iterable, Sequence

from src.replay.buffer import Group, restore_rng, rng_state, write_json_atomic
from src.replay.fifo import check_int

_STATE_VERSION = 1

POPO_VARIANTS = ("popo", "popo-ineff", "popo-stale")


def is_effective(group: Group) -> bool:
    """True when the group's rewards are not all equal (non-zero variance, seed 003 Definition 3.1)."""
    return min(group.rewards) != max(group.rewards)


def _check_variant(variant: str) -> str:
    if variant not in POPO_VARIANTS:
        raise ValueError(f"variant must be one of {', '.join(POPO_VARIANTS)}; got {variant!r}.")
    return variant


class EffectiveGroupMemory:
    """FIFO memory of recent (effective) groups for POPO refills; oldest dropped first."""

    def __init__(self, capacity: int, effective_only: bool = True, seed: int = 0) -> None:
        self.capacity = check_int("capacity", capacity, 1, "POPO uses the batch size B.")
        self.effective_only = bool(effective_only)  # False only for the POPO-ineff ablation
        self.seed = int(seed)
        self._rng = random.Random(self.seed)
        self._groups: list[Group] = []  # insertion order == step order
        self.added = 0
        self.rejected = 0  # ineffective groups refused by an effective-only memory
        self.dropped = 0  # groups pushed out by newer ones

    def __len__(self) -> int:
        return len(self._groups)

    @property
    def groups(self) -> tuple[Group, ...]:
        """All stored groups, oldest first (read-only view)."""
        return tuple(self._groups)

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

    # ---- persistence (the RNG is saved too, so POPO-stale continues identically) ----

    def state_dict(self) -> dict:
        """Plain-data snapshot: config, groups, RNG state and counters."""
        return {
            "version": _STATE_VERSION,
            "capacity": self.capacity,
            "effective_only": self.effective_only,
            "seed": self.seed,
            "groups": [dataclasses.asdict(g) for g in self._groups],
            "rng_state": rng_state(self._rng),
            "counters": {"added": self.added, "rejected": self.rejected, "dropped": self.dropped},
        }

    def load_state_dict(self, state: dict) -> None:
        """Restore a snapshot from state_dict(); capacity and effective_only must match."""
        if state.get("version") != _STATE_VERSION:
            raise ValueError(
                f"Unsupported POPO memory state version {state.get('version')!r}; expected {_STATE_VERSION}."
            )
        for name in ("capacity", "effective_only"):
            if state[name] != getattr(self, name):
                raise ValueError(
                    f"Saved memory has {name}={state[name]!r} but this memory has {name}={getattr(self, name)!r}; "
                    "resume with the same variant and batch size or build it with EffectiveGroupMemory.load()."
                )
        self.seed = int(state["seed"])
        self._groups = [Group(**g) for g in state["groups"]]
        restore_rng(self._rng, state["rng_state"])
        counters = state["counters"]
        self.added = int(counters["added"])
        self.rejected = int(counters["rejected"])
        self.dropped = int(counters["dropped"])

    def save(self, path: str | os.PathLike) -> None:
        """Write the state as JSON atomically."""
        write_json_atomic(path, self.state_dict())

    @classmethod
    def load(cls, path: str | os.PathLike) -> "EffectiveGroupMemory":
        """Build a memory from a file written by save()."""
        with open(path, encoding="utf-8") as f:
            state = json.load(f)
        memory = cls(capacity=state["capacity"], effective_only=state["effective_only"], seed=state["seed"])
        memory.load_state_dict(state)
        return memory


def make_memory(variant: str, batch_size: int, stale_factor: int = 1, seed: int = 0) -> EffectiveGroupMemory:
    """The memory a variant needs: capacity B (n*B for popo-stale), effective-only except for popo-ineff."""
    variant = _check_variant(variant)
    batch_size = check_int("batch_size", batch_size, 1)
    stale_factor = check_int("stale_factor (n of POPO-stale(n))", stale_factor, 1)
    if variant != "popo-stale" and stale_factor != 1:
        raise ValueError(f"stale_factor={stale_factor} only applies to variant 'popo-stale', not {variant!r}.")
    capacity = batch_size * stale_factor
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
