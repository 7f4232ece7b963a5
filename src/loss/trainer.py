"""The trainer's half of an update, the same for every objective: micro-batches, forward passes, the KL and
entropy terms of eq. 3, backward, gradient clipping and the optimizer step (`Trainer.update`).

An objective only turns one micro-batch's per-token log-probs into its own loss term (`MicroBatch` -> `Loss`),
normalised by the batch-wide `Totals` its `Reducer` sums over the ranks that share the batch; the trainer adds
beta_KL KL - beta_H H to it (`penalised`), once for every loss. The objective never calls backward or steps.

Over data-parallel ranks (src/distributed/data_parallel.py) every rank runs this loop on its shard with
rank-aware micro-batches and reducer, so any objective trains over ranks unchanged.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass, field, replace

import torch

from src.batch import Batch, Group
from src.loss.inputs import RowInputs
from src.loss.kl import KL_ESTIMATORS
from src.loss.reducer import Reducer
from src.loss.rloo_math import interleaved_mini_batches
from src.policy.forward import place_tokens, row_values, upcast
from src.policy.token_stats import on_device


# The batch-wide totals where no micro-batch measured them (every one skipped: IPO's batch without a pair).
UNMEASURED = {"loss": float("nan"), "policy_loss": float("nan"), "kl": float("nan"), "entropy": float("nan")}


@dataclass
class UpdateResult:
    """Per-response numbers from the update, in the batch's row order (detached, on the CPU)."""

    logprobs: torch.Tensor      # log pi_theta(y|x) before the update
    raw_weights: torch.Tensor
    weights: torch.Tensor       # clipped, as used in the gradient
    kl_sums: torch.Tensor       # per-response sum of token KL estimates
    token_counts: torch.Tensor
    # Per-response log pi_ref per token, stored with new groups; None where the update read no pi_ref (kl_coef = 0).
    reference_tokens: list[tuple[float, ...] | None]
    loss: float
    policy_loss: float
    kl: float
    entropy: float
    # Per-response log mu per token to store with fresh groups (loss=grpo: pi_prox's); None: not kept.
    behaviour_tokens: list[tuple[float, ...]] | None = None
    extras: dict[str, float] = field(default_factory=dict)  # loss-specific diagnostics (grpo/*, ipo/*)
    optimizer_steps: int = 1
    # Where the objective weights tokens (loss=grpo's capped pi_prox/mu, token-level truncated IS): per
    # row, the raw and the used weight of each response token. None: one weight per response.
    token_raw_weights: list[torch.Tensor] | None = None
    token_weights: list[torch.Tensor] | None = None

    def weights_of(self, rows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Raw and used importance weights of the selected rows (a bool mask over the batch's rows): one
        per response, or one per response token where the objective weights tokens, since that is where
        its cap or truncation acts (a clip fraction then counts capped tokens, not responses)."""
        if self.token_weights is None:
            return self.raw_weights[rows], self.weights[rows]
        picked = rows.nonzero().flatten().tolist()
        if not picked:
            return torch.empty(0), torch.empty(0)
        return (torch.cat([self.token_raw_weights[i] for i in picked]),
                torch.cat([self.token_weights[i] for i in picked]))

    def stored(self, group: Group, first_row: int) -> Group:
        """A trained fresh group as a store keeps it: with log mu and its per-token log pi_ref.

        A group sampled by a stale or tempered behaviour already carries that behaviour's mu.
        """
        rows = slice(first_row, first_row + group.size)
        reference = self.reference_tokens[rows]
        if any(tokens is None for tokens in reference):  # not read at kl_coef = 0: a later update computes it
            reference = None
        if group.behaviour_logprobs is not None:
            return group.with_behaviour_logprobs(group.behaviour_logprobs, reference, group.behaviour_token_logprobs)
        tokens = self.behaviour_tokens[rows] if self.behaviour_tokens else None
        return group.with_behaviour_logprobs(self.logprobs[rows].tolist(), reference, tokens)


def batch_sequences(batch: Batch) -> tuple[list, list, torch.Tensor]:
    """The batch's trained rows as (prompt, response) id pairs, their stored log pi_ref (or None) and lengths."""
    groups = batch.groups
    sequences = [(groups[g].prompt_ids, groups[g].response_ids[j]) for g, j in batch.rows]
    cached = [groups[g].reference_logprobs[j] if groups[g].reference_logprobs is not None else None
              for g, j in batch.rows]
    token_counts = torch.tensor([float(len(response)) for _, response in sequences])
    return sequences, cached, token_counts


@dataclass
class MicroBatch:
    """One micro-batch as a loss sees it: its rows' per-token numbers, [rows, positions], and per row what the
    trainer laid out for it (`src.loss.inputs.RowInputs`), on the policy's device."""

    index: list[int]              # the rows' positions in the batch
    chunk: list                   # their (prompt ids, response ids)
    policy: torch.Tensor          # log pi_theta per token (with grad in the training pass)
    entropy: torch.Tensor | None  # None: not asked for
    reference: torch.Tensor | None  # log pi_ref per token; None: not read
    mask: torch.Tensor            # 1.0 on response tokens (float)
    advantages: torch.Tensor | None = None  # A_i per row (the loss's estimator, eq. 1 by default)
    behaviour: torch.Tensor | None = None   # log mu(y|x) per row; fresh rows of an on-policy sampler: log pi_theta now
    truncated: list[bool] | None = None     # rows seed 002's truncated IS weighs (`Needs.truncates`)
    # log mu per token: on truncated rows (zeros elsewhere) where the batch is weighed per token, on every row where
    # the loss asks for pi_prox (`Needs.proximal`); None: neither
    behaviour_tokens: torch.Tensor | None = None
    proximal: torch.Tensor | None = None   # log pi_prox per token where the loss asks for it (`Needs.proximal`)
    state: object = None  # what the loss fixed for the whole batch (`Fixed.state`: M2PO's mask; None for most)
    _sequence: torch.Tensor | None = field(default=None, init=False, repr=False)

    def sequence_logprobs(self) -> torch.Tensor:
        """log pi_theta(y|x) per response, detached (on the device: reading it would be a host sync); computed
        once a micro-batch, however many of the loss's terms and the trainer's diagnostics read it."""
        if self._sequence is None:
            self._sequence = (self.policy * self.mask).sum(-1).detach()
        return self._sequence


@dataclass(frozen=True)
class Totals:
    """What a micro-batch's terms are normalised by: the responses and response tokens of its mini-batch (the
    whole batch where the objective takes one optimizer step), summed over the ranks that share it."""

    rows: int
    tokens: int


@dataclass
class Loss:
    """One micro-batch's loss and the per-row numbers the trainer keeps of it (None: the objective keeps none)."""

    loss: torch.Tensor                        # the objective's term; the trainer adds the KL and entropy terms
    policy_loss: torch.Tensor | None = None   # the loss's terms, each its share of the batch's value
    kl: torch.Tensor | None = None            # the trainer's (`penalised`)
    entropy: torch.Tensor | None = None
    kl_tokens: torch.Tensor | None = None     # masked per-token KL estimates
    logprobs: torch.Tensor | None = None      # log pi_theta(y|x) per row
    weights: tuple[torch.Tensor, torch.Tensor] | None = None        # (raw, used) per row
    token_weights: tuple[torch.Tensor, torch.Tensor] | None = None  # (raw, used) per token
    # The loss's diagnostics of the micro-batch ("family/name": a token mean, or a maximum where the name ends in
    # _max): the trainer averages them over the update, weighted by response tokens, and over ranks (`Tally`).
    diagnostics: dict[str, float] | None = None


@dataclass(frozen=True)
class Fixed:
    """What a loss fixes for the whole batch from the trainer's first pass (`Objective.fix`), before any step."""

    state: object = None  # handed to every training micro-batch (`MicroBatch.state`): M2PO's mask
    # Per row, in place of the estimator's: IPO's -dL/d log pi(y|x), so its term is a plain sum_i A_i log pi
    advantages: torch.Tensor | None = None
    # This rank's share of the batch's loss, where its micro-batches' terms are not its value (IPO's)
    loss: float | None = None
    diagnostics: dict[str, float] = field(default_factory=dict)  # batch-wide, over every rank ("family/name")


class Tally:
    """The update's per-row numbers and its loss terms (averaged over its optimizer steps), as micro-batches end.

    Each micro-batch's numbers stay on the device, detached (`add` reads nothing back: a read is a host sync);
    the first use of a per-row attribute (`result`, an objective's own) reads them all in one copy (`_read`).
    """

    READ = ("logprobs", "raw_weights", "weights", "kl_sums", "reference_tokens", "current_tokens", "token_raw",
            "token_used", "token_level", "totals")

    def __init__(self, rows: int, updates: int, keep_token_logprobs: bool) -> None:
        self.rows, self.updates, self.keep_token_logprobs = rows, updates, keep_token_logprobs
        self.pieces: list[tuple[str, list[int], list | None, torch.Tensor]] = []  # (name, rows, their chunk, values)
        self.diagnostics: defaultdict = defaultdict(float)  # token-weighted sums (maxima for *_max), "tokens"

    def add(self, lp: MicroBatch, out: Loss) -> None:
        def keep(name: str, values: torch.Tensor, per_token: bool = False) -> None:
            self.pieces.append((name, lp.index, lp.chunk if per_token else None, values.detach()))

        # log pi_theta(y|x) of every row, which a fresh group stores as its log mu: the trainer's own, where the
        # loss gives none, so no loss can leave a stored row's behaviour log-prob at the default 0.0.
        keep("logprobs", out.logprobs if out.logprobs is not None else lp.sequence_logprobs())
        if out.weights is not None:
            keep("raw_weights", out.weights[0])
            keep("weights", out.weights[1])
        if lp.reference is not None:
            keep("reference_tokens", lp.reference, per_token=True)
        if self.keep_token_logprobs:
            keep("current_tokens", lp.policy, per_token=True)
        if out.token_weights is not None:
            keep("token_raw", out.token_weights[0], per_token=True)
            keep("token_used", out.token_weights[1], per_token=True)
        if out.kl_tokens is not None:
            keep("kl_sums", out.kl_tokens.sum(-1))
        for key in ("loss", "policy_loss", "kl", "entropy"):
            value = getattr(out, key)
            if value is not None:
                keep(key, value.reshape(1))
        if out.diagnostics:
            tokens = sum(len(response) for _, response in lp.chunk)
            for key, value in out.diagnostics.items():
                sums = self.diagnostics
                sums[key] = max(sums[key], value) if key.endswith("_max") else sums[key] + value * tokens
            self.diagnostics["tokens"] += tokens

    def diagnostic_means(self, reducer, optimizer_steps: int) -> dict[str, float]:
        """The losses' diagnostics over the update and the ranks that share it (token means, maxima), and the
        optimizer steps taken, as `family/updates` for each family of diagnostics."""
        sums = dict(self.diagnostics)
        for key in sorted(sums):  # one order on every rank: each key is a collective
            sums[key] = reducer.maximum(sums[key]) if key.endswith("_max") else reducer.total(sums[key])
        tokens = sums.pop("tokens", 0.0)
        means = {key: value if key.endswith("_max") else value / tokens for key, value in sums.items()}
        return {**means, **{f"{key.split('/')[0]}/updates": float(optimizer_steps) for key in sums}}

    def __getattr__(self, name: str):
        if name not in Tally.READ:
            raise AttributeError(name)
        self._read()
        return self.__dict__[name]

    def _read(self) -> None:
        """Every kept number to the CPU in one copy, laid out per row as `UpdateResult` has them."""
        pieces = self.pieces
        flat = torch.cat([values.reshape(-1) for *_, values in pieces]).cpu().tolist() if pieces else []
        rows = self.rows
        per_row = {"logprobs": [0.0] * rows, "raw_weights": [1.0] * rows, "weights": [1.0] * rows,
                   "kl_sums": [0.0] * rows}
        tokens = {"reference_tokens": [None] * rows, "current_tokens": [()] * rows, "token_raw": [torch.empty(0)] * rows,
                  "token_used": [torch.empty(0)] * rows}
        totals, start = defaultdict(float), 0
        for name, index, chunk, values in pieces:
            part, start = flat[start : start + values.numel()], start + values.numel()
            if name in per_row:
                for i, value in zip(index, part):
                    per_row[name][i] = value
            elif chunk is None:
                totals[name] += part[0] / self.updates  # mean over the optimizer steps
            else:
                width = values.shape[1]
                for row, (i, (prompt, response)) in enumerate(zip(index, chunk)):
                    first = row * width + len(prompt) - 1  # position t predicts token t + 1
                    row_tokens = part[first : first + len(response)]
                    tokens[name][i] = (tuple(row_tokens) if name.endswith("_tokens")
                                       else torch.tensor(row_tokens, dtype=values.dtype))
        self.__dict__.update({name: torch.tensor(values) for name, values in per_row.items()})
        self.__dict__.update(tokens, totals=totals, token_level=any(name == "token_raw" for name, *_ in pieces))

    def result(self, token_counts: torch.Tensor, optimizer_steps: int) -> UpdateResult:
        """The update's `UpdateResult` from the per-row numbers the micro-batches left."""
        return UpdateResult(logprobs=self.logprobs, raw_weights=self.raw_weights, weights=self.weights,
                            kl_sums=self.kl_sums, token_counts=token_counts, reference_tokens=self.reference_tokens,
                            behaviour_tokens=self.current_tokens if self.keep_token_logprobs else None,
                            token_raw_weights=self.token_raw if self.token_level else None,
                            token_weights=self.token_used if self.token_level else None,
                            optimizer_steps=optimizer_steps, **{**UNMEASURED, **self.totals})


class Trainer:
    """The update every loss runs through (SPEC 4), with the trainer group's settings: the forward passes
    (`forward`: micro-batches, autocast, the fused head), eq. 3's beta_KL KL - beta_H H (`penalised`), gradient
    clipping at `max_grad_norm` and the optimizer steps; `objective` gives the loss of each micro-batch.

    The objective's batch-wide totals go through the trainer's `Reducer` (over data-parallel ranks,
    `src.distributed.data_parallel.DataParallelTrainer` swaps in one that sums over them), and a loss that
    reports its KL itself (IPO) measures it with the trainer's `kl_estimator`.
    """

    def __init__(self, objective, forward, kl_coef: float = 0.0, entropy_coef: float = 0.0,
                 kl_estimator: str = "k3", max_grad_norm: float | None = None) -> None:
        if kl_estimator not in KL_ESTIMATORS:
            raise ValueError(f"trainer.kl_estimator={kl_estimator!r}: choose one of {', '.join(KL_ESTIMATORS)} "
                             "(README: which KL each one's gradient gives; default k3)")
        self.objective, self.forward = objective, forward
        self.kl_coef, self.entropy_coef = float(kl_coef), float(entropy_coef)
        self.kl_tokens = KL_ESTIMATORS[kl_estimator]  # per-token KL estimate, (log pi, log pi_ref) -> [rows, T]
        self.max_grad_norm = max_grad_norm
        self.use_reducer(Reducer())  # one process: the totals are this process's

    def use_reducer(self, reducer: Reducer) -> None:
        """Batch-wide totals from `reducer`: the trainer's, lent to the objective's `fix`."""
        self.reducer = reducer

    def train_reads(self) -> tuple[bool, bool]:
        """(entropy, pi_ref) of each training micro-batch's forward pass: the objective's own, and what eq. 3's
        terms read where the trainer adds them: the entropy, and pi_ref only at kl_coef != 0 (seeds 001 and 003
        train without it: the reference forward is skipped and the KL is logged as nan, not measured)."""
        needs = self.objective.needs
        entropy, reference = needs.reads
        if needs.penalised:
            return True, reference or self.kl_coef != 0
        return entropy, reference

    def micro_batch(self, model, reference, inputs: "_BatchInputs", index, reads: tuple[bool, bool]) -> MicroBatch:
        """The forward passes of one micro-batch: log pi_theta per token, with its entropy and log pi_ref as
        `reads` (entropy, reference) asks (pi_ref's from the stored rows where it can), and its rows' inputs."""
        chunk = [inputs.sequences[i] for i in index]
        with_entropy, with_reference = reads
        token_logprobs, entropy, mask = self.forward.token_stats(model, chunk, with_entropy=with_entropy)
        ref = (self.forward.reference_tokens(reference, chunk, [inputs.cached[i] for i in index], like=token_logprobs)
               if with_reference else None)
        lp = row_inputs(MicroBatch(index, chunk, token_logprobs, entropy, ref, mask.float(), state=inputs.state),
                        inputs.rows)
        return inputs.first.laid_out(lp) if inputs.first is not None and inputs.first.proximal else lp

    def mini_batches(self, rows: int) -> list[list[int]]:
        """This rank's rows (0..rows-1) per optimizer step: all of them, or, at `Needs.updates` = M > 1, the
        batch's row i in mini-batch i mod M (`interleaved_mini_batches`) as this shard's local rows.

        A shard holds consecutive batch rows, so with at least M rows it has some in every mini-batch, and every
        rank takes the same M optimizer steps."""
        updates = self.objective.needs.updates
        if updates == 1:
            return [list(range(rows))]
        first, batch_rows = self.reducer.first_row(rows), self.reducer.total(rows)
        count = min(updates, batch_rows)
        if not self.reducer.every(rows >= count):
            raise ValueError(f"loss.updates_per_step={updates}: every data-parallel rank needs at least {count} "
                             "responses (one for each mini-batch), and this batch leaves a rank fewer; lower "
                             "loss.updates_per_step or raise trainer.groups_per_step")
        minis = interleaved_mini_batches(batch_rows, updates)
        return [[i - first for i in mini if first <= i < first + rows] for mini in minis]

    def update(self, policy, reference, optimizer, batch: Batch) -> UpdateResult:
        """One update of `policy` on `batch` with the objective's loss: one optimizer step per mini-batch.

        1. Every row's inputs (`RowInputs`: advantages, log mu...) and the mini-batches (`Needs.updates`).
        2. Where the loss asks for one, a no-grad pass over every micro-batch before the first optimizer step
           (`FirstPass`: pi_prox, and mu per token), and what the loss fixes from it for the batch (`fix`).
        3. Per mini-batch: zero the gradients, backpropagate each micro-batch's loss (normalised by the
           mini-batch's totals, so accumulation gives the one-batch gradient exactly), clip, step; micro-batches
           that add nothing are skipped, and a batch of nothing but those takes no step (`idle`).
        """
        objective, reducer, needs = self.objective, self.reducer, self.objective.needs
        sequences, cached, token_counts = batch_sequences(batch)
        inputs = _BatchInputs(sequences, cached, RowInputs.of(batch, objective.advantages, needs))  # 1.
        plans = [[[mini[k] for k in chunk] for chunk in self.forward.batches([sequences[i] for i in mini])]
                 for mini in self.mini_batches(len(sequences))]
        policy.train()
        # Under autocast: the update's forward and backward passes on bf16 copies of the fp32 weights, made once.
        reads_reference = self.train_reads()[1] or (needs.first_pass is not None and needs.first_pass[1])
        with self.forward.compute_weights(policy, reference if reads_reference else None) as weights:
            fixed = self.first_pass(policy, reference, inputs, [chunk for plan in plans for chunk in plan], batch)  # 2.
            steps = 0 if self.idle(inputs.rows, None) else len(plans)
            tally = Tally(len(sequences), max(steps, 1), needs.keep_token_logprobs)
            for plan in plans[:steps]:  # 3.
                totals = Totals(reducer.total(sum(len(chunk) for chunk in plan)),
                                reducer.total(sum(len(sequences[i][1]) for chunk in plan for i in chunk)))
                weights.zero_grad(optimizer)
                for index in plan:
                    if self.idle(inputs.rows, index):
                        continue
                    lp = self.micro_batch(policy, reference, inputs, index, self.train_reads())
                    out = objective(lp, totals)
                    if needs.penalised:
                        out = penalised(out, lp, totals, self.kl_coef, self.entropy_coef, self.kl_tokens)
                    out.loss.backward()
                    tally.add(lp, out)  # kept on the device: read once, after the update
                weights.step(lambda: self.optimizer_step(policy, optimizer))
        return self.result(tally, inputs.first, fixed, token_counts, steps)

    def first_pass(self, policy, reference, inputs: "_BatchInputs", chunks: list[list[int]], batch: Batch) -> Fixed:
        """The no-grad pass before the first optimizer step, where the loss asks for one (`Needs.first_pass`,
        `Needs.proximal`), into `inputs.first`; and what the loss fixes from it (`fix`): the state every training
        micro-batch gets, and the rows' advantages where it replaces them."""
        needs = self.objective.needs
        if needs.first_pass is None and not needs.proximal:
            return Fixed()
        first = FirstPass.of(batch, needs)
        with torch.no_grad():
            for index in chunks:
                first.observe(self.micro_batch(policy, reference, inputs, index, first.reads), self.kl_tokens)
        fixed = self.objective.fix(first, self.reducer)
        inputs.first, inputs.state = first, fixed.state
        if fixed.advantages is not None:
            inputs.rows = replace(inputs.rows, advantages=fixed.advantages)
        return fixed

    def idle(self, rows: RowInputs, index: list[int] | None) -> bool:
        """Whether rows `index` (None: the whole batch) add nothing to the gradient: the loss's rows of zero
        advantage add nothing (`Needs.skips_zero_advantage`: IPO's rows in no pair) and theirs are all zero, on
        every rank (a collective, so every rank takes the same branch)."""
        if not self.objective.needs.skips_zero_advantage:
            return False
        advantages = rows.advantages if index is None else rows.advantages[index]
        return self.reducer.every(not advantages.any())

    def result(self, tally: Tally, first: "FirstPass | None", fixed: Fixed, token_counts: torch.Tensor,
               steps: int) -> UpdateResult:
        """The update's numbers: its micro-batches' (`Tally`), the first pass's, measured before any step
        (`FirstPass.numbers`), and those the loss fixed for the batch (`Fixed`)."""
        reducer = self.reducer
        result = tally.result(token_counts, steps)
        if first is not None:
            tokens = max(reducer.total(float(token_counts.sum())), 1.0) if any(first.reads) else 1.0
            result = replace(result, **first.numbers(tally, tokens))
        if fixed.loss is not None:
            result = replace(result, loss=fixed.loss, policy_loss=fixed.loss)
        return replace(result, extras={**tally.diagnostic_means(reducer, steps), **fixed.diagnostics})

    def optimizer_step(self, policy, optimizer) -> None:
        """Reduce the accumulated gradients over ranks (where the reducer must), clip them, step."""
        self.reducer.before_step(policy)
        if self.max_grad_norm:
            torch.nn.utils.clip_grad_norm_(policy.parameters(), self.max_grad_norm)
        optimizer.step()


@dataclass
class _BatchInputs:
    """What every micro-batch of one update reads: the rows' (prompt, response) ids, their stored log pi_ref,
    their `RowInputs` and, after the first pass, its record and what the loss fixed from it (`Fixed.state`)."""

    sequences: list
    cached: list
    rows: RowInputs
    first: "FirstPass | None" = None
    state: object = None


@dataclass
class FirstPass:
    """What the trainer's no-grad pass before the first optimizer step keeps of every trained row, for a loss that
    asks for one: log pi_prox per response token (the policy before the step, so the first mini-batch's ratio is
    exactly 1); where the loss weighs tokens by pi_prox/mu (`Needs.proximal`: GRPO's decoupled ratio, M2PO's
    mask), log mu per token (a replayed group's stored one, a stale sampler's fresh one; pi_prox for a fresh row
    of an on-policy sampler, whose behaviour weight is then exactly 1); and where the pass reads them
    (`Needs.first_pass`: IPO), log pi_ref per token, each row's KL sum and the entropy summed over tokens."""

    batch: Batch
    proximal: bool
    reads: tuple[bool, bool]  # (entropy, pi_ref)
    stored: list[torch.Tensor | None]  # None: a fresh row's, mu = pi_prox
    prox: list[torch.Tensor]
    logprobs: torch.Tensor  # log pi_prox(y|x), the sum over response tokens
    reference: list[tuple[float, ...] | None]
    reference_sums: torch.Tensor  # log pi_ref(y|x)
    kl_sums: torch.Tensor
    entropy: float = 0.0

    @classmethod
    def of(cls, batch: Batch, needs) -> "FirstPass":
        """mu per token as stored where the loss asks for it; the rest still to come (`observe`)."""
        rows = len(batch.rows)
        stored = stored_behaviour(batch) if needs.proximal else [None] * rows
        return cls(batch, needs.proximal, needs.first_pass or (False, False), stored, [torch.empty(0)] * rows,
                   torch.zeros(rows), [None] * rows, torch.zeros(rows), torch.zeros(rows))

    def observe(self, lp: MicroBatch, kl_tokens) -> None:
        """One micro-batch of the pass: pi_prox per response token, and pi_ref, KL and entropy where read."""
        token_logprobs, mask = upcast(lp.policy), lp.mask
        on_cpu, kept = token_logprobs.cpu(), mask.bool().cpu()
        for row, i in enumerate(lp.index):
            self.prox[i] = on_cpu[row][kept[row]].clone()
        self.logprobs[lp.index] = (on_cpu * kept).sum(-1)  # from the host copy: one device-to-host copy, not two
        if lp.reference is not None:
            reference = upcast(lp.reference)
            self.reference_sums[lp.index] = (reference * mask).sum(-1).cpu()
            self.kl_sums[lp.index] = (kl_tokens(token_logprobs, reference) * mask).sum(-1).cpu()
            for i, tokens in zip(lp.index, row_values(reference, mask)):
                self.reference[i] = tokens
        if lp.entropy is not None:
            self.entropy += (upcast(lp.entropy) * mask).sum().item()

    def behaviour(self, row: int) -> torch.Tensor:
        stored = self.stored[row]
        return self.prox[row] if stored is None else stored.to(self.prox[row].dtype)

    def numbers(self, tally: Tally, tokens: float) -> dict:
        """The update's per-row numbers as the pass measured them, before any step: log pi (stored as a fresh
        row's log mu); where it read them, log pi_ref per token and the KL and entropy (means over the batch's
        `tokens`); where the loss weighs tokens by pi_prox/mu, the sequence ratio pi_prox/mu as the raw weight,
        the mean of the used token weights (the loss's) and pi_prox per token (a fresh row's stored mu)."""
        numbers = {"logprobs": self.logprobs}
        if self.reads[1]:
            numbers.update(kl_sums=self.kl_sums, reference_tokens=list(self.reference),
                           kl=float(self.kl_sums.sum()) / tokens)
        if self.reads[0]:
            numbers["entropy"] = self.entropy / tokens
        if not self.proximal:
            return numbers
        prox, behaviour = self.prox, [self.behaviour(i) for i in range(len(self.prox))]
        return {**numbers,
                "raw_weights": torch.stack([(p - b).sum().exp() for p, b in zip(prox, behaviour)]),
                "weights": torch.stack([u.mean() if len(u) else torch.tensor(1.0, dtype=p.dtype)
                                        for u, p in zip(tally.token_used, prox)]),
                "behaviour_tokens": [tuple(p.tolist()) for p in prox]}

    def laid_out(self, lp: MicroBatch) -> MicroBatch:
        """`lp` with pi_prox and mu per token at its rows' response positions (zeros elsewhere)."""
        zeros = torch.zeros_like(upcast(lp.policy))
        laid = replace(lp, proximal=place_tokens(lp.chunk, [self.prox[i] for i in lp.index], zeros.clone()),
                       behaviour_tokens=place_tokens(lp.chunk, [self.behaviour(i) for i in lp.index], zeros.clone()))
        laid._sequence = lp._sequence  # the same log-probs and mask: not summed again
        return laid


def stored_behaviour(batch: Batch) -> list[torch.Tensor | None]:
    """Each trained row's stored log mu per token (None for a fresh row, whose mu is pi_prox)."""
    groups, stored = batch.groups, []
    for g, j in batch.rows:
        group = groups[g]
        if group.behaviour_logprobs is None:
            stored.append(None)
        elif group.behaviour_token_logprobs is None:
            raise ValueError(f"a replayed group of step {group.step} has no per-token behaviour log-probs, which "
                             "a loss weighing tokens by pi_prox/mu needs (loss=grpo, loss=m2po); groups stored by "
                             "a loss=rloo run cannot be replayed under it")
        else:
            stored.append(torch.tensor(group.behaviour_token_logprobs[j]))
    return stored


def row_inputs(lp: MicroBatch, rows: RowInputs) -> MicroBatch:
    """`lp` with its rows' inputs on its device: advantages, log mu per row (log pi_theta now, detached, for
    fresh rows of an on-policy sampler, so their weight is exactly 1), the truncated rows and their log mu per
    token where the batch is weighed per token. One copy each (`on_device`): a copy a row was a host sync."""
    mask, index = lp.mask, lp.index
    current = lp.sequence_logprobs()
    behaviour = [rows.behaviour[i] for i in index]
    mu = current
    if any(mu_i is not None for mu_i in behaviour):
        stored, known = on_device(mask.device, torch.tensor([0.0 if mu_i is None else mu_i for mu_i in behaviour]),
                                  torch.tensor([mu_i is not None for mu_i in behaviour]))
        mu = torch.where(known, stored.to(current.dtype), current)
    truncated = [rows.truncated[i] for i in index]
    tokens = (place_tokens(lp.chunk, [rows.behaviour_tokens[i] for i in index], torch.zeros_like(mask))
              if rows.token_level else None)
    laid = replace(lp, advantages=on_device(mask.device, rows.advantages[index])[0], behaviour=mu,
                   truncated=truncated, behaviour_tokens=tokens)
    laid._sequence = current  # the same log-probs and mask: not summed again
    return laid


def penalised(out: Loss, lp: MicroBatch, totals: Totals, kl_coef: float, entropy_coef: float, estimator) -> Loss:
    """The objective's term plus eq. 3's beta_KL KL - beta_H H, each a token mean over the mini-batch's `totals`
    (so micro-batches add up to the mini-batch's value). KL: `estimator` per token (k3 by default) against
    log pi_ref; where the micro-batch read no pi_ref (kl_coef = 0) it is not measured (nan) and not in the loss."""
    entropy = (lp.entropy * lp.mask).sum() / totals.tokens
    if lp.reference is None:
        kl_tokens = torch.full_like(lp.policy.detach(), float("nan"))
        return replace(out, loss=out.loss - entropy_coef * entropy, kl=kl_tokens.sum(), entropy=entropy,
                       kl_tokens=kl_tokens)
    kl_tokens = estimator(lp.policy, lp.reference) * lp.mask
    kl = kl_tokens.sum() / totals.tokens
    return replace(out, loss=out.loss + kl_coef * kl - entropy_coef * entropy, kl=kl, entropy=entropy,
                   kl_tokens=kl_tokens)
