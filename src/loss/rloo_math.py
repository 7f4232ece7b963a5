"""Pure tensor pieces of the Replay-RLOO objective (SPEC 4; paper eqs. 1-3).

The loss is eq. 3:

    L(theta) = -(1/B) sum_i w_i A_i log pi_theta(y_i|x_i) + beta_KL * KL[pi_theta || pi_ref] - beta_H * H[pi_theta]

with A_i from `leave_one_out_advantages` (eq. 1), w_i from `importance_weights` (eq. 2, a
constant in the gradient), and its policy term from `rloo_policy_loss`. The trainer adds the KL, estimated
per response token with one of the estimators (`src.loss.kl`, `trainer.kl_estimator`, default k3), and the
entropy per response token (`src.policy.token_stats.token_entropy`), as it does for every loss
(`src.loss.trainer.penalised`).
"""

from __future__ import annotations

import torch
from torch import Tensor


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


def rloo_policy_loss(token_logprobs: Tensor, mask: Tensor, advantages: Tensor, token_weights: Tensor, *,
                     batch_size: int) -> Tensor:
    """Eq. 3's policy term on [rows, positions] tensors: -(1/B) sum_i A_i sum_t w_it log pi(y_it).

    Normalised by the number of responses B, so a micro-batch passing the full batch's `batch_size`
    contributes exactly its share of the one-batch loss. A sequence weight w_i (eq. 2) is `token_weights`
    constant along its row; seed 002's token-level IS varies it. The trainer adds eq. 3's KL and entropy
    terms (`src.loss.trainer.penalised`).
    """
    return -(advantages[:, None] * token_weights * token_logprobs * mask).sum() / batch_size


def interleaved_mini_batches(rows: int, updates: int) -> list[list[int]]:
    """Split rows 0..rows-1 into min(updates, rows) mini-batches, row i going to mini-batch i mod M.

    Deterministic (a resumed run splits identically) and it mixes fresh and replayed rows,
    which the batch lists fresh first.
    """
    if updates < 1:
        raise ValueError(f"updates_per_step must be >= 1, got {updates!r}.")
    m = min(int(updates), rows)
    return [list(range(start, rows, m)) for start in range(m)]
