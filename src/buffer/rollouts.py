"""The one replay core (SPEC 11 "Queues"; seed 001 B.5, D.2-D.4): rollouts, their groups, their use statistics.

The unit is a rollout, not a group (seed 001 D.2): each of a group's K responses is a `Rollout` record carrying
the clock it was generated at (the version of the weights under `runtime=async`, the RL step under
`runtime=sync`), its creation time (wall and virtual), its use count and the clock of its last use. Its reward
and log mu were fixed when its group was generated; the group itself (prompt, K rewards, log mu) is kept once
and shared by its rollouts, so a trainer rebuilds the update batch from it, and its advantage from the group's
K rewards (which generation fixed, so it is the generation-time advantage of D.2).

`RolloutQueue` is the one object for every form seed 001 gives:

* FIFO (`buffer=fifo`, B.5 and D.4): the N most recent rollouts, oldest evicted first; a draw removes nothing.
  `mode` says how a draw picks: distinct (without_replacement, Listing 5's `random.sample`, the pipeline's
  default), independent (with_replacement, as section 4's analysis assumes, the synchronous step's default), or
  never-drawn first (at_least_once, Figure 18). Positive bias delta keeps the freshest N - round(delta N)
  rollouts plus the freshest round(delta N) correct ones older than those (`src.buffer.positive_bias`), counted
  in units of `unit` rollouts (K for the synchronous store, so no fresh group is split). With `shards` = T
  (D.4's sharded buffer) rollout u belongs to trainer u mod T, each shard keeps its N/T newest, and a batch is
  B/T rollouts from every shard. With `whole_groups` the FIFO keeps and draws whole groups (the synchronous
  store without positive bias: the newest groups that fit in N, drawn uniformly).
* LIFO (`LifoQueue`, `buffer=none` under `runtime=async`, B.1's on-policy streaming baseline): the same object
  with the other order: newest first, each rollout used exactly once; workers wait while the queue (with what is
  in flight) would exceed N.

The pipeline (`runtime=async`) talks to a queue through `put`, `ready`, `room`, `take`, `drop_stale`, `age`,
`size`, `drain_events`, `replay_count_distribution`, `distributions`, `state_dict`, `load_state_dict` and its
`name`, `replays` and `capacity`, so the same queue runs in the driver (the pure tests) or in a Ray actor behind
`src.runtime.queue_actor.QueueActor`. The synchronous step's FIFO (`src.buffer.fifo.FifoReplayBuffer`) is an
adapter over the same object: groups in, `draw` with only groups of earlier steps eligible, `BatchGroup`s out.
Which form a run gets the run's replay store says (`src.buffer.store.ReplayStore.rollout_queue`).

Every form records seed 001's measures (section 3.2, Figure 2, D.3): off-policiness (clock at use - clock at
generation) of every sample, steps since last use ("new" on first use, 0 for a repeat in the same batch), and
each rollout's replay count when it leaves the queue (and, for those still queued, at the end). Every put,
sample and eviction is appended to `events` (with rollout ids and versions) for the run's event log, which the
pipeline takes with `drain_events`.
"""

from __future__ import annotations

import dataclasses
import math
import random
from collections import Counter
from dataclasses import dataclass
from typing import Callable, Sequence, TypeVar

from src.batch import Group
from src.buffer.positive_bias import positive_bias_keep
from src.validate.checks import check_choice, check_int

SAMPLING_MODES = ("with_replacement", "without_replacement", "at_least_once")
T = TypeVar("T")

@dataclass
class Rollout:
    """One response of a generated group, as the queue keeps it."""

    uid: int                     # order of arrival in the queue
    group_key: int               # the request that generated its group
    index: int                   # its response index in the group
    version: int                 # its clock: the weights' version (async) or the RL step (sync) it came from
    reward: float
    created_wall: float          # seconds since the run started
    created_virtual: float | None = None  # lockstep clock; None in the free schedule
    uses: int = 0
    last_used: int | None = None  # the clock of its latest use


@dataclass(frozen=True)
class Sample:
    """One use of a rollout in a trainer batch, with seed 001's statistics."""

    rollout: Rollout
    group: Group                 # the group it was generated in (K rewards, log mu), for the update batch
    off_policiness: int          # clock at use - version (>= 0)
    since_last_use: int | None   # None: first use ("new"); else steps since its previous use
    use: int = 1                 # 1 for the rollout's first use, 2 for its second, ...


def percentile(values: list[float], q: float) -> float:
    """The q-th percentile by linear interpolation (numpy's default); nan for no values."""
    if not values:
        return math.nan
    ordered = sorted(values)
    position = (len(ordered) - 1) * q / 100.0
    low = math.floor(position)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (position - low)


def choose(items: Sequence[T], k: int, mode: str, rng: random.Random, never_drawn: Callable[[T], bool]) -> list[T]:
    """`k` of `items` by a FIFO's sampling mode (seed 001 B.5 and Figure 18), written once for every draw unit:
    with_replacement, k independent draws; without_replacement, min(k, len) distinct ones; at_least_once,
    min(k, len) distinct ones, the never-drawn first (all of them if they fit, else a random subset), then the
    remainder from those drawn before."""
    if mode == "with_replacement":
        return rng.choices(items, k=k)
    k = min(k, len(items))
    if mode == "without_replacement":
        return rng.sample(items, k)
    never = [item for item in items if never_drawn(item)]
    chosen = rng.sample(never, min(k, len(never)))
    return chosen + rng.sample([item for item in items if not never_drawn(item)], k - len(chosen))


def newest_that_fit(sizes: Sequence[int], capacity: int) -> int:
    """How many of the newest groups (`sizes`: their rollouts, oldest first) fit together in `capacity` rollouts:
    a store of N rollouts keeps whole groups, floor(N / K) of K."""
    held = 0
    for count, size in enumerate(reversed(sizes)):
        held += size
        if held > capacity:
            return count
    return len(sizes)


class RolloutQueue:
    """The one replay core: rollouts and their groups, retention, draws, use statistics, events, persistence.

    FIFO by default (`name` buffer: a draw removes nothing); `LifoQueue` sets the other order."""

    name = "buffer"
    replays = True  # whether a rollout may be drawn again (seed 001 footnote 5 predicts its reuse)
    order = "fifo"  # fifo: the newest N stay and draws remove nothing; lifo: newest first, each used once
    bound = "buffer.capacity"  # the setting that gives `capacity`, for the pipeline's messages

    def __init__(self, capacity: int, seed: int = 0, mode: str = "without_replacement", positive_bias: float = 0.0,
                 correct_reward: float = 1.0, shards: int = 1, unit: int = 1, whole_groups: bool = False,
                 rng: random.Random | None = None, log_events: bool = True) -> None:
        self.capacity = check_int("buffer.capacity", capacity, 1, "N counts rollouts (e.g. 512).")
        self.mode = check_choice("buffer.mode", mode, SAMPLING_MODES)
        if isinstance(positive_bias, bool) or not 0.0 <= float(positive_bias) < 1.0:
            raise ValueError(f"buffer.positive_bias delta={positive_bias!r}: use 0 <= delta < 1 (0 = plain FIFO; "
                             "seed 001 uses 0.5)")
        if isinstance(correct_reward, bool) or not isinstance(correct_reward, (int, float)):
            raise ValueError(f"correct_reward must be a number (the task's Task.correct_reward, e.g. 1.0), "
                             f"got {correct_reward!r}.")
        self.positive_bias, self.correct_reward = float(positive_bias), float(correct_reward)
        self.shards = check_int("runtime.trainers (shards)", shards, 1)
        if self.capacity % self.shards:
            raise ValueError(f"buffer.capacity N={self.capacity} with buffer.sharded=true and T={self.shards}: each "
                             f"trainer keeps N/T rollouts, so N must be a multiple of T")
        self.unit, self.whole_groups, self.log_events = int(unit), bool(whole_groups), bool(log_events)
        self._rng = random.Random(int(seed)) if rng is None else rng
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

    def _event(self, event: dict) -> None:
        if self.log_events:
            self.events.append(event)

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
        new = [Rollout(self._next_uid + i, group_key, i, int(version), group.rewards[i], float(wall), virtual)
               for i in range(group.size)]
        self._next_uid += group.size
        self.rollouts += new
        self._event({"event": "put", "group": group_key, "version": int(version), "ids": [r.uid for r in new]})
        return self._evict(self._kept())

    def ready(self, batch: int) -> bool:
        """Whether a trainer can take a batch of `batch` rollouts now."""
        if self.order == "lifo":
            return len(self.rollouts) >= batch
        if batch % self.shards:
            raise ValueError(f"a batch of {batch} rollouts cannot be split over {self.shards} shards evenly")
        return all(len(pool) >= batch // self.shards for pool in self._pools())

    def room(self, rollouts: int, in_flight: int) -> bool:
        """Whether a worker may start a group of `rollouts` with `in_flight` rollouts still being generated."""
        return self.order == "fifo" or len(self.rollouts) + in_flight + rollouts <= self.capacity

    def take(self, batch: int, step: int) -> list[Sample]:
        """A trainer batch of `batch` rollouts for trainer step `step`, in the order they are used."""
        if not self.ready(batch):
            raise ValueError(f"the {self.name} queue holds {len(self.rollouts)} rollouts, fewer than a batch of {batch}")
        chosen = self._choose(batch)
        samples = self._record(chosen, step)
        self._after_take(chosen)
        return samples

    def take_ready(self, batch: int, step: int) -> list[Sample] | None:
        """`take` if the queue holds a batch (`ready`), else None: one call where a queue answers from another
        process."""
        return self.take(batch, step) if self.ready(batch) else None

    def draw(self, count: int, now: int) -> list[Sample]:
        """The synchronous step's draw at RL step `now`: `count` units (groups with `whole_groups`, else rollouts)
        from the rollouts of earlier steps (a group stored at `now` has age 0, not eligible); none, and no
        randomness consumed, where nothing is eligible."""
        pool = [r for r in self.rollouts if r.version < now]
        if count == 0 or not pool:
            return []
        return self._record(self._choose_from(pool, count), now)

    def drop_stale(self, step: int, eta: int) -> list[Rollout]:
        """The age window: evict every rollout whose off-policiness at `step` would exceed eta."""
        keep = [i for i, r in enumerate(self.rollouts) if step - r.version <= eta]
        return self._evict(keep, reason="stale")

    # ---- the two orders ----
    def _kept(self) -> list[int]:
        """Positions (ascending) of the rollouts to keep after a put: a FIFO's newest N (per shard, with positive
        bias), or with `whole_groups` its newest whole groups that fit; a LIFO keeps all (workers wait instead)."""
        if self.order == "lifo":
            return list(range(len(self.rollouts)))
        if self.whole_groups:
            return self._newest_whole_groups()
        size, kept = self.capacity // self.shards // self.unit, []
        for pool in self._pools():
            correct = [self.rollouts[i].reward >= self.correct_reward for i in pool]
            kept += [pool[i] for i in positive_bias_keep(correct, size, self.positive_bias, unit=self.unit)]
        return sorted(kept)

    def _newest_whole_groups(self) -> list[int]:
        sizes = Counter(r.group_key for r in self.rollouts)  # keys in order of arrival, oldest first
        kept = set(list(sizes)[len(sizes) - newest_that_fit(list(sizes.values()), self.capacity):])
        return [i for i, r in enumerate(self.rollouts) if r.group_key in kept]

    def _choose(self, batch: int) -> list[Rollout]:
        if self.order == "lifo":
            return self.rollouts[::-1][:batch]  # newest first, as asyncio.LifoQueue hands them out
        share = batch // self.shards
        return [r for pool in self._pools() for r in self._choose_from([self.rollouts[i] for i in pool], share)]

    def _choose_from(self, pool: list[Rollout], count: int) -> list[Rollout]:
        """`count` units of `pool` by the mode: rollouts, or whole groups (their rollouts in index order)."""
        if not self.whole_groups:
            return choose(pool, count, self.mode, self._rng, lambda r: r.uses == 0)
        groups: dict[int, list[Rollout]] = {}
        for rollout in pool:
            groups.setdefault(rollout.group_key, []).append(rollout)
        chosen = choose(list(groups.values()), count, self.mode, self._rng, lambda g: g[0].uses == 0)
        return [r for group in chosen for r in group]

    def _after_take(self, chosen: list[Rollout]) -> None:
        if self.order == "lifo":
            taken = {r.uid for r in chosen}
            self.rollouts = [r for r in self.rollouts if r.uid not in taken]
            self._retire(chosen, "consume", "used")

    def _pools(self) -> list[list[int]]:
        """Positions of each shard's rollouts, oldest first."""
        pools: list[list[int]] = [[] for _ in range(self.shards)]
        for position, rollout in enumerate(self.rollouts):
            pools[rollout.uid % self.shards].append(position)
        return pools

    # ---- shared bookkeeping ----
    def _record(self, chosen: list[Rollout], now: int) -> list[Sample]:
        samples = []
        for rollout in chosen:  # in draw order: a repeat within the batch counts 0 steps since its last use
            since = None if rollout.last_used is None else now - rollout.last_used
            rollout.uses += 1
            rollout.last_used = now
            samples.append(Sample(rollout, self.groups[rollout.group_key], now - rollout.version, since,
                                  rollout.uses))
            self.off_policiness[now - rollout.version] += 1
            if since is None:
                self.new_uses += 1
            else:
                self.since_last_use[since] += 1
        self._event({"event": "sample", "step": now, "ids": [s.rollout.uid for s in samples],
                     "versions": [s.rollout.version for s in samples]})
        return samples

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
        self._event({"event": event, "reason": reason, "ids": [r.uid for r in gone],
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


class LifoQueue(RolloutQueue):
    """`buffer=none` under `runtime=async`: seed 001's streaming baseline; the newest B rollouts, each used once."""

    name = "lifo"
    replays = False
    order = "lifo"
