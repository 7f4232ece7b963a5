"""Frontier curriculum (SPEC 9; seed 004, sec. 3.1 and app. B), for any task that embeds its prompts.

Pieces, each pure or self-contained (no trainer integration here):

* `prompt_embedding` / `embed_instances` -- the task's numeric features of a prompt
  (`Task.features`: Countdown's fixed 14 of seed 004 app. B.2), L2-normalised;
  `PromptBank` caches them for the training prompts.
* `frontier_priority` -- the memory criterion and priority per variant: frontier
  0 < s < K with f = 4p(1 - p) (sec. 3.1, app. B.1); failure-based s = 0 and Goldilocks
  (app. A.2).
* `FrontierMemory` -- a bounded memory of recent frontier prompts with priorities.
* `retrieval_scores` / `select_replacements` -- best priority-weighted cosine match
  c_m = max_j (e_m . e_j) u_j over memory (app. B.3), duplicate filtering by the instance's
  `key` (Countdown: target, sorted numbers) against memory, the current batch and earlier picks,
  and replacement of a fraction rho = 0.10 of each batch, falling back to uniform prompts
  while memory is small or filtering leaves too few candidates.

Instances are the task's and opaque here: the curriculum reads their `key` and asks the task for
their features and, in checkpoints, their ground truth. The priority only steers prompt sampling;
it never enters the reward, the advantage or the loss (sec. 3.1).
"""

from __future__ import annotations

import random
from collections import OrderedDict
from collections.abc import Hashable
from dataclasses import dataclass, field
from typing import Any, Iterable, Iterator, Sequence

import torch
from torch import Tensor

from src.task.base import Task

MODES = ("frontier", "failure", "goldilocks")

_STATE_VERSION = 2

Instance = Any  # a task's instance: its `key` is read here, the task says the rest
Key = Hashable


# --------------------------------------------------------------------------- embedding


def _check_max_numbers(max_numbers: int) -> int:
    """Return max_numbers as an int, or raise a ValueError naming the bad value."""
    if isinstance(max_numbers, bool) or int(max_numbers) != max_numbers or max_numbers < 1:
        raise ValueError(f"max_numbers must be an integer >= 1, got {max_numbers!r}; Countdown 3to4 uses 4.")
    return int(max_numbers)


def prompt_embedding(instance: Instance, task: Task, max_numbers: int = 4) -> Tensor:
    """e(x) = phi(x) / ||phi(x)||_2 (seed 004 app. B.2), float64 [D]; dot product = cosine."""
    return embed_instances([instance], task, max_numbers)[0]


def embed_instances(instances: Sequence[Instance], task: Task, max_numbers: int = 4) -> Tensor:
    """Row-wise e(x) for many prompts at once, float64 [N, D] (D = 10 + max_numbers for Countdown)."""
    max_numbers = _check_max_numbers(max_numbers)
    if not instances:
        return torch.zeros((0, 0), dtype=torch.float64)  # no prompt, no features to count
    # One torch.tensor call for a whole prompt bank beats stacking N tensors.
    phi = torch.tensor([task.features(x, max_numbers) for x in instances], dtype=torch.float64)
    # ||phi|| > 0 for Countdown: the count feature n / max_numbers is positive.
    return phi / torch.linalg.vector_norm(phi, dim=-1, keepdim=True)


class PromptBank:
    """Training prompts with their embeddings and keys, computed once (seed 004 app. B.3's bank B)."""

    def __init__(self, instances: Sequence[Instance], task: Task, max_numbers: int = 4) -> None:
        self.instances: tuple[Instance, ...] = tuple(instances)
        self.max_numbers = _check_max_numbers(max_numbers)
        self.keys: tuple[Key, ...] = tuple(x.key for x in self.instances)
        self.embeddings = embed_instances(self.instances, task, self.max_numbers)  # [N, D]

    def __len__(self) -> int:
        return len(self.instances)


# --------------------------------------------------------------------------- priority


def frontier_priority(correct: int, k: int, mode: str = "frontier", goldilocks_band: float = 0.25) -> float | None:
    """Memory priority of a prompt with `correct` = s fully correct of K, or None if it is not admitted.

    * "frontier" (seed 004 sec. 3.1): admitted iff 0 < s < K; u = 4p(1 - p), p = s/K.
    * "failure" (app. A.2, failure-based retrieval): admitted iff s = 0; u = 1. (4p(1 - p)
      is 0 there, which would zero every retrieval score, so all failures weigh the same.)
    * "goldilocks" (app. A.2): the paper gives only "closer to p = 1/2" and "a stricter
      filter"; here: admitted iff 0 < s < K and |p - 1/2| <= goldilocks_band, with
      u = 1 - 2|p - 1/2| (1 at p = 1/2, falling linearly to 0 at p = 0 or 1).
    s counts only fully correct responses (the task's correct reward, app. B.1), not Countdown's 0.1 partial
    credit.
    """
    if mode not in MODES:
        raise ValueError(f"mode must be one of {MODES}, got {mode!r}.")
    if isinstance(k, bool) or int(k) != k or k < 1:
        raise ValueError(f"K must be an integer >= 1, got {k!r}.")
    if isinstance(correct, bool) or int(correct) != correct or not 0 <= correct <= k:
        raise ValueError(f"correct count s must be an integer in [0, K={k}], got {correct!r}.")
    s, k = int(correct), int(k)
    p = s / k
    if mode == "failure":
        return 1.0 if s == 0 else None
    if not 0 < s < k:
        return None
    if mode == "frontier":
        return 4.0 * p * (1.0 - p)
    if abs(p - 0.5) > goldilocks_band:
        return None
    return 1.0 - 2.0 * abs(p - 0.5)


# --------------------------------------------------------------------------- memory


@dataclass(frozen=True)
class MemoryEntry:
    """One remembered prompt: the instance, its priority u, and the observation (s of K at `step`)."""

    instance: Instance
    priority: float
    correct: int
    k: int
    step: int
    embedding: Tensor = field(repr=False, compare=False)


class FrontierMemory:
    """Bounded memory of recently observed frontier prompts and their priorities (seed 004 app. B.3's M_t).

    Drop policy, so the memory follows the current policy's learning boundary ("bounded to
    recent frontier prompts", app. B.3):
    * entries are ordered by their latest observation; re-observing a stored prompt (same
      key) that is still admitted refreshes its priority and step and moves it to the newest end;
    * re-observing a stored prompt that is no longer admitted (e.g. now solved K/K in
      frontier mode) removes it: its priority under the current policy is 0;
    * when more than `capacity` entries remain, the oldest are dropped.
    """

    def __init__(
        self, capacity: int, mode: str = "frontier", *, task: Task, max_numbers: int = 4,
        goldilocks_band: float = 0.25,
    ) -> None:
        if isinstance(capacity, bool) or int(capacity) != capacity or capacity < 1:
            raise ValueError(f"capacity must be an integer >= 1, got {capacity!r}.")
        if mode not in MODES:
            raise ValueError(f"mode must be one of {MODES}, got {mode!r}.")
        band = float(goldilocks_band)
        if not 0 <= band <= 0.5:
            raise ValueError(
                f"goldilocks_band must be in [0, 0.5], got {goldilocks_band!r}; 0.25 keeps p in [1/4, 3/4]."
            )
        self.capacity = int(capacity)
        self.mode = mode
        self.task = task  # embeds the prompts, and says their truth in a checkpoint
        self.max_numbers = _check_max_numbers(max_numbers)
        self.goldilocks_band = band
        self._entries: OrderedDict[Key, MemoryEntry] = OrderedDict()  # oldest first
        self._stacked: tuple[Tensor, Tensor] | None = None  # cache of (embeddings, priorities)
        self.dropped = 0  # capacity evictions, for logging

    def __len__(self) -> int:
        return len(self._entries)

    def __contains__(self, key: object) -> bool:
        return key in self._entries

    @property
    def entries(self) -> tuple[MemoryEntry, ...]:
        """Stored entries, oldest first."""
        return tuple(self._entries.values())

    def keys(self) -> set[Key]:
        """The duplicate-filter keys (the instances' `key`s) of all stored prompts."""
        return set(self._entries)

    def update(self, instances: Sequence[Instance], correct_counts: Iterable[int], K: int, step: int) -> int:
        """Record one step's rollout outcomes (s fully correct of K per prompt); return how many were admitted."""
        counts = [c.item() if isinstance(c, Tensor) else c for c in correct_counts]
        if len(counts) != len(instances):
            raise ValueError(
                f"got {len(instances)} instances but {len(counts)} correct counts; pass one count per prompt."
            )
        # Validate every count and embed every prompt before touching the memory, so a bad
        # call leaves it unchanged.
        priorities = [frontier_priority(s, K, self.mode, self.goldilocks_band) for s in counts]
        embeddings = embed_instances(instances, self.task, self.max_numbers)
        admitted = 0
        for instance, s, priority, embedding in zip(instances, counts, priorities, embeddings):
            key = instance.key
            self._entries.pop(key, None)  # re-observation replaces (or, if not admitted, removes) the entry
            if priority is None:
                continue
            self._entries[key] = MemoryEntry(
                instance=instance, priority=priority, correct=int(s), k=int(K), step=int(step), embedding=embedding
            )
            admitted += 1
        while len(self._entries) > self.capacity:
            self._entries.popitem(last=False)
            self.dropped += 1
        self._stacked = None
        return admitted

    def matrices(self) -> tuple[Tensor, Tensor]:
        """(embeddings [L, D], priorities [L]) of the stored prompts, oldest first."""
        if self._stacked is None:
            entries = list(self._entries.values())
            emb = torch.stack([e.embedding for e in entries]) if entries else torch.zeros((0, 0), dtype=torch.float64)
            pri = torch.tensor([e.priority for e in entries], dtype=torch.float64)
            self._stacked = (emb, pri)
        return self._stacked

    # ---- persistence (checkpoints) ----

    def state_dict(self) -> dict:
        """Plain-data snapshot (JSON-safe): config, counters and entries oldest first, each prompt as the task's
        ground truth of it; embeddings are recomputed."""
        return {
            "version": _STATE_VERSION,
            "capacity": self.capacity,
            "mode": self.mode,
            "max_numbers": self.max_numbers,
            "goldilocks_band": self.goldilocks_band,
            "dropped": self.dropped,
            "entries": [
                {
                    "truth": self.task.truth(e.instance),
                    "priority": e.priority,
                    "correct": e.correct,
                    "k": e.k,
                    "step": e.step,
                }
                for e in self._entries.values()
            ],
        }

    def load_state_dict(self, state: dict) -> None:
        """Restore a snapshot from state_dict(); mode, capacity and max_numbers must match this memory's."""
        if state.get("version") != _STATE_VERSION:
            raise ValueError(
                f"Unsupported frontier memory state version {state.get('version')!r}; expected {_STATE_VERSION}."
            )
        for name in ("mode", "capacity", "max_numbers", "goldilocks_band"):
            if state[name] != getattr(self, name):
                raise ValueError(
                    f"Saved frontier memory has {name}={state[name]!r} but this memory has "
                    f"{name}={getattr(self, name)!r}; resume with the same curriculum config."
                )
        entries: OrderedDict[Key, MemoryEntry] = OrderedDict()
        for item in state["entries"]:
            instance = self.task.instance_from_truth(item["truth"])
            entries[instance.key] = MemoryEntry(
                instance=instance,
                priority=float(item["priority"]),
                correct=int(item["correct"]),
                k=int(item["k"]),
                step=int(item["step"]),
                embedding=prompt_embedding(instance, self.task, self.max_numbers),
            )
        self._entries = entries
        self.dropped = int(state["dropped"])
        self._stacked = None


# --------------------------------------------------------------------------- retrieval


def retrieval_scores(candidate_embeddings: Tensor, memory_embeddings: Tensor, priorities: Tensor) -> Tensor:
    """Best priority-weighted match c_m = max_j (e_m . e_j) u_j (seed 004 app. B.3): [N, D], [L, D], [L] -> [N]."""
    if memory_embeddings.shape[0] == 0:
        raise ValueError("memory is empty; retrieval needs at least one frontier prompt (check min_memory >= 1).")
    if candidate_embeddings.shape[-1] != memory_embeddings.shape[-1]:
        raise ValueError(
            f"candidate embeddings have dim {candidate_embeddings.shape[-1]} but memory embeddings have dim "
            f"{memory_embeddings.shape[-1]}; build the prompt bank and the memory with the same max_numbers."
        )
    if priorities.shape != memory_embeddings.shape[:1]:
        raise ValueError(
            f"priorities shape {tuple(priorities.shape)} != ({memory_embeddings.shape[0]},); "
            "pass one priority per memory entry."
        )
    similarity = candidate_embeddings @ memory_embeddings.T  # cosines: both sides are unit vectors
    return (similarity * priorities.to(similarity.dtype)).amax(dim=-1)


def replacement_count(batch_size: int, fraction: float) -> int:
    """Number of batch slots to replace: round(fraction * batch_size) (64 prompts at 0.10 -> 6, seed 004 sec. 3.1)."""
    f = float(fraction)
    if not 0 <= f <= 1:
        raise ValueError(f"fraction must be in [0, 1], got {fraction!r}; seed 004 replaces 0.10 of each batch.")
    return round(f * batch_size)


def _lazy_permutation(n: int, rng: random.Random) -> Iterator[int]:
    """Yield a uniform random permutation of range(n) lazily (sparse Fisher-Yates: O(k) for k draws)."""
    swapped: dict[int, int] = {}
    for i in range(n):
        j = rng.randrange(i, n)
        yield swapped.get(j, j)
        swapped[j] = swapped.get(i, i)


@dataclass(frozen=True)
class Replacements:
    """Prompts to put in the last len(prompts) batch slots: retrieved ones first, then uniform fall-back ones."""

    prompts: list[Instance]
    requested: int  # round(fraction * len(batch))
    retrieved: int  # picked by similarity to memory
    uniform: int  # uniform fall-back picks (memory too small, or too few valid retrieval candidates)
    scores: list[float]  # c_m of each retrieved prompt, in pick order

    def apply(self, batch: Sequence[Instance]) -> list[Instance]:
        """The mixed batch: the first len(batch) - len(prompts) uniform prompts, then the replacements."""
        return list(batch[: len(batch) - len(self.prompts)]) + list(self.prompts)


def select_replacements(
    memory: FrontierMemory,
    candidates: PromptBank | Sequence[Instance],
    batch: Sequence[Instance],
    fraction: float = 0.10,
    *,
    min_memory: int,
    rng: random.Random,
    pool_factor: int = 4,
) -> Replacements:
    """Pick round(fraction * len(batch)) training prompts to replace part of `batch` (seed 004 app. B.3).

    1. Exclude every candidate whose key (Countdown: target, sorted numbers) is in memory or in
       `batch`; each pick adds its key, so no key is returned twice. Duplicate keys
       inside `candidates` are therefore harmless.
    2. If memory holds at least `min_memory` prompts: score candidates by
       c_m = max_j (e_m . e_j) u_j, take the top pool of pool_factor * n valid candidates
       (distinct keys, highest c_m, ties by bank order) and sample n of them uniformly
       without replacement. The paper samples "from a top candidate pool" without giving
       its size; pool_factor = 1 makes retrieval the deterministic top-n.
    3. Any missing positions (memory below `min_memory`, or too few valid candidates) are
       filled with uniform draws from `candidates`, under the same key filter.
    Fewer than n prompts come back only when the filtered candidates run out; the caller
    then keeps that many more of its uniform prompts (`Replacements.apply`).
    """
    _check_selection(min_memory, pool_factor, rng)
    bank = candidates if isinstance(candidates, PromptBank) else PromptBank(candidates, memory.task, memory.max_numbers)
    if bank.max_numbers != memory.max_numbers:
        raise ValueError(
            f"prompt bank max_numbers={bank.max_numbers} != memory max_numbers={memory.max_numbers}; "
            "embeddings must share one dimension."
        )
    n = replacement_count(len(batch), fraction)
    excluded: set[Key] = memory.keys() | {x.key for x in batch}
    if n == 0 or len(bank) == 0:
        return Replacements([], n, 0, 0, [])
    picks, scores = [], []
    if len(memory) >= min_memory:
        picks, scores = _retrieve(memory, bank, excluded, n, pool_factor * n, rng)
    retrieved = len(picks)
    picks += _uniform_fill(bank, excluded, n - retrieved, rng)  # early training, or filtering left too few
    return Replacements(picks, n, retrieved, len(picks) - retrieved, scores)


def _check_selection(min_memory: int, pool_factor: int, rng: random.Random) -> None:
    if isinstance(min_memory, bool) or int(min_memory) != min_memory or min_memory < 1:
        raise ValueError(f"min_memory must be an integer >= 1, got {min_memory!r}.")
    if isinstance(pool_factor, bool) or int(pool_factor) != pool_factor or pool_factor < 1:
        raise ValueError(f"pool_factor must be an integer >= 1, got {pool_factor!r}; 1 = deterministic top-n.")
    if not isinstance(rng, random.Random):
        raise ValueError(f"rng must be a random.Random (seeded, checkpointable), got {type(rng).__name__}.")


def _retrieve(memory: FrontierMemory, bank: PromptBank, excluded: set[Key], n: int, pool_size: int,
              rng: random.Random) -> tuple[list[Instance], list[float]]:
    """Step 2: n of the `pool_size` valid candidates of highest c_m (ties by bank order), with their scores;
    each pick's key joins `excluded`."""
    mem_emb, mem_pri = memory.matrices()
    c = retrieval_scores(bank.embeddings, mem_emb, mem_pri)
    order = torch.sort(c, descending=True, stable=True).indices.tolist()
    pool: list[int] = []
    pool_keys: set[Key] = set()
    for idx in order:
        key = bank.keys[idx]
        if key in excluded or key in pool_keys:
            continue
        pool.append(idx)
        pool_keys.add(key)
        if len(pool) == pool_size:
            break
    chosen = pool if len(pool) <= n else rng.sample(pool, n)
    excluded.update(bank.keys[idx] for idx in chosen)
    return [bank.instances[idx] for idx in chosen], [float(c[idx]) for idx in chosen]


def _uniform_fill(bank: PromptBank, excluded: set[Key], missing: int, rng: random.Random) -> list[Instance]:
    """Step 3: up to `missing` uniform draws from the bank whose keys are not in `excluded` (each added to it)."""
    picks: list[Instance] = []
    if missing <= 0:
        return picks
    for idx in _lazy_permutation(len(bank), rng):
        key = bank.keys[idx]
        if key in excluded:
            continue
        picks.append(bank.instances[idx])
        excluded.add(key)
        if len(picks) == missing:
            break
    return picks
