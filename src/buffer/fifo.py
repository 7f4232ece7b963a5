"""FIFO experience replay of whole prompt groups (SPEC 9 "FIFO replay"; seeds 001 and 002).

Sources (docs/papers.md summarises each cited part):

* seed 001, "Experience replay for LLM post-training":
  a first-in, first-out buffer holding the last N samples, sampled uniformly with replacement
  (section 3.1-3.2 and appendix B.5); the "No replacement" and "No replacement, at least once"
  variants (appendix E, Figure 18); positive-bias sampling with coefficient delta (section 5 and
  appendix D.4); the off-policiness, replay-ratio and steps-since-last-use statistics
  (section 3.2, Figure 2 and appendix D.3).
* seed 002, "Off-policy sampling for RLOO", section 3.2 and
  Algorithm 1: one update on the fresh batch, then R - 1 extra updates on batches drawn from the
  FIFO buffer, and only then the fresh batch is appended to the buffer
  (:func:`extra_updates`, :meth:`FifoReplayBuffer.extra_update_batches`).

The rollouts, their retention, the draws, the per-rollout statistics and the persistence are the one replay core's
(:class:`src.buffer.rollouts.RolloutQueue`, which the pipeline's FIFO under runtime=async is too): this store
is an adapter over it on the RL-step clock, groups in and :class:`~src.batch.BatchGroup` entries out, adding
seed 002's extra updates and the per-group view of each draw (:class:`FifoDraw`).

Conventions shared with :class:`src.buffer.age.ReplayBuffer`:

* The stored unit is :class:`~src.buffer.age.Group` (one prompt and its K responses), and the
  capacity N counts rollouts, as seed 001 counts its buffer (B.5: "the last N samples"; D.2:
  N = 252 rollouts) and as the pipeline's FIFO does under runtime=async: the buffer keeps the
  newest whole groups whose rollouts fit in N, floor(N / K) groups of K, oldest dropped first
  (with positive bias the same N rollouts, some of them single correct ones, see below).
* A group sampled at step ``s`` has age ``t - s`` at step ``t`` (seed 001's off-policiness,
  measured in gradient steps). ``sample(count, t)`` draws only groups of age >= 1: fresh groups
  are ``add``-ed after the update of the step that sampled them, and were they stored already
  their age would be 0, which is not eligible. There is no upper age limit; the capacity bounds
  staleness.
* Sampling never removes a group; a replayed group is not re-added.

Sampling modes (``mode``):

* ``"with_replacement"`` (default, seed 001's "vanilla"): ``count`` independent draws from the
  eligible groups, so one group may appear more than once in a batch.
* ``"without_replacement"``: ``min(count, #eligible)`` distinct groups.
* ``"at_least_once"`` (seed 001 Figure 18, "samples that have never been used are sampled in
  priority, after what the remainder of the batch is filled without replacement"). Precisely,
  one call draws ``min(count, #eligible)`` distinct groups: first from the eligible groups that
  have never been drawn (all of them if they fit, else a random subset), then the remainder
  from the eligible groups already drawn before. Hence a group is drawn a second time only in
  a call that also draws every eligible never-drawn group: every stored group is drawn once
  before any group is drawn again, except groups that the FIFO pushes out before a draw
  reaches them.

Positive-bias sampling (``positive_bias = delta``, seed 001 section 5 and appendix D.4): "instead
of keeping the freshest N generated rollouts in the buffer, we keep the freshest (1 - delta)N
generated rollouts along with the freshest delta N correct rollouts not included in those
(1 - delta)N trajectories, and uniformly sample from these N samples". The paper stores single
rollouts, so the rule is per rollout, and we follow it per rollout:

* With group size K the buffer holds n = floor(N / K) groups' worth of rollouts. The freshest
  ``n - round(delta n)`` groups are kept whole (the paper's (1 - delta) share, rounded to whole
  groups so that no fresh group is split); older groups keep only their correct responses
  (reward >= ``correct_reward``, the task's `Task.correct_reward`, which `src.build.build_store`
  passes), the freshest ``round(delta n) * K`` of them in total. Within one group
  all responses were generated at the same step; a higher response index counts as fresher.
  A positive-bias buffer therefore needs one K for all groups. ``round`` is Python's (halves to
  even). The rule holds at all times, also before the buffer is full: as in the paper, an
  incorrect rollout outside the freshest (1 - delta) share is never kept.
* A trimmed group is still stored with all K rewards. A drawn rollout's leave-one-out baseline is
  the mean of the other K - 1 rewards of the group it was generated in, as at generation: the
  paper computes each rollout's advantage from its whole group when the rollout is generated
  (appendix D.2) and stores it with the rollout. So the trainer computes leave-one-out advantages
  from ``draw.group.rewards`` and trains only on ``draw.responses``.
* "Uniformly sample from these N samples" is per rollout, and so is the draw: a batch's replay
  share of ``count`` groups is ``count * K`` rollouts drawn from all stored rollouts of age >= 1 by
  the buffer's mode (with replacement; distinct; never-drawn rollouts first), then grouped by the
  group they belong to. Every kept rollout, a correct one left in a trimmed group included, is
  drawn at the same rate. The use statistics count a group as used when any of its rollouts is.
  Without positive bias every group is whole and the draw is of whole groups, uniformly, which
  is the same per-rollout rate.

Use statistics (seed 001): every draw returns a :class:`FifoDraw` carrying its age at use, its use
number and its steps since last use ("new" for a first use, 0 for a repeat within the same
batch, as in appendix D.3), those of the group's drawn rollouts (the core keeps them per rollout: the
highest use number, the most recent use); :func:`use_statistics` summarises draws and
:meth:`FifoReplayBuffer.replay_counts` gives the replay count per rollout (mean / max / histogram).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Iterable, Sequence

from src.batch import Batch, BatchGroup, Group, plan_batch
from src.buffer.rollouts import RolloutQueue, Sample
from src.buffer.store import QUEUE_KNOBS, ReplayStore, checked_for_storing
from src.validate.checks import check_int
from src.variant import Knob, described, float_knob, int_knob


def extra_updates(replay_factor: int) -> int:
    """Number of extra replay updates per fresh batch in seed 002's replay mode: R - 1."""
    return check_int("replay_factor (R)", replay_factor, 1, "R = 1 means no extra replay updates.") - 1


@dataclass(frozen=True)
class FifoDraw:
    """One use of a stored group in a training batch, with its seed-001 statistics."""

    group: Group
    responses: tuple[int, ...]  # response indices to train on: all K, or (positive bias) the rollouts drawn
    uid: int  # stable id of the stored group (order of add)
    step: int  # step at which the group is used
    age: int  # off-policiness: step - group.step (>= 1)
    use: int  # 1 for the group's first use, 2 for its second, ...
    steps_since_last_use: int | None  # None for a first use ("new"); 0 for a repeat within one batch
    # Off-policiness in updates, as seed 001 counts it (one gradient step per trainer batch): the updates
    # taken since the update of the step that sampled the group. With R - 1 extra updates per step it
    # grows R times as fast as `age`. None where unknown (a draw outside the store interface).
    update_age: int | None = None


@dataclass(frozen=True)
class UseStats:
    """Age-at-use and steps-since-last-use summary of some draws (seed 001 section 3.2, D.3)."""

    draws: int
    age_mean: float | None  # None when there are no draws
    age_max: int | None
    age_histogram: dict[int, int]
    new: int  # first uses
    since_last_use_mean: float | None  # over repeat uses; None when every draw is new
    since_last_use_histogram: dict[int, int]  # repeat uses only; "new" is counted in `new`
    update_age_mean: float | None = None  # age at use in updates (gradient steps); None when unknown
    update_age_max: int | None = None

    def metrics(self, prefix: str = "fifo/") -> dict[str, float]:
        """Flat float metrics for logging; undefined means are left out rather than logged as 0."""
        out = {f"{prefix}draws": float(self.draws), f"{prefix}new_draws": float(self.new)}
        if self.age_mean is not None:
            out[f"{prefix}age_at_use_mean"] = self.age_mean
            out[f"{prefix}age_at_use_max"] = float(self.age_max)
        if self.since_last_use_mean is not None:
            out[f"{prefix}steps_since_last_use_mean"] = self.since_last_use_mean
        if self.update_age_mean is not None:
            out[f"{prefix}age_at_use_updates_mean"] = self.update_age_mean
            out[f"{prefix}age_at_use_updates_max"] = float(self.update_age_max)
        return out


@dataclass(frozen=True)
class ReplayCounts:
    """Replay count per rollout (seed 001's replay ratio, D.3): how many times each rollout was drawn."""

    rollouts: int
    mean: float | None  # None when no rollout was ever added
    max: int | None
    histogram: dict[int, int]  # uses -> number of rollouts

    def metrics(self, prefix: str = "fifo/") -> dict[str, float]:
        """Flat float metrics for logging; undefined values are left out."""
        out = {f"{prefix}replay_count_rollouts": float(self.rollouts)}
        if self.mean is not None:
            out[f"{prefix}replay_count_mean"] = self.mean
            out[f"{prefix}replay_count_max"] = float(self.max)
        return out


def _histogram(values: Iterable[int]) -> dict[int, int]:
    hist: dict[int, int] = {}
    for v in values:
        hist[v] = hist.get(v, 0) + 1
    return dict(sorted(hist.items()))


def use_statistics(draws: Sequence[FifoDraw]) -> UseStats:
    """Summarise draws: age at use (mean / max / histogram) and steps since last use."""
    ages = [d.age for d in draws]
    since = [d.steps_since_last_use for d in draws if d.steps_since_last_use is not None]
    update_ages = [d.update_age for d in draws if d.update_age is not None]
    return UseStats(
        draws=len(draws),
        age_mean=sum(ages) / len(ages) if ages else None,
        age_max=max(ages) if ages else None,
        age_histogram=_histogram(ages),
        new=len(draws) - len(since),
        since_last_use_mean=sum(since) / len(since) if since else None,
        since_last_use_histogram=_histogram(since),
        update_age_mean=sum(update_ages) / len(update_ages) if update_ages else None,
        update_age_max=max(update_ages) if update_ages else None,
    )


class FifoReplayBuffer(ReplayStore):
    """`buffer=fifo`: keeps the last N rollouts in whole groups (optionally positive-biased), draws replay groups
    of age >= 1."""

    settings = ("capacity", "capacity_unit", "mode", "positive_bias", "correct_reward")
    capacity_unit = "rollouts"  # checkpoints written before N counted rollouts have none (`load_state_dict`)
    capacity_counted_groups = True
    counters = ("added", "dropped", "dropped_rollouts", "_next_uid", "updates")
    knobs = {**ReplayStore.knobs, "positive_bias": float_knob(0, 1, "0.5 (seed 001)", high_open=True,
                                                                        why="delta = 1 would keep no fresh group whole"),
             "extra_updates": int_knob(0, 100, "1 (seed 002)", why="R - 1 extra updates per step"),
             "batch_rollouts": QUEUE_KNOBS["batch_rollouts"],
             "sharded": Knob("bool", example="true", queue_only=True,
                             why="one FIFO of N/T rollouts per trainer (seed 001 D.4)")}

    @classmethod
    def rollout_queue(cls, node, trainers: int) -> tuple[type, dict]:
        """Under `runtime=async`, seed 001's FIFO of rollouts (B.5, D.4): the N newest rollouts (the paper's
        N = 252), drawn without removal, one FIFO of N/T per trainer with `sharded`; `mode` says
        whether a batch's draws are distinct (without_replacement, Listing 5's random.sample), independent
        (with_replacement, section 4's analysis) or never-drawn first (at_least_once, Figure 18), per rollout.
        The pipeline's schedule sets the reuse (mu T / W, footnote 5), so rho does not enter; the synchronous
        step's extra updates are refused."""
        if node.extra_updates:
            raise ValueError(f"buffer=fifo with buffer.extra_updates={node.extra_updates} under runtime=async: the "
                             "pipeline updates once per batch it draws; use extra_updates=0, or runtime=sync")
        return RolloutQueue, {"capacity": node.capacity, "mode": node.mode, "positive_bias": node.positive_bias,
                              "shards": int(trainers) if node.get("sharded", False) else 1}

    @classmethod
    def cell_label(cls, node, cfg) -> str:
        """e.g. fifo-rho1-N4096-with_replacement-pb0.5-R2 (N in rollouts)."""
        return f"fifo-rho{node.ratio:g}-N{node.capacity}-{node.mode}" + cls._extras(node, "-pb", "-R")

    @classmethod
    def reader_label(cls, node, cfg) -> str:
        return "FIFO replay" + cls._extras(node, " δ=", " R=")

    @staticmethod
    def _extras(node, bias: str, repeats: str) -> str:
        return ((f"{bias}{node.positive_bias:g}" if node.positive_bias else "")
                + (f"{repeats}{node.extra_updates + 1}" if node.extra_updates else ""))

    @classmethod
    def reward_dependent(cls, node) -> bool:
        # With distinct draws the pool of a positive-bias FIFO is its kept rollouts, which rewards decide.
        return node.positive_bias > 0 and node.mode != "with_replacement"

    @classmethod
    def short_pool(cls, node, b_replay: int, gap_fill: str, group_size: int) -> str:
        groups = int(node.capacity) // int(group_size)
        held = f"N={node.capacity} rollouts ({groups} groups of K={group_size})"
        if node.positive_bias > 0:
            kept = groups - round(float(node.positive_bias) * groups)
            return (f"formula does not hold: the positive-bias FIFO of {held} keeps incorrect rollouts only in its "
                    f"freshest {kept} groups, fewer than B_replay={b_replay} distinct draws "
                    f"({node.mode}), so {gap_fill} if none is correct (fewer with correct rollouts)")
        return (f"formula does not hold: the FIFO keeps {held}, fewer than B_replay={b_replay} "
                f"distinct draws ({node.mode}): {gap_fill}")

    @classmethod
    def check(cls, node, run) -> None:
        """The synchronous step's store: N rollouts must hold a group of K, and with distinct draws cover B_replay
        groups, or every step would need gap fill. (The pipeline's FIFO checks N against its batch itself.)"""
        if not described(run.groups["runtime"]).step_replays:
            return
        group_size, groups = run.trainer.group_size, node.capacity // run.trainer.group_size
        if groups == 0:
            raise ValueError(f"buffer.capacity N={node.capacity} rollouts < K={group_size}: the FIFO keeps whole "
                             f"groups and would keep none; raise buffer.capacity to a multiple of {group_size}")
        if node.mode == "with_replacement" or node.get("allow_infeasible", False):
            return
        replay_groups = plan_batch(run.trainer.groups_per_step, node.ratio)[1]
        if groups < replay_groups:
            raise ValueError(
                f"buffer.capacity N={node.capacity} rollouts holds {groups} groups of K={group_size} < "
                f"B_replay={replay_groups}: mode={node.mode} draws distinct groups, so every step would need gap "
                f"fill; raise buffer.capacity to {replay_groups * group_size} or more, use mode=with_replacement, "
                "or buffer.allow_infeasible=true")

    def __init__(self, capacity: int, mode: str = "with_replacement", positive_bias: float = 0.0,
                 correct_reward: float = 1.0, seed: int = 0, ratio: float = 1.0,
                 extra_updates: int = 0, groups_per_step: int = 1, name: str = "fifo", max_age: int = 0,
                 allow_infeasible: bool = False, sharded: bool = False, batch_rollouts: int | None = None) -> None:
        # `sharded` and `batch_rollouts` shape the FIFO's rollout form only (`rollout_queue`, runtime=async).
        super().__init__(seed)
        self.extra_updates = int(extra_updates)
        if max_age != 0:
            raise ValueError(f"buffer.max_age={max_age}: under runtime=sync buffer=fifo has no age window (the "
                             "capacity N bounds staleness); leave max_age=0, use buffer=age1/age2/age3 for an age "
                             "window, or runtime=async, where rollouts older than max_age updates are dropped")
        if not (ratio > 0 or self.extra_updates > 0):
            raise ValueError(f"buffer=fifo with buffer.ratio rho={ratio} and buffer.extra_updates=0 never replays; "
                             "set rho > 0 or extra_updates >= 1, or use buffer=none")
        self.ratio = float(ratio)
        self.groups_per_step = int(groups_per_step)
        # The one replay core, on the RL-step clock, sharing this store's generator (persisted by ReplayStore).
        # Without positive bias it keeps and draws whole groups; with it, rollouts in units of K (set by `add`).
        self.fifo = RolloutQueue(capacity, mode=mode, positive_bias=positive_bias, correct_reward=correct_reward,
                                 whole_groups=float(positive_bias) == 0, rng=self._rng, log_events=False)
        self.capacity, self.mode = self.fifo.capacity, self.fifo.mode
        self.positive_bias, self.correct_reward = self.fifo.positive_bias, self.fifo.correct_reward
        self._draws: list[FifoDraw] = []  # this step's, main and extra batches (seed 001's use statistics)
        self._extra_draws = 0
        self.group_size: int | None = None  # K, fixed by the first group when positive_bias > 0
        self._update_of: dict[int, int] = {}  # stored group -> the update of the step that sampled it
        self._next_uid = 0  # the next group's key in the core
        self.added = 0
        self.dropped = 0  # groups that left the buffer entirely
        self.dropped_rollouts = 0  # responses that left it (whole dropped groups and positive-bias trims)
        self.updates = 0  # update batches handed out so far (main and extra): the gradient-step clock
        self._update: int | None = None  # the update a draw is for (None: a bare `sample`, not for an update)
        self._step_update = 0  # this step's main update, recorded with the groups the step stores

    def __len__(self) -> int:
        return len(self.fifo.groups)

    @property
    def groups(self) -> tuple[Group, ...]:
        """All stored groups, oldest first (read-only view)."""
        return tuple(self.fifo.groups.values())

    @property
    def stored_responses(self) -> tuple[tuple[int, ...], ...]:
        """Response indices still stored for each group in `groups` (all K unless trimmed by positive bias)."""
        held: dict[int, list[int]] = {key: [] for key in self.fifo.groups}
        for rollout in self.fifo.rollouts:
            held[rollout.group_key].append(rollout.index)
        return tuple(tuple(indices) for indices in held.values())

    @property
    def rollouts(self) -> int:
        """Number of stored responses (at most N)."""
        return len(self.fifo)

    def eligible(self, step: int) -> list[Group]:
        """Groups that may be drawn at `step`: age >= 1, i.e. not sampled at `step` itself."""
        return [g for g in self.groups if g.age(step) >= 1]

    # ---- adding and the retention rule ----

    def add(self, groups: Iterable[Group]) -> None:
        """Store this step's fresh groups (call after the update); the core applies the retention rule."""
        new = list(groups)
        newest = max((g.step for g in self.fifo.groups.values()), default=None)
        group_size = self.group_size
        for g in checked_for_storing(new, "FifoReplayBuffer"):
            # FIFO order must be step order, or "oldest dropped first" would drop the wrong groups.
            if newest is not None and g.step < newest:
                raise ValueError(
                    f"Group sampled at step {g.step} added after a group of step {newest}; "
                    "add each step's fresh groups once, in step order."
                )
            newest = g.step
            if self.positive_bias > 0:
                group_size = g.size if group_size is None else group_size
                if g.size != group_size:
                    raise ValueError(
                        f"Positive-bias buffer holds groups of K={group_size} but got K={g.size}; "
                        "its rollout budget N*K needs one group size (use positive_bias=0 for mixed K)."
                    )
        self.group_size = group_size  # set only once the whole call is valid
        if group_size is not None:
            self.fifo.unit = group_size  # seed 001 D.4 in whole groups: delta N rounds to groups of K
        for g in new:
            self._update_of[self._next_uid] = self._step_update
            gone = self.fifo.put(self._next_uid, g, g.step, wall=0.0)
            self._next_uid += 1
            self.dropped_rollouts += len(gone)
            left = {r.group_key for r in gone} - set(self.fifo.groups)
            self.dropped += len(left)
            for key in left:
                del self._update_of[key]
        self.added += len(new)

    # ---- sampling ----

    def sample(self, count: int, step: int) -> list[FifoDraw]:
        """Draw `count` groups' worth of replay for the batch of `step`; the caller fills any gap fresh.

        Whole groups without positive bias: with_replacement returns `count` draws (none if nothing is
        eligible); the other modes min(count, #eligible) distinct groups. With positive bias, `count * K`
        rollouts by the same rules, one draw per group they fall in, in the order the groups were stored.
        """
        count = check_int("count", count, 0)
        wanted = count * self.group_size if self.positive_bias > 0 and self.group_size else count
        samples = self.fifo.draw(wanted, int(step))
        if self.positive_bias == 0:  # whole groups, in draw order: each starts at its response 0
            runs: list[list[Sample]] = []
            for sample in samples:
                if sample.rollout.index == 0:
                    runs.append([])
                runs[-1].append(sample)
        else:
            by_key: dict[int, list[Sample]] = {}
            for sample in sorted(samples, key=lambda s: s.rollout.group_key):
                by_key.setdefault(sample.rollout.group_key, []).append(sample)
            runs = list(by_key.values())
        return [self._as_draw(run, int(step)) for run in runs]

    def _as_draw(self, run: list[Sample], step: int) -> FifoDraw:
        """One group's share of a draw: its drawn responses, its use number and steps since any of them was
        used (the core keeps both per rollout)."""
        key, group = run[0].rollout.group_key, run[0].group
        since = [s.since_last_use for s in run if s.since_last_use is not None]
        return FifoDraw(group=group, responses=tuple(sorted(s.rollout.index for s in run)), uid=key, step=step,
                        age=group.age(step), use=max(s.use for s in run),
                        steps_since_last_use=min(since) if since else None,
                        update_age=None if self._update is None else self._update - self._update_of[key])

    def extra_update_batches(self, replay_factor: int, batch_size: int, step: int) -> list[list[FifoDraw]]:
        """Seed 002's replay mode: the R - 1 extra batches after the fresh update at optimizer step `step`.

        Every extra batch is drawn at RL step ``step``: `age` and steps since last use count RL
        steps; `update_age` counts updates (seed 001's gradient steps), one more per extra batch.
        Call it after the fresh update and before ``add``-ing the
        fresh batch (seed 002 Algorithm 1, lines 4-10). Returns [] when nothing is eligible (the
        first step), so no extra update is taken; otherwise R - 1 batches of this buffer's mode.
        """
        n_extra = extra_updates(replay_factor)
        batch_size = check_int("batch_size", batch_size, 1)
        step = int(step)
        if any(g.step >= step for g in self.groups):
            raise ValueError(
                f"The buffer already holds groups of step {step} or later; the extra updates of step {step} "
                "replay only older batches, so add() the fresh batch after extra_update_batches()."
            )
        if n_extra == 0 or not len(self):
            return []
        batches = []
        for _ in range(n_extra):  # every stored group is at least one step old: each draw is non-empty
            self._update = self.updates
            self.updates += 1
            batches.append(self.sample(batch_size, step))
        return batches

    # ---- the store interface ----

    def _draw(self, count: int, step: int) -> list[BatchGroup]:
        self._step_update = self._update = self.updates  # this step's main update
        self.updates += 1
        self._draws = self.sample(count, step)
        self._extra_draws = 0
        return [as_entry(draw) for draw in self._draws]

    def extra_batches(self, step: int) -> list[Batch]:
        """Seed 002 Algorithm 1: R - 1 further batches of B groups, before this step's fresh ones are stored."""
        batches = self.extra_update_batches(self.extra_updates + 1, self.groups_per_step, step)
        for draws in batches:
            self._draws += draws
            self._extra_draws += len(draws)
        return [Batch([as_entry(draw) for draw in draws]) for draws in batches]

    def store(self, groups: list[Group], step: int) -> None:
        self.add(groups)  # the FIFO drops its oldest in add()

    def metrics(self, step: int) -> dict[str, float]:
        """Seed 001's off-policiness, replay count and steps-since-last-use statistics."""
        return {**super().metrics(step), **use_statistics(self._draws).metrics(), **self.replay_counts().metrics(),
                "fifo/extra_draws": self._extra_draws, "fifo/stored_rollouts": self.rollouts}

    # ---- statistics ----

    def replay_counts(self) -> ReplayCounts:
        """Replay count per rollout over every rollout ever added (dropped ones: final; stored ones: so far)."""
        hist = self.fifo.replay_count_distribution()
        rollouts = sum(hist.values())
        return ReplayCounts(
            rollouts=rollouts,
            mean=sum(u * n for u, n in hist.items()) / rollouts if rollouts else None,
            max=max(hist) if rollouts else None,
            histogram=hist,
        )

    def age_histogram(self, step: int) -> dict[int, int]:
        """Map age at `step` -> number of stored groups of that age."""
        return _histogram(g.age(step) for g in self.groups)

    # ---- persistence (ReplayStore.state_dict adds settings, counters and the RNG) ----

    def load_state_dict(self, state: dict) -> None:
        """Also a checkpoint written while N counted groups (no `capacity_unit`): its N groups of its K are N * K
        rollouts, which a run resumed with the same buffer holds (an empty store's N decided nothing it holds)."""
        settings = state["settings"]
        if "capacity_unit" not in settings:
            contents = state["contents"]
            stored = contents["slots"] if "slots" in contents else [{"group": g} for _, g in contents["queue"]["groups"]]
            sizes = [len(slot["group"]["rewards"]) for slot in stored]
            group_size = contents["group_size"] or (sizes[0] if sizes else None)
            rollouts = self.capacity if group_size is None else settings["capacity"] * int(group_size)
            state = {**state, "settings": {**settings, "capacity": rollouts, "capacity_unit": "rollouts"}}
        super().load_state_dict(state)

    def _contents(self) -> dict:
        return {"group_size": self.group_size, "queue": self.fifo.state_dict(),
                "update_of": sorted([key, update] for key, update in self._update_of.items())}

    def _restore(self, contents: dict) -> None:
        self.group_size = None if contents["group_size"] is None else int(contents["group_size"])
        if self.group_size is not None:
            self.fifo.unit = self.group_size
        if "slots" in contents:  # the slot form, one slot per stored group: converted into the core's
            contents = slots_as_queue(contents, self.fifo)
        self.fifo.load_state_dict(contents["queue"])
        self._update_of = {int(key): int(update) for key, update in contents["update_of"]}


def slots_as_queue(contents: dict, fifo: RolloutQueue) -> dict:
    """A checkpoint's FIFO contents as slots of groups (one per stored group: its responses, uses, last use, the
    responses ever drawn, its update) in the core's form: a rollout per stored response, keyed by the slot's uid,
    with the group's uses for each response it drew (all of them for a whole group); a retired group's use
    count counts once for each of its K rollouts. The generator's state is the store's own (restored already)."""
    version, internal, gauss = fifo._rng.getstate()
    rollouts, groups, replay_counts = [], [], {}
    for slot in contents["slots"]:
        group, drawn = Group(**slot["group"]), set(slot.get("drawn", slot["responses"] if slot["uses"] else ()))
        groups.append([int(slot["uid"]), slot["group"]])
        for i in slot["responses"]:
            used = int(i) in drawn
            rollouts.append({"uid": len(rollouts), "group_key": int(slot["uid"]), "index": int(i),
                             "version": group.step, "reward": group.rewards[int(i)], "created_wall": 0.0,
                             "uses": int(slot["uses"]) if used else 0,
                             "last_used": slot["last_used"] if used else None})
    size = int(contents["group_size"] or (len(groups[0][1]["rewards"]) if groups else 1))
    for uses, count in contents["retired_uses"]:
        replay_counts[int(uses)] = replay_counts.get(int(uses), 0) + int(count) * size
    queue = {"queue": fifo.name, "capacity": fifo.capacity, "rng": [version, list(internal), gauss],
             "next_uid": len(rollouts), "rollouts": rollouts, "groups": groups,
             "replay_counts": sorted(replay_counts.items()), "off_policiness": [], "since_last_use": [],
             "new_uses": 0}
    updates = [[int(slot["uid"]), int(slot.get("update", slot["group"]["step"]))] for slot in contents["slots"]]
    return {"queue": queue, "update_of": updates}


def as_entry(draw: FifoDraw) -> BatchGroup:
    """A draw as a replayed batch entry: it trains the drawn responses (a rollout drawn twice, twice)."""
    whole = draw.responses == tuple(range(draw.group.size))
    return BatchGroup(draw.group, "replay", draw.age, None if whole else draw.responses)
