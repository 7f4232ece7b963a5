"""`loss=grpo`: POPO's decoupled clip-higher surrogate with group-normalised advantages (seed 003; SPEC 9)."""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass, field

import torch

from src.batch import Batch
from src.checks import check_choice
from src.loss.base import Objective, UpdateResult, batch_sequences
from src.loss.variant_math import clipped_surrogate, group_normalised_advantages
from src.loss.rloo_math import interleaved_mini_batches
from src.policy.forward import place_tokens, row_values, upcast
from src.variant import float_knob, int_knob


RATIO_TO = ("proximal", "behaviour")


class ClippedObjective(Objective):
    """`updates_per_step` mini-batch optimizer steps on the clipped surrogate.

    1. Group-normalised advantages from each group's K rewards (`group_normalised_advantages`).
    2. pi_prox = the policy at the start of this update: its per-token log-probs (and pi_ref's,
       or the stored ones) come from a no-grad forward over the same micro-batches the updates
       use, before the first optimizer step (so the first mini-batch's ratio is exactly 1).
    3. mu per token: a replayed group's stored `behaviour_token_logprobs`; a fresh group has
       mu = pi_prox (behaviour weight exactly 1), a fresh group of a stale sampler its own mu.
    4. Rows go to mini-batch i mod M (`interleaved_mini_batches`). Per mini-batch:
       L = surrogate (token-mean over the mini-batch, `clipped_surrogate`) + beta_KL * KL
       - beta_H * H (k3 KL and exact entropy, token means over the mini-batch); micro-batch
       terms are scaled by their share of the mini-batch's tokens, so gradient accumulation is exact.
    """

    splits_over_ranks = True

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
    def check(cls, node, cfg) -> None:
        """Over data-parallel ranks every rank takes each mini-batch's optimizer step, so needs a row in each."""
        ranks, groups, k = int(cfg.hardware.ranks), int(cfg.trainer.groups_per_step), int(cfg.trainer.group_size)
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

    def advantages(self, rewards: torch.Tensor) -> torch.Tensor:
        """GRPO's group-normalised advantages (POPO eq. 3; seed 001 eq. 6)."""
        return group_normalised_advantages(rewards)

    def update(self, policy, reference, optimizer, batch: Batch) -> UpdateResult:
        """Steps 1-4 of the class docstring, in order."""
        rows = batch.rows
        rewards = torch.tensor([g.rewards for g in batch.groups])
        advantages = self.advantages(rewards)[[g for g, _ in rows], [j for _, j in rows]]  # 1.
        sequences, cached_reference, token_counts = batch_sequences(batch)
        minis = self._mini_batches(len(sequences))  # 4. rows to mini-batches
        plans = [[[mini[k] for k in chunk] for chunk in self.forward.batches([sequences[i] for i in mini])]
                 for mini in minis]
        prox, reference_tokens = self._proximal_tokens(policy, reference, sequences, cached_reference, plans)  # 2.
        fixed = _FixedTokens(prox, self._behaviour_tokens(batch, prox), reference_tokens)  # 3.
        tally = _Tally(updates=len(plans), kl_sums=torch.zeros(len(sequences)))
        for plan in plans:  # 4. one optimizer step per mini-batch
            mini_tokens = self.reducer.total(sum(len(sequences[i][1]) for chunk in plan for i in chunk))
            optimizer.zero_grad(set_to_none=True)
            for index in plan:
                loss, terms, kl_tokens, diag = self._micro_batch_loss(
                    policy, [sequences[i] for i in index], index, advantages, fixed, mini_tokens)
                loss.backward()
                tally.add(index, loss, terms, kl_tokens, diag)
            self.optimizer_step(policy, optimizer)
        return self._result(fixed, tally.over(self.reducer), token_counts)

    def _mini_batches(self, rows: int) -> list[list[int]]:
        """4. The batch's row i in mini-batch i mod M (`interleaved_mini_batches`), as this shard's local rows.

        A shard holds consecutive batch rows, so with at least M rows it has some in every mini-batch, and
        every rank takes the same M optimizer steps."""
        first, batch_rows = self.reducer.first_row(rows), self.reducer.total(rows)
        count = min(self.updates_per_step, batch_rows)
        if not self.reducer.every(rows >= count):
            raise ValueError(f"loss.updates_per_step={self.updates_per_step}: every data-parallel rank needs at "
                             f"least {count} responses (one for each mini-batch), and this batch leaves a rank "
                             "fewer; lower loss.updates_per_step or raise trainer.groups_per_step")
        minis = interleaved_mini_batches(batch_rows, self.updates_per_step)
        return [[i - first for i in mini if first <= i < first + rows] for mini in minis]

    def _proximal_tokens(self, policy, reference, sequences, cached_reference, plans):
        """2. pi_prox and pi_ref per response token, from a no-grad forward before any optimizer step."""
        n = len(sequences)
        prox: list[torch.Tensor] = [torch.empty(0)] * n
        reference_tokens: list[tuple[float, ...] | None] = [None] * n
        policy.train()
        with torch.no_grad():
            for index in (chunk for plan in plans for chunk in plan):
                chunk = [sequences[i] for i in index]
                token_logprobs, _, mask = self.forward.token_stats(policy, chunk, with_entropy=False)
                ref = self.reference_chunk(reference, chunk, [cached_reference[i] for i in index], like=token_logprobs)
                token_logprobs, mask = upcast(token_logprobs).cpu(), mask.cpu()
                refs = row_values(ref, mask) if ref is not None else [None] * len(index)
                for row, (i, tokens) in enumerate(zip(index, refs)):
                    prox[i] = token_logprobs[row][mask[row]].clone()
                    reference_tokens[i] = tokens
        return prox, reference_tokens

    @staticmethod
    def _behaviour_tokens(batch: Batch, prox: list[torch.Tensor]) -> list[torch.Tensor]:
        """3. mu per token: stored for replayed groups (and a stale sampler's fresh ones), pi_prox for fresh ones."""
        groups, behaviour = batch.groups, []
        for i, (g, j) in enumerate(batch.rows):
            group = groups[g]
            if group.behaviour_logprobs is None:
                behaviour.append(prox[i])
            elif group.behaviour_token_logprobs is None:
                raise ValueError(f"a replayed group of step {group.step} has no per-token behaviour log-probs; "
                                 "loss=grpo needs them (groups stored by a loss=rloo run cannot be replayed "
                                 "under grpo)")
            else:
                behaviour.append(torch.tensor(group.behaviour_token_logprobs[j]))
        return behaviour

    def _micro_batch_loss(self, policy, chunk, index, advantages, fixed: _FixedTokens, mini_tokens: int):
        """4. L = surrogate + beta_KL * KL - beta_H * H on one micro-batch, each term its share of the mini-batch.

        Returns (loss, its terms, the masked k3 KL per token, the surrogate's diagnostics).
        """
        token_logprobs, entropy, mask = self.forward.token_stats(policy, chunk, with_entropy=True)
        zeros = torch.zeros_like(upcast(token_logprobs))
        behaviour_chunk = place_tokens(chunk, [fixed.behaviour[i] for i in index], zeros.clone())
        prox_chunk = (behaviour_chunk if self.ratio_to == "behaviour"
                      else place_tokens(chunk, [fixed.prox[i] for i in index], zeros.clone()))
        mask = mask.float()
        surrogate, diag = clipped_surrogate(token_logprobs, prox_chunk, behaviour_chunk,
                                            advantages[index].to(token_logprobs.device), mask,
                                            eps_low=self.eps_low, eps_high=self.eps_high,
                                            behaviour_cap=self.behaviour_cap)
        if self.reads_reference:
            ref_chunk = place_tokens(chunk, [fixed.reference[i] for i in index], zeros.clone())
            kl_tokens = self.kl_tokens(token_logprobs, ref_chunk) * mask
        else:  # no pi_ref read (kl_coef = 0): the KL is not measured, and not in the loss
            kl_tokens = torch.full_like(zeros, float("nan"))
        terms = {"policy_loss": surrogate * (diag["n_tokens"] / mini_tokens),
                 "kl": kl_tokens.sum() / mini_tokens,
                 "entropy": (entropy * mask).sum() / mini_tokens}
        kl_term = self.kl_coef * terms["kl"] if self.reads_reference else 0.0
        loss = terms["policy_loss"] + kl_term - self.entropy_coef * terms["entropy"]
        return loss, terms, kl_tokens, diag

    def _result(self, fixed: _FixedTokens, tally: _Tally, token_counts: torch.Tensor) -> UpdateResult:
        """Per-response numbers: raw = sequence pi_prox/mu, weights = mean capped token weight used. The
        weight diagnostics are per token (`token_raw_weights`), where the cap acts."""
        prox, behaviour = fixed.prox, fixed.behaviour
        logprobs = torch.stack([p.sum() for p in prox])
        raw_weights = torch.stack([(p - b).sum().exp() for p, b in zip(prox, behaviour)])
        token_raw = [(p - b).exp() for p, b in zip(prox, behaviour)]
        token_used = [tokens.clamp(max=self.behaviour_cap) for tokens in token_raw]
        weights = torch.stack([tokens.mean() if len(tokens) else torch.tensor(1.0) for tokens in token_used])
        return UpdateResult(logprobs=logprobs, raw_weights=raw_weights, weights=weights, kl_sums=tally.kl_sums,
                            token_counts=token_counts, reference_tokens=fixed.reference,
                            behaviour_tokens=[tuple(p.tolist()) for p in prox], extras=tally.extras(),
                            token_raw_weights=token_raw, token_weights=token_used,
                            optimizer_steps=tally.updates, **tally.totals)


@dataclass
class _FixedTokens:
    """Per trained response, the log-probs that stay fixed through the update: pi_prox, mu and pi_ref per token."""

    prox: list[torch.Tensor]
    behaviour: list[torch.Tensor]
    reference: list[tuple[float, ...] | None]  # None: not read (kl_coef = 0)


@dataclass
class _Tally:
    """The update's bookkeeping: KL per response, loss terms averaged over the mini-batch updates, and the
    surrogate's diagnostics weighted by tokens (ratio_max: the largest)."""

    updates: int
    kl_sums: torch.Tensor
    totals: defaultdict = field(default_factory=lambda: defaultdict(float))
    diagnostics: defaultdict = field(default_factory=lambda: defaultdict(float))

    def add(self, index: list[int], loss: torch.Tensor, terms: dict, kl_tokens: torch.Tensor, diag: dict) -> None:
        self.kl_sums[index] = kl_tokens.sum(-1).detach().cpu()
        for key, value in (("loss", loss), ("policy_loss", terms["policy_loss"]), ("kl", terms["kl"]),
                           ("entropy", terms["entropy"])):
            self.totals[key] += value.item() / self.updates  # mean over the mini-batch updates
        for key in ("clip_frac_low", "clip_frac_high", "ratio_mean", "behaviour_weight_mean", "behaviour_cap_frac"):
            self.diagnostics[key] += diag[key] * diag["n_tokens"]
        self.diagnostics["ratio_max"] = max(self.diagnostics["ratio_max"], diag["ratio_max"])
        self.diagnostics["n_tokens"] += diag["n_tokens"]

    def over(self, reducer) -> "_Tally":
        """The diagnostics summed over the ranks that share the batch (the loss terms are each rank's share)."""
        for key in sorted(self.diagnostics):  # one order on every rank: each key is a collective
            value = self.diagnostics[key]
            self.diagnostics[key] = reducer.maximum(value) if key == "ratio_max" else reducer.total(value)
        return self

    def extras(self) -> dict[str, float]:
        """The diagnostics as logged: token means (ratio_max as it is) and the number of updates."""
        diagnostics = dict(self.diagnostics)
        tokens = diagnostics.pop("n_tokens")
        extras = {f"grpo/{key}": (value if key == "ratio_max" else value / tokens)
                  for key, value in diagnostics.items()}
        extras["grpo/updates"] = float(self.updates)
        return extras
