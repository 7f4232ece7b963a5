"""The objective interface (`loss` config group): a loss as a function of one micro-batch, `objective(lp,
totals) -> Loss`, which the shared trainer (`src.loss.trainer.Trainer`) runs: the trainer owns the forward
passes, every row's inputs, eq. 3's KL and entropy terms, clipping and the optimizer steps.

An objective is built from its YAML by `hydra.utils.instantiate`, with the behaviour group's truncation
settings added for objectives that correct off-policy fresh rows. A new
loss is a new subclass and a YAML file naming it; the subclass describes itself (`src.variant.Variant`):
its cell and reader labels, whether it is plain Replay-RLOO, and whether it reads clip.ceiling.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from src.loss.inputs import Needs
from src.loss.rloo_math import leave_one_out_advantages
from src.validate.checks import check_choice
from src.loss.trainer import FirstPass, Fixed, Loss, MicroBatch, Totals
from src.variant import Variant

IS_LEVELS = ("sequence", "token")  # truncated importance weights per response or per token (seed 002 eq. 3)


@dataclass(frozen=True)
class Truncation:
    """Seed 002's truncated importance weight for fresh rows from a stale or tempered sampler (eq. 3)."""

    is_min: float = 0.0
    is_max: float = 2.0
    is_level: str = "sequence"  # "sequence": one weight per response; "token": one per token

    @classmethod
    def checked(cls, group: str, is_min: float, is_max: float, is_level: str,
                is_max_token: float | None = None) -> "Truncation":
        """The settings of config group `group` (behaviour or loss), refused with their keys unless valid.

        Seed 002 (l.121) truncates at rho_max = 10 per sequence and at 2 per token, so the group has a cap
        per level: `is_max` at is_level=sequence, `is_max_token` (when given) at is_level=token.
        """
        check_choice(f"{group}.is_level", is_level, IS_LEVELS)
        caps = {"is_max": is_max} if is_max_token is None else {"is_max": is_max, "is_max_token": is_max_token}
        for key, cap in caps.items():
            if not 0 <= is_min <= 1 <= cap:
                raise ValueError(f"{group}.is_min={is_min}, {group}.{key}={cap}: the truncation interval must hold 1 "
                                 f"(0 <= is_min <= 1 <= {key}; seed 002: 0 and 10, or 2 with token-level IS)")
        cap = is_max_token if is_level == "token" and is_max_token is not None else is_max
        return cls(float(is_min), float(cap), is_level)


class Objective(Variant):
    """A loss: `__call__(micro_batch, totals) -> Loss`, and what it asks of the trainer as data (`needs`).

    The trainer (`src.loss.trainer.Trainer`) lays out every row's inputs (advantages by `advantages`, log mu,
    truncated rows, and pi_prox and mu per token where `needs.proximal` asks for them) on each micro-batch and
    calls the loss on it; the loss's diagnostics travel in its `Loss`. A loss that fixes numbers for the whole
    batch from the trainer's first pass adds `fix` (M2PO's mask, IPO's pair gradients).
    """

    # Whether the objective weighs replayed rows with clip.ceiling (eq. 2): then the ceiling names the cell
    # of a run that replays (`src.study.sweep.cell_name`), and enters its identity.
    reads_clip: bool = False
    # The weight ceiling metrics compare raw weights against (clip fraction).
    weight_ceiling: float = float("inf")

    def __init__(self, truncation: Truncation | None = None, name: str = "") -> None:
        # `name` is the YAML's label for people (MLflow tags); the objective describes itself by its class.
        self.truncation = truncation or Truncation()
        self.needs = Needs(behaviour_tokens=self.truncation.is_level == "token")

    def __call__(self, lp: MicroBatch, totals: Totals) -> Loss:
        """One micro-batch's loss, each term normalised by `totals` (its share of the mini-batch's loss)."""
        raise NotImplementedError

    def advantages(self, rewards: torch.Tensor) -> torch.Tensor:
        """Each response's advantage from its group's K rewards ([G, K]): leave-one-out (eq. 1) by default.

        The trainer lays them out per row; an asynchronous worker fixes them when it generates a group
        (SPEC 11), with the same function.
        """
        return leave_one_out_advantages(rewards)

    def fix(self, first: FirstPass, reducer) -> Fixed:
        """Where the loss asks for a first pass (`Needs.first_pass`, `Needs.proximal`): what it fixes for the whole
        batch from every row's numbers of that pass (`FirstPass`), over the ranks that share the batch
        (`reducer`): a state for each micro-batch, the rows' advantages, the batch's loss and diagnostics."""
        return Fixed()
