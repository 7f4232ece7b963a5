"""`loss=m2po`: M2PO, a trust region on the second moment of the log importance ratio (Zheng, Zhao and Chen
2025, arXiv 2510.01161; docs/papers.md#m2po).

Instead of PPO's per-token clip, M2PO masks the few tokens whose squared log importance ratio is largest:

    M2_hat = (1/N) sum_t (log r_t)^2,  r_t = pi(y_t) / mu(y_t)        over the batch's N response tokens
    M_t = 0 for the largest (log r_t)^2, removed one by one until the mean of the rest is <= tau_M2 (m2_threshold)
    J = (1/N) sum_it M_it r_it A_i                                    (no clip; token mean; A group-normalised)

The mask is fixed once per RL step, from the trainer's first no-grad pass (pi_prox, the policy before this
step's first optimizer step, where pi = pi_prox), over the whole batch and every rank that shares it, as AReaL
computes it (docs/papers.md#m2po). A fresh row of an on-policy sampler has mu = pi_prox: log r = 0, never masked.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from src.batch import Batch
from src.loss.base import Objective
from src.loss.grpo import stored_behaviour_tokens
from src.loss.inputs import Needs, Shared
from src.loss.trainer import Loss, MicroBatch, Tally, Totals
from src.loss.variant_math import group_normalised_advantages
from src.policy.forward import place_tokens, upcast
from src.variant import float_knob, int_knob

BISECTIONS = 64  # halvings of [0, max (log r)^2]: below any gap between distinct float32 values near tau_M2


def second_moment_mask(squared: list[torch.Tensor], tau: float, reducer) -> tuple[list[torch.Tensor], dict]:
    """M2PO's mask (its Algorithm 1) over every response token of the batch: True where a token is kept.

    `squared`: (log r)^2 per response token of each row. Removing the largest values one at a time until the
    mean of the rest is <= `tau` keeps exactly the tokens at or below the largest threshold s whose kept mean
    mean{v <= s} is <= `tau` (that mean only grows with s), so the threshold is found by bisection over
    `reducer` totals: the same mask on every data-parallel rank, with no token gathered. Tokens tied at the
    cut are kept or removed together.
    """
    flat = torch.cat([values.double() for values in squared]) if squared else torch.zeros(0, dtype=torch.float64)

    def kept_mean(threshold: float) -> float:
        kept = flat <= threshold
        count = reducer.total(float(kept.sum()))
        return reducer.total(float(flat[kept].sum())) / count if count else 0.0

    tokens = reducer.total(float(flat.numel()))
    before = reducer.total(float(flat.sum())) / tokens if tokens else 0.0
    high = reducer.maximum(float(flat.max()) if flat.numel() else 0.0)
    if before <= tau:
        threshold = high
    else:  # kept_mean(low) <= tau < kept_mean(high)
        low = -1.0
        for _ in range(BISECTIONS):
            middle = (low + high) / 2
            low, high = (middle, high) if kept_mean(middle) <= tau else (low, middle)
        threshold = low
    kept = reducer.total(float((flat <= threshold).sum()))
    diagnostics = {"m2po/m2_before": before, "m2po/m2_after": kept_mean(threshold),
                   "m2po/masked_frac": 1.0 - kept / tokens if tokens else 0.0}
    return [values.double() <= threshold for values in squared], diagnostics


class M2po(Objective):
    """`updates_per_step` mini-batch optimizer steps on J (above), to which the trainer adds its KL and
    entropy terms (the paper trains without them: the preset sets both to 0)."""

    knobs = {"m2_threshold": float_knob(0, 1e6, "0.04 (M2PO)", low_open=True,
                               why="the bound on the batch's mean (log r)^2 that the mask enforces"),
             "updates_per_step": int_knob(1, 1_000, "4", why="mini-batch optimizer steps per RL step")}
    cell_tag = "-m2po"
    reader_tag = " (M2PO loss)"

    def __init__(self, m2_threshold: float, updates_per_step: int, **settings) -> None:
        super().__init__(**settings)
        self.m2_threshold, self.updates_per_step = float(m2_threshold), int(updates_per_step)
        # pi_prox from a first pass; mu per token is the loss's own, so no row is truncated.
        self.needs = Needs(truncates="none", first_pass=(False, False), updates=self.updates_per_step)

    def advantages(self, rewards: torch.Tensor) -> torch.Tensor:
        """GRPO's group-normalised advantages, as M2PO trains with."""
        return group_normalised_advantages(rewards)

    def prepare(self, batch: Batch, shared: Shared) -> "_Step":
        return _Step(stored_behaviour_tokens(batch), [torch.empty(0)] * len(batch.rows), shared.reducer)

    def observe(self, step: "_Step", lp: MicroBatch) -> None:
        """pi_prox per response token of one micro-batch (the first pass)."""
        token_logprobs, mask = upcast(lp.policy).cpu(), lp.mask.bool().cpu()
        for row, i in enumerate(lp.index):
            step.prox[i] = token_logprobs[row][mask[row]].clone()

    def trains(self, step: "_Step") -> bool:
        """Called once the first pass is over: the step's mask, from every row's pi_prox and mu."""
        squared = [(step.prox[i] - step.behaviour(i)) ** 2 for i in range(len(step.prox))]
        step.kept, step.extras = second_moment_mask(squared, self.m2_threshold, step.reducer)
        return True

    def __call__(self, lp: MicroBatch, totals: Totals) -> Loss:
        zeros = torch.zeros_like(upcast(lp.policy))
        step = lp.state
        behaviour = place_tokens(lp.chunk, [step.behaviour(i) for i in lp.index], zeros.clone())
        kept = place_tokens(lp.chunk, [step.kept[i].to(zeros.dtype) for i in lp.index], zeros.clone())
        log_ratio = torch.where(kept > 0, upcast(lp.policy) - behaviour, zeros)  # no exp of a masked token
        terms = kept * torch.exp(log_ratio) * lp.advantages[:, None].to(zeros.dtype)
        policy_loss = -terms.sum() / totals.tokens
        return Loss(policy_loss, policy_loss)

    def result(self, step: "_Step", tally: Tally, token_counts: torch.Tensor, optimizer_steps: int) -> dict:
        """Per response: log pi_prox (stored as a fresh row's log mu, per token too), its sequence ratio to mu,
        and the share of its tokens kept as the used weight's mean; the mask's diagnostics."""
        prox, behaviour = step.prox, [step.behaviour(i) for i in range(len(step.prox))]
        token_raw = [(p - b).exp() for p, b in zip(prox, behaviour)]
        token_used = [raw * kept for raw, kept in zip(token_raw, step.kept)]
        return {"logprobs": torch.stack([p.sum() for p in prox]),
                "raw_weights": torch.stack([(p - b).sum().exp() for p, b in zip(prox, behaviour)]),
                "weights": torch.stack([used.mean() if len(used) else torch.tensor(1.0) for used in token_used]),
                "behaviour_tokens": [tuple(p.tolist()) for p in prox],
                "token_raw_weights": token_raw, "token_weights": token_used,
                "extras": {**step.extras, "m2po/updates": float(optimizer_steps)}}


@dataclass
class _Step:
    """What stays fixed through one RL step's updates: mu and pi_prox per response token, and the mask."""

    stored_behaviour: list[torch.Tensor | None]  # None: a fresh row's, mu = pi_prox
    prox: list[torch.Tensor]
    reducer: object
    kept: list[torch.Tensor] = field(default_factory=list)
    extras: dict = field(default_factory=dict)

    def behaviour(self, row: int) -> torch.Tensor:
        stored = self.stored_behaviour[row]
        return self.prox[row] if stored is None else stored.to(self.prox[row].dtype)
