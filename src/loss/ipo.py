"""IPO baseline (seed 004 Table 1; Azar et al. 2023): pairwise preferences from the policy's own verifier-scored samples.

`loss=ipo` keeps the runner's sampling exactly (B groups of K fresh responses per step, each scored
once by the verifier, so its fresh evaluations count like every method's) and replaces the RLOO
update with IPO on preference pairs built inside each group:

- Pairing: every pair (w, l) of responses of one group with reward r_w > r_l; equal rewards give no
  pair (no preference), so a group whose K rewards are all equal contributes nothing. A group with
  rewards [1.0, 0.1, 0.1, 0.0] gives the 5 pairs (0,1), (0,2), (0,3), (1,3), (2,3). All pairs, not a
  sampled subset: the per-response log-probs are computed once whatever the number of pairs. Where the batch
  trains some of a group's responses (a positive-bias FIFO's draw, the async pipeline's), the pairs are those
  among them.
- Loss (Azar et al. eq. 17): with h = (log pi(y_w|x) - log pi_ref(y_w|x)) - (log pi(y_l|x) - log pi_ref(y_l|x))
  (sequence log-probs, sums over response tokens), L = mean over the batch's pairs of (h - 1/(2 tau))^2.
  pi_ref is the frozen warm start (the runner's reference); tau (loss.tau) sets the target margin.
  No KL or entropy term: IPO's regression to 1/(2 tau) is its regulariser.

Micro-batching: L is not a sum over responses, so accumulating per-micro-batch losses would not give
its gradient. The trainer's first, no-grad pass gives every response's log pi and log pi_ref; from them
IPO computes g_i = dL/d log pi(y_i|x) exactly (`ipo_response_gradients`) and hands the trainer A_i = -g_i as
the rows' advantages, so its loss on each micro-batch of the training pass is -sum_i A_i log pi(y_i|x): the
same gradient as one batch, at one extra forward. A response in no pair has A_i = 0 and no backward pass.
"""

from __future__ import annotations

import torch

from src.batch import Batch
from src.loss.base import Objective
from src.loss.inputs import Needs
from src.loss.trainer import FirstPass, Fixed, Loss, MicroBatch, Totals
from src.policy.forward import upcast


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


def batch_pairs(batch: Batch) -> list[tuple[int, int]]:
    """Every group's pairs among the responses the batch trains of it (all K, or the share a FIFO or the async
    pipeline drew), as indices into the batch's rows."""
    rows_of: dict[int, list[int]] = {}
    for row, (g, _) in enumerate(batch.rows):
        rows_of.setdefault(g, []).append(row)
    pairs = []
    for g, rows in rows_of.items():
        rewards = [batch.groups[g].rewards[batch.rows[row][1]] for row in rows]
        pairs += [(rows[w], rows[l]) for w, l in ipo_pairs(rewards)]
    return pairs


class IpoObjective(Objective):
    """One optimizer step of IPO on the pairs within each group among the responses the batch trains (KL and
    entropy only logged)."""

    cell_tag = "-ipo"

    reader_tag = " (IPO loss)"

    def __init__(self, tau: float, **settings) -> None:
        super().__init__(**settings)
        if not tau > 0:
            raise ValueError(f"loss.tau={tau}: IPO's regularisation strength, a number > 0 (target margin "
                             "1/(2 tau); seed 004: 0.1)")
        self.tau = float(tau)
        # The first pass reads log pi and log pi_ref (its loss is a margin to pi_ref, whatever kl_coef is), KL and
        # entropy; the training pass needs log pi alone (log pi_ref is a constant of the gradient). No trainer KL
        # or entropy term: the margin to pi_ref is IPO's regulariser. No importance weight: no truncated row.
        self.needs = Needs(truncates="none", first_pass=(True, True), penalised=False, skips_zero_advantage=True)

    def fix(self, first: FirstPass, reducer) -> Fixed:
        """The batch's pairs, L and A_i = -dL/d log pi(y_i|x) of every response from the first pass's log pi and
        log pi_ref. L is the mean over the whole batch's pairs: a shard's pairs weigh by their share of them."""
        batch = first.batch
        pairs = batch_pairs(batch)
        all_pairs = reducer.total(len(pairs))
        share = len(pairs) / all_pairs if all_pairs else 0.0
        ratios = first.logprobs - first.reference_sums
        gradients, loss = ipo_response_gradients(ratios, pairs, self.tau)
        return Fixed(advantages=-gradients * share, loss=loss * share,
                     diagnostics=self._diagnostics(batch, pairs, all_pairs, ratios, reducer))

    def __call__(self, lp: MicroBatch, totals: Totals) -> Loss:
        """The training pass: -sum_i A_i log pi(y_i|x) = sum_i g_i log pi(y_i|x); log pi_ref is a constant of the
        gradient, so this term's gradient is dL/dtheta."""
        sequence = (upcast(lp.policy) * lp.mask).sum(-1)
        return Loss(-(lp.advantages.to(sequence.dtype) * sequence).sum())

    def _diagnostics(self, batch: Batch, pairs, all_pairs: int, ratios: torch.Tensor, reducer) -> dict[str, float]:
        """The batch's pair counts and mean margin h, summed over the ranks that share it."""
        margin_sum = reducer.total(float(sum(ratios[w] - ratios[l] for w, l in pairs)))
        paired = {batch.rows[row][0] for pair in pairs for row in pair}  # groups with a pair
        return {"ipo/pairs": float(all_pairs),
                "ipo/groups_with_pairs": float(reducer.total(len(paired))),
                "ipo/margin_mean": margin_sum / all_pairs if all_pairs else float("nan"),
                "ipo/target_margin": 1.0 / (2.0 * self.tau)}
