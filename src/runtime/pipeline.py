"""Seed 001's asynchronous pipeline as a driver over an abstract `Work` (SPEC 11), pure Python.

W workers generate groups and put their rollouts in the queue; the trainer takes batches of B
rollouts and updates; every `sync_every` updates it publishes its weights, which a worker loads
when it starts its next group. The pipeline decides what happens when; `Work` does it (Ray
actors and the trainer's `learn` in `src.runtime.ray_work`, a stand-in in the tests):

    work.start(worker, key, version)    # begin request `key`: groups key .. key + g - 1 (g groups a request)
                                        #   with published weights `version` (None: the newest published
                                        #   when the worker starts it)
    work.result(worker, version) -> [Generated]  # lockstep: that worker's groups, once they are done
    work.poll(timeout, version) -> [Generated]   # free: the groups of whatever requests are done
    work.train(step, samples, arrived, publish)  # begin one update on the batch; `arrived`: groups put since
                                        #   the last one; `publish`: the version its weights become, the workers'
                                        #   next load, once it is done (None: not with this update)
    work.trained() -> (metrics, seconds)  # wait for that update: its metrics, and the seconds its publish took
    work.publish(version) -> seconds    # make the trainer's weights the workers' next load

`version` in `result` and `poll` is the one step counter, the updates done as the schedule counts them
(`Counters.version`): what the curriculum records with the groups that arrive.

The queue is any object with `src.buffer.rollouts.RolloutQueue`'s methods: the queue itself here and
in the pure tests, `src.runtime.queue_actor.QueueActor` (the queue in a Ray actor, each call a
`ray.get`) under `runtime=async`. The pipeline's calls are sequential, so both give the same run. What
the pipeline reads of a drawn batch is each sample's off-policiness and steps since its last use; the
batch itself it hands to `work.train` (the buffer actor's: a reference, so the samples go from the
buffer actor to the trainer actor without passing through the driver).

`LockstepPipeline` runs the virtual clock of `src.runtime.schedule` (real work in event order,
so the same seed gives the same event log and metrics); `FreePipeline` lets every role go as
fast as it can. Both apply the optional staleness bound eta (AReaL's rule, `src.runtime.formulas.may_start`:
workers wait) and the buffer's age window L (rollouts more than L updates old evicted before a draw), and return,
per trainer step, the update's metrics with seed 001's measures (off-policiness, replay count,
steps since last use, queue size and age, idle ratios, weight-sync time, rates, mu and gamma).
Measures of the machine (wall-clock rates, mu from busy seconds, the free schedule's idle ratios)
are logged under `time/`, which a lockstep comparison and a resumed run's check leave out.
"""

from __future__ import annotations

import dataclasses
import math
import time
from dataclasses import dataclass, field
from typing import Protocol

from src.batch import Group
from src.runtime import formulas
from src.buffer.rollouts import RolloutQueue, Sample, percentile
from src.runtime.schedule import LockstepClock

SCHEDULES = ("lockstep", "free")
HISTOGRAM_BINS = 8  # off-policiness histogram per step: 0..7 and "8plus"


class PipelineError(RuntimeError):
    """The pipeline cannot go on (a stall, a worker that keeps dying); the message names the cause and the fix."""


@dataclass
class Generated:
    """A worker's group of K rollouts with what the queue records about it."""

    key: int                      # the group's id
    worker: int
    version: int                  # the weights it was generated with
    group: Group                  # K responses, rewards, log mu per response and token; from Ray workers a
                                  #   handle to it in the object store (its size, and `get()`: the group)
    busy_s: float = 0.0           # the worker's wall seconds on it
    restarted: bool = False       # the worker's actor was restarted since its previous group
    request: int | None = None    # the request it came with (its seed derives from it); None: its own key

    def state(self) -> dict:
        group = self.group if isinstance(self.group, Group) else self.group.get()
        return {**{f.name: getattr(self, f.name) for f in dataclasses.fields(self) if f.name != "group"},
                "group": dataclasses.asdict(group)}

    @classmethod
    def from_state(cls, state: dict) -> "Generated":
        # A checkpoint's group may carry the advantages a worker computed; the trainer recomputes them from
        # the group's rewards, so they are not read back.
        known = {f.name for f in dataclasses.fields(cls)}
        return cls(**{**{k: v for k, v in state.items() if k in known}, "group": Group(**state["group"])})


class Work(Protocol):
    def start(self, worker: int, key: int, version: int | None) -> None: ...  # None: the latest published
    def result(self, worker: int, version: int) -> list[Generated]: ...
    def poll(self, timeout: float | None, version: int) -> list[Generated]: ...
    def train(self, step: int, samples, arrived: list[Generated], publish: int | None) -> None: ...
    def trained(self) -> tuple[dict[str, float], float | None]: ...
    def publish(self, version: int) -> float: ...
    def peek(self, worker: int) -> list[Generated]: ...             # lockstep checkpoint: in-flight result, kept
    def preload(self, worker: int, groups: list[Generated]) -> None: ...  # lockstep resume: `result` returns it


@dataclass(frozen=True)
class PipelineSettings:
    workers: int
    trainers: int
    batch: int                    # B, rollouts per update
    group_size: int               # K
    sync_every: int = 1
    staleness: int | None = None  # eta, AReaL's bound on generation ahead of the trainer; None: none (seed 001)
    max_age: int | None = None    # L, the buffer's age window: older rollouts are dropped; None: none
    mu: float = 4.0               # configured inference/trainer cost ratio (lockstep rates, predictions)
    worker_cost: float | None = None   # lockstep time of a group; None: mu T K / B
    trainer_cost: float = 1.0
    depth: int = 8                # free schedule: requests queued per worker, so it works while the trainer trains
    groups_per_request: int = 1   # g: groups a worker generates in one call (one batched generate)

    def group_cost(self) -> float:
        if self.worker_cost is not None:
            return self.worker_cost
        return formulas.worker_cost_per_group(self.mu, self.trainers, self.group_size, self.batch)

    @property
    def request_rollouts(self) -> int:
        return self.groups_per_request * self.group_size


@dataclass
class Counters:
    """The pipeline's running totals (saved in a checkpoint)."""

    version: int = 0              # updates done
    published: int = 0            # version the workers load
    next_key: int = 0             # group keys handed out (a request takes g)
    started_rollouts: int = 0     # N_r of AReaL's rule
    generated_rollouts: int = 0
    trained_samples: int = 0
    added_since_train: int = 0
    added_between_trains: int = 0  # rollouts added between the first and the latest trainer start
    restarts: int = 0
    sync_seconds: float = 0.0
    worker_busy_s: float = 0.0
    trainer_busy_s: float = 0.0
    trainer_wait_s: float = 0.0
    elapsed_s: float = 0.0        # wall seconds of the pipeline before this session (a resumed run adds on)
    in_flight: list = field(default_factory=list)   # [worker, key, version] of requests being generated


class Pipeline:
    """What both schedules share: starting workers, putting groups, training, publishing, measuring."""

    def __init__(self, settings: PipelineSettings, queue: RolloutQueue, work: Work) -> None:
        self.settings, self.queue, self.work = settings, queue, work  # queue: or a QueueActor (same methods)
        self.counters = Counters()
        self.events: list[dict] = []
        self.arrived: list[Generated] = []
        self._wall_start = time.perf_counter()
        self._last_sync = 0.0

    # ---- the roles' moves ----
    def may_launch(self) -> bool:
        s, c = self.settings, self.counters
        # The local rule first: a blocked worker then costs no call to the queue (an actor under runtime=async).
        return (formulas.may_start(c.started_rollouts + s.request_rollouts, s.batch, c.version, s.staleness)
                and self.queue.room(s.request_rollouts, len(c.in_flight) * s.request_rollouts))

    def launch(self, worker: int, latest: bool = False) -> None:
        """Start a request of g groups on `worker`: with the published weights now (lockstep), or (`latest`)
        with whatever weights are published when the worker gets to it (free; its result says which)."""
        c, s = self.counters, self.settings
        key, c.next_key = c.next_key, c.next_key + s.groups_per_request
        c.started_rollouts += s.request_rollouts
        version = None if latest else c.published
        c.in_flight.append([worker, key, version])
        self.work.start(worker, key, version)
        self._event({"event": "generate", "worker": worker, "group": key, "version": version})

    def arrive(self, generated: Generated, virtual: float | None = None) -> None:
        c = self.counters
        request = generated.key if generated.request is None else generated.request
        c.in_flight = [entry for entry in c.in_flight if entry[1] != request]
        c.generated_rollouts += generated.group.size
        c.added_since_train += generated.group.size
        c.worker_busy_s += generated.busy_s
        if generated.restarted:
            c.restarts += 1
            self._event({"event": "restart", "worker": generated.worker})
        self.queue.put(generated.key, generated.group, generated.version, self.wall(), virtual)
        self.arrived.append(generated)  # the queue's events of the put are drained before the next event

    def take(self) -> list[Sample] | None:
        """The next batch, or None while the queue cannot give one (the trainer waits)."""
        s, c = self.settings, self.counters
        if s.max_age is not None:
            self.queue.drop_stale(c.version, s.max_age)
        samples = self.queue.take_ready(s.batch, c.version)
        self._drain_queue_events()
        if samples is None:
            return None
        if c.trained_samples:  # the first batch waited for the queue to fill: not a steady-state R
            c.added_between_trains += c.added_since_train
        c.added_since_train = 0
        return samples

    def train(self, samples: list[Sample]) -> dict[str, float]:
        """One update on `samples`, waited for, with its measures (the lockstep schedule publishes on its clock)."""
        self.begin_update(samples)
        metrics, _ = self.end_update()
        return {**metrics, **self.measures(samples)}

    def begin_update(self, samples: list[Sample], publish: bool = False) -> None:
        """Start the trainer's update on `samples`; with `publish`, its weights are published when it is done
        if `runtime.sync_every` says so (the free schedule: the trainer goes on at once, with no call between)."""
        c = self.counters
        self._update_started = time.perf_counter()
        arrived, self.arrived = self.arrived, []
        due = publish and (c.version + 1) % self.settings.sync_every == 0
        self.work.train(c.version, samples, arrived, c.version + 1 if due else None)
        c.trained_samples += len(samples)
        self._event({"event": "update", "step": c.version, "rollouts": len(samples)})

    def end_update(self) -> tuple[dict[str, float], float | None]:
        """Wait for the update: its metrics, and the seconds its publish took (None: it published nothing)."""
        metrics, seconds = self.work.trained()
        self.counters.trainer_busy_s += time.perf_counter() - self._update_started
        return metrics, seconds

    def finish_update(self, published_s: float | None = None) -> None:
        """Count the update; publish its weights when due, unless it did so itself (`published_s`, its seconds)."""
        c = self.counters
        c.version += 1
        if c.version % self.settings.sync_every == 0:
            self._last_sync = self.work.publish(c.version) if published_s is None else published_s
            c.sync_seconds += self._last_sync
            c.published = c.version
            self._event({"event": "publish", "version": c.version})

    # ---- seed 001's measures ----
    def measures(self, samples: list[Sample]) -> dict[str, float]:
        """Per trainer step: this batch's off-policiness and reuse, the run's replay counts, rates, mu, gamma."""
        return {**self.batch_measures(samples), **self.rate_measures()}

    def batch_measures(self, samples: list[Sample]) -> dict[str, float]:
        """The batch's off-policiness and reuse, the replay counts and the queue's age (the queue's state)."""
        c = self.counters
        off = [sample.off_policiness for sample in samples]
        repeats = [sample.since_last_use for sample in samples if sample.since_last_use is not None]
        out = {"offpolicy/mean": sum(off) / len(off), "offpolicy/p95": percentile(off, 95),
               "offpolicy/max": float(max(off))}
        for k in range(HISTOGRAM_BINS):
            out[f"offpolicy/hist_{k}"] = float(sum(1 for v in off if v == k))
        out[f"offpolicy/hist_{HISTOGRAM_BINS}plus"] = float(sum(1 for v in off if v >= HISTOGRAM_BINS))
        out.update({"reuse/new_fraction": 1 - len(repeats) / len(samples),
                    "reuse/since_last_use_mean": sum(repeats) / len(repeats) if repeats else math.nan,
                    "reuse/since_last_use_p95": percentile(repeats, 95)})
        out.update(self.replay_measures())
        out.update(self.queue.age(c.version))
        return out

    def replay_measures(self) -> dict[str, float]:
        """Replay counts so far (retired rollouts final, queued ones so far) against footnote 5's B/R."""
        s, c = self.settings, self.counters
        counts = self.queue.replay_count_distribution()
        total = sum(counts.values())
        steps_between = c.version  # trainer starts after the first, before this step's update is done
        measured_r = c.added_between_trains / steps_between if steps_between else math.nan
        out = {"replay/count_mean": sum(k * n for k, n in counts.items()) / total if total else math.nan,
               "replay/count_max": float(max(counts)) if counts else math.nan,
               "replay/rollouts_per_step": measured_r,
               "replay/ratio_measured": s.batch / measured_r if measured_r and measured_r > 0 else math.nan,
               "replay/ratio_counts": c.trained_samples / c.generated_rollouts if c.generated_rollouts else math.nan}
        if self.queue.replays:  # footnote 5 predicts a buffer's reuse; a LIFO trains each rollout once
            out["replay/ratio_predicted"] = formulas.expected_replay_count_from_rates(s.workers, s.trainers, s.mu)
        return out

    def rate_measures(self) -> dict[str, float]:
        s, c = self.settings, self.counters
        wall = self.wall()
        per_batch_worker = c.worker_busy_s / c.generated_rollouts * s.batch if c.generated_rollouts else math.nan
        per_batch_trainer = c.trainer_busy_s / (c.version + 1)
        mu_busy = formulas.mu_from_busy_times(per_batch_worker, per_batch_trainer)
        buffered = self.queue.replays
        out = {"time/rollouts_per_s": c.generated_rollouts / wall if wall else math.nan,
               "time/updates_per_s": (c.version + 1) / wall if wall else math.nan,
               "runtime/generated_rollouts": float(c.generated_rollouts),
               "time/weight_sync": self._last_sync, "time/weight_sync_total": c.sync_seconds,
               "runtime/worker_restarts": float(c.restarts),
               "time/mu_busy": mu_busy, "time/gamma_busy": self._gamma(mu_busy),
               # Eq. 1 (seed 001 lines 136 and 150): C(1 + W/T) with a buffer, C(1 + mu) without one.
               "runtime/compute_per_update": formulas.compute_per_update(s.workers, s.trainers, s.mu, buffered)}
        if buffered:
            # D.4's estimate (seed 001 lines 2436-2442) holds because with a buffer neither side waits for the
            # other. A LIFO trains each rollout once, so the same counts give W/T and gamma 1 by construction.
            mu_counts = formulas.mu_from_counts(c.trained_samples, c.generated_rollouts, s.workers, s.trainers)
            out.update({"runtime/mu_counts": mu_counts, "runtime/gamma_counts": self._gamma(mu_counts)})
        return out

    def _gamma(self, mu: float) -> float:
        s = self.settings
        return formulas.compute_ratio(s.workers, s.trainers, mu) if mu > 0 else math.nan

    # ---- bookkeeping ----
    def wall(self) -> float:
        return self.counters.elapsed_s + time.perf_counter() - self._wall_start

    def _event(self, event: dict) -> None:
        self._drain_queue_events()  # the queue's events so far come first: the log keeps the order things happened
        self.events.append(event)

    def _drain_queue_events(self) -> None:
        self.events += self.queue.drain_events()

    def take_events(self) -> list[dict]:
        """Every event since the last call, the queue's included, in the order they happened."""
        self._drain_queue_events()
        events, self.events = self.events, []
        return events

    def state_dict(self) -> dict:
        counters = dataclasses.asdict(self.counters)
        counters["elapsed_s"] = self.wall()
        return {"counters": counters, "queue": self.queue.state_dict(),
                "arrived": [generated.state() for generated in self.arrived]}

    def load_state_dict(self, state: dict) -> None:
        self.counters = Counters(**state["counters"])
        self._wall_start = time.perf_counter()
        self.queue.load_state_dict(state["queue"])
        self.arrived = [Generated.from_state(g) for g in state["arrived"]]


class LockstepPipeline(Pipeline):
    """Roles take turns on the virtual clock; the real work runs in event order."""

    def __init__(self, settings: PipelineSettings, queue: RolloutQueue, work: Work) -> None:
        super().__init__(settings, queue, work)
        self.clock = LockstepClock(settings.workers, settings.group_cost() * settings.groups_per_request,
                                   settings.trainer_cost)

    def next_step(self) -> dict[str, float]:
        """Run the schedule until the next trainer step is done; returns its metrics."""
        while True:
            metrics = self._start_idle()
            if metrics is not None:
                self._pending_metrics = metrics
            updated = False
            for role, ident in self.clock.advance():  # every job finishing now, before anything starts
                if role == "worker":
                    for generated in self.work.result(ident, self.counters.version):
                        self.arrive(generated, virtual=float(self.clock.now))
                else:
                    self.finish_update()
                    updated = True
            if updated:
                return {**self._pending_metrics, **self.clock_measures()}

    def _start_idle(self) -> dict[str, float] | None:
        # The trainer's batch is taken first (a tie goes to the trainer), the workers' groups are then
        # dispatched, and only then does the trainer's update run, so generation overlaps it in wall time.
        samples = self.take() if self.clock.idle("trainer") else None
        if samples is not None:
            self.clock.start("trainer", 0)
            self._event({"event": "train", "step": self.counters.version, "t": str(self.clock.now)})
        for worker in self.clock.idle("worker"):
            if not self.may_launch():
                break
            self.clock.start("worker", worker)
            self.launch(worker)
        if not self.clock.has_pending():
            raise PipelineError(self.stall_message())
        return self.train(samples) if samples is not None else None

    def stall_message(self) -> str:
        s = self.settings
        return (f"the lockstep pipeline stalled at virtual time {float(self.clock.now):g}: the trainer waits for "
                f"{s.batch} rollouts, the {self.queue.name} queue holds {self.queue.size()} and no worker may start "
                f"(buffer.capacity={self.queue.capacity}, runtime.staleness={s.staleness}, "
                f"buffer.max_age={s.max_age or 0}); raise buffer.capacity or the staleness bound")

    def clock_measures(self) -> dict[str, float]:
        return {"runtime/virtual_time": float(self.clock.now),
                "runtime/idle_trainer": self.clock.idle_ratio("trainer"),
                "runtime/idle_workers": self.clock.idle_ratio("worker")}

    def state_dict(self) -> dict:
        """Also the clock and the groups in flight, whose results are saved (a resumed run puts exactly them)."""
        in_flight = [[worker, [g.state() for g in self.work.peek(worker)]] for worker, _, _ in self.counters.in_flight]
        return {**super().state_dict(), "clock": self.clock.state_dict(), "in_flight_results": in_flight}

    def load_state_dict(self, state: dict) -> None:
        super().load_state_dict(state)
        self.clock.load_state_dict(state["clock"])
        for worker, groups in state["in_flight_results"]:
            self.work.preload(int(worker), [Generated.from_state(g) for g in groups])


class FreePipeline(Pipeline):
    """Every role as fast as it can: the trainer trains whenever the queue gives a batch."""

    def next_step(self) -> dict[str, float]:
        """Put what arrived, start the update as soon as the queue gives a batch (its weights published by the same
        call), and keep the workers busy and read the queue's measures while it runs."""
        s = self.settings
        while True:
            if self.counters.in_flight:  # whatever finished while the trainer trained
                for generated in self.work.poll(0, self.counters.version):
                    self.arrive(generated)
            samples = self.take()
            if samples is not None:
                self.begin_update(samples, publish=True)
                self._fill_workers()
                measures = self.batch_measures(samples)  # the queue as drawn: nothing is put until the next step
                metrics, published_s = self.end_update()
                metrics = {**metrics, **measures, **self.rate_measures()}
                self.finish_update(published_s)
                return {**metrics, **self.wall_measures()}
            self._fill_workers()
            if not self.counters.in_flight:
                raise PipelineError(f"the free pipeline stalled: the trainer waits for {s.batch} rollouts, the "
                                    f"{self.queue.name} queue holds {self.queue.size()} and no worker may start; "
                                    "raise buffer.capacity or the staleness bound")
            waited = time.perf_counter()
            for generated in self.work.poll(None, self.counters.version):
                self.arrive(generated)
            self.counters.trainer_wait_s += time.perf_counter() - waited

    def _fill_workers(self) -> None:
        queued = {w: 0 for w in range(self.settings.workers)}
        for worker, _, _ in self.counters.in_flight:
            queued[worker] += 1
        for _ in range(self.settings.depth):
            for worker in range(self.settings.workers):
                if queued[worker] < self.settings.depth and self.may_launch():
                    self.launch(worker, latest=True)
                    queued[worker] += 1

    def wall_measures(self) -> dict[str, float]:
        c, wall = self.counters, self.wall()
        return {"time/idle_trainer": c.trainer_wait_s / wall if wall else math.nan,
                "time/idle_workers": max(0.0, 1 - c.worker_busy_s / (wall * self.settings.workers)) if wall
                else math.nan}

    def resume_in_flight(self) -> None:
        """Groups in flight at the checkpoint are generated again, with their keys (so their seeds)."""
        pending, self.counters.in_flight = self.counters.in_flight, []
        for worker, key, _ in pending:
            self.counters.in_flight.append([worker, key, None])
            self.work.start(worker, key, None)
