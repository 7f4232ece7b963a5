"""`loss=rloo`: Replay-RLOO's objective, one optimizer step on eq. 3 (SPEC 4; paper eqs. 1-3), and
`loss=rloo-tis`: seed 002's off-policy RLOO, the same step with truncated IS on every off-policy row."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from src.batch import Batch, Group
from src.loss.base import Objective, Truncation
from src.loss.trainer import Loss, MicroBatch, Totals
from src.loss.variant_math import truncated_importance_weights
from src.loss.rloo_math import importance_weights, rloo_policy_loss
from src.policy.forward import place_tokens, upcast
from src.policy.token_stats import on_device
from src.variant import float_knob


@dataclass
class RowInputs:
    """Per trained row, what RLOO's loss reads besides the log-probs: its advantage and its behaviour's log mu."""

    advantages: torch.Tensor
    behaviour: list[float | None]               # log mu(y|x); None for fresh rows: mu = pi_theta now
    behaviour_tokens: list[tuple[float, ...] | None]  # log mu per token, where token-level IS reads it
    truncated: torch.Tensor                     # rows weighted by seed 002's truncated IS (eq. 3) instead of eq. 2
    token_level: bool                           # truncated rows weighted per token
    truncated_rows: list[bool]                  # `truncated` as Python flags: a micro-batch reads them without a sync

    @classmethod
    def of(cls, batch: Batch, advantages, truncated_rows: list[bool], is_level: str) -> "RowInputs":
        """The batch's rows: advantages from each group's K rewards (`advantages`, eq. 1 by default)."""
        groups, rows = batch.groups, batch.rows
        per_group = advantages(torch.tensor([g.rewards for g in groups]))
        truncated = torch.tensor(truncated_rows, dtype=torch.bool)
        token_level = any(truncated_rows) and is_level == "token"
        return cls(advantages=per_group[[g for g, _ in rows], [j for _, j in rows]],
                   behaviour=[groups[g].behaviour_logprobs[j] if groups[g].behaviour_logprobs is not None else None
                              for g, j in rows],
                   behaviour_tokens=[stored_token_logprobs(groups[g], j) if token_level and on else None
                                     for (g, j), on in zip(rows, truncated_rows)],
                   truncated=truncated, token_level=token_level, truncated_rows=list(truncated_rows))


def stored_token_logprobs(group: Group, response: int) -> tuple[float, ...]:
    if group.behaviour_token_logprobs is None:
        raise ValueError(f"a group of step {group.step} has no per-token behaviour log-probs, which token-level "
                         "truncated IS needs; groups stored by a run with is_level=sequence cannot be replayed "
                         "with is_level=token")
    return group.behaviour_token_logprobs[response]


def sequence_weights(lp: MicroBatch, rows: RowInputs, clip_ceiling: float, truncation: Truncation):
    """(log pi per response, used and raw weight per response, used and raw weight per token) of a micro-batch.

    Fresh rows of an on-policy sampler have no mu: mu = pi_theta now, weight exactly 1. Replayed rows get
    eq. 2's min(c, pi/mu); the rows `rows.truncated` names get seed 002's truncated IS (its eq. 3), per
    response or, at is_level=token, per token (the response's weight is then its mean token weight).
    """
    mask, device = lp.mask, lp.mask.device
    truncated = [rows.truncated_rows[i] for i in lp.index]
    current = lp.sequence_logprobs()                                        # log pi_theta(y|x), on the device
    behaviour = [rows.behaviour[i] for i in lp.index]
    mu = current                                                            # fresh rows: mu = pi_theta now
    if any(mu_i is not None for mu_i in behaviour):
        stored, known = on_device(device, torch.tensor([0.0 if mu_i is None else mu_i for mu_i in behaviour]),
                                  torch.tensor([mu_i is not None for mu_i in behaviour]))
        mu = torch.where(known, stored.to(current.dtype), current)
    clipped, raw = importance_weights(current, mu, clip_ceiling)          # eq. 2
    if any(truncated):  # seed 002 eq. 3
        on = on_device(device, torch.tensor(truncated))[0]
        seq_weights, seq_raw = truncated_importance_weights(current, mu, truncation.is_min, truncation.is_max)
        clipped, raw = torch.where(on, seq_weights, clipped), torch.where(on, seq_raw, raw)
    token_weights = clipped[:, None].expand_as(mask)  # a sequence weight on each token
    raw_tokens = raw[:, None].expand_as(mask)
    if rows.token_level and any(truncated):
        mu_tokens = place_tokens(lp.chunk, [rows.behaviour_tokens[i] for i in lp.index], torch.zeros_like(mask))
        per_token, per_token_raw = truncated_importance_weights(
            upcast(lp.policy.detach()), mu_tokens, truncation.is_min, truncation.is_max, level="token", mask=mask)
        on_tokens = on[:, None]
        token_weights = torch.where(on_tokens, per_token, token_weights)
        raw_tokens = torch.where(on_tokens, per_token_raw, raw_tokens)
        token_mean = (per_token * mask).sum(-1) / mask.sum(-1).clamp(min=1)
        clipped = torch.where(on, token_mean, clipped)
    return current, clipped, raw, token_weights, raw_tokens


class RlooObjective(Objective):
    """L = -(1/B) sum_i w_i A_i log pi(y_i|x_i) + beta_KL KL - beta_H H over the batch's trained responses.

    A_i: leave-one-out advantages from the group's K rewards (eq. 1), also for a FIFO draw that
    trains only some of them. w_i: 1 for fresh rows (mu = pi_theta now), min(c, pi/mu) for
    replayed rows (eq. 2), and for the rows `truncated_rows` names (fresh rows of a stale or
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

    def truncated_rows(self, batch: Batch) -> list[bool]:
        """Rows weighted by seed 002's truncated IS instead of eq. 2: fresh rows of an off-policy sampler."""
        return batch.row_off_policy()

    def prepare(self, batch: Batch) -> RowInputs:
        return RowInputs.of(batch, self.advantages, self.truncated_rows(batch), self.truncation.is_level)

    def weights(self, lp: MicroBatch, rows: RowInputs):
        """`sequence_weights` with this objective's ceiling (eq. 2) and truncation (seed 002 eq. 3)."""
        return sequence_weights(lp, rows, self.clip_ceiling, self.truncation)

    def __call__(self, lp: MicroBatch, rows: RowInputs, totals: Totals) -> Loss:
        current, clipped, raw, token_weights, raw_tokens = self.weights(lp, rows)
        advantages = on_device(lp.mask.device, rows.advantages[lp.index])[0]
        policy = rloo_policy_loss(lp.policy, lp.mask, advantages, token_weights, batch_size=totals.rows)
        return Loss(policy, policy, logprobs=current, weights=(raw, clipped),
                    token_weights=(raw_tokens, token_weights) if rows.token_level else None)


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
        self.keep_token_logprobs = is_level == "token"
        self.weight_ceiling = self.truncation.is_max

    def truncated_rows(self, batch: Batch) -> list[bool]:
        return [off_policy or age > 0 for off_policy, age in zip(batch.row_off_policy(), batch.row_ages())]


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

    def advantages(self, rewards: torch.Tensor) -> torch.Tensor:
        return rewards - (rewards.mean(dim=-1, keepdim=True) + self.delta_v)

    def truncated_rows(self, batch: Batch) -> list[bool]:
        return [False] * len(batch.rows)

    def weights(self, lp: MicroBatch, rows: RowInputs):
        current = lp.sequence_logprobs()
        ones = torch.ones_like(current)
        return current, ones, ones, torch.ones_like(lp.mask), torch.ones_like(lp.mask)
