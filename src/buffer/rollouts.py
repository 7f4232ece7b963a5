"""The rollout queues between seed 001's workers and trainers (SPEC 11 "Queues"), pure Python.

The unit is a rollout, not a group (seed 001 D.2): each of a group's K responses enters the
queue on its own, carrying the version of the weights that generated it, its creation time
(wall and virtual), its use count and the step it was last used. Its reward and log mu were
fixed when its group was generated; the group itself (prompt, K rewards, log mu) is kept once
and shared by its rollouts, so a trainer rebuilds the update batch from it, and its advantage from the
group's K rewards (which generation fixed, so it is the generation-time advantage of D.2).

* `RolloutReplayBuffer` (`buffer=fifo` under `runtime=async`, seed 001 B.5 and D.4): the N most recent rollouts,
  oldest evicted first; a draw removes nothing. The B rollouts of one batch are distinct by
  default (Listing 5's `random.sample`); `independent=True` draws them independently, as the
  analysis of section 4 assumes. Positive bias delta keeps the freshest N - round(delta N)
  rollouts plus the freshest round(delta N) correct ones older than those (D.4;
  `src.buffer.positive_bias`). Trainers wait until it holds B rollouts.
* `LifoQueue` (`buffer=none` under `runtime=async`, seed 001 B.1's on-policy streaming baseline): newest
  first, each rollout used exactly once; trainers wait for B queued rollouts, workers wait while
  the queue (with what is in flight) would exceed N.

Both record seed 001's measures (section 3.2, Figure 2, D.3): off-policiness t - v of every
sample, steps since last use ("new" on first use, 0 for a repeat in the same batch), and each
rollout's replay count when it leaves the queue (and, for those still queued, at the end).
Every put, sample and eviction is appended to `events` (with rollout ids and versions) for the
run's event log, which the pipeline takes with `drain_events`.

The pipeline talks to a queue only through its methods (put, ready, room, take, drop_stale, age,
size, drain_events, replay_count_distribution, distributions, state_dict, load_state_dict) and
its `name`, `replays` and `capacity`, so the same queue runs in the driver (the pure tests) or in a Ray
actor behind `src.runtime.queue_actor.QueueActor` (`runtime=async`). Which one a run gets, and with what
arguments, the run's replay store says (`src.buffer.store.ReplayStore.rollout_queue`): the store of groups
and the rollout queue are one `buffer` option, in the group's form under `runtime=sync` and in this one under
`runtime=async`.
"""

from __future__ import annotations

import dataclasses
import math
import random
from collections import Counter
from dataclasses import dataclass

from src.batch import Group
from src.buffer.positive_bias import positive_bias_keep
from src.validate.checks import check_int

@dataclass
class Rollout:
    """One response of a generated group, as the queue keeps it."""

    uid: int                     # order of arrival in the queue
    group_key: int               # the request that generated its group
    index: int                   # its response index in the group
    version: int                 # trainer updates behind the weights that generated it
    reward: float
    created_wall: float          # seconds since the run started
    created_virtual: float | None = None  # lockstep clock; None in the free schedule
    uses: int = 0
    last_used: int | None = None  # trainer step of its latest use


@dataclass(frozen=True)
class Sample:
    """One use of a rollout in a trainer batch, with seed 001's statistics."""

    rollout: Rollout
    group: Group                 # the group it was generated in (K rewards, log mu), for the update batch
    off_policiness: int          # trainer step - version (>= 0)
    since_last_use: int | None   # None: first use ("new"); else steps since its previous use


def percentile(values: list[float], q: float) -> float:
    """The q-th percentile by linear interpolation (numpy's default); nan for no values."""
    if not values:
        return math.nan
    ordered = sorted(values)
    position = (len(ordered) - 1) * q / 100.0
    low = math.floor(position)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (position - low)


class RolloutQueue:
    """What both queues share: storage of rollouts and their groups, use statistics, events, persistence."""

    name = ""
    replays = False  # whether a rollout may be drawn again (seed 001 footnote 5 predicts its reuse)
    bound = "buffer.capacity"  # the setting that gives `capacity`, for the pipeline's messages

    def __init__(self, capacity: int, seed: int = 0) -> None:
        self.capacity = check_int("buffer.capacity", capacity, 1, "N counts rollouts (e.g. 512).")
        self._rng = random.Random(int(seed))
        self.rollouts: list[Rollout] = []          # oldest first
        self.groups: dict[int, Group] = {}          # group key -> group, while any of its rollouts is queued
        self._next_uid = 0
        self.events: list[dict] = []                # drained by the pipeline into the run's event log
        # Figure 2's distributions over the run: replay count per retired rollout, off-policiness and
        # steps since last use per sample ("new" counted apart).
        self.replay_counts: Counter = Counter()
        self.off_policiness: Counter = Counter()
        self.since_last_use: Counter = Counter()
        self.new_uses = 0

    @classmethod
    def label(cls, arguments: dict) -> str:
        """The queue's part of a cell name under runtime=async: N252 for a buffer, lifo for the pipe."""
        return f"N{arguments['capacity']}" if cls.replays else cls.name

    def __len__(self) -> int:
        return len(self.rollouts)

    def size(self) -> int:
        """Rollouts queued (`len`, as a method a Ray actor can answer)."""
        return len(self.rollouts)

    def drain_events(self) -> list[dict]:
        """The events since the last drain, for the run's event log, in the order they happened."""
        events, self.events = self.events, []
        return events

    def put(self, group_key: int, group: Group, version: int, wall: float,
            virtual: float | None = None) -> list[Rollout]:
        """Queue the K rollouts of one generated group; returns the rollouts this evicted."""
        if group_key in self.groups:
            raise ValueError(f"group {group_key} is queued already; each request's group is put once")
        self.groups[group_key] = group
        new = [Rollout(self._next_uid + i, group_key, i, int(version), group.rewards[i], float(wall), virtual) for i in range(group.size)]
        self._next_uid += group.size
        self.rollouts += new
        self.events.append({"event": "put", "group": group_key, "version": int(version),
                            "ids": [r.uid for r in new]})
        return self._evict(self._kept())

    def ready(self, batch: int) -> bool:
        """Whether a trainer can take a batch of `batch` rollouts now."""
        return len(self.rollouts) >= batch

    def room(self, rollouts: int, in_flight: int) -> bool:
        """Whether a worker may start a group of `rollouts` with `in_flight` rollouts still being generated."""
        return True

    def take(self, batch: int, step: int) -> list[Sample]:
        """A trainer batch of `batch` rollouts for trainer step `step`, in the order they are used."""
        if not self.ready(batch):
            raise ValueError(f"the {self.name} queue holds {len(self.rollouts)} rollouts, fewer than a batch of {batch}")
        chosen = self._choose(batch)
        samples = []
        for rollout in chosen:  # in draw order: a repeat within the batch counts 0 steps since its last use
            since = None if rollout.last_used is None else step - rollout.last_used
            samples.append(Sample(rollout, self.groups[rollout.group_key], step - rollout.version, since))
            rollout.uses += 1
            rollout.last_used = step
            self.off_policiness[step - rollout.version] += 1
            if since is None:
                self.new_uses += 1
            else:
                self.since_last_use[since] += 1
        self.events.append({"event": "sample", "step": step, "ids": [s.rollout.uid for s in samples],
                            "versions": [s.rollout.version for s in samples]})
        self._after_take(chosen)
        return samples

    def take_ready(self, batch: int, step: int) -> list[Sample] | None:
        """`take` if the queue holds a batch (`ready`), else None: one call where a queue answers from another
        process."""
        return self.take(batch, step) if self.ready(batch) else None

    def drop_stale(self, step: int, eta: int) -> list[Rollout]:
        """SPEC 11's `drop` bound: evict every rollout whose off-policiness at `step` would exceed eta."""
        keep = [i for i, r in enumerate(self.rollouts) if step - r.version <= eta]
        return self._evict(keep, reason="stale")

    # ---- what the two queues do differently ----
    def _kept(self) -> list[int]:
        """Positions (ascending) of the rollouts to keep after a put."""
        return list(range(len(self.rollouts)))

    def _choose(self, batch: int) -> list[Rollout]:
        raise NotImplementedError

    def _after_take(self, chosen: list[Rollout]) -> None:
        pass

    # ---- shared bookkeeping ----
    def _evict(self, keep: list[int], reason: str = "capacity") -> list[Rollout]:
        kept = set(keep)
        gone = [r for i, r in enumerate(self.rollouts) if i not in kept]
        if not gone:
            return []
        self.rollouts = [r for i, r in enumerate(self.rollouts) if i in kept]
        self._retire(gone, "evict", reason)
        return gone

    def _retire(self, gone: list[Rollout], event: str, reason: str) -> None:
        for rollout in gone:
            self.replay_counts[rollout.uses] += 1
        queued = {r.group_key for r in self.rollouts}
        for key in {r.group_key for r in gone} - queued:
            del self.groups[key]
        self.events.append({"event": event, "reason": reason, "ids": [r.uid for r in gone],
                            "versions": [r.version for r in gone]})

    def replay_count_distribution(self) -> dict[int, int]:
        """Rollouts per replay count so far: retired rollouts' final counts, queued ones' uses until now."""
        counts = Counter(self.replay_counts)
        for rollout in self.rollouts:
            counts[rollout.uses] += 1
        return dict(sorted(counts.items()))

    def distributions(self) -> dict:
        """Figure 2's distributions over the run so far (the run's `runtime_distributions.json`)."""
        return {"off_policiness": dict(sorted(self.off_policiness.items())),
                "replay_count": self.replay_count_distribution(),
                "since_last_use": dict(sorted(self.since_last_use.items())), "new_uses": self.new_uses}

    def age(self, version: int) -> dict[str, float]:
        """Size of the queue and the age (versions behind `version`) of what it holds."""
        ages = [version - r.version for r in self.rollouts]
        return {"queue/size": float(len(ages)),
                "queue/age_mean": sum(ages) / len(ages) if ages else math.nan,
                "queue/age_max": float(max(ages)) if ages else math.nan}

    def state_dict(self) -> dict:
        """Plain data only (a checkpoint loads with weights_only=True)."""
        version, internal, gauss = self._rng.getstate()
        return {"queue": self.name, "capacity": self.capacity, "rng": [version, list(internal), gauss],
                "next_uid": self._next_uid, "rollouts": [dataclasses.asdict(r) for r in self.rollouts],
                "groups": [[key, dataclasses.asdict(group)] for key, group in self.groups.items()],
                "replay_counts": sorted(self.replay_counts.items()),
                "off_policiness": sorted(self.off_policiness.items()),
                "since_last_use": sorted(self.since_last_use.items()), "new_uses": self.new_uses}

    def load_state_dict(self, state: dict) -> None:
        if state["queue"] != self.name or state["capacity"] != self.capacity:
            raise ValueError(f"the checkpoint's queue is {state['queue']} of N={state['capacity']}, this run's is "
                             f"{self.name} of N={self.capacity}; resume with the buffer settings the run started with")
        version, internal, gauss = state["rng"]
        self._rng.setstate((int(version), tuple(int(x) for x in internal), gauss))
        self._next_uid = int(state["next_uid"])
        known = {f.name for f in dataclasses.fields(Rollout)}  # a checkpoint's rollout may carry its advantage
        self.rollouts = [Rollout(**{k: v for k, v in r.items() if k in known}) for r in state["rollouts"]]
        self.groups = {int(key): Group(**group) for key, group in state["groups"]}
        for name in ("replay_counts", "off_policiness", "since_last_use"):
            setattr(self, name, Counter({int(k): int(v) for k, v in state[name]}))
        self.new_uses = int(state["new_uses"])


class RolloutReplayBuffer(RolloutQueue):
    """`buffer=fifo` under `runtime=async`: seed 001's FIFO of the N newest rollouts, sampled without removal.

    With `shards` = T (D.4's sharded buffer) rollout u belongs to trainer u mod T, each shard keeps its
    N/T newest (positive bias within the shard), and a batch is B/T rollouts from every shard.
    """

    name = "buffer"
    replays = True

    def __init__(self, capacity: int, seed: int = 0, independent: bool = False, positive_bias: float = 0.0,
                 correct_reward: float = 1.0, shards: int = 1) -> None:
        super().__init__(capacity, seed)
        if isinstance(positive_bias, bool) or not 0.0 <= float(positive_bias) < 1.0:
            raise ValueError(f"buffer.positive_bias delta={positive_bias!r}: use 0 <= delta < 1 (0 = plain FIFO; "
                             "seed 001 uses 0.5)")
        self.independent = bool(independent)
        self.positive_bias = float(positive_bias)
        self.correct_reward = float(correct_reward)
        self.shards = check_int("runtime.trainers (shards)", shards, 1)
        if self.capacity % self.shards:
            raise ValueError(f"buffer.capacity N={self.capacity} with buffer.sharded=true and T={self.shards}: each "
                             f"trainer keeps N/T rollouts, so N must be a multiple of T")

    def ready(self, batch: int) -> bool:
        if batch % self.shards:
            raise ValueError(f"a batch of {batch} rollouts cannot be split over {self.shards} shards evenly")
        return all(len(pool) >= batch // self.shards for pool in self._pools())

    def _pools(self) -> list[list[int]]:
        """Positions of each shard's rollouts, oldest first."""
        pools: list[list[int]] = [[] for _ in range(self.shards)]
        for position, rollout in enumerate(self.rollouts):
            pools[rollout.uid % self.shards].append(position)
        return pools

    def _kept(self) -> list[int]:
        size = self.capacity // self.shards
        kept = []
        for pool in self._pools():
            correct = [self.rollouts[i].reward >= self.correct_reward for i in pool]
            kept += [pool[i] for i in positive_bias_keep(correct, size, self.positive_bias)]
        return sorted(kept)

    def _choose(self, batch: int) -> list[Rollout]:
        share, chosen = batch // self.shards, []
        for pool in self._pools():
            rollouts = [self.rollouts[i] for i in pool]
            chosen += self._rng.choices(rollouts, k=share) if self.independent else self._rng.sample(rollouts, share)
        return chosen


class LifoQueue(RolloutQueue):
    """`buffer=none` under `runtime=async`: seed 001's streaming baseline; the newest B rollouts, each used once."""

    name = "lifo"

    def room(self, rollouts: int, in_flight: int) -> bool:
        return len(self.rollouts) + in_flight + rollouts <= self.capacity

    def _choose(self, batch: int) -> list[Rollout]:
        return self.rollouts[::-1][:batch]  # newest first, as asyncio.LifoQueue hands them out

    def _after_take(self, chosen: list[Rollout]) -> None:
        taken = {r.uid for r in chosen}
        self.rollouts = [r for r in self.rollouts if r.uid not in taken]
        self._retire(chosen, "consume", "used")
