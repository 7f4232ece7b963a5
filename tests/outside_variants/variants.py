"""A copy of the age replay store and of the RLOO objective under new names, outside src/.

Nothing in src/ lists them: each class subclasses only its interface (`ReplayStore`, `Objective`) and
describes itself (cell label, budget plan, checks, knobs) as the originals do, so one module and one
YAML per variant (tests/outside_variants/conf/) is all a new variant takes. The code is copied, not
inherited, so that no isinstance or name check in src/ could be what makes them work
(tests/test_outside_variant.py).
"""

from __future__ import annotations

from collections import defaultdict
from typing import Iterable

import torch

from src.batch import Batch, BatchGroup, Group
from src.buffer.store import ReplayStore, checked_for_storing, replayed
from src.checks import check_int
from src.loss.base import Objective, UpdateResult, batch_sequences
from src.loss.rloo_math import importance_weights, rloo_loss
from src.loss.variant_math import truncated_importance_weights
from src.policy.forward import place_tokens, row_values, upcast


class AgeCopyStore(ReplayStore):
    """`buffer=ageL`: stores recent groups and draws replay groups of age 1..L uniformly without replacement."""

    settings = ("max_age",)
    counters = ("capacity_drops", "evicted", "added")

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
    def check(cls, node, cfg) -> None:
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
        self.capacity = check_int("buffer.capacity", capacity, 1, "A safety net only (default 4096).")
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
        overflow = len(self._groups) - self.capacity
        if overflow > 0:
            # Safety net only (never reached with the paper's sizes): drop the oldest groups.
            self._groups.sort(key=lambda g: g.step)  # stable: ties keep insertion order
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
    """L = -(1/B) sum_i w_i A_i log pi(y_i|x_i) + beta_KL KL - beta_H H over the batch's trained responses.

    A_i: leave-one-out advantages from the group's K rewards (eq. 1), also for a FIFO draw that
    trains only some of them. w_i: 1 for fresh rows (mu = pi_theta now), min(c, pi/mu) for
    replayed rows (eq. 2), and for the rows `truncated_rows` names (fresh rows of a stale or
    tempered sampler) seed 002's truncated exp(clip(log pi - log mu, log rho_min, log rho_max)),
    per response or per token. Weights are constants in the gradient. Micro-batch terms are
    normalised by the full batch (`rloo_loss`), so the accumulated gradient equals the one-batch
    gradient exactly; `autocast="bfloat16"` runs the forward passes in bf16 on fp32 weights (bf16
    weights would round lr-1e-5 updates away).
    """

    reads_clip = True

    @classmethod
    def plain(cls, node) -> bool:
        return True  # Replay-RLOO's own objective: the cell identity leaves the loss out, the clip names it

    def __init__(self, clip_ceiling: float, **settings) -> None:
        super().__init__(**settings)
        self.clip_ceiling = float(clip_ceiling)
        self.weight_ceiling = self.clip_ceiling
        # Keep log mu per token of fresh rows for their replay: only a loss that truncates replayed rows per
        # token reads it (eq. 2 weighs replayed rows per sequence), so the others skip the per-row copies.
        self.keep_token_logprobs = False

    def truncated_rows(self, batch: Batch) -> list[bool]:
        """Rows weighted by seed 002's truncated IS instead of eq. 2: fresh rows of an off-policy sampler."""
        return batch.row_off_policy()

    def update(self, policy, reference, optimizer, batch: Batch) -> UpdateResult:
        groups, rows = batch.groups, batch.rows
        loo = self.advantages(torch.tensor([g.rewards for g in groups]))
        advantages = loo[[g for g, _ in rows], [j for _, j in rows]]
        sequences, cached_reference, token_counts = batch_sequences(batch)
        # Fresh groups have no behaviour log-probs yet: mu = pi_theta now, so their weight is exactly 1.
        behaviour = [groups[g].behaviour_logprobs[j] if groups[g].behaviour_logprobs is not None else None
                     for g, j in rows]
        truncated_rows = torch.tensor(self.truncated_rows(batch), dtype=torch.bool)
        token_level = bool(truncated_rows.any()) and self.truncation.is_level == "token"
        behaviour_tokens = [self._stored_token_logprobs(groups[g], j) if token_level and truncated else None
                            for (g, j), truncated in zip(rows, truncated_rows.tolist())]
        size, total_tokens = len(sequences), int(token_counts.sum())
        logprobs, raw_weights, weights = torch.zeros(size), torch.ones(size), torch.ones(size)
        kl_sums = torch.zeros(size)
        reference_tokens: list[tuple[float, ...]] = [()] * size
        current_tokens: list[tuple[float, ...]] = [()] * size
        token_raw: list[torch.Tensor] = [torch.empty(0)] * size
        token_used: list[torch.Tensor] = [torch.empty(0)] * size
        totals = defaultdict(float)

        policy.train()
        optimizer.zero_grad(set_to_none=True)
        for index in self.forward.batches(sequences):
            chunk = [sequences[i] for i in index]
            token_logprobs, entropy, mask = self.forward.token_stats(policy, chunk, with_entropy=True)
            reference_logprobs = self.forward.reference_tokens(reference, chunk, [cached_reference[i] for i in index],
                                                               like=token_logprobs)
            mask = mask.float()
            current, clipped, raw, token_weights, raw_tokens = self._chunk_weights(
                chunk, token_logprobs, mask, [behaviour[i] for i in index], [behaviour_tokens[i] for i in index],
                truncated_rows[index], token_level)
            terms = rloo_loss(token_logprobs, reference_logprobs, entropy, mask,
                              advantages[index].to(mask.device), token_weights, batch_size=size,
                              total_tokens=total_tokens, kl_coef=self.kl_coef, entropy_coef=self.entropy_coef,
                              kl_estimator=self.kl_tokens)
            terms.loss.backward()

            logprobs[index], raw_weights[index], weights[index] = current, raw, clipped
            for i, tokens in zip(index, row_values(reference_logprobs, mask)):
                reference_tokens[i] = tokens
            if self.keep_token_logprobs:
                for i, tokens in zip(index, row_values(token_logprobs, mask)):
                    current_tokens[i] = tokens
            if token_level:
                on = mask.bool().cpu()
                for row, i in enumerate(index):
                    token_raw[i] = raw_tokens[row].detach().cpu()[on[row]]
                    token_used[i] = token_weights[row].detach().cpu()[on[row]]
            kl_sums[index] = terms.kl_tokens.sum(-1).detach().cpu()
            for key, value in (("loss", terms.loss), ("policy_loss", terms.policy), ("kl", terms.kl),
                               ("entropy", terms.entropy)):
                totals[key] += value.item()
        self.optimizer_step(policy, optimizer)
        return UpdateResult(logprobs=logprobs, raw_weights=raw_weights, weights=weights, kl_sums=kl_sums,
                            token_counts=token_counts, reference_tokens=reference_tokens,
                            behaviour_tokens=current_tokens if self.keep_token_logprobs else None,
                            token_raw_weights=token_raw if token_level else None,
                            token_weights=token_used if token_level else None, **totals)

    def _chunk_weights(self, chunk, token_logprobs, mask, behaviour, behaviour_tokens, truncated, token_level: bool):
        """(log pi per response, used and raw weight per response, used and raw weight per token) of a micro-batch.

        Fresh rows of an on-policy sampler have no mu: mu = pi_theta now, weight exactly 1. Replayed rows get
        eq. 2's min(c, pi/mu); the rows `truncated_rows` names get seed 002's truncated IS (its eq. 3), per
        response or, at is_level=token, per token (the response's weight is then its mean token weight).
        """
        current = (token_logprobs * mask).sum(-1).detach().cpu()                # log pi_theta(y|x)
        mu = torch.tensor([mu_i if mu_i is not None else current[n].item() for n, mu_i in enumerate(behaviour)])
        clipped, raw = importance_weights(current, mu, self.clip_ceiling)     # eq. 2
        if truncated.any():  # seed 002 eq. 3
            seq_weights, seq_raw = truncated_importance_weights(current, mu, self.truncation.is_min,
                                                                self.truncation.is_max)
            clipped, raw = torch.where(truncated, seq_weights, clipped), torch.where(truncated, seq_raw, raw)
        token_weights = clipped.to(mask.device)[:, None].expand_as(mask)  # a sequence weight on each token
        raw_tokens = raw.to(mask.device)[:, None].expand_as(mask)
        if token_level and truncated.any():
            mu_tokens = place_tokens(chunk, behaviour_tokens, torch.zeros_like(mask))
            per_token, per_token_raw = truncated_importance_weights(
                upcast(token_logprobs.detach()), mu_tokens, self.truncation.is_min, self.truncation.is_max,
                level="token", mask=mask)
            on_tokens = truncated.to(mask.device)[:, None]
            token_weights = torch.where(on_tokens, per_token, token_weights)
            raw_tokens = torch.where(on_tokens, per_token_raw, raw_tokens)
            token_mean = (per_token * mask).sum(-1).cpu() / mask.sum(-1).clamp(min=1).cpu()
            clipped = torch.where(truncated, token_mean, clipped)
        return current, clipped, raw, token_weights, raw_tokens

    @staticmethod
    def _stored_token_logprobs(group, response: int) -> tuple[float, ...]:
        if group.behaviour_token_logprobs is None:
            raise ValueError(f"a group of step {group.step} has no per-token behaviour log-probs, which token-level "
                             "truncated IS needs; groups stored by a run with is_level=sequence cannot be replayed "
                             "with is_level=token")
        return group.behaviour_token_logprobs[response]
