"""What a loss asks of the trainer (`Needs`, data it declares) and what the trainer hands it per row (`RowInputs`).

A loss is a function of one micro-batch (`src.loss.trainer.MicroBatch`): its per-token log-probs and mask, and
per row its advantage, its behaviour log mu and whether truncated importance sampling weighs it. The trainer
builds those rows once per batch from the loss's `Needs` and its advantage estimator, so a loss never reads the
batch's groups itself.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from src.batch import Batch, Group

# Which rows seed 002's truncated IS (its eq. 3) weighs instead of eq. 2's min(c, pi/mu):
# "off_policy": fresh rows of a stale or tempered sampler; "off_policy_or_replayed": those and every replayed
# row (loss=rloo-tis); "none": no row (a loss without importance weights, or with its own).
TRUNCATES = ("off_policy", "off_policy_or_replayed", "none")


@dataclass(frozen=True)
class Needs:
    """What a loss asks of the shared trainer, declared as data (`Objective.needs`)."""

    truncates: str = "off_policy"  # one of TRUNCATES
    behaviour_tokens: bool = False  # log mu per token of the truncated rows (token-level IS, seed 002 l.121)
    # (entropy, pi_ref) of a no-grad pass over every micro-batch before the first optimizer step, which the
    # trainer keeps (`src.loss.trainer.FirstPass`) and hands to the loss's `fix`; None: no such pass.
    first_pass: tuple[bool, bool] | None = None
    # pi_prox and mu per token, which the trainer keeps from a first pass and lays out on every training
    # micro-batch (`MicroBatch.proximal`, `behaviour_tokens`), and the update's per-row numbers it gives
    # (`src.loss.trainer.FirstPass`): GRPO's decoupled ratio, M2PO's mask.
    proximal: bool = False
    reads: tuple[bool, bool] = (False, False)  # (entropy, pi_ref) the loss itself reads in each training pass
    updates: int = 1  # optimizer steps per batch, on interleaved mini-batches (`interleaved_mini_batches`)
    # Whether the trainer adds eq. 3's beta_KL KL - beta_H H (`src.loss.trainer.penalised`); a loss with a
    # regulariser of its own (IPO's margin to pi_ref) reads KL and entropy in the first pass, for the logs.
    penalised: bool = True
    keep_token_logprobs: bool = False  # keep log pi_theta per token of fresh rows, stored as their mu
    # Whether a row of zero advantage adds nothing to the loss's gradient (IPO's rows in no pair): the trainer
    # then skips micro-batches of such rows, and takes no optimizer step on a batch of nothing else.
    skips_zero_advantage: bool = False

    def __post_init__(self) -> None:
        if self.truncates not in TRUNCATES:
            raise ValueError(f"Needs.truncates={self.truncates!r}: choose one of {', '.join(TRUNCATES)}")
        if self.updates < 1:
            raise ValueError(f"loss.updates_per_step={self.updates}: at least 1 optimizer step per batch")

    def truncated_rows(self, batch: Batch) -> list[bool]:
        if self.truncates == "none":
            return [False] * len(batch.rows)
        if self.truncates == "off_policy":
            return batch.row_off_policy()
        return [off_policy or age > 0 for off_policy, age in zip(batch.row_off_policy(), batch.row_ages())]


@dataclass
class RowInputs:
    """Per trained row of a batch, what a loss reads besides the log-probs (laid out by the trainer)."""

    advantages: torch.Tensor
    behaviour: list[float | None]               # log mu(y|x); None for fresh rows: mu = pi_theta now
    behaviour_tokens: list[tuple[float, ...] | None]  # log mu per token of truncated rows, at token-level IS
    truncated: list[bool]                       # rows weighted by seed 002's truncated IS instead of eq. 2
    token_level: bool                           # truncated rows weighted per token

    @classmethod
    def of(cls, batch: Batch, advantages, needs: Needs) -> "RowInputs":
        """The batch's rows: advantages from each group's K rewards by `advantages` (eq. 1 by default)."""
        groups, rows = batch.groups, batch.rows
        per_group = group_advantages(groups, advantages)
        truncated = needs.truncated_rows(batch)
        token_level = any(truncated) and needs.behaviour_tokens
        return cls(advantages=torch.stack([per_group[g][j] for g, j in rows]) if rows else torch.zeros(0),
                   behaviour=[groups[g].behaviour_logprobs[j] if groups[g].behaviour_logprobs is not None else None
                              for g, j in rows],
                   behaviour_tokens=[stored_token_logprobs(groups[g], j) if token_level and on else None
                                     for (g, j), on in zip(rows, truncated)],
                   truncated=list(truncated), token_level=token_level)


def group_advantages(groups: list[Group], advantages) -> list[torch.Tensor]:
    """Each group's advantages from its own rewards. An estimator takes a [groups, K] tensor, so groups of one
    size go in one call; a batch may hold groups of several sizes (RLEP appends M successes to some of its G)."""
    by_size: dict[int, list[int]] = {}
    for index, group in enumerate(groups):
        by_size.setdefault(group.size, []).append(index)
    out: list[torch.Tensor] = [torch.zeros(0)] * len(groups)
    for indices in by_size.values():
        for index, values in zip(indices, advantages(torch.tensor([groups[i].rewards for i in indices]))):
            out[index] = values
    return out


def stored_token_logprobs(group: Group, response: int) -> tuple[float, ...]:
    if group.behaviour_token_logprobs is None:
        raise ValueError(f"a group of step {group.step} has no per-token behaviour log-probs, which token-level "
                         "truncated IS needs; groups stored by a run with is_level=sequence cannot be replayed "
                         "with is_level=token")
    return group.behaviour_token_logprobs[response]
