"""`loss=rloo`: Replay-RLOO's objective, one optimizer step on eq. 3 (SPEC 4; paper eqs. 1-3), and
`loss=rloo-tis`: seed 002's off-policy RLOO, the same step with truncated IS on every off-policy row."""

from __future__ import annotations

import torch

from src.loss.base import Objective, Truncation
from src.loss.inputs import Needs
from src.loss.trainer import Loss, MicroBatch, Totals
from src.loss.variant_math import truncated_importance_weights
from src.loss.rloo_math import importance_weights, rloo_policy_loss
from src.policy.forward import upcast
from src.policy.token_stats import on_device
from src.variant import float_knob


def sequence_weights(lp: MicroBatch, clip_ceiling: float, truncation: Truncation):
    """(used and raw weight per response, used and raw weight per token) of a micro-batch.

    Fresh rows of an on-policy sampler have mu = pi_theta now (`MicroBatch.behaviour`), weight exactly 1.
    Replayed rows get eq. 2's min(c, pi/mu); the rows `lp.truncated` names get seed 002's truncated IS (its
    eq. 3), per response or, where the trainer laid out log mu per token, per token (the response's weight is
    then its mean token weight).
    """
    mask, device = lp.mask, lp.mask.device
    current = lp.sequence_logprobs()                                        # log pi_theta(y|x), on the device
    clipped, raw = importance_weights(current, lp.behaviour, clip_ceiling)  # eq. 2
    if any(lp.truncated):  # seed 002 eq. 3
        on = on_device(device, torch.tensor(lp.truncated))[0]
        seq_weights, seq_raw = truncated_importance_weights(current, lp.behaviour, truncation.is_min, truncation.is_max)
        clipped, raw = torch.where(on, seq_weights, clipped), torch.where(on, seq_raw, raw)
    token_weights = clipped[:, None].expand_as(mask)  # a sequence weight on each token
    raw_tokens = raw[:, None].expand_as(mask)
    if lp.behaviour_tokens is not None and any(lp.truncated):
        per_token, per_token_raw = truncated_importance_weights(
            upcast(lp.policy.detach()), lp.behaviour_tokens, truncation.is_min, truncation.is_max, level="token",
            mask=mask)
        on_tokens = on[:, None]
        token_weights = torch.where(on_tokens, per_token, token_weights)
        raw_tokens = torch.where(on_tokens, per_token_raw, raw_tokens)
        token_mean = (per_token * mask).sum(-1) / mask.sum(-1).clamp(min=1)
        clipped = torch.where(on, token_mean, clipped)
    return clipped, raw, token_weights, raw_tokens


class RlooObjective(Objective):
    """L = -(1/B) sum_i w_i A_i log pi(y_i|x_i) + beta_KL KL - beta_H H over the batch's trained responses.

    A_i: leave-one-out advantages from the group's K rewards (eq. 1), also for a FIFO draw that
    trains only some of them. w_i: 1 for fresh rows (mu = pi_theta now), min(c, pi/mu) for
    replayed rows (eq. 2), and for the rows `Needs.truncates` names (fresh rows of a stale or
    tempered sampler) seed 002's truncated exp(clip(log pi - log mu, log rho_min, log rho_max)),
    per response or per token. Weights are constants in the gradient. Micro-batch terms are
    normalised by the full batch (`rloo_policy_loss`; the trainer's KL and entropy terms alike), so the
    accumulated gradient equals the one-batch gradient exactly; `autocast="bfloat16"` runs the forward
    and backward passes on bf16 copies of fp32 weights, with fp32 gradients and optimizer steps
    (`src.policy.compute_weights`: bf16 weights alone would round lr-1e-5 updates away).
    """

    reads_clip = True

    @classmethod
    def plain(cls, node) -> bool:
        return True  # Replay-RLOO's own objective: the cell identity leaves the loss out, the clip names it

    def __init__(self, clip_ceiling: float, **settings) -> None:
        super().__init__(**settings)
        self.clip_ceiling = float(clip_ceiling)
        self.weight_ceiling = self.clip_ceiling

    def weights(self, lp: MicroBatch):
        """`sequence_weights` with this objective's ceiling (eq. 2) and truncation (seed 002 eq. 3)."""
        return sequence_weights(lp, self.clip_ceiling, self.truncation)

    def __call__(self, lp: MicroBatch, totals: Totals) -> Loss:
        clipped, raw, token_weights, raw_tokens = self.weights(lp)
        policy = rloo_policy_loss(lp.policy, lp.mask, lp.advantages, token_weights, batch_size=totals.rows)
        return Loss(policy, policy, logprobs=lp.sequence_logprobs(), weights=(raw, clipped),
                    token_weights=(raw_tokens, token_weights) if lp.behaviour_tokens is not None else None)


class TruncatedIsRloo(RlooObjective):
    """`loss=rloo-tis`, seed 002's off-policy RLOO (sec. 3.2, eq. 3): every off-policy row, fresh from a
    stale or tempered sampler or replayed from the buffer, gets the truncated IS weight
    exp(clip(log pi - log mu, log rho_min, log rho_max)), per response or per token; eq. 2's ceiling c
    is not used. Seed 002 runs rho_max = 10 "for all experiments" and 2 with token-level IS."""

    reads_clip = False
    # The truncation interval is checked by `Truncation.checked` (it follows the behaviour's by default).
    knobs = {"is_max_token": float_knob(example="2", id_omitted_at=(2.0,))}

    @classmethod
    def plain(cls, node) -> bool:
        return False

    cell_tag = "-rloo-tis"

    reader_tag = " (RLOO, truncated IS)"

    def __init__(self, is_min: float, is_max: float, is_level: str, is_max_token: float = 2.0, **settings) -> None:
        settings.pop("truncation", None)  # this loss's own is_* (by default the behaviour group's) apply
        super().__init__(clip_ceiling=float("inf"), **settings)
        self.truncation = Truncation.checked("loss", is_min, is_max, is_level, is_max_token)
        self.needs = Needs(truncates="off_policy_or_replayed", behaviour_tokens=is_level == "token",
                           keep_token_logprobs=is_level == "token")
        self.weight_ceiling = self.truncation.is_max


class AsymRE(RlooObjective):
    """`loss=asymre`, seed 001's other objective (section 5.5, D.2; Arnal et al. 2025): REINFORCE with the
    generated group's mean reward shifted by delta_V as the baseline, A = r - (V_hat + delta_V), and no
    importance ratio (every row weighs 1, however stale), L = -(1/B) sum_i A_i log pi(y_i|x_i) + the
    trainer's KL and entropy terms. delta_V < 0 (seed 001: -0.1) tilts every update towards the sampled
    responses."""

    reads_clip = False
    knobs = {"delta_v": float_knob(example="-0.1")}  # no importance ratio, so no truncation knob

    @classmethod
    def plain(cls, node) -> bool:
        return False

    cell_tag = "-asymre"

    reader_tag = " (AsymRE loss)"

    def __init__(self, delta_v: float = -0.1, **settings) -> None:
        settings.pop("truncation", None)
        super().__init__(clip_ceiling=float("inf"), **settings)
        self.delta_v = float(delta_v)
        self.needs = Needs(truncates="none")

    def advantages(self, rewards: torch.Tensor) -> torch.Tensor:
        return rewards - (rewards.mean(dim=-1, keepdim=True) + self.delta_v)

    def weights(self, lp: MicroBatch):
        ones = torch.ones_like(lp.sequence_logprobs())
        return ones, ones, torch.ones_like(lp.mask), torch.ones_like(lp.mask)
