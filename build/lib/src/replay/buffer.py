"""Replay buffer of whole prompt groups for Replay-RLOO (SPEC 3; paper appendix B.3).

Age convention (one rule, used everywhere):

* A group sampled at optimizer step ``s`` has age ``t - s`` at step ``t``.
* ``sample(count, t)`` draws only groups whose age at step ``t`` is in ``[1, L]``,
  tested per group. Fresh groups are ``add``-ed *after* the update of the step
  that sampled them, so at that step they are not stored yet, and were they
  stored their age would be 0, which is not eligible either.
* ``evict(t)`` is called at the end of step ``t`` (after ``add``). It drops every
  group that can never be eligible again, i.e. whose age at the *next* step
  ``t + 1`` would exceed ``L``: ``t - s >= L``. Hence a group sampled at step
  ``s`` can be replayed at steps ``s + 1 .. s + L`` and is gone after ``evict(s + L)``.
  After eviction the buffer holds the fresh groups of the last ``L`` steps
  (about ``L * B_fresh`` groups, SPEC 3 "feasibility"); the paper's ``(L + 1) * B``
  bound counts one extra, never-replayable generation that we do not keep.
* Replayed groups are not re-added; they stay stored until they are over-age.
"""

from __future__ import annotations

import dataclasses
import json
import os
import random
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterable

_STATE_VERSION = 1


def _ints(values: Any) -> tuple[int, ...]:
    # Accept lists, tuples and 1-D tensors; store plain ints so the state is plain data.
    if hasattr(values, "tolist"):
        values = values.tolist()
    return tuple(int(v) for v in values)


def _floats(values: Any) -> tuple[float, ...]:
    if hasattr(values, "tolist"):
        values = values.tolist()
    return tuple(float(v) for v in values)


@dataclass(frozen=True)
class Group:
    """One prompt's group of K responses, as stored for replay (SPEC 3)."""

    prompt: str
    prompt_ids: tuple[int, ...]
    numbers: tuple[int, ...]  # ground truth
    target: int  # ground truth
    responses: tuple[str, ...]
    response_ids: tuple[tuple[int, ...], ...]
    rewards: tuple[float, ...]
    step: int  # optimizer step the group was sampled at
    # log mu(y|x) per response, filled in at first use by the trainer's own forward pass.
    behaviour_logprobs: tuple[float, ...] | None = None
    # log pi_ref per response token, also from first use: pi_ref is frozen, so a replayed group
    # needs no second reference forward pass.
    reference_logprobs: tuple[tuple[float, ...], ...] | None = None
    # log mu per response token (loss=grpo's token-level behaviour weight pi_prox/mu); None for loss=rloo,
    # which needs only the sequence log-prob above.
    behaviour_token_logprobs: tuple[tuple[float, ...], ...] | None = None

    def __post_init__(self) -> None:
        # Normalise to tuples of plain numbers so the group is immutable and serialisable.
        setter = object.__setattr__
        setter(self, "prompt_ids", _ints(self.prompt_ids))
        setter(self, "numbers", _ints(self.numbers))
        setter(self, "target", int(self.target))
        setter(self, "responses", tuple(self.responses))
        setter(self, "response_ids", tuple(_ints(ids) for ids in self.response_ids))
        setter(self, "rewards", _floats(self.rewards))
        setter(self, "step", int(self.step))
        if self.behaviour_logprobs is not None:
            setter(self, "behaviour_logprobs", _floats(self.behaviour_logprobs))
        if self.reference_logprobs is not None:
            setter(self, "reference_logprobs", tuple(_floats(tokens) for tokens in self.reference_logprobs))
        if self.behaviour_token_logprobs is not None:
            setter(self, "behaviour_token_logprobs", tuple(_floats(t) for t in self.behaviour_token_logprobs))

        # A length mismatch would silently break the leave-one-out baseline (paper B.3).
        lengths = {
            "responses": len(self.responses),
            "response_ids": len(self.response_ids),
            "rewards": len(self.rewards),
        }
        if self.behaviour_logprobs is not None:
            lengths["behaviour_logprobs"] = len(self.behaviour_logprobs)
        if self.reference_logprobs is not None:
            lengths["reference_logprobs"] = len(self.reference_logprobs)
        if self.behaviour_token_logprobs is not None:
            lengths["behaviour_token_logprobs"] = len(self.behaviour_token_logprobs)
        if len(set(lengths.values())) != 1:
            detail = ", ".join(f"{name}={n}" for name, n in lengths.items())
            raise ValueError(
                f"Group lists must all have length K; got {detail}. "
                "Build the group from one aligned list per response."
            )
        if self.size < 2:
            raise ValueError(
                f"Group has K={self.size} responses; leave-one-out advantages (eq. 1) need K >= 2."
            )

        if self.reference_logprobs is not None and any(
            len(tokens) != len(ids) for tokens, ids in zip(self.reference_logprobs, self.response_ids)
        ):
            raise ValueError("reference_logprobs must hold one value per response token")
        if self.behaviour_token_logprobs is not None and any(
            len(tokens) != len(ids) for tokens, ids in zip(self.behaviour_token_logprobs, self.response_ids)
        ):
            raise ValueError("behaviour_token_logprobs must hold one value per response token")

    @property
    def size(self) -> int:
        """Number of responses K in the group."""
        return len(self.responses)

    def age(self, step: int) -> int:
        """Age of the group at optimizer step `step` (step - sampled step)."""
        return int(step) - self.step

    def with_behaviour_logprobs(self, logprobs: Iterable[float],
                                reference: Iterable[Iterable[float]] | None = None,
                                tokens: Iterable[Iterable[float]] | None = None) -> "Group":
        """Return a copy carrying log mu(y|x) (optionally per-token log pi_ref and log mu), validated again."""
        reference = tuple(_floats(t) for t in reference) if reference is not None else None
        tokens = tuple(_floats(t) for t in tokens) if tokens is not None else None
        return dataclasses.replace(self, behaviour_logprobs=_floats(logprobs), reference_logprobs=reference,
                                   behaviour_token_logprobs=tokens)


class ReplayBuffer:
    """Stores recent groups and samples replay groups of age 1..L uniformly without replacement."""

    def __init__(self, max_age: int, capacity: int = 4096, seed: int = 0) -> None:
        if int(max_age) != max_age or max_age < 1:
            raise ValueError(
                f"max_age (L) must be an integer >= 1, got {max_age!r}; use ratio=0 for fresh-only runs."
            )
        if int(capacity) != capacity or capacity < 1:
            raise ValueError(f"capacity must be an integer >= 1, got {capacity!r}.")
        self.max_age = int(max_age)
        self.capacity = int(capacity)
        self.seed = int(seed)
        self._rng = random.Random(self.seed)
        self._groups: list[Group] = []  # insertion order == step order
        self.capacity_drops = 0
        self.evicted = 0
        self.added = 0

    def __len__(self) -> int:
        return len(self._groups)

    @property
    def groups(self) -> tuple[Group, ...]:
        """All stored groups, oldest first (read-only view)."""
        return tuple(self._groups)

    def eligible(self, step: int) -> list[Group]:
        """Groups whose age at `step` is in [1, L], tested per group."""
        return [g for g in self._groups if 1 <= g.age(step) <= self.max_age]

    def sample(self, count: int, step: int) -> list[Group]:
        """Draw min(count, #eligible) distinct eligible groups uniformly; the caller fills any gap fresh."""
        if int(count) != count or count < 0:
            raise ValueError(f"count must be an integer >= 0, got {count!r}.")
        pool = self.eligible(step)
        k = min(int(count), len(pool))
        if k == 0:
            return []  # consume no randomness, so ratio-0 steps do not shift the RNG stream
        return self._rng.sample(pool, k)

    def add(self, groups: Iterable[Group]) -> None:
        """Store this step's fresh groups (call after the update); each needs behaviour log-probs."""
        new = list(groups)
        for g in new:
            if not isinstance(g, Group):
                raise TypeError(f"ReplayBuffer.add expects Group objects, got {type(g).__name__}.")
            if g.behaviour_logprobs is None:
                raise ValueError(
                    f"Group sampled at step {g.step} has no behaviour_logprobs; "
                    "call group.with_behaviour_logprobs(...) with the trainer's log mu(y|x) before add()."
                )
        self._groups.extend(new)
        self.added += len(new)
        overflow = len(self._groups) - self.capacity
        if overflow > 0:
            # Safety net only (never reached with the paper's sizes): drop the oldest groups.
            self._groups.sort(key=lambda g: g.step)  # stable: ties keep insertion order
            del self._groups[:overflow]
            self.capacity_drops += overflow

    def evict(self, step: int) -> int:
        """At the end of step `step`, drop groups that can never be replayed again (age >= L now, > L next step)."""
        keep = [g for g in self._groups if g.age(step + 1) <= self.max_age]
        dropped = len(self._groups) - len(keep)
        self._groups = keep
        self.evicted += dropped
        return dropped

    def age_histogram(self, step: int) -> dict[int, int]:
        """Map age at `step` -> number of stored groups of that age."""
        hist: dict[int, int] = {}
        for g in self._groups:
            a = g.age(step)
            hist[a] = hist.get(a, 0) + 1
        return dict(sorted(hist.items()))

    # ---- persistence (crash recovery; unlike the paper we also restore the sampling RNG) ----

    def state_dict(self) -> dict:
        """Plain-data snapshot: config, groups, RNG state and counters."""
        return {
            "version": _STATE_VERSION,
            "max_age": self.max_age,
            "capacity": self.capacity,
            "seed": self.seed,
            "groups": [dataclasses.asdict(g) for g in self._groups],
            "rng_state": rng_state(self._rng),
            "counters": {
                "capacity_drops": self.capacity_drops,
                "evicted": self.evicted,
                "added": self.added,
            },
        }

    def load_state_dict(self, state: dict) -> None:
        """Restore a snapshot from state_dict(); max_age must match this buffer's."""
        if state.get("version") != _STATE_VERSION:
            raise ValueError(
                f"Unsupported replay buffer state version {state.get('version')!r}; expected {_STATE_VERSION}."
            )
        if int(state["max_age"]) != self.max_age:
            raise ValueError(
                f"Saved buffer has max_age={state['max_age']} but this buffer has max_age={self.max_age}; "
                "resume with the same L or build the buffer with ReplayBuffer.load()."
            )
        self.capacity = int(state["capacity"])
        self.seed = int(state["seed"])
        self._groups = [Group(**g) for g in state["groups"]]
        restore_rng(self._rng, state["rng_state"])
        counters = state["counters"]
        self.capacity_drops = int(counters["capacity_drops"])
        self.evicted = int(counters["evicted"])
        self.added = int(counters["added"])

    def save(self, path: str | os.PathLike) -> None:
        """Write the state as JSON atomically (temp file in the same directory, then os.replace)."""
        write_json_atomic(path, self.state_dict())

    @classmethod
    def load(cls, path: str | os.PathLike) -> "ReplayBuffer":
        """Build a buffer from a file written by save()."""
        with open(path, encoding="utf-8") as f:
            state = json.load(f)
        buf = cls(max_age=state["max_age"], capacity=state["capacity"], seed=state["seed"])
        buf.load_state_dict(state)
        return buf


def rng_state(rng: random.Random) -> list:
    """A random.Random's state as plain JSON data."""
    version, internal, gauss_next = rng.getstate()
    return [version, list(internal), gauss_next]


def restore_rng(rng: random.Random, state: list) -> None:
    """Inverse of `rng_state`."""
    version, internal, gauss_next = state
    rng.setstate((int(version), tuple(int(x) for x in internal), gauss_next))


def write_json_atomic(path: str | os.PathLike, state: dict) -> None:
    """Write `state` as JSON to `path` atomically, so a crash never leaves a half-written checkpoint."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            json.dump(state, f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        try:
            os.unlink(tmp)
        except FileNotFoundError:
            pass
        raise
