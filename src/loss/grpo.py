"""`loss=grpo`: POPO's decoupled clip-higher surrogate with group-normalised advantages (seed 003; SPEC 9)."""

from __future__ import annotations

import torch

from src.validate.checks import check_choice
from src.loss.base import Objective
from src.loss.inputs import Needs
from src.loss.trainer import Loss, MicroBatch, Totals
from src.loss.variant_math import clipped_surrogate, group_normalised_advantages
from src.variant import float_knob, int_knob


RATIO_TO = ("proximal", "behaviour")


class ClippedObjective(Objective):
    """`updates_per_step` mini-batch optimizer steps on the clipped surrogate (the shared trainer takes them).

    1. Group-normalised advantages from each group's K rewards (`group_normalised_advantages`).
    2. pi_prox = the policy at the start of this update: its per-token log-probs come from the
       trainer's no-grad pass over the same micro-batches the updates use, before the first
       optimizer step (so the first mini-batch's ratio is exactly 1).
    3. mu per token: a replayed group's stored `behaviour_token_logprobs`; a fresh group has
       mu = pi_prox (behaviour weight exactly 1), a fresh group of a stale sampler its own mu.
    4. Rows go to mini-batch i mod M (`interleaved_mini_batches`). Per mini-batch:
       L = surrogate (token-mean over the mini-batch, `clipped_surrogate`), to which the trainer adds
       beta_KL * KL - beta_H * H (token means over the mini-batch); micro-batch terms are scaled by
       their share of the mini-batch's tokens, so gradient accumulation is exact.
    """

    knobs = {"eps_low": float_knob(0, 1, "0.2 (POPO)", high_open=True, why="the ratio is clipped below at 1 - eps_low"),
             "eps_high": float_knob(0, 1e6, "0.28 (clip-higher)", why="the ratio is clipped above at 1 + eps_high"),
             "behaviour_cap": float_knob(0, 1e6, "2.0 (POPO)", low_open=True, why="the cap on pi_prox/mu"),
             "updates_per_step": int_knob(1, 1_000, "4", why="mini-batch optimizer steps per RL step")}

    @classmethod
    def cell_label(cls, node, cfg) -> str:
        """-grpo (POPO's decoupled form), or -grpo-coupled (the ratio to mu clipped itself, seed 001)."""
        return "-grpo-coupled" if node.get("ratio_to", "proximal") == "behaviour" else "-grpo"

    @classmethod
    def reader_label(cls, node, cfg) -> str:
        return " (coupled GRPO loss)" if node.get("ratio_to", "proximal") == "behaviour" else " (GRPO loss)"

    @classmethod
    def check(cls, node, run) -> None:
        """Over data-parallel ranks every rank takes each mini-batch's optimizer step, so needs a row in each."""
        ranks, groups, k = run.hardware.ranks, run.trainer.groups_per_step, run.trainer.group_size
        rows = groups // ranks * k
        if ranks > 1 and rows < min(int(node.updates_per_step), groups * k):
            raise ValueError(f"loss.updates_per_step={node.updates_per_step} with hardware.ranks={ranks}: a rank may "
                             f"hold only {rows} responses ({groups} groups of {k} over {ranks} ranks), fewer than one "
                             f"per mini-batch; lower loss.updates_per_step to {rows} or raise trainer.groups_per_step")

    def __init__(self, eps_low: float, eps_high: float, behaviour_cap: float, updates_per_step: int,
                 ratio_to: str = "proximal", **settings) -> None:
        super().__init__(**settings)
        # proximal: POPO's decoupled form (clip pi_theta/pi_prox, times the capped pi_prox/mu); behaviour: the
        # coupled form, clip pi_theta/mu itself with no further weight (seed 003 eq. 9; seed 001 D.2).
        self.ratio_to = check_choice("loss.ratio_to", ratio_to, RATIO_TO)
        self.eps_low, self.eps_high, self.behaviour_cap = float(eps_low), float(eps_high), float(behaviour_cap)
        self.updates_per_step = int(updates_per_step)
        self.weight_ceiling = self.behaviour_cap
        # 2. and 3. pi_prox and mu per token from the trainer's first pass; 4. M interleaved mini-batches. No row is
        # truncated: pi_prox/mu weighs every token.
        self.needs = Needs(truncates="none", proximal=True, updates=self.updates_per_step)

    def advantages(self, rewards: torch.Tensor) -> torch.Tensor:
        """GRPO's group-normalised advantages (POPO eq. 3; seed 001 eq. 6)."""
        return group_normalised_advantages(rewards)

    def __call__(self, lp: MicroBatch, totals: Totals) -> Loss:
        """4. The surrogate on one micro-batch, its share of the mini-batch's (advantages: 1.; pi_prox and mu per
        token: 2. and 3., the trainer's), with the capped pi_prox/mu per token as the used weight and the clip's
        diagnostics."""
        behaviour = lp.behaviour_tokens
        prox = behaviour if self.ratio_to == "behaviour" else lp.proximal
        surrogate, diag = clipped_surrogate(lp.policy, prox, behaviour, lp.advantages, lp.mask,
                                            eps_low=self.eps_low, eps_high=self.eps_high,
                                            behaviour_cap=self.behaviour_cap)
        policy_loss = surrogate * (diag["n_tokens"] / totals.tokens)
        raw = (lp.proximal - behaviour).exp()
        return Loss(policy_loss, policy_loss, token_weights=(raw, raw.clamp(max=self.behaviour_cap)),
                    diagnostics={f"grpo/{key}": value for key, value in diag.items() if key != "n_tokens"})
