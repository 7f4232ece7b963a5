"""`loss=grpo`: POPO's decoupled clip-higher surrogate with group-normalised advantages (seed 003; SPEC 9)."""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass, field

import torch

from src.batch import Batch
from src.validate.checks import check_choice
from src.loss.base import Objective
from src.loss.inputs import Needs, Shared
from src.loss.trainer import Loss, MicroBatch, Tally, Totals
from src.loss.variant_math import clipped_surrogate, group_normalised_advantages
from src.policy.forward import place_tokens, upcast
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
        # 2. pi_prox from a first pass before any optimizer step (pi_ref is frozen: the trainer reads it later);
        # 4. M interleaved mini-batches; mu per token is the loss's own (3.), so no row is truncated.
        self.needs = Needs(truncates="none", first_pass=(False, False), updates=self.updates_per_step)

    def advantages(self, rewards: torch.Tensor) -> torch.Tensor:
        """GRPO's group-normalised advantages (POPO eq. 3; seed 001 eq. 6)."""
        return group_normalised_advantages(rewards)

    def prepare(self, batch: Batch, shared: Shared) -> "_FixedTokens":
        """3.: mu per token where it is stored (pi_prox, from the first pass, elsewhere)."""
        return _FixedTokens(stored_behaviour_tokens(batch), [torch.empty(0)] * len(batch.rows), _Diagnostics(),
                            shared.reducer)

    def observe(self, fixed: "_FixedTokens", lp: MicroBatch) -> None:
        """2. pi_prox per response token of one micro-batch."""
        token_logprobs, mask = upcast(lp.policy).cpu(), lp.mask.bool().cpu()
        for row, i in enumerate(lp.index):
            fixed.prox[i] = token_logprobs[row][mask[row]].clone()

    def __call__(self, lp: MicroBatch, totals: Totals) -> Loss:
        """4. The surrogate on one micro-batch, its share of the mini-batch's (advantages: 1., the trainer's)."""
        chunk, index, fixed = lp.chunk, lp.index, lp.state
        zeros = torch.zeros_like(upcast(lp.policy))
        behaviour_chunk = place_tokens(chunk, [fixed.behaviour(i) for i in index], zeros.clone())
        prox_chunk = (behaviour_chunk if self.ratio_to == "behaviour"
                      else place_tokens(chunk, [fixed.prox[i] for i in index], zeros.clone()))
        surrogate, diag = clipped_surrogate(lp.policy, prox_chunk, behaviour_chunk,
                                            lp.advantages, lp.mask,
                                            eps_low=self.eps_low, eps_high=self.eps_high,
                                            behaviour_cap=self.behaviour_cap)
        policy_loss = surrogate * (diag["n_tokens"] / totals.tokens)
        fixed.diagnostics.add(diag)
        return Loss(policy_loss, policy_loss)

    def result(self, fixed: "_FixedTokens", tally: Tally, token_counts: torch.Tensor,
               optimizer_steps: int) -> dict:
        """Per-response numbers: raw = sequence pi_prox/mu, weights = mean capped token weight used. The
        weight diagnostics are per token (`token_raw_weights`), where the cap acts."""
        prox, behaviour = fixed.prox, [fixed.behaviour(i) for i in range(len(fixed.prox))]
        logprobs = torch.stack([p.sum() for p in prox])
        raw_weights = torch.stack([(p - b).sum().exp() for p, b in zip(prox, behaviour)])
        token_raw = [(p - b).exp() for p, b in zip(prox, behaviour)]
        token_used = [tokens.clamp(max=self.behaviour_cap) for tokens in token_raw]
        weights = torch.stack([tokens.mean() if len(tokens) else torch.tensor(1.0) for tokens in token_used])
        return {"logprobs": logprobs, "raw_weights": raw_weights, "weights": weights,
                "behaviour_tokens": [tuple(p.tolist()) for p in prox],
                "extras": fixed.diagnostics.over(fixed.reducer).extras(optimizer_steps),
                "token_raw_weights": token_raw, "token_weights": token_used}


def stored_behaviour_tokens(batch: Batch) -> list[torch.Tensor | None]:
    """3. mu per token as stored: a replayed group's (and a stale sampler's fresh one's); None for fresh groups,
    whose mu is pi_prox."""
    groups, behaviour = batch.groups, []
    for g, j in batch.rows:
        group = groups[g]
        if group.behaviour_logprobs is None:
            behaviour.append(None)
        elif group.behaviour_token_logprobs is None:
            raise ValueError(f"a replayed group of step {group.step} has no per-token behaviour log-probs; "
                             "loss=grpo needs them (groups stored by a loss=rloo run cannot be replayed "
                             "under grpo)")
        else:
            behaviour.append(torch.tensor(group.behaviour_token_logprobs[j]))
    return behaviour


@dataclass
class _FixedTokens:
    """Per trained response, what stays fixed through the update: pi_prox and mu per token; plus the surrogate's
    diagnostics as the micro-batches add them."""

    stored_behaviour: list[torch.Tensor | None]  # None: a fresh group's, mu = pi_prox
    prox: list[torch.Tensor]
    diagnostics: "_Diagnostics"
    reducer: object  # the trainer's, over the ranks that share the batch (the diagnostics' sums)

    def behaviour(self, row: int) -> torch.Tensor:
        stored = self.stored_behaviour[row]
        return self.prox[row] if stored is None else stored


@dataclass
class _Diagnostics:
    """The surrogate's diagnostics weighted by tokens (ratio_max: the largest)."""

    sums: defaultdict = field(default_factory=lambda: defaultdict(float))

    def add(self, diag: dict) -> None:
        for key in ("clip_frac_low", "clip_frac_high", "ratio_mean", "behaviour_weight_mean", "behaviour_cap_frac"):
            self.sums[key] += diag[key] * diag["n_tokens"]
        self.sums["ratio_max"] = max(self.sums["ratio_max"], diag["ratio_max"])
        self.sums["n_tokens"] += diag["n_tokens"]

    def over(self, reducer) -> "_Diagnostics":
        """The diagnostics summed over the ranks that share the batch (the loss terms are each rank's share)."""
        for key in sorted(self.sums):  # one order on every rank: each key is a collective
            value = self.sums[key]
            self.sums[key] = reducer.maximum(value) if key == "ratio_max" else reducer.total(value)
        return self

    def extras(self, updates: int) -> dict[str, float]:
        """The diagnostics as logged: token means (ratio_max as it is) and the number of updates."""
        diagnostics = dict(self.sums)
        tokens = diagnostics.pop("n_tokens")
        extras = {f"grpo/{key}": (value if key == "ratio_max" else value / tokens)
                  for key, value in diagnostics.items()}
        extras["grpo/updates"] = float(updates)
        return extras
