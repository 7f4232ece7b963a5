"""A copy of the age replay store and of the RLOO objective under new names, outside src/.

Nothing in src/ lists them: each class subclasses only its interface (`ReplayStore`, `Objective`) and
describes itself (cell label, budget plan, checks, knobs) as the originals do, so one module and one
YAML per variant (tests/outside_variants/conf/) is all a new variant takes. The code is copied, not
inherited (the loss reuses only src's maths of eqs. 2 and 3), so that no isinstance or name check in
src/ could be what makes them work (tests/e2e/test_outside_variant.py). The shared trainer runs the loss's
micro-batches, backward passes and optimizer steps, so the loss is its per-micro-batch function alone.
"""

from __future__ import annotations

from typing import Iterable

import torch

from src.batch import BatchGroup, Group
from src.buffer.rollouts import newest_that_fit
from src.buffer.store import ReplayStore, checked_for_storing, replayed
from src.validate.checks import check_int
from src.loss.base import Objective
from src.loss.rloo_math import importance_weights, rloo_policy_loss
from src.loss.variant_math import truncated_importance_weights
from src.policy.forward import upcast
from src.loss.trainer import Loss, MicroBatch, Totals


class AgeCopyStore(ReplayStore):
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
        new = checked_for_storing(groups, "AgeCopyStore")
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


class RlooCopy(Objective):
    """L = -(1/B) sum_i w_i A_i log pi(y_i|x_i) (eq. 3; the trainer adds the KL and entropy terms).

    The trainer lays out A_i (eq. 1) and log mu per row (log pi now for fresh rows). w_i = min(c, pi/mu) (eq. 2),
    and seed 002's truncated IS on the rows `lp.truncated` names, per response or, where the trainer laid out
    log mu per token, per token; constants in the gradient. Each term is normalised by the whole batch.
    """

    reads_clip = True

    @classmethod
    def plain(cls, node) -> bool:
        return True  # Replay-RLOO's own objective: the cell identity leaves the loss out, the clip names it

    def __init__(self, clip_ceiling: float, **settings) -> None:
        super().__init__(**settings)
        self.clip_ceiling = self.weight_ceiling = float(clip_ceiling)

    def __call__(self, lp: MicroBatch, totals: Totals) -> Loss:
        t, now = self.truncation, lp.sequence_logprobs()
        used, raw = importance_weights(now, lp.behaviour, self.clip_ceiling)
        on = torch.tensor(lp.truncated, device=now.device)
        cut, cut_raw = truncated_importance_weights(now, lp.behaviour, t.is_min, t.is_max)
        used, raw = torch.where(on, cut, used), torch.where(on, cut_raw, raw)
        tokens, raw_tokens = used[:, None].expand_as(lp.mask), raw[:, None].expand_as(lp.mask)
        if lp.behaviour_tokens is not None and any(lp.truncated):
            per, per_raw = truncated_importance_weights(upcast(lp.policy.detach()), lp.behaviour_tokens, t.is_min,
                                                        t.is_max, level="token", mask=lp.mask)
            tokens, raw_tokens = torch.where(on[:, None], per, tokens), torch.where(on[:, None], per_raw, raw_tokens)
            used = torch.where(on, (per * lp.mask).sum(-1) / lp.mask.sum(-1).clamp(min=1), used)
        policy = rloo_policy_loss(lp.policy, lp.mask, lp.advantages, tokens, batch_size=totals.rows)
        token_weights = (raw_tokens, tokens) if lp.behaviour_tokens is not None else None
        return Loss(policy, policy, logprobs=now, weights=(raw, used), token_weights=token_weights)
