"""Replay-RLOO training: one optimizer step reads as SPEC 3 (paper section 3, appendix B.3).

    plan -> draw replay groups -> sample and score fresh groups -> leave-one-out advantages
    -> clipped importance weights from the same forward as the loss -> loss (eq. 3), update
    -> add fresh groups to the buffer, drop over-age ones -> log

Fresh-only RLOO is the same loop with rho = 0: no buffer, every weight is exactly 1.

Variants are options of this same loop (SPEC 9), never a second trainer:

* `loss=grpo` swaps only the update (`policy_update` dispatches to `clipped_update`: group-
  normalised advantages, POPO's decoupled clip-higher surrogate, `loss.updates_per_step`
  mini-batch optimizer steps); plan, draw, generate, store and log are unchanged.
* `buffer=fifo` swaps the buffer (`FifoReplayBuffer`): the draw at step 3 returns `FifoDraw`s,
  whose possibly trimmed groups (positive bias) train only on `draw.responses` with advantages
  from all K rewards; `buffer.extra_updates` = R - 1 extra updates follow the main one (seed 002).
"""

from __future__ import annotations

import contextlib
import itertools
import logging
import math
import os
import time
import uuid
from collections import defaultdict
from dataclasses import dataclass, field
from pathlib import Path

import torch
from omegaconf import DictConfig

from src.objective import (
    clip_fraction,
    effective_sample_size,
    batch_rows,
    importance_weights,
    interleaved_mini_batches,
    kl_k3,
    leave_one_out_advantages,
    plan_batch,
    token_entropy,
)
from src.lifecycle import LATEST_CHECKPOINT, PREVIOUS_CHECKPOINT, checkpoint_files
from src.losses import clipped_surrogate, group_normalised_advantages, truncated_importance_weights
from src.replay.buffer import Group, ReplayBuffer
from src.replay.fifo import FifoReplayBuffer, use_statistics
from src.replay.popo import EffectiveGroupMemory, compose_batch, is_effective
from src.policy.token_stats import token_logprobs_and_entropy
from src.rollout.behaviour import BehaviourPolicy
from src.rollout.engine import RolloutEngine, SamplingParams
from src.task import countdown
from src.task.sampler import PromptSampler

log = logging.getLogger(__name__)

AGE_BUCKETS = ("age0", "age1", "age2", "age3plus")


@dataclass
class TrainState:
    """Everything that changes during training; all of it goes into a checkpoint."""

    step: int = 0                         # next step to run
    fresh_evaluations: int = 0            # fresh verifier calls so far (SPEC 5), counted as they happen
    fresh_groups: int = 0
    replay_groups: int = 0
    gradient_steps: int = 0               # optimizer steps so far (grpo: updates_per_step per update; fifo extras)
    groups_trained: int = 0               # groups in all update batches so far
    effective_groups_trained: int = 0     # ... of which had rewards not all equal (a non-zero advantage)
    history: list[dict] = field(default_factory=list)  # per-step headline numbers for the summary


def age_bucket(age: int) -> str:
    return AGE_BUCKETS[min(age, 3)]


def generation_seed(base_seed: int, step: int) -> int:
    """A per-step sampling seed, so a resumed run generates exactly what the uninterrupted one would."""
    return base_seed * 1_000_003 + step


def round_seed(base_seed: int, step: int, round_index: int) -> int:
    """The sampling seed of a step's round (sampling=dynamic generates in rounds; round 0 is the step's seed)."""
    return generation_seed(base_seed, step) + round_index * 2**40


# --------------------------------------------------------------------------- forward pass
def response_token_stats(model, sequences, pad_id: int, with_entropy: bool, temperature: float = 1.0,
                         fused: bool = False):
    """Per-token log-probs (and entropies) of each response given its prompt, plus the response mask.

    `sequences` are (prompt_ids, response_ids) pairs; they are right-padded, so position ids
    from the attention mask are plain 0..n-1 for every row. `temperature` != 1 gives the
    log-probs of the tempered distribution softmax(logits / T) a sampler at T drew from.
    `fused` (`trainer.fused_logprobs`, on for GPUs): the head only on response positions and no
    fp32 vocabulary tensors kept for backward (`fused_response_token_stats`).
    """
    width = max(len(p) + len(r) for p, r in sequences)
    device = next(model.parameters()).device
    input_ids = torch.full((len(sequences), width), pad_id, dtype=torch.long)
    attention = torch.zeros((len(sequences), width), dtype=torch.long)
    response_mask = torch.zeros((len(sequences), width - 1), dtype=torch.bool)
    for row, (prompt, response) in enumerate(sequences):
        length = len(prompt) + len(response)
        input_ids[row, :length] = torch.tensor(list(prompt) + list(response))
        attention[row, :length] = 1
        # Position t predicts token t+1: response tokens are predicted from len(prompt)-1 on.
        response_mask[row, len(prompt) - 1 : length - 1] = True
    input_ids, attention, response_mask = input_ids.to(device), attention.to(device), response_mask.to(device)
    if fused:
        return fused_response_token_stats(model, input_ids, attention, response_mask, with_entropy, temperature)
    logits = model(input_ids=input_ids, attention_mask=attention).logits[:, :-1].float()
    if temperature != 1.0:
        logits = logits / temperature
    token_logprobs = torch.log_softmax(logits, dim=-1).gather(-1, input_ids[:, 1:, None]).squeeze(-1)
    entropy = token_entropy(logits) if with_entropy else None
    return token_logprobs, entropy, response_mask


def fused_response_token_stats(model, input_ids, attention, response_mask, with_entropy: bool, temperature: float):
    """`response_token_stats` computing the output head on response positions only, in bf16-sized memory.

    The decoder runs on every position, the vocabulary projection only where a response token
    is predicted (prompt positions are a third of the sequence at the paper's shapes), and
    log-probs and entropies come from `token_logprobs_and_entropy`, which keeps no fp32
    [tokens, V] tensor for the backward pass. Values equal the plain path's to fp32 rounding;
    they are laid out in the same padded [rows, width - 1] form.
    """
    hidden = model.get_decoder()(input_ids=input_ids, attention_mask=attention).last_hidden_state[:, :-1]
    logits = model.get_output_embeddings()(hidden[response_mask])
    targets = input_ids[:, 1:][response_mask]
    chosen, entropy = token_logprobs_and_entropy(logits, targets, temperature)
    token_logprobs = torch.zeros(response_mask.shape, dtype=chosen.dtype, device=chosen.device)
    token_logprobs = token_logprobs.masked_scatter(response_mask, chosen)
    if not with_entropy:
        return token_logprobs, None, response_mask
    return token_logprobs, torch.zeros_like(token_logprobs).masked_scatter(response_mask, entropy), response_mask


def build_optimizer(policy, trainer_cfg: DictConfig) -> torch.optim.AdamW:
    """AdamW over the policy's parameters (SPEC 4); on CUDA the fused kernel (one launch for all tensors)."""
    on_cuda = next(policy.parameters()).device.type == "cuda"
    return torch.optim.AdamW(policy.parameters(), lr=trainer_cfg.learning_rate, weight_decay=trainer_cfg.weight_decay,
                             betas=tuple(trainer_cfg.betas), fused=on_cuda)


def autocast_context(model, dtype: str | None):
    """torch.autocast on the model's device for `dtype` ("bfloat16"), or a no-op."""
    if not dtype:
        return contextlib.nullcontext()
    device_type = next(model.parameters()).device.type
    return torch.autocast(device_type=device_type, dtype=getattr(torch, dtype))


def micro_batches(sequences, max_rows: int, max_tokens: int | None) -> list[list[int]]:
    """Row indices of length-sorted micro-batches of at most `max_rows` rows and `max_tokens` padded tokens.

    Sorting by length keeps padding small; the loss does not depend on the order. A single
    sequence longer than the token budget still gets a micro-batch of its own.
    """
    order = sorted(range(len(sequences)), key=lambda i: len(sequences[i][0]) + len(sequences[i][1]))
    batches, current, width = [], [], 0
    for i in order:
        length = len(sequences[i][0]) + len(sequences[i][1])
        too_many_tokens = max_tokens is not None and (len(current) + 1) * max(width, length) > max_tokens
        if current and (len(current) == max_rows or too_many_tokens):
            batches.append(current)
            current, width = [], 0
        current.append(i)
        width = max(width, length)
    if current:
        batches.append(current)
    return batches


@torch.no_grad()
def sampled_token_logprobs(model, sequences, pad_id: int, temperature: float, trainer_cfg: DictConfig,
                           autocast: str | None) -> list[tuple[float, ...]]:
    """Per-response-token log mu of `sequences` under `model` at `temperature`: a no-grad forward pass.

    For rollouts whose behaviour is not the policy the update starts from (a stale or tempered
    sampler, seed 002), and for POPO-ineff's dropped groups, which the update never sees.
    """
    out: list[tuple[float, ...]] = [()] * len(sequences)
    was_training = model.training
    model.eval()
    try:
        for index in micro_batches(sequences, trainer_cfg.micro_batch_size, trainer_cfg.micro_batch_tokens):
            chunk = [sequences[i] for i in index]
            with autocast_context(model, autocast):
                token_logprobs, _, mask = response_token_stats(model, chunk, pad_id, with_entropy=False,
                                                               temperature=temperature,
                                                               fused=trainer_cfg.fused_logprobs)
            token_logprobs, mask = token_logprobs.float().cpu(), mask.cpu()
            for row, i in enumerate(index):
                out[i] = tuple(token_logprobs[row][mask[row]].tolist())
    finally:
        model.train(was_training)
    return out


def with_sampled_logprobs(groups: list[Group], model, pad_id: int, temperature: float, trainer_cfg: DictConfig,
                          autocast: str | None) -> list[Group]:
    """Copies of `groups` carrying log mu (per response and per token) under `model` at `temperature`."""
    sequences = [(group.prompt_ids, ids) for group in groups for ids in group.response_ids]
    tokens = sampled_token_logprobs(model, sequences, pad_id, temperature, trainer_cfg, autocast)
    out, start = [], 0
    for group in groups:
        group_tokens = tokens[start : start + group.size]
        out.append(group.with_behaviour_logprobs([sum(t) for t in group_tokens], group.reference_logprobs,
                                                 group_tokens))
        start += group.size
    return out


def reference_token_logprobs(reference, chunk, cached, pad_id: int, like: torch.Tensor,
                             fused: bool = False) -> torch.Tensor:
    """Per-token log pi_ref laid out like the policy's `like` tensor; a forward pass only for rows not cached."""
    out = torch.zeros_like(like, dtype=torch.float32)
    missing = [row for row, tokens in enumerate(cached) if tokens is None]
    if missing:
        with torch.no_grad():
            computed, _, _ = response_token_stats(reference, [chunk[row] for row in missing], pad_id, with_entropy=False,
                                                  fused=fused)
        # Rows are right-padded from position 0, so a row's positions agree whatever the batch width.
        out[missing, : computed.shape[1]] = computed.to(out.dtype)
    return place_tokens(chunk, cached, out)


def place_tokens(chunk, values, out: torch.Tensor) -> torch.Tensor:
    """Write each row's per-response-token values (None: leave the row) at its response positions in `out`."""
    for row, tokens in enumerate(values):
        if tokens is not None:
            start = len(chunk[row][0]) - 1  # position t predicts token t + 1
            out[row, start : start + len(tokens)] = torch.as_tensor(tokens, dtype=out.dtype)
    return out


@dataclass
class UpdateResult:
    """Per-response numbers from the update, in batch order (detached, on the CPU)."""

    logprobs: torch.Tensor      # log pi_theta(y|x) before the update
    raw_weights: torch.Tensor
    weights: torch.Tensor       # clipped, as used in the gradient
    kl_sums: torch.Tensor       # per-response sum of token KL estimates
    token_counts: torch.Tensor
    reference_tokens: list[tuple[float, ...]]  # per-response log pi_ref per token, stored with new groups
    loss: float
    policy_loss: float
    kl: float
    entropy: float
    # loss=grpo: per-response log pi_prox per token (stored as the fresh groups' token log mu); else None.
    behaviour_tokens: list[tuple[float, ...]] | None = None
    extras: dict[str, float] = field(default_factory=dict)  # loss-specific diagnostics (grpo/*)
    optimizer_steps: int = 1


def policy_update(policy, reference, optimizer, groups: list[Group], trainer_cfg: DictConfig,
                  clip_ceiling: float, pad_id: int, autocast: str | None = None,
                  loss_cfg: DictConfig | None = None, responses: list | None = None,
                  off_policy_groups: int = 0, truncation: DictConfig | None = None) -> UpdateResult:
    """Update the policy on a batch of groups with the configured loss; returns per-response numbers in batch order.

    `loss_cfg=None` or `loss.name == "rloo"`: one optimizer step, loss eq. 3 (below).
    `loss.name == "grpo"`: `clipped_update`. `loss.name == "ipo"`: `src.ipo.ipo_update` (whole groups). `responses[g]` (None: all) are the response
    indices of group g to train on; advantages always use the group's K rewards.
    `off_policy_groups`: the first groups were sampled this step by a stale or tempered
    behaviour (seed 002) and carry its log mu; rloo corrects them with the truncated IS of
    `truncation` (the behaviour group), grpo with its own capped behaviour weight.
    """
    if loss_cfg is not None and loss_cfg.name == "ipo":  # seed 004's pairwise baseline, self-contained
        from src.ipo import ipo_update
        return ipo_update(policy, reference, optimizer, groups, trainer_cfg, loss_cfg, pad_id, autocast)
    rows = batch_rows([g.size for g in groups], responses)
    if loss_cfg is not None and loss_cfg.name == "grpo":
        return clipped_update(policy, reference, optimizer, groups, rows, trainer_cfg, loss_cfg, pad_id, autocast)
    return rloo_update(policy, reference, optimizer, groups, rows, trainer_cfg, clip_ceiling, pad_id, autocast,
                       off_policy_groups, truncation)


def rloo_update(policy, reference, optimizer, groups: list[Group], rows: list[tuple[int, int]],
                trainer_cfg: DictConfig, clip_ceiling: float, pad_id: int, autocast: str | None,
                off_policy_groups: int = 0, truncation: DictConfig | None = None) -> UpdateResult:
    """One optimizer step on the whole batch of groups, loss eq. 3, micro-batched with gradient accumulation.

    L = -(1/B) sum_i w_i A_i log pi(y_i|x_i) + beta_KL * KL - beta_H * H, where B is the number of
    responses; KL (k3 estimator) and H (exact per-token entropy) are means over all response tokens.
    Micro-batch losses are scaled by the full-batch B and token count, so the accumulated gradient
    equals the one-batch gradient exactly. `autocast="bfloat16"` runs the forward passes in bf16
    on fp32 weights (fp32 optimizer state: bf16 weights would round lr-1e-5 updates away).

    Weights: fresh rows 1; replayed rows min(c, pi/mu) (eq. 2); rows of the first
    `off_policy_groups` groups (fresh, from a stale or tempered sampler) the truncated
    exp(clip(log pi - log mu, log rho_min, log rho_max)) of seed 002 eq. 3, one per response
    (`truncation.is_level == "sequence"`) or one per token ("token": the policy term becomes
    -(1/B) sum_i A_i sum_t w_it log pi(y_it)).
    """
    # Leave-one-out advantages within each group (eq. 1); groups always stay whole.
    loo = leave_one_out_advantages(torch.tensor([g.rewards for g in groups], dtype=torch.float32))
    advantages = loo[[g for g, _ in rows], [j for _, j in rows]]
    sequences = [(groups[g].prompt_ids, groups[g].response_ids[j]) for g, j in rows]
    # Fresh groups have no behaviour log-probs yet: mu = pi_theta now, so their weight is exactly 1.
    behaviour = [groups[g].behaviour_logprobs[j] if groups[g].behaviour_logprobs is not None else None
                 for g, j in rows]
    batch_size = len(sequences)
    total_tokens = sum(len(response) for _, response in sequences)
    logprobs = torch.zeros(batch_size)
    raw_weights = torch.ones(batch_size)
    weights = torch.ones(batch_size)
    kl_sums = torch.zeros(batch_size)
    token_counts = torch.tensor([float(len(response)) for _, response in sequences])
    totals = defaultdict(float)

    # Reference log-probs stored with a replayed group (pi_ref is frozen) save its reference forward.
    cached_reference = [groups[g].reference_logprobs[j] if groups[g].reference_logprobs is not None else None
                        for g, j in rows]
    reference_tokens: list[tuple[float, ...]] = [()] * batch_size
    truncated_rows = torch.tensor([g < off_policy_groups for g, _ in rows])
    token_level = off_policy_groups > 0 and truncation.is_level == "token"
    behaviour_tokens = [groups[g].behaviour_token_logprobs[j] if token_level and g < off_policy_groups else None
                        for g, j in rows]

    policy.train()
    optimizer.zero_grad(set_to_none=True)
    for index in micro_batches(sequences, trainer_cfg.micro_batch_size, trainer_cfg.micro_batch_tokens):
        index = torch.tensor(index)
        chunk = [sequences[i] for i in index.tolist()]
        with autocast_context(policy, autocast):
            token_logprobs, entropy, mask = response_token_stats(policy, chunk, pad_id, with_entropy=True,
                                                                 fused=trainer_cfg.fused_logprobs)
            reference_logprobs = reference_token_logprobs(reference, chunk, [cached_reference[i] for i in index.tolist()],
                                                          pad_id, like=token_logprobs,
                                                          fused=trainer_cfg.fused_logprobs)
        mask = mask.float()
        sequence_logprobs = (token_logprobs * mask).sum(-1)                      # log pi_theta(y|x)
        current = sequence_logprobs.detach().cpu()
        behaviour_chunk = torch.tensor([behaviour[i] if behaviour[i] is not None else current[n].item()
                                        for n, i in enumerate(index.tolist())])
        clipped, raw = importance_weights(current, behaviour_chunk, clip_ceiling)  # eq. 2, constants
        device = sequence_logprobs.device
        token_weights = clipped.to(device)[:, None].expand_as(mask)  # a sequence weight on each of its tokens
        off_policy = truncated_rows[index]
        if off_policy.any():  # seed 002 eq. 3, also constants
            truncated, truncated_raw = truncated_importance_weights(current, behaviour_chunk, truncation.is_min,
                                                                    truncation.is_max)
            clipped, raw = torch.where(off_policy, truncated, clipped), torch.where(off_policy, truncated_raw, raw)
            token_weights = clipped.to(device)[:, None].expand_as(mask)
            if token_level:
                mu_tokens = place_tokens(chunk, [behaviour_tokens[i] for i in index.tolist()],
                                         torch.zeros_like(mask))
                per_token, _ = truncated_importance_weights(token_logprobs.detach().float(), mu_tokens,
                                                            truncation.is_min, truncation.is_max, level="token",
                                                            mask=mask)
                token_weights = torch.where(off_policy.to(device)[:, None], per_token, token_weights)
                token_mean = (per_token * mask).sum(-1).cpu() / mask.sum(-1).clamp(min=1).cpu()
                clipped = torch.where(off_policy, token_mean, clipped)  # logged: the mean token weight
        kl_tokens = kl_k3(token_logprobs, reference_logprobs) * mask
        policy_term = -(advantages[index].to(device)[:, None] * token_weights * token_logprobs * mask).sum() / batch_size
        kl_term = kl_tokens.sum() / total_tokens
        entropy_term = (entropy * mask).sum() / total_tokens
        loss = policy_term + trainer_cfg.kl_coef * kl_term - trainer_cfg.entropy_coef * entropy_term   # eq. 3
        loss.backward()

        logprobs[index], raw_weights[index], weights[index] = current, raw, clipped
        reference_cpu, mask_cpu = reference_logprobs.detach().cpu(), mask.bool().cpu()
        for row, i in enumerate(index.tolist()):
            reference_tokens[i] = tuple(reference_cpu[row][mask_cpu[row]].tolist())
        kl_sums[index] = kl_tokens.sum(-1).detach().cpu()
        totals["loss"] += loss.item()
        totals["policy_loss"] += policy_term.item()
        totals["kl"] += kl_term.item()
        totals["entropy"] += entropy_term.item()

    if trainer_cfg.max_grad_norm:
        torch.nn.utils.clip_grad_norm_(policy.parameters(), trainer_cfg.max_grad_norm)
    optimizer.step()
    return UpdateResult(logprobs=logprobs, raw_weights=raw_weights, weights=weights, kl_sums=kl_sums,
                        token_counts=token_counts, reference_tokens=reference_tokens, **totals)


def clipped_update(policy, reference, optimizer, groups: list[Group], rows: list[tuple[int, int]],
                   trainer_cfg: DictConfig, loss_cfg: DictConfig, pad_id: int, autocast: str | None) -> UpdateResult:
    """loss=grpo: `loss.updates_per_step` mini-batch optimizer steps on POPO's decoupled clip-higher surrogate.

    1. Group-normalised advantages from each group's K rewards (`group_normalised_advantages`).
    2. pi_prox = the policy at the start of this update: its per-token log-probs (and pi_ref's,
       or the stored ones) come from a no-grad forward over the same micro-batches the updates
       use, before the first optimizer step (so the first mini-batch's ratio is exactly 1).
    3. mu per token: a replayed group's stored `behaviour_token_logprobs`; a fresh group has
       mu = pi_prox (behaviour weight exactly 1).
    4. Rows go to mini-batch i mod M (`interleaved_mini_batches`). Per mini-batch:
       L = surrogate (token-mean over the mini-batch, `clipped_surrogate`) + beta_KL * KL
       - beta_H * H (k3 KL and exact entropy, token means over the mini-batch); micro-batch
       terms are scaled by their share of the mini-batch's tokens, so gradient accumulation is exact.
    """
    rewards = torch.tensor([g.rewards for g in groups], dtype=torch.float32)
    advantages = group_normalised_advantages(rewards)[[g for g, _ in rows], [j for _, j in rows]]
    sequences = [(groups[g].prompt_ids, groups[g].response_ids[j]) for g, j in rows]
    cached_reference = [groups[g].reference_logprobs[j] if groups[g].reference_logprobs is not None else None
                        for g, j in rows]
    n = len(sequences)
    minis = interleaved_mini_batches(n, loss_cfg.updates_per_step)
    plans = [[[mini[k] for k in chunk] for chunk in micro_batches([sequences[i] for i in mini],
                                                                   trainer_cfg.micro_batch_size,
                                                                   trainer_cfg.micro_batch_tokens)]
             for mini in minis]

    # 2. pi_prox and pi_ref per response token, before any optimizer step.
    prox: list[torch.Tensor] = [torch.empty(0)] * n
    reference_tokens: list[tuple[float, ...]] = [()] * n
    policy.train()
    with torch.no_grad():
        for index in (chunk for plan in plans for chunk in plan):
            chunk = [sequences[i] for i in index]
            with autocast_context(policy, autocast):
                token_logprobs, _, mask = response_token_stats(policy, chunk, pad_id, with_entropy=False,
                                                               fused=trainer_cfg.fused_logprobs)
                ref = reference_token_logprobs(reference, chunk, [cached_reference[i] for i in index], pad_id,
                                               like=token_logprobs, fused=trainer_cfg.fused_logprobs)
            token_logprobs, ref, mask = token_logprobs.float().cpu(), ref.cpu(), mask.cpu()
            for row, i in enumerate(index):
                prox[i] = token_logprobs[row][mask[row]].clone()
                reference_tokens[i] = tuple(ref[row][mask[row]].tolist())

    # 3. mu per token: stored for replayed groups, pi_prox for fresh ones.
    behaviour: list[torch.Tensor] = []
    for i, (g, j) in enumerate(rows):
        group = groups[g]
        if group.behaviour_logprobs is None:
            behaviour.append(prox[i])
        elif group.behaviour_token_logprobs is None:
            raise ValueError(f"a replayed group of step {group.step} has no per-token behaviour log-probs; "
                             "loss=grpo needs them (groups stored by a loss=rloo run cannot be replayed under grpo)")
        else:
            behaviour.append(torch.tensor(group.behaviour_token_logprobs[j], dtype=torch.float32))

    token_counts = torch.tensor([float(len(response)) for _, response in sequences])
    kl_sums = torch.zeros(n)
    totals, diagnostics = defaultdict(float), defaultdict(float)
    for plan in plans:  # 4. one optimizer step per mini-batch
        mini_tokens = sum(len(sequences[i][1]) for chunk in plan for i in chunk)
        optimizer.zero_grad(set_to_none=True)
        for index in plan:
            chunk = [sequences[i] for i in index]
            with autocast_context(policy, autocast):
                token_logprobs, entropy, mask = response_token_stats(policy, chunk, pad_id, with_entropy=True,
                                                                     fused=trainer_cfg.fused_logprobs)
            zeros = torch.zeros_like(token_logprobs, dtype=torch.float32)
            prox_chunk = place_tokens(chunk, [prox[i] for i in index], zeros.clone())
            behaviour_chunk = place_tokens(chunk, [behaviour[i] for i in index], zeros.clone())
            ref_chunk = place_tokens(chunk, [reference_tokens[i] for i in index], zeros.clone())
            mask = mask.float()
            device = token_logprobs.device
            surrogate, diag = clipped_surrogate(token_logprobs, prox_chunk, behaviour_chunk,
                                                advantages[index].to(device), mask, eps_low=loss_cfg.eps_low,
                                                eps_high=loss_cfg.eps_high, behaviour_cap=loss_cfg.behaviour_cap)
            share = diag["n_tokens"] / mini_tokens
            kl_tokens = kl_k3(token_logprobs, ref_chunk) * mask
            policy_term = surrogate * share
            kl_term = kl_tokens.sum() / mini_tokens
            entropy_term = (entropy * mask).sum() / mini_tokens
            loss = policy_term + trainer_cfg.kl_coef * kl_term - trainer_cfg.entropy_coef * entropy_term
            loss.backward()

            kl_sums[index] = kl_tokens.sum(-1).detach().cpu()
            for key, value in (("loss", loss), ("policy_loss", policy_term), ("kl", kl_term),
                               ("entropy", entropy_term)):
                totals[key] += value.item() / len(plans)  # mean over the mini-batch updates
            for key in ("clip_frac_low", "clip_frac_high", "ratio_mean", "behaviour_weight_mean", "behaviour_cap_frac"):
                diagnostics[key] += diag[key] * diag["n_tokens"]
            diagnostics["ratio_max"] = max(diagnostics["ratio_max"], diag["ratio_max"])
            diagnostics["n_tokens"] += diag["n_tokens"]
        if trainer_cfg.max_grad_norm:
            torch.nn.utils.clip_grad_norm_(policy.parameters(), trainer_cfg.max_grad_norm)
        optimizer.step()

    # Per-response diagnostics: raw = sequence pi_prox/mu, weights = mean capped token weight used.
    logprobs = torch.stack([p.sum() for p in prox])
    raw_weights = torch.stack([(p - b).sum().exp() for p, b in zip(prox, behaviour)])
    weights = torch.stack([(p - b).exp().clamp(max=loss_cfg.behaviour_cap).mean() if len(p) else torch.tensor(1.0)
                           for p, b in zip(prox, behaviour)])
    tokens = diagnostics.pop("n_tokens")
    extras = {f"grpo/{key}": (value if key == "ratio_max" else value / tokens) for key, value in diagnostics.items()}
    extras["grpo/updates"] = float(len(plans))
    return UpdateResult(logprobs=logprobs, raw_weights=raw_weights, weights=weights, kl_sums=kl_sums,
                        token_counts=token_counts, reference_tokens=reference_tokens,
                        behaviour_tokens=[tuple(p.tolist()) for p in prox], extras=extras,
                        optimizer_steps=len(plans), **totals)


# --------------------------------------------------------------------------- bookkeeping
def step_metrics(groups: list[Group], ages: list[int], update: UpdateResult, clip_ceiling: float,
                 responses: list | None = None) -> dict[str, float]:
    """SPEC 6 per-step diagnostics, overall and split by source (fresh/replay) and by age bucket.

    `responses` as for `policy_update`: the trained responses of each group (None: all).
    """
    rows = batch_rows([g.size for g in groups], responses)
    rewards = torch.tensor([groups[g].rewards[j] for g, j in rows])
    response_ages = torch.tensor([ages[g] for g, _ in rows])
    metrics = {
        "train/loss": update.loss,
        "train/policy_loss": update.policy_loss,
        "train/kl": update.kl,
        "train/entropy": update.entropy,
    }
    selections = {"all": torch.ones_like(response_ages, dtype=torch.bool),
                  "fresh": response_ages == 0, "replay": response_ages > 0}
    selections.update({bucket: response_ages.clamp(max=3) == n for n, bucket in enumerate(AGE_BUCKETS)})
    for name, selected in selections.items():
        if not selected.any():
            continue
        suffix = "" if name == "all" else f"/{name}"
        raw, clipped = update.raw_weights[selected], update.weights[selected]
        metrics.update({
            f"train/reward{suffix}": rewards[selected].mean().item(),
            f"train/correct_fraction{suffix}": (rewards[selected] == 1.0).float().mean().item(),
            f"train/kl_per_token{suffix}": (update.kl_sums[selected].sum() / update.token_counts[selected].sum()).item(),
            f"weights/raw_mean{suffix}": raw.mean().item(),
            f"weights/raw_max{suffix}": raw.max().item(),
            f"weights/clipped_mean{suffix}": clipped.mean().item(),
            f"weights/clipped_max{suffix}": clipped.max().item(),
        })
        if name != "fresh" and name != "age0":
            reused = response_ages[selected] > 0
            if reused.any():  # clip fraction and ESS are about reused responses only
                metrics[f"weights/clip_fraction{suffix}"] = clip_fraction(raw[reused], clip_ceiling)
                metrics[f"weights/ess{suffix}"] = effective_sample_size(clipped[reused])
    metrics.update(update.extras)
    return metrics


# --------------------------------------------------------------------------- the loop
@dataclass
class Components:
    """What the loop works with, built from config by `src.run`."""

    policy: torch.nn.Module
    reference: torch.nn.Module
    tokenizer: object
    engine: RolloutEngine
    optimizer: torch.optim.Optimizer
    buffer: ReplayBuffer | FifoReplayBuffer | EffectiveGroupMemory | None
    sampler: PromptSampler                 # or a CurriculumSampler (curriculum=frontier/failure/goldilocks)
    behaviour: BehaviourPolicy | None = None  # None: fresh rollouts from the current policy


def train_step(cfg: DictConfig, parts: Components, state: TrainState) -> dict[str, float]:
    """Run optimizer step `state.step` (SPEC 3) and return its metrics."""
    trainer, step = cfg.trainer, state.step
    started = time.perf_counter()

    # 1. Plan: B_fresh = round(B / (1 + rho)), B_replay = B - B_fresh.
    planned_fresh, planned_replay = plan_batch(trainer.groups_per_step, cfg.buffer.ratio)

    # 3. Draw reused groups: eligible = age in [1, L], uniform without replacement. (Drawn before
    #    generating so that the fresh and gap-fill groups share one generate call; the draw does not
    #    depend on this step's fresh groups, which only enter the buffer after the update.)
    #    buffer=fifo: any age >= 1, the buffer's sampling mode; a draw may keep only some responses.
    #    buffer=popo draws after scoring instead: its refill depends on this step's online groups.
    fifo = isinstance(parts.buffer, FifoReplayBuffer)
    popo = isinstance(parts.buffer, EffectiveGroupMemory)
    buffer_ages = parts.buffer.age_histogram(step) if parts.buffer and not popo else {}
    draws = parts.buffer.sample(planned_replay, step) if parts.buffer and not popo else []
    replayed = [draw.group for draw in draws] if fifo else draws
    gap_fill = planned_replay - len(replayed)  # too few eligible (e.g. step 0): fill with fresh groups
    drawn = time.perf_counter()

    # 2. Sample fresh prompts, generate K responses each with the behaviour policy (the current one
    #    unless behaviour=stale/diverse, seed 002), score each once; every response is one fresh
    #    verifier evaluation. sampling=dynamic (DAPO) repeats this in rounds of oversampled prompts
    #    and keeps only effective groups until the fresh slots are full. The prompt sampler sees
    #    every outcome (curriculum=frontier remembers the frontier prompts, seed 004).
    sampler_model, lag = parts.behaviour.model_for_step(parts.policy) if parts.behaviour else (parts.policy, 0)
    temperature = parts.behaviour.temperature if parts.behaviour else trainer.rollout.temperature
    off_policy = lag > 0 or temperature != trainer.rollout.temperature
    if sampler_model is not parts.policy:
        parts.engine.sync_weights(sampler_model)  # back to the policy after the update, as every step
    sampling = SamplingParams(temperature=temperature, top_p=trainer.rollout.top_p, top_k=trainer.rollout.top_k,
                              max_new_tokens=cfg.policy.max_new_tokens)
    wanted, dynamic = planned_fresh + gap_fill, cfg.sampling.name == "dynamic"
    fresh, generated, timings = [], [], defaultdict(float)
    for round_index in itertools.count():
        count = math.ceil((wanted - len(fresh)) * cfg.sampling.oversample) if dynamic else wanted
        instances = parts.sampler.sample(count)
        groups = sample_groups(cfg, parts, instances, sampling, round_seed(trainer.seed, step, round_index), step,
                               timings)
        state.fresh_evaluations += sum(group.size for group in groups)  # one verifier call per response
        parts.sampler.observe(instances, [group.rewards for group in groups], step)
        generated += groups
        fresh += [group for group in groups if is_effective(group)][: wanted - len(fresh)] if dynamic else groups
        if not dynamic or len(fresh) == wanted or round_index + 1 == cfg.sampling.max_rounds:
            break
    if off_policy:  # log mu of the stale/tempered sampler, for the truncated IS weight (seed 002 eq. 3)
        fresh = with_sampled_logprobs(fresh, sampler_model, parts.tokenizer.pad_token_id, temperature, trainer,
                                      cfg.hardware.autocast)
    score_done = time.perf_counter()

    # buffer=popo (seed 003): drop the ineffective online groups (all rewards equal: no advantage),
    # refill the batch with the most recent effective groups of earlier steps. POPO-ineff's memory
    # also keeps the dropped groups, so they need log mu from a forward pass the update never makes.
    online, composed, measured = fresh, None, {}
    if popo:
        composed = compose_batch(fresh, parts.buffer, trainer.groups_per_step, cfg.buffer.variant, step=step)
        online, replayed = list(composed.online), list(composed.replayed)
        unmeasured = [group for group in composed.dropped if group.behaviour_logprobs is None]
        if cfg.buffer.variant == "popo-ineff" and unmeasured:
            with_mu = with_sampled_logprobs(unmeasured, parts.policy, parts.tokenizer.pad_token_id,
                                            trainer.rollout.temperature, trainer, cfg.hardware.autocast)
            measured = {id(group): group_with_mu for group, group_with_mu in zip(unmeasured, with_mu)}

    # 4. Update: one optimizer step on fresh + reused groups (advantages eq. 1, weights eq. 2, loss eq. 3).
    #    loss=grpo: updates_per_step mini-batch steps on the clipped surrogate instead (see policy_update).
    batch = online + replayed
    ages = [0] * len(online) + [group.age(step) for group in replayed]
    trained = None  # every response of every group, unless a FIFO draw kept only some
    if fifo and any(len(draw.responses) < draw.group.size for draw in draws):
        trained = [None] * len(online) + [draw.responses for draw in draws]
    update = None  # POPO can meet a step with nothing to learn from (every group ineffective, memory empty)
    if batch:
        update = policy_update(parts.policy, parts.reference, parts.optimizer, batch, trainer,
                               cfg.clip.ceiling, parts.tokenizer.pad_token_id, cfg.hardware.autocast,
                               loss_cfg=cfg.loss, responses=trained,
                               off_policy_groups=len(online) if off_policy else 0, truncation=cfg.behaviour)
        state.gradient_steps += update.optimizer_steps
    # buffer=fifo, extra_updates = R - 1 > 0 (seed 002 Algorithm 1): further updates on B groups
    # drawn from the buffer, before this step's fresh groups are added.
    extra_draws = []
    if fifo and cfg.buffer.extra_updates > 0:
        for extra_batch in parts.buffer.extra_update_batches(cfg.buffer.extra_updates + 1, trainer.groups_per_step, step):
            if not extra_batch:
                continue
            extra = policy_update(parts.policy, parts.reference, parts.optimizer, [d.group for d in extra_batch],
                                  trainer, cfg.clip.ceiling, parts.tokenizer.pad_token_id, cfg.hardware.autocast,
                                  loss_cfg=cfg.loss, responses=[d.responses for d in extra_batch])
            state.gradient_steps += extra.optimizer_steps
            extra_draws += extra_batch
    parts.engine.sync_weights(parts.policy)
    train_done = time.perf_counter()

    # 5. After the update: store fresh groups with mu's log-probs from this step's forward pass
    #    (so they cannot be replayed in the step that sampled them), then drop over-age groups.
    #    loss=grpo also stores mu per token (pi_prox's, from the no-grad forward before its first update).
    #    A stale/tempered sampler's groups keep their own mu. buffer=popo stores the online groups it
    #    trained on (the effective ones); popo-ineff stores every online group.
    if parts.buffer is not None and update is not None:
        starts = itertools.accumulate((group.size for group in online), initial=0)  # online come first, whole
        trained_at = {id(group): start for group, start in zip(online, starts)}
        to_store = fresh if popo and cfg.buffer.variant == "popo-ineff" else online
        parts.buffer.add(stored_group(group, trained_at.get(id(group)), update, measured) for group in to_store)
    if parts.buffer is not None and not (fifo or popo):  # FIFO and POPO memories drop their oldest in add()
        parts.buffer.evict(step)
    stored = time.perf_counter()

    # Bookkeeping (SPEC 6).
    state.fresh_groups += len(fresh)
    state.replay_groups += len(replayed)
    state.groups_trained += len(batch)
    state.effective_groups_trained += sum(is_effective(group) for group in batch)
    ceiling = cfg.loss.behaviour_cap if cfg.loss.name == "grpo" else cfg.clip.ceiling
    if update is not None:
        metrics = step_metrics(batch, ages, update, ceiling, trained)
    else:  # nothing trained this step: the sampled rewards still show where the policy is
        rewards = torch.tensor([r for group in generated for r in group.rewards])
        metrics = {"train/reward": rewards.mean().item(), "train/correct_fraction": (rewards == 1.0).float().mean().item()}
    if popo:  # seed 003's effective-sample ratio and on-policy share
        metrics.update(composed.metrics())
    if dynamic:  # DAPO: what the rounds generated against what the batch kept
        metrics.update({"dynamic/rounds": round_index + 1, "dynamic/generated_groups": len(generated),
                        "dynamic/kept_groups": len(fresh), "dynamic/shortfall": wanted - len(fresh)})
    if parts.behaviour is not None:  # seed 002: how far the sampler was from the policy it trains
        metrics.update(behaviour_metrics(lag, temperature, update, sum(group.size for group in online),
                                         cfg.behaviour) if off_policy else {"behaviour/lag": 0.0})
    metrics.update(parts.sampler.metrics())
    if fifo:  # seed 001's off-policiness, replay count and steps-since-last-use statistics
        metrics.update(use_statistics(draws + extra_draws).metrics())
        metrics.update(parts.buffer.replay_counts().metrics())
        metrics["fifo/extra_draws"] = len(extra_draws)
        metrics["fifo/stored_rollouts"] = parts.buffer.rollouts
    metrics.update({
        "budget/fresh_evaluations": state.fresh_evaluations,
        "budget/gradient_steps": state.gradient_steps,
        "batch/fresh_groups": len(fresh),
        "batch/replay_groups": len(replayed),
        "batch/gap_fill_groups": gap_fill,
        "batch/replay_ratio": len(replayed) / len(fresh) if fresh else math.nan,
        "batch/replay_ratio_cumulative": state.replay_groups / state.fresh_groups if state.fresh_groups else math.nan,
        "batch/effective_fraction": sum(is_effective(group) for group in batch) / len(batch) if batch else math.nan,
        "batch/effective_fraction_fresh": sum(is_effective(group) for group in generated) / len(generated),
        "batch/effective_fraction_cumulative": (state.effective_groups_trained / state.groups_trained
                                                if state.groups_trained else math.nan),
        "buffer/size": sum(buffer_ages.values()),
        **{f"buffer/age{age}": count for age, count in buffer_ages.items()},
        "time/replay_draw": drawn - started,
        "time/generate": timings["generate"],
        "time/score": timings["score"],
        **({"time/behaviour_logprobs": score_done - drawn - timings["generate"] - timings["score"]} if off_policy else {}),
        "time/train": train_done - score_done,
        "time/buffer_update": stored - train_done,
    })
    done = time.perf_counter()
    metrics["time/bookkeeping"] = done - stored
    metrics["time/step"] = done - started
    state.step += 1
    return metrics


def sample_groups(cfg: DictConfig, parts: Components, instances, sampling: SamplingParams, seed: int, step: int,
                  timings: dict[str, float]) -> list[Group]:
    """Generate K responses for each instance's prompt and score each once; adds to timings' generate/score."""
    started = time.perf_counter()
    prompts = [countdown.format_prompt(instance, cfg.task.prompt_template) for instance in instances]
    prompts = [apply_chat_template(parts.tokenizer, p) if cfg.policy.use_chat_template else p for p in prompts]
    generated = parts.engine.generate(prompts, cfg.trainer.group_size, sampling, seed=seed)
    generate_done = time.perf_counter()
    groups = []
    for instance, prompt, prompt_ids, completions in zip(instances, prompts, generated.prompt_ids, generated.completions):
        rewards = [countdown.score(c.text, instance.numbers, instance.target) for c in completions]
        groups.append(Group(prompt=prompt, prompt_ids=prompt_ids, numbers=instance.numbers, target=instance.target,
                            responses=[c.text for c in completions], response_ids=[c.token_ids for c in completions],
                            rewards=rewards, step=step))
    timings["generate"] += generate_done - started
    timings["score"] += time.perf_counter() - generate_done
    return groups


def stored_group(group: Group, start: int | None, update: UpdateResult, measured: dict[int, Group]) -> Group:
    """`group` as the buffer keeps it: with log mu, and log pi_ref per token when the update computed it.

    `start`: the group's first row in the update (None: not trained, POPO-ineff's dropped groups,
    whose mu is in `measured`). A group sampled by a stale/tempered behaviour keeps that mu.
    """
    if start is None:
        return measured.get(id(group), group)
    rows = slice(start, start + group.size)
    reference = update.reference_tokens[rows]
    if group.behaviour_logprobs is not None:
        return group.with_behaviour_logprobs(group.behaviour_logprobs, reference, group.behaviour_token_logprobs)
    tokens = update.behaviour_tokens[rows] if update.behaviour_tokens else None
    return group.with_behaviour_logprobs(update.logprobs[rows].tolist(), reference, tokens)


def behaviour_metrics(lag: int, temperature: float, update: UpdateResult | None, fresh_rows: int,
                      truncation: DictConfig) -> dict[str, float]:
    """Seed 002's view of an off-policy sampler: lag, temperature and how often truncation binds."""
    metrics = {"behaviour/lag": float(lag), "behaviour/temperature": temperature}
    if update is not None and fresh_rows:
        raw = update.raw_weights[:fresh_rows]  # online rows come first
        metrics["behaviour/truncated_fraction"] = ((raw > truncation.is_max) | (raw < truncation.is_min)).float().mean().item()
        metrics["behaviour/log_ratio_mean"] = raw.log().mean().item()
    return metrics


def apply_chat_template(tokenizer, prompt: str) -> str:
    """Wrap a prompt as one user turn; the text after '<think>' stays the model's to write."""
    question, _, assistant_start = prompt.partition("\nAssistant:")
    messages = [{"role": "user", "content": question}]
    prefix = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    return prefix + assistant_start.lstrip()


# --------------------------------------------------------------------------- checkpoints
class CheckpointError(RuntimeError):
    """No checkpoint of a run folder loads, or the one found belongs to another run or cell."""


def save_checkpoint(path: Path, parts: Components, state: TrainState, run_id: str, cell_id: str) -> None:
    """Model, optimizer, buffer, sampler and RNG states, step, MLflow run id and cell id; the previous generation
    stays as `checkpoint.prev.pt` next to `path` until this one is complete."""
    payload = {
        "policy": parts.policy.state_dict(),
        "optimizer": parts.optimizer.state_dict(),
        "buffer": parts.buffer.state_dict() if parts.buffer else None,
        "sampler": parts.sampler.state_dict(),
        "behaviour": parts.behaviour.state_dict() if parts.behaviour else None,
        "torch_rng": torch.get_rng_state(),
        "state": state.__dict__,
        "run_id": run_id,
        "cell_id": cell_id,
    }
    path.parent.mkdir(parents=True, exist_ok=True)
    # Unique per writer: two processes writing into one folder by mistake never mix their bytes.
    temporary = path.with_name(f"{path.name}.{os.getpid()}.{uuid.uuid4().hex[:8]}.tmp")
    torch.save(payload, temporary)
    with open(temporary, "rb") as handle:
        os.fsync(handle.fileno())  # on disk before it replaces anything
    if path.exists():
        os.replace(path, path.with_name(PREVIOUS_CHECKPOINT))
    os.replace(temporary, path)


def read_checkpoint(path: Path, map_location=None) -> dict:
    """The checkpoint's payload, unpickled with `weights_only=True`: tensors and plain types only, so a crafted
    file (a path read from a shared tracking store) cannot run code. Raises CheckpointError naming the file."""
    try:
        payload = torch.load(path, weights_only=True, map_location=map_location)
    except Exception as error:  # noqa: BLE001  (truncated zip, foreign pickle, missing file: all say the same)
        first_line = (str(error).splitlines() or ["empty file"])[0][:160]
        raise CheckpointError(f"{path} does not load ({error.__class__.__name__}: {first_line})") from None
    if not isinstance(payload, dict) or not {"policy", "state", "run_id"} <= payload.keys():
        raise CheckpointError(f"{path}: not a training checkpoint (no policy, state and run id)")
    return payload


def read_latest_checkpoint(folder: Path, map_location=None) -> tuple[dict, Path]:
    """The newest checkpoint of a run folder that loads; a damaged latest falls back to the previous generation
    with a warning naming both. Raises CheckpointError naming every file tried and the fix."""
    failures = []
    for path in checkpoint_files(folder):
        try:
            payload = read_checkpoint(path, map_location)
        except CheckpointError as error:
            failures.append((path, error))
            continue
        if failures:
            log.warning("%s; falling back to the previous checkpoint generation %s", failures[0][1], path)
        return payload, path
    tried = ("; ".join(str(error) for _, error in failures)
             or f"no {LATEST_CHECKPOINT} or {PREVIOUS_CHECKPOINT} in {folder}")
    raise CheckpointError(f"no checkpoint in {folder} loads ({tried}). Start the cell afresh with "
                          "trainer.auto_resume=false, or move that folder's checkpoint files away")


def restore_checkpoint(payload: dict, parts: Components) -> TrainState:
    """Restore everything `save_checkpoint` wrote into the components; returns the training state."""
    parts.policy.load_state_dict(payload["policy"])
    parts.optimizer.load_state_dict(payload["optimizer"])
    if parts.buffer is not None:
        parts.buffer.load_state_dict(payload["buffer"])
    parts.sampler.load_state_dict(payload["sampler"])
    if parts.behaviour is not None:
        parts.behaviour.load_state_dict(payload["behaviour"])
    torch.set_rng_state(payload["torch_rng"])
    return TrainState(**payload["state"])
