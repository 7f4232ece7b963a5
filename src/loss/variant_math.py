"""Pure tensor pieces of the variant objectives (SPEC 9): POPO / GRPO and truncated IS.

Nothing here touches a model or a trainer; the trainer composes these later.

* `group_normalised_advantages` -- GRPO's group-normalised advantage, POPO eq. 3
  (seed 003, sec. 2): A_i = (r_i - mean_j r_j) / (std_j r_j + eps) within each group.
* `clipped_surrogate` -- the PPO/GRPO clipped surrogate with DAPO's clip-higher
  (eps_low = 0.2, eps_high = 0.28; seed 003, app. D.2) in POPO's *decoupled* form,
  eq. 10 (seed 003, sec. 4.2): the clip acts on r = pi_theta / pi_prox, where pi_prox is
  the policy at the start of the optimizer step, and each sample is additionally
  multiplied by the constant behaviour weight min(pi_prox / mu, 2.0) (sec. 4.3 and
  app. "Variance Control in Importance Sampling"). The *coupled* objective eq. 9 clips
  pi_theta / mu instead; Lemma 4.2 says the two agree wherever neither ratio is clipped.
* `truncated_importance_weights` -- seed 002, eq. 3: sequence- or token-level IS
  weights rho = exp(clip(log pi_theta - log pi_b, log rho_min, log rho_max)), used as
  constants in L = -E[A_i * rho_i * log pi_theta(y_i|x)] (seed 002, sec. 3.2).

Conventions shared by the functions below: token tensors are [N, T] (N responses, T
response positions, right-padded), `mask` is [N, T] with 1/True on real response
tokens; log-probs of the proximal and behaviour policies are data (detached).
"""

from __future__ import annotations

import math
from typing import NamedTuple

import torch
from torch import Tensor

_LEVELS = ("token", "sequence")


def group_normalised_advantages(rewards: Tensor, eps: float = 1e-6, *, unbiased: bool = True) -> Tensor:
    """GRPO advantages (r - mean) / (std + eps) over the last dim, 0 for zero-variance groups (POPO eq. 3).

    `rewards` is [G, K] (groups x responses; any leading dims work). The paper writes
    std(.) without saying which; it runs GRPO in verl (seed 003, app. D.2), whose GRPO
    estimator uses `torch.std`, i.e. the *sample* std with Bessel's correction (divide
    by K - 1), and eps = 1e-6. That is the default here; `unbiased=False` gives the
    population std (divide by K) for comparison.

    A group whose rewards are all equal (POPO's "ineffective" group, Def. 3.1) gets
    exactly 0 advantages. Computing (r - mean) / eps there instead would turn float
    rounding in the mean (eight rewards of 0.1 do not average to exactly 0.1 in
    float32) into advantages of order 1e-3 or more, with eps in the denominator.
    """
    if rewards.dim() < 1:
        raise ValueError("rewards must have shape [G, K] (groups x responses), got a scalar.")
    eps = float(eps)
    if not eps >= 0 or math.isinf(eps):  # also rejects nan
        raise ValueError(f"eps must be a finite number >= 0, got {eps!r}; verl's GRPO uses 1e-6.")
    k = rewards.shape[-1]
    if k < 2:
        # The sample std of one value is undefined, and a single response has no group contrast.
        raise ValueError(f"group normalisation needs K >= 2 responses per group, got K={k}.")
    mean = rewards.mean(dim=-1, keepdim=True)
    std = rewards.std(dim=-1, keepdim=True, correction=1 if unbiased else 0)
    advantages = (rewards - mean) / (std + eps)
    constant = rewards.amax(dim=-1, keepdim=True) == rewards.amin(dim=-1, keepdim=True)
    return torch.where(constant, torch.zeros_like(advantages), advantages)


def _check_token_tensor(name: str, tensor: Tensor, shape: torch.Size) -> None:
    """Raise a ValueError naming `name` when its shape is not the token shape [N, T]."""
    if tensor.shape != shape:
        raise ValueError(
            f"{name} has shape {tuple(tensor.shape)} but token_logprobs has shape {tuple(shape)}; "
            "pass one value per response token, right-padded to the same [N, T]."
        )


def clipped_surrogate(
    token_logprobs: Tensor,
    prox_logprobs: Tensor,
    behaviour_logprobs: Tensor | None,
    advantages: Tensor,
    mask: Tensor,
    eps_low: float = 0.2,
    eps_high: float = 0.28,
    behaviour_cap: float = 2.0,
) -> tuple[Tensor, dict[str, float]]:
    """POPO's decoupled clip-higher PPO loss (seed 003 eq. 10) and its diagnostics.

    Per response token t of response i, with r = pi_theta / pi_prox and the constant per-token
    behaviour weight w = min(pi_prox / mu, behaviour_cap) (per token, as seed 003's Lemma 4.2):

        l_it = w_it * min(r_it * A_i, clip(r_it, 1 - eps_low, 1 + eps_high) * A_i)
        loss = -(sum_it mask_it * l_it) / (sum_it mask_it)

    Token averaging: the loss is the per-token mean over *all* response tokens of the
    batch (DAPO's token-level aggregation, verl's "token-mean", used by POPO), not a
    mean over responses of per-response token means; a long response therefore weighs
    in proportion to its length. If the batch is split into micro-batches, the caller
    must rescale by each micro-batch's share of the tokens.

    Arguments:
        token_logprobs: [N, T] log pi_theta per token, carrying the gradient.
        prox_logprobs: [N, T] log pi_prox per token (the policy at the start of the
            optimizer step); detached, so it is a constant.
        behaviour_logprobs: [N, T] log mu per token (the policy that generated the
            response), or None when every row is on-policy (w = 1). For fresh rows in a
            mixed batch pass `prox_logprobs` there (w = 1 exactly).
        advantages: [N] per response (broadcast over tokens) or [N, T] per token.
        mask: [N, T], 1/True on real response tokens.
        eps_low, eps_high: clip-higher bounds; r is clipped into [1 - eps_low, 1 + eps_high].
        behaviour_cap: upper cap on the behaviour weight pi_prox / mu (POPO: 2.0).

    Diagnostics (python floats): clip_frac_low / clip_frac_high, the share of masked
    tokens where the clip is active and zeroes the gradient (A < 0 and r < 1 - eps_low;
    A > 0 and r > 1 + eps_high); ratio_mean / ratio_max of r over masked tokens;
    behaviour_weight_mean (the capped w actually used), behaviour_weight_raw_max and
    behaviour_cap_frac (share of weights above the cap), all over masked tokens; n_tokens.
    """
    eps_low, eps_high, cap = float(eps_low), float(eps_high), float(behaviour_cap)
    advantages, valid, n_tokens = _surrogate_inputs(token_logprobs, prox_logprobs, behaviour_logprobs, advantages,
                                                    mask, eps_low, eps_high, cap)
    dtype = token_logprobs.dtype
    zero = torch.zeros((), dtype=dtype, device=token_logprobs.device)
    advantages = advantages.detach().to(dtype)
    # Mask *before* exp: padding may hold garbage log-probs whose exp overflows, and
    # inf * 0 is nan in both the forward and the backward pass.
    log_ratio = torch.where(valid, token_logprobs - prox_logprobs.detach().to(dtype), zero)
    ratio = torch.exp(log_ratio)

    # The behaviour weight is a constant (POPO sec. 4.3: multiply each replayed sample's
    # loss by it), so it is computed without autograd.
    with torch.no_grad():
        if behaviour_logprobs is None:
            raw_w = torch.ones_like(log_ratio)
        else:
            raw_w = torch.exp(torch.where(valid, prox_logprobs.detach().to(dtype) - behaviour_logprobs.detach().to(dtype),
                                          zero))
        weight = raw_w.clamp(max=cap)

    unclipped = ratio * advantages
    clipped = ratio.clamp(1.0 - eps_low, 1.0 + eps_high) * advantages
    per_token = weight * torch.minimum(unclipped, clipped)
    loss = -torch.where(valid, per_token, zero).sum() / n_tokens
    return loss, _surrogate_diagnostics(ratio, advantages, weight, raw_w, valid, eps_low, eps_high, cap)


def _surrogate_inputs(token_logprobs: Tensor, prox_logprobs: Tensor, behaviour_logprobs: Tensor | None,
                      advantages: Tensor, mask: Tensor, eps_low: float, eps_high: float,
                      cap: float) -> tuple[Tensor, Tensor, int]:
    """Check `clipped_surrogate`'s settings and shapes; (advantages as [N, 1] or [N, T], bool mask, token count)."""
    if not 0 <= eps_low < 1:
        raise ValueError(f"eps_low must be in [0, 1), got {eps_low!r}; POPO/DAPO use 0.2.")
    if not 0 <= eps_high < math.inf:
        raise ValueError(f"eps_high must be a finite number >= 0, got {eps_high!r}; POPO/DAPO use 0.28.")
    if not cap > 0:
        raise ValueError(f"behaviour_cap must be > 0, got {cap!r}; POPO caps pi_prox/mu at 2.0.")
    if token_logprobs.dim() != 2:
        raise ValueError(
            f"token_logprobs must be [N, T] (responses x tokens), got shape {tuple(token_logprobs.shape)}."
        )
    shape = token_logprobs.shape
    _check_token_tensor("prox_logprobs", prox_logprobs, shape)
    _check_token_tensor("mask", mask, shape)
    if behaviour_logprobs is not None:
        _check_token_tensor("behaviour_logprobs", behaviour_logprobs, shape)
    if advantages.shape == shape[:1]:
        advantages = advantages.unsqueeze(-1)
    elif advantages.shape != shape:
        raise ValueError(
            f"advantages has shape {tuple(advantages.shape)}; expected [N]={tuple(shape[:1])} "
            f"(one per response) or [N, T]={tuple(shape)} (one per token)."
        )
    valid = mask.bool()
    n_tokens = int(valid.sum().item())
    if n_tokens == 0:
        raise ValueError("mask selects no response tokens; the token-mean loss would divide by zero.")
    return advantages, valid, n_tokens


@torch.no_grad()
def _surrogate_diagnostics(ratio: Tensor, advantages: Tensor, weight: Tensor, raw_w: Tensor, valid: Tensor,
                           eps_low: float, eps_high: float, cap: float) -> dict[str, float]:
    """`clipped_surrogate`'s diagnostics over the masked tokens (its docstring names each)."""
    n_tokens = int(valid.sum().item())
    r = ratio.detach()
    adv = advantages.expand_as(r)
    low = valid & (adv < 0) & (r < 1.0 - eps_low)
    high = valid & (adv > 0) & (r > 1.0 + eps_high)
    w_sel, raw_sel = weight[valid], raw_w[valid]
    return {
        "clip_frac_low": low.sum().item() / n_tokens,
        "clip_frac_high": high.sum().item() / n_tokens,
        "ratio_mean": r[valid].mean().item(),
        "ratio_max": r[valid].max().item(),
        "behaviour_weight_mean": w_sel.mean().item(),
        "behaviour_weight_raw_max": raw_sel.max().item(),
        "behaviour_cap_frac": (raw_sel > cap).double().mean().item(),
        "n_tokens": float(n_tokens),
    }


class TruncatedWeights(NamedTuple):
    """Truncated IS weights (used in the loss) and the raw, unclipped ones (for logging)."""

    weights: Tensor
    raw: Tensor


def truncated_importance_weights(
    logprobs: Tensor,
    behaviour_logprobs: Tensor,
    rho_min: float,
    rho_max: float,
    level: str = "sequence",
    mask: Tensor | None = None,
) -> TruncatedWeights:
    """Seed 002 eq. 3: rho = exp(clip(log pi_theta - log pi_b, log rho_min, log rho_max)), detached.

    level="sequence": one weight per response. Pass sequence log-probs [N] (the sum of
    the response's token log-probs, SPEC 4), or token log-probs [N, T] with `mask`, which
    are summed over the masked tokens first.
    level="token": one weight per token; inputs are [N, T]. With `mask`, padding
    positions get weight 0 (and raw 0) so they contribute nothing downstream.

    rho_min = 0 means no lower truncation and rho_max = inf no upper truncation (the
    paper's rho_max = infinity row). Clipping the log-ratio into [log rho_min, log rho_max]
    equals clipping the ratio into [rho_min, rho_max], but cannot overflow. The weights
    are constants in the gradient (seed 002 sec. 3.2: L = -E[A_i rho_i log pi_theta]).
    """
    if level not in _LEVELS:
        raise ValueError(f"level must be one of {_LEVELS}, got {level!r}.")
    lo, hi = float(rho_min), float(rho_max)
    if not (lo >= 0 and hi > 0 and lo <= hi):  # also rejects nan
        raise ValueError(
            f"need 0 <= rho_min <= rho_max and rho_max > 0, got rho_min={rho_min!r}, rho_max={rho_max!r}; "
            "seed 002 uses rho_max = 10 (mild) or 2 (aggressive); use rho_min = 0 for no lower bound."
        )
    if logprobs.shape != behaviour_logprobs.shape:
        raise ValueError(
            f"logprobs shape {tuple(logprobs.shape)} != behaviour_logprobs shape "
            f"{tuple(behaviour_logprobs.shape)}; pass the same responses (and tokens) for both policies."
        )
    if mask is not None and mask.shape != logprobs.shape:
        raise ValueError(f"mask shape {tuple(mask.shape)} != logprobs shape {tuple(logprobs.shape)}.")
    if level == "token" and logprobs.dim() != 2:
        raise ValueError(f"level='token' needs per-token log-probs [N, T], got shape {tuple(logprobs.shape)}.")
    if level == "sequence" and logprobs.dim() == 2 and mask is None:
        raise ValueError(
            "level='sequence' with [N, T] token log-probs needs `mask` to sum the response tokens; "
            "or pass sequence log-probs of shape [N]."
        )
    if level == "sequence" and logprobs.dim() not in (1, 2):
        raise ValueError(f"level='sequence' takes [N] or [N, T] log-probs, got shape {tuple(logprobs.shape)}.")

    with torch.no_grad():
        cur = logprobs.detach()
        beh = behaviour_logprobs.detach().to(cur.dtype)
        zero = torch.zeros((), dtype=cur.dtype, device=cur.device)
        valid = None if mask is None else mask.bool()
        # Mask before subtracting so garbage in padding never reaches exp.
        log_ratio = cur - beh if valid is None else torch.where(valid, cur - beh, zero)
        if level == "sequence" and log_ratio.dim() == 2:
            log_ratio = log_ratio.sum(dim=-1)
        log_lo = math.log(lo) if lo > 0 else -math.inf
        log_hi = math.log(hi) if math.isfinite(hi) else math.inf
        weights = torch.exp(log_ratio.clamp(min=log_lo, max=log_hi))
        raw = torch.exp(log_ratio)
        if level == "token" and valid is not None:
            weights = torch.where(valid, weights, zero)
            raw = torch.where(valid, raw, zero)
    return TruncatedWeights(weights, raw)
