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

from dataclasses import dataclass

import torch

from src.loss.base import Objective
from src.loss.inputs import Needs
from src.loss.trainer import FirstPass, Fixed, Loss, MicroBatch, Totals
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
        # pi_prox and mu per token from the trainer's first pass; no row is truncated: r weighs every token.
        self.needs = Needs(truncates="none", proximal=True, updates=self.updates_per_step)

    def advantages(self, rewards: torch.Tensor) -> torch.Tensor:
        """GRPO's group-normalised advantages, as M2PO trains with."""
        return group_normalised_advantages(rewards)

    def fix(self, first: FirstPass, reducer) -> Fixed:
        """The step's mask, from every row's pi_prox and mu per token (the trainer's first pass)."""
        squared = [(first.prox[i] - first.behaviour(i)) ** 2 for i in range(len(first.prox))]
        return Fixed(state=_Mask(*second_moment_mask(squared, self.m2_threshold, reducer)))

    def __call__(self, lp: MicroBatch, totals: Totals) -> Loss:
        """J on one micro-batch, with r = pi_prox/mu per token as the raw weight, r kept by the mask as the used
        one, and the mask's diagnostics."""
        zeros = torch.zeros_like(upcast(lp.policy))
        behaviour = lp.behaviour_tokens
        kept = place_tokens(lp.chunk, [lp.state.kept[i].to(zeros.dtype) for i in lp.index], zeros.clone())
        log_ratio = torch.where(kept > 0, upcast(lp.policy) - behaviour, zeros)  # no exp of a masked token
        terms = kept * torch.exp(log_ratio) * lp.advantages[:, None].to(zeros.dtype)
        policy_loss = -terms.sum() / totals.tokens
        raw = (lp.proximal - behaviour).exp()
        return Loss(policy_loss, policy_loss, token_weights=(raw, raw * kept), diagnostics=lp.state.diagnostics)


@dataclass(frozen=True)
class _Mask:
    """What stays fixed through one RL step's updates: the tokens kept, per row, and the mask's diagnostics."""

    kept: list[torch.Tensor]
    diagnostics: dict
