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
batch, as in appendix D.3); :func:`use_statistics` summarises draws and
:meth:`FifoReplayBuffer.replay_counts` gives the replay count per group (mean / max / histogram).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Iterable, Sequence

from src.batch import Batch, BatchGroup, Group
from src.buffer.positive_bias import positive_bias_keep
from src.buffer.store import QUEUE_KNOBS, ReplayStore, checked_for_storing, newest_that_fit
from src.batch import plan_batch
from src.validate.checks import check_choice, check_int
from src.variant import Knob, described, float_knob, int_knob

SAMPLING_MODES = ("with_replacement", "without_replacement", "at_least_once")


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
    """Replay count per group (seed 001's replay ratio): how many times each group was drawn."""

    groups: int
    mean: float | None  # None when no group was ever added
    max: int | None
    histogram: dict[int, int]  # uses -> number of groups

    def metrics(self, prefix: str = "fifo/") -> dict[str, float]:
        """Flat float metrics for logging; undefined values are left out."""
        out = {f"{prefix}replay_count_groups": float(self.groups)}
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


@dataclass
class _Slot:
    # Mutable bookkeeping for one stored group; never handed out (FifoDraw is the public view).
    uid: int
    group: Group
    responses: tuple[int, ...]
    uses: int = 0
    last_used: int | None = None
    drawn: set[int] = field(default_factory=set)  # responses ever drawn (positive bias draws rollouts)
    update: int = 0  # index of the update of the step that sampled the group (seed 001's gradient-step clock)


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
        whether a batch's draws are distinct (without_replacement, Listing 5's random.sample) or independent
        (with_replacement, section 4's analysis). The pipeline's schedule sets the reuse (mu T / W, footnote 5),
        so rho does not enter; what the synchronous step alone reads is refused."""
        from src.buffer.rollouts import RolloutReplayBuffer

        if node.mode not in ("with_replacement", "without_replacement") or node.extra_updates:
            raise ValueError(f"buffer=fifo with buffer.mode={node.mode}, buffer.extra_updates={node.extra_updates} "
                             "under runtime=async: the pipeline draws each batch with or without replacement and "
                             "updates once per batch; use mode=with_replacement or without_replacement and "
                             "extra_updates=0, or runtime=sync")
        return RolloutReplayBuffer, {"capacity": node.capacity, "independent": node.mode == "with_replacement",
                                     "positive_bias": node.positive_bias,
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
        self.mode = check_choice("buffer.mode", mode, SAMPLING_MODES)
        self.positive_bias = float(positive_bias)
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
        self._draws: list[FifoDraw] = []  # this step's, main and extra batches (seed 001's use statistics)
        self._extra_draws = 0
        self.capacity = int(capacity)
        if isinstance(correct_reward, bool) or not isinstance(correct_reward, (int, float)):
            raise ValueError(f"correct_reward must be a number (the task's Task.correct_reward, e.g. 1.0), "
                             f"got {correct_reward!r}.")
        self.correct_reward = float(correct_reward)
        self._slots: list[_Slot] = []  # insertion order == step order
        self.group_size: int | None = None  # K, fixed by the first group when positive_bias > 0
        self._next_uid = 0
        self._retired_uses: dict[int, int] = {}  # final use count -> groups that left the buffer
        self.added = 0
        self.dropped = 0  # groups that left the buffer entirely
        self.dropped_rollouts = 0  # responses that left it (whole dropped groups and positive-bias trims)
        self.updates = 0  # update batches handed out so far (main and extra): the gradient-step clock
        self._update: int | None = None  # the update a draw is for (None: a bare `sample`, not for an update)
        self._step_update = 0  # this step's main update, recorded with the groups the step stores

    def __len__(self) -> int:
        return len(self._slots)

    @property
    def groups(self) -> tuple[Group, ...]:
        """All stored groups, oldest first (read-only view)."""
        return tuple(s.group for s in self._slots)

    @property
    def stored_responses(self) -> tuple[tuple[int, ...], ...]:
        """Response indices still stored for each group in `groups` (all K unless trimmed by positive bias)."""
        return tuple(s.responses for s in self._slots)

    @property
    def rollouts(self) -> int:
        """Number of stored responses (at most N)."""
        return sum(len(s.responses) for s in self._slots)

    def eligible(self, step: int) -> list[Group]:
        """Groups that may be drawn at `step`: age >= 1, i.e. not sampled at `step` itself."""
        return [s.group for s in self._eligible_slots(step)]

    def _eligible_slots(self, step: int) -> list[_Slot]:
        return [s for s in self._slots if s.group.age(step) >= 1]

    # ---- adding and the retention rule ----

    def add(self, groups: Iterable[Group]) -> None:
        """Store this step's fresh groups (call after the update), then apply the retention rule."""
        new = list(groups)
        newest = self._slots[-1].group.step if self._slots else None
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
        for g in new:
            self._slots.append(_Slot(uid=self._next_uid, group=g, responses=tuple(range(g.size)),
                                     update=self._step_update))
            self._next_uid += 1
        self.added += len(new)
        if self.positive_bias > 0:
            self._retain_positive_bias()
        else:
            kept = newest_that_fit([len(slot.responses) for slot in self._slots], self.capacity)
            self._remove(self._slots[: len(self._slots) - kept])

    def _retain_positive_bias(self) -> None:
        # Seed 001 D.4 on the flattened rollout stream (oldest group first, response index order).
        flat = [(slot, i) for slot in self._slots for i in slot.responses]
        correct = [slot.group.rewards[i] >= self.correct_reward for slot, i in flat]
        keep = positive_bias_keep(correct, self.capacity // self.group_size, self.positive_bias, unit=self.group_size)
        kept_by_uid: dict[int, list[int]] = {}
        for j in keep:
            slot, i = flat[j]
            kept_by_uid.setdefault(slot.uid, []).append(i)
        gone = []
        for slot in self._slots:
            kept = tuple(kept_by_uid.get(slot.uid, ()))
            if not kept:
                gone.append(slot)
            else:
                self.dropped_rollouts += len(slot.responses) - len(kept)
                slot.responses = kept
        self._remove(gone)

    def _remove(self, slots: list[_Slot]) -> None:
        if not slots:
            return
        uids = {s.uid for s in slots}
        for s in slots:
            self._retired_uses[s.uses] = self._retired_uses.get(s.uses, 0) + 1
            self.dropped_rollouts += len(s.responses)
        self.dropped += len(slots)
        self._slots = [s for s in self._slots if s.uid not in uids]

    # ---- sampling ----

    def sample(self, count: int, step: int) -> list[FifoDraw]:
        """Draw `count` groups' worth of replay for the batch of `step`; the caller fills any gap fresh.

        Whole groups without positive bias: with_replacement returns `count` draws (none if nothing is
        eligible); the other modes min(count, #eligible) distinct groups. With positive bias,
        `count * K` rollouts by the same rules (`_sample_rollouts`), one draw per group they fall in.
        """
        count = check_int("count", count, 0)
        step = int(step)
        pool = self._eligible_slots(step)
        if count == 0 or not pool:
            return []  # consume no randomness, so empty draws do not shift the RNG stream
        if self.positive_bias > 0:
            return self._sample_rollouts(pool, count * self.group_size, step)
        if self.mode == "with_replacement":
            chosen = self._rng.choices(pool, k=count)
        elif self.mode == "without_replacement":
            chosen = self._rng.sample(pool, min(count, len(pool)))
        else:  # at_least_once: never-drawn groups first, then fill without replacement
            never = [s for s in pool if s.uses == 0]
            used = [s for s in pool if s.uses > 0]
            k = min(count, len(pool))
            chosen = self._rng.sample(never, min(k, len(never)))
            chosen += self._rng.sample(used, k - len(chosen))
        return [self._record(slot, step, slot.responses) for slot in chosen]

    def _sample_rollouts(self, pool: list[_Slot], wanted: int, step: int) -> list[FifoDraw]:
        # Seed 001 D.4: uniform over the stored rollouts, the buffer's mode applied to rollouts.
        rollouts = [(slot, i) for slot in pool for i in slot.responses]
        if self.mode == "with_replacement":
            chosen = self._rng.choices(rollouts, k=wanted)
        elif self.mode == "without_replacement":
            chosen = self._rng.sample(rollouts, min(wanted, len(rollouts)))
        else:  # at_least_once, per rollout
            never = [(slot, i) for slot, i in rollouts if i not in slot.drawn]
            used = [(slot, i) for slot, i in rollouts if i in slot.drawn]
            k = min(wanted, len(rollouts))
            chosen = self._rng.sample(never, min(k, len(never)))
            chosen += self._rng.sample(used, k - len(chosen))
        by_group: dict[int, list[int]] = {}
        for slot, i in chosen:
            by_group.setdefault(slot.uid, []).append(i)
        return [self._record(slot, step, tuple(sorted(by_group[slot.uid]))) for slot in pool if slot.uid in by_group]

    def _record(self, slot: _Slot, step: int, responses: tuple[int, ...]) -> FifoDraw:
        since = None if slot.last_used is None else step - slot.last_used
        slot.uses += 1
        slot.last_used = step
        slot.drawn.update(responses)
        return FifoDraw(group=slot.group, responses=responses, uid=slot.uid, step=step,
                        age=slot.group.age(step), use=slot.uses, steps_since_last_use=since,
                        update_age=None if self._update is None else self._update - slot.update)

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
        if any(s.group.step >= step for s in self._slots):
            raise ValueError(
                f"The buffer already holds groups of step {step} or later; the extra updates of step {step} "
                "replay only older batches, so add() the fresh batch after extra_update_batches()."
            )
        if n_extra == 0 or not self._slots:
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
        """Replay count per group over every group ever added (dropped groups: final; stored ones: so far)."""
        hist = dict(self._retired_uses)
        for s in self._slots:
            hist[s.uses] = hist.get(s.uses, 0) + 1
        groups = sum(hist.values())
        return ReplayCounts(
            groups=groups,
            mean=sum(u * n for u, n in hist.items()) / groups if groups else None,
            max=max(hist) if groups else None,
            histogram=dict(sorted(hist.items())),
        )

    def age_histogram(self, step: int) -> dict[int, int]:
        """Map age at `step` -> number of stored groups of that age."""
        return _histogram(s.group.age(step) for s in self._slots)

    # ---- persistence (ReplayStore.state_dict adds settings, counters and the RNG) ----

    def load_state_dict(self, state: dict) -> None:
        """Also a checkpoint written while N counted groups (no `capacity_unit`): its N groups of its K are N * K
        rollouts, which a run resumed with the same buffer holds (an empty store's N decided nothing it holds)."""
        settings = state["settings"]
        if "capacity_unit" not in settings:
            sizes = [len(slot["group"]["rewards"]) for slot in state["contents"]["slots"]]
            group_size = state["contents"]["group_size"] or (sizes[0] if sizes else None)
            rollouts = self.capacity if group_size is None else settings["capacity"] * int(group_size)
            state = {**state, "settings": {**settings, "capacity": rollouts, "capacity_unit": "rollouts"}}
        super().load_state_dict(state)

    def _contents(self) -> dict:
        return {
            "group_size": self.group_size,
            "slots": [
                {"uid": s.uid, "group": dataclasses.asdict(s.group), "responses": list(s.responses),
                 "uses": s.uses, "last_used": s.last_used, "drawn": sorted(s.drawn), "update": s.update}
                for s in self._slots
            ],
            "retired_uses": sorted([u, n] for u, n in self._retired_uses.items()),
        }

    def _restore(self, contents: dict) -> None:
        self.group_size = None if contents["group_size"] is None else int(contents["group_size"])
        self._slots = [
            _Slot(uid=int(s["uid"]), group=Group(**s["group"]), responses=tuple(int(i) for i in s["responses"]),
                  uses=int(s["uses"]), last_used=None if s["last_used"] is None else int(s["last_used"]),
                  drawn={int(i) for i in s.get("drawn", ())},
                  update=int(s.get("update", s["group"]["step"])))  # older checkpoints: one update per step
            for s in contents["slots"]
        ]
        self._retired_uses = {int(u): int(n) for u, n in contents["retired_uses"]}


def as_entry(draw: FifoDraw) -> BatchGroup:
    """A draw as a replayed batch entry: it trains the drawn responses (a rollout drawn twice, twice)."""
    whole = draw.responses == tuple(range(draw.group.size))
    return BatchGroup(draw.group, "replay", draw.age, None if whole else draw.responses)
