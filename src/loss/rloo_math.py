"""Pure tensor pieces of the Replay-RLOO objective (SPEC 4; paper eqs. 1-3).

The trainer composes the loss itself (eq. 3):

    L(theta) = -(1/B) sum_i w_i A_i log pi_theta(y_i|x_i) + beta_KL * KL[pi_theta || pi_ref] - beta_H * H[pi_theta]

with A_i from `leave_one_out_advantages` (eq. 1), w_i from `importance_weights` (eq. 2, a
constant in the gradient), the KL estimated per response token with one of the
estimators (`src.loss.kl`, `trainer.kl_estimator`, default k3), and the entropy per response token
(`src.policy.token_stats.token_entropy`).
"""

from __future__ import annotations

import math
from typing import NamedTuple

import torch
from torch import Tensor

from src.loss.kl import KlEstimator, kl_k3


def leave_one_out_advantages(rewards: Tensor) -> Tensor:
    """Leave-one-out advantages A_i = r_i - mean_{j != i} r_j over the last dim (eq. 1)."""
    if rewards.dim() < 1:
        raise ValueError("rewards must have shape [G, K] (groups x responses), got a scalar.")
    k = rewards.shape[-1]
    if k < 2:
        raise ValueError(f"leave-one-out needs K >= 2 responses per group, got K={k}.")
    total = rewards.sum(dim=-1, keepdim=True)
    return rewards - (total - rewards) / (k - 1)


def importance_weights(
    current_logprobs: Tensor, behaviour_logprobs: Tensor, clip_ceiling: float
) -> tuple[Tensor, Tensor]:
    """Return (clipped, raw) sequence weights min(c, exp(log pi - log mu)) and exp(log pi - log mu), detached (eq. 2)."""
    c = float(clip_ceiling)
    if not c > 0:  # also rejects nan
        raise ValueError(f"clip_ceiling c must be > 0, got {clip_ceiling!r}; the paper uses c in {{1, 3, 10}}.")
    if current_logprobs.shape != behaviour_logprobs.shape:
        raise ValueError(
            f"current_logprobs shape {tuple(current_logprobs.shape)} != behaviour_logprobs shape "
            f"{tuple(behaviour_logprobs.shape)}; pass one sequence log-prob per response for both."
        )
    # The weight is a constant in the gradient (SPEC 4), so it is computed without autograd.
    with torch.no_grad():
        raw = torch.exp(current_logprobs.detach() - behaviour_logprobs.detach().to(current_logprobs.dtype))
        clipped = raw.clamp(max=c)  # one-sided clip: only large weights are capped
    return clipped, raw


def clip_fraction(raw_weights: Tensor, clip_ceiling: float) -> float:
    """Share of raw weights strictly above c; nan for empty input (nothing was reused)."""
    if raw_weights.numel() == 0:
        return float("nan")
    return (raw_weights.detach() > float(clip_ceiling)).double().mean().item()


def effective_sample_size(weights: Tensor) -> float:
    """Normalised ESS (sum w)^2 / (n * sum w^2) in (0, 1]; nan for empty or all-zero weights."""
    w = weights.detach().double().flatten()
    n = w.numel()
    if n == 0:
        return float("nan")
    denom = n * (w * w).sum().item()
    if denom == 0:
        return float("nan")
    return w.sum().item() ** 2 / denom


class LossTerms(NamedTuple):
    """Eq. 3's value and its three terms (each already normalised), plus the per-token KL estimates."""

    loss: Tensor
    policy: Tensor
    kl: Tensor
    entropy: Tensor
    kl_tokens: Tensor


def rloo_loss(token_logprobs: Tensor, reference_logprobs: Tensor, entropy: Tensor, mask: Tensor,
              advantages: Tensor, token_weights: Tensor, *, batch_size: int, total_tokens: int,
              kl_coef: float, entropy_coef: float, kl_estimator: KlEstimator = kl_k3) -> LossTerms:
    """Eq. 3 on [rows, positions] tensors: -(1/B) sum_i A_i sum_t w_it log pi(y_it) + beta_KL KL - beta_H H.

    The policy term is normalised by the number of responses B, the KL (by default k3) and entropy terms by the
    number of response tokens of the whole batch, so a micro-batch passing the full batch's
    `batch_size` and `total_tokens` contributes exactly its share of the one-batch loss. A sequence
    weight w_i (eq. 2) is `token_weights` constant along its row; seed 002's token-level IS varies it.
    `reference_logprobs` None (no pi_ref read, kl_coef = 0): no KL term, and its value is nan (not measured).
    """
    policy = -(advantages[:, None] * token_weights * token_logprobs * mask).sum() / batch_size
    entropy_term = (entropy * mask).sum() / total_tokens
    if reference_logprobs is None:
        kl_tokens = torch.full_like(token_logprobs.detach(), math.nan)
        return LossTerms(policy - entropy_coef * entropy_term, policy, kl_tokens.sum(), entropy_term, kl_tokens)
    kl_tokens = kl_estimator(token_logprobs, reference_logprobs) * mask
    kl = kl_tokens.sum() / total_tokens
    return LossTerms(policy + kl_coef * kl - entropy_coef * entropy_term, policy, kl, entropy_term, kl_tokens)


def interleaved_mini_batches(rows: int, updates: int) -> list[list[int]]:
    """Split rows 0..rows-1 into min(updates, rows) mini-batches, row i going to mini-batch i mod M.

    Deterministic (a resumed run splits identically) and it mixes fresh and replayed rows,
    which the batch lists fresh first.
    """
    if updates < 1:
        raise ValueError(f"updates_per_step must be >= 1, got {updates!r}.")
    m = min(int(updates), rows)
    return [list(range(start, rows, m)) for start in range(m)]
