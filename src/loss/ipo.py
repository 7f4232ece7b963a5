"""IPO baseline (seed 004 Table 1; Azar et al. 2023): pairwise preferences from the policy's own verifier-scored samples.

`loss=ipo` keeps the runner's sampling exactly (B groups of K fresh responses per step, each scored
once by the verifier, so its fresh evaluations count like every method's) and replaces the RLOO
update with IPO on preference pairs built inside each group:

- Pairing: every pair (w, l) of responses of one group with reward r_w > r_l; equal rewards give no
  pair (no preference), so a group whose K rewards are all equal contributes nothing. A group with
  rewards [1.0, 0.1, 0.1, 0.0] gives the 5 pairs (0,1), (0,2), (0,3), (1,3), (2,3). All pairs, not a
  sampled subset: the per-response log-probs are computed once whatever the number of pairs.
- Loss (Azar et al. eq. 17): with h = (log pi(y_w|x) - log pi_ref(y_w|x)) - (log pi(y_l|x) - log pi_ref(y_l|x))
  (sequence log-probs, sums over response tokens), L = mean over the batch's pairs of (h - 1/(2 tau))^2.
  pi_ref is the frozen warm start (the runner's reference); tau (loss.tau) sets the target margin.
  No KL or entropy term: IPO's regression to 1/(2 tau) is its regulariser.

Micro-batching: L is not a sum over responses, so accumulating per-micro-batch losses would not give
its gradient. The trainer's first, no-grad pass gives every response's log pi and log pi_ref; from them
IPO computes dL/d log pi(y_i|x) exactly (`ipo_response_gradients`), and its loss on each micro-batch of the
training pass is sum_i g_i log pi(y_i|x): the same gradient as one batch, at one extra forward.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property

import torch

from src.batch import Batch, Group
from src.loss.base import Objective
from src.loss.inputs import Needs, Shared
from src.loss.trainer import Loss, MicroBatch, Tally, Totals
from src.policy.forward import row_values, upcast


def ipo_pairs(rewards: list[float]) -> list[tuple[int, int]]:
    """(chosen, rejected) index pairs of one group: every ordered pair whose rewards differ, higher reward chosen."""
    return [(w, l) for w in range(len(rewards)) for l in range(len(rewards)) if rewards[w] > rewards[l]]


def ipo_loss(chosen_logratio: torch.Tensor, rejected_logratio: torch.Tensor, tau: float) -> torch.Tensor:
    """Mean over pairs of ((log pi/pi_ref)(y_w) - (log pi/pi_ref)(y_l) - 1/(2 tau))^2 (Azar et al. eq. 17)."""
    if tau <= 0:
        raise ValueError(f"tau must be > 0, got {tau}")
    margin = chosen_logratio - rejected_logratio
    return ((margin - 1.0 / (2.0 * tau)) ** 2).mean()


def ipo_response_gradients(logratios: torch.Tensor, pairs: list[tuple[int, int]], tau: float) -> tuple[torch.Tensor, float]:
    """(dL/d logratio_i for every response, L) for the pairs over flat response indices; zeros when no pairs."""
    if not pairs:
        return torch.zeros_like(logratios), 0.0
    ratios = logratios.detach().clone().requires_grad_(True)
    chosen = torch.tensor([w for w, _ in pairs])
    rejected = torch.tensor([l for _, l in pairs])
    loss = ipo_loss(ratios[chosen], ratios[rejected], tau)
    (gradient,) = torch.autograd.grad(loss, ratios)
    return gradient, loss.item()


def batch_pairs(groups: list[Group]) -> list[tuple[int, int]]:
    """Every group's pairs as indices into the flat list of the batch's responses (group by group)."""
    pairs, start = [], 0
    for group in groups:
        pairs += [(start + w, start + l) for w, l in ipo_pairs(list(group.rewards))]
        start += group.size
    return pairs


class IpoObjective(Objective):
    """One optimizer step of IPO on the batch's within-group pairs (whole groups; KL and entropy only logged)."""

    cell_tag = "-ipo"

    reader_tag = " (IPO loss)"

    def __init__(self, tau: float, **settings) -> None:
        super().__init__(**settings)
        if not tau > 0:
            raise ValueError(f"loss.tau={tau}: IPO's regularisation strength, a number > 0 (target margin "
                             "1/(2 tau); seed 004: 0.1)")
        self.tau = float(tau)
        # Pass 1 reads log pi and log pi_ref (its loss is a margin to pi_ref, whatever kl_coef is), KL and entropy;
        # pass 2 needs log pi alone (log pi_ref is a constant of the gradient). No trainer KL or entropy term:
        # the margin to pi_ref is IPO's regulariser. No importance weight: no truncated row.
        self.needs = Needs(truncates="none", first_pass=(True, True), reads=(False, False), penalised=False)

    def prepare(self, batch: Batch, shared: Shared) -> "_IpoInputs":
        if any(entry.responses is not None for entry in batch.entries):
            raise ValueError("loss=ipo pairs whole groups; a FIFO positive-bias draw trains only some responses. "
                             "Use buffer.positive_bias=0 with loss=ipo")
        # L is the mean over the whole batch's pairs: a shard's pairs weigh by their share of them.
        pairs, count = batch_pairs(batch.groups), len(batch.rows)
        all_pairs = shared.reducer.total(len(pairs))
        stats = _SequenceStats(torch.zeros(count), torch.zeros(count), torch.zeros(count), [()] * count)
        return _IpoInputs(batch.groups, pairs, all_pairs, len(pairs) / all_pairs if all_pairs else 0.0, self.tau, stats,
                          shared)

    def observe(self, inputs: "_IpoInputs", lp: MicroBatch) -> None:
        """Pass 1 (no grad): log pi and log pi_ref per response, KL and entropy for the logs."""
        stats, index, mask = inputs.stats, lp.index, lp.mask
        token_logprobs, ref = upcast(lp.policy), upcast(lp.reference)
        stats.logprobs[index] = (token_logprobs * mask).sum(-1).cpu()
        stats.reference_sums[index] = (ref * mask).sum(-1).cpu()
        stats.kl_sums[index] = (inputs.shared.kl_tokens(token_logprobs, ref) * mask).sum(-1).cpu()
        stats.entropy += (upcast(lp.entropy) * mask).sum().item()
        for i, tokens in zip(index, row_values(ref, mask)):
            stats.reference_tokens[i] = tokens

    def trains(self, inputs: "_IpoInputs") -> bool:
        return inputs.all_pairs > 0  # a batch without preferences takes no optimizer step

    def skips(self, inputs: "_IpoInputs", index: list[int]) -> bool:
        # responses in no pair (or with zero gradient) need no backward pass
        return inputs.shared.reducer.every(not inputs.gradients[index].any())

    def __call__(self, lp: MicroBatch, totals: Totals) -> Loss:
        """Pass 2: sum_i g_i log pi(y_i|x); log pi_ref is a constant, so its gradient is dL/dtheta."""
        sequence = (upcast(lp.policy) * lp.mask).sum(-1)
        return Loss((lp.state.gradients[lp.index].to(sequence.device) * sequence).sum())

    def result(self, inputs: "_IpoInputs", tally: Tally, token_counts: torch.Tensor,
               optimizer_steps: int) -> dict:
        stats, loss = inputs.stats, inputs.loss
        reducer = inputs.shared.reducer
        total_tokens = max(reducer.total(float(token_counts.sum())), 1.0)
        ones = torch.ones(len(token_counts))
        return {"logprobs": stats.logprobs, "raw_weights": ones, "weights": ones, "kl_sums": stats.kl_sums,
                "reference_tokens": stats.reference_tokens, "loss": loss, "policy_loss": loss,
                "kl": float(stats.kl_sums.sum()) / total_tokens, "entropy": stats.entropy / total_tokens,
                "extras": self._extras(inputs.groups, inputs.pairs, inputs.all_pairs, stats, reducer)}

    def _extras(self, groups: list[Group], pairs, all_pairs: int, stats: "_SequenceStats",
                reducer) -> dict[str, float]:
        """The batch's pair counts and mean margin h, summed over the ranks that share it."""
        ratios = stats.logprobs - stats.reference_sums
        margin_sum = reducer.total(float(sum(ratios[w] - ratios[l] for w, l in pairs)))
        return {"ipo/pairs": float(all_pairs),
                "ipo/groups_with_pairs": float(reducer.total(sum(bool(ipo_pairs(list(g.rewards))) for g in groups))),
                "ipo/margin_mean": margin_sum / all_pairs if all_pairs else float("nan"),
                "ipo/target_margin": 1.0 / (2.0 * self.tau)}


@dataclass
class _SequenceStats:
    """Pass 1's per-response numbers (no grad): log pi, log pi_ref and KL summed over tokens; entropy summed."""

    logprobs: torch.Tensor
    reference_sums: torch.Tensor
    kl_sums: torch.Tensor
    reference_tokens: list[tuple[float, ...]]
    entropy: float = 0.0


@dataclass
class _IpoInputs:
    """The batch's pairs (this shard's, and how many the whole batch has) and pass 1's numbers."""

    groups: list[Group]
    pairs: list[tuple[int, int]]
    all_pairs: int
    share: float  # this shard's pairs' share of the batch's
    tau: float
    stats: _SequenceStats
    shared: Shared  # the trainer's reducer over ranks and KL estimate

    @cached_property
    def _gradients_and_loss(self) -> tuple[torch.Tensor, float]:
        """dL/d log pi(y_i|x) for every response, exactly (`ipo_response_gradients`), and L: after pass 1."""
        gradients, loss = ipo_response_gradients(self.stats.logprobs - self.stats.reference_sums, self.pairs, self.tau)
        return gradients * self.share, loss * self.share

    @property
    def gradients(self) -> torch.Tensor:
        return self._gradients_and_loss[0]

    @property
    def loss(self) -> float:
        return self._gradients_and_loss[1]
