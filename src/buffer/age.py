"""Replay buffer of whole prompt groups for Replay-RLOO (SPEC 3; paper appendix B.3).

Age convention (one rule, used everywhere):

* A group sampled at optimizer step ``s`` has age ``t - s`` at step ``t``.
* ``sample(count, t)`` draws only groups whose age at step ``t`` is in ``[1, L]``,
  tested per group. Fresh groups are ``add``-ed *after* the update of the step
  that sampled them, so at that step they are not stored yet, and were they
  stored their age would be 0, which is not eligible either.
* ``evict(t)`` drops the groups older than ``L`` at step ``t`` (age ``t - s > L``): they can never be
  drawn again. `store` calls it at the end of step ``t`` before adding the step's fresh groups, so a
  group sampled at step ``s`` is replayable at steps ``s + 1 .. s + L`` and stays stored until the
  end of step ``s + L + 1`` (appendix B.3: "groups older than L are dropped at the end of the
  step"). After a step the buffer holds the fresh groups of the last ``L + 1`` steps, ages ``0 .. L``,
  at most ``(L + 1) * B`` groups, as appendix B.3 bounds it; at the next draw the oldest generation
  is ``L + 1`` old and not eligible (eligibility is tested per group). The capacity check runs on
  those ``L + 1`` generations: a safety net of N = ``capacity`` rollouts (the newest whole groups that fit,
  oldest dropped first; by default 4096 groups' worth, never reached at the papers' sizes).
* Replayed groups are not re-added; they stay stored until they are over-age.
"""

from __future__ import annotations

from typing import Iterable

from src.batch import BatchGroup, Group
from src.buffer.rollouts import newest_that_fit
from src.buffer.store import ReplayStore, checked_for_storing, replayed
from src.validate.checks import check_int


class ReplayBuffer(ReplayStore):
    """`buffer=ageL`: stores recent groups and draws replay groups of age 1..L uniformly without replacement."""

    settings = ("max_age",)
    counters = ("capacity_drops", "evicted", "added")
    capacity_counted_groups = True

    @classmethod
    def fresh_only(cls, node) -> bool:
        return node.ratio == 0  # nothing is drawn: the same cell as buffer=none

    @classmethod
    def cell_label(cls, node, cfg) -> str:
        return "rho0" if node.ratio == 0 else f"rho{node.ratio:g}-L{node.max_age}"

    @classmethod
    def reader_label(cls, node, cfg) -> str:
        return "Fresh-only" if node.ratio == 0 else "Replay-RLOO"

    @classmethod
    def plan_window(cls, node, steps: int) -> int | None:
        return max(int(node.max_age), 1)

    @classmethod
    def check(cls, node, run) -> None:
        """rho <= L: otherwise the pool of reusable groups (about L * B_fresh) cannot meet the demand."""
        if node.ratio <= node.max_age or node.ratio == 0 or node.get("allow_infeasible", False):
            return
        raise ValueError(
            f"buffer.ratio rho={node.ratio} > buffer.max_age L={node.max_age}: the pool of reusable groups "
            "(about L * B_fresh) cannot meet the replay demand (rho * B_fresh), so the planned budget is "
            f"unreachable. Use rho <= {node.max_age}, a larger L (buffer=age2/age3), or "
            "buffer.allow_infeasible=true to run anyway with gap fill logged")

    def __init__(self, max_age: int, capacity: int = 4096, seed: int = 0, ratio: float = 1.0,
                 name: str = "age", allow_infeasible: bool = False, groups_per_step: int | None = None) -> None:
        super().__init__(seed)
        self.max_age = check_int("buffer.max_age", max_age, 1, "L, the age window: choose buffer=age1, age2 or "
                                 "age3, or buffer=none for fresh-only runs.")
        self.capacity = check_int("buffer.capacity", capacity, 1, "N rollouts, a safety net only (default 4096 "
                                  "groups' worth).")
        self.ratio = float(ratio)
        self.capacity_drops = 0
        self.evicted = 0
        self.added = 0

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

    def _draw(self, count: int, step: int) -> list[BatchGroup]:
        return replayed(self.sample(count, step), step)

    def store(self, groups: list[Group], step: int) -> None:
        if self.ratio == 0:
            return  # nothing will ever be drawn: keep nothing
        self.evict(step)  # before adding: the capacity safety net then counts only what can still be drawn
        self.add(groups)

    def add(self, groups: Iterable[Group]) -> None:
        """Store this step's fresh groups (call after the update); each needs behaviour log-probs."""
        new = checked_for_storing(groups, "ReplayBuffer")
        self._groups.extend(new)
        self.added += len(new)
        if sum(group.size for group in self._groups) > self.capacity:
            # Safety net only (never reached with the paper's sizes): drop the oldest groups.
            self._groups.sort(key=lambda g: g.step)  # stable: ties keep insertion order
            overflow = len(self._groups) - newest_that_fit([group.size for group in self._groups], self.capacity)
            del self._groups[:overflow]
            self.capacity_drops += overflow

    def evict(self, step: int) -> int:
        """At the end of step `step`, drop the groups older than L (they can never be drawn again)."""
        keep = [g for g in self._groups if g.age(step) <= self.max_age]
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

