"""Forward passes over (prompt, response) token sequences: per-token log-probs, entropies, log mu and
log pi_ref, micro-batched by rows and padded tokens, or packed end to end (`src.policy.packing`). Every
objective and the rollout collection use these; nothing here knows which variant runs.
"""

from __future__ import annotations

import contextlib

import torch

from src.batch import Group
from src.policy.compute_weights import ComputeWeights
from src.policy.packing import packed_micro_batches, packed_response_token_stats
from src.policy.token_stats import (final_hidden_states, laid_out, on_device, response_head, response_positions,
                                    token_entropy, upcast)

Sequence = tuple[tuple[int, ...], tuple[int, ...]]  # (prompt ids, response ids)


def response_token_stats(model, sequences, pad_id: int, with_entropy: bool, temperature: float = 1.0,
                         fused: bool = False):
    """Per-token log-probs (and entropies) of each response given its prompt, plus the response mask.

    `sequences` are (prompt_ids, response_ids) pairs, right-padded: under causal attention no real token
    attends to a pad (they all come after it), so no attention mask is passed and every row's position ids
    are plain 0..n-1. Values at pad positions are never read. (A mask would cost a host sync in every
    micro-batch: transformers reads it to decide whether it may skip it, masking_utils.py:307.)
    `temperature` != 1 gives the log-probs of the tempered distribution softmax(logits / T) a sampler
    at T drew from. `fused` (`trainer.fused_logprobs`, on for GPUs): the head only on response
    positions and no fp32 vocabulary tensors kept for backward (`fused_response_token_stats`). The
    layout is built on the CPU and sent without blocking, so a micro-batch waits for nothing.
    """
    width = max(len(p) + len(r) for p, r in sequences)
    device = next(model.parameters()).device
    # Built as lists and made tensors at once: a tensor write a row is an op (and a copy) a row.
    input_ids = torch.tensor([[*p, *r] + [pad_id] * (width - len(p) - len(r)) for p, r in sequences], dtype=torch.long)
    # Position t predicts token t+1: response tokens are predicted from len(prompt)-1 on.
    response_mask = torch.tensor([[len(p) - 1 <= t < len(p) + len(r) - 1 for t in range(width - 1)]
                                  for p, r in sequences], dtype=torch.bool)
    if fused:
        return fused_response_token_stats(model, sequences, input_ids, response_mask, with_entropy, temperature)
    input_ids, response_mask = on_device(device, input_ids, response_mask)
    logits = upcast(model(input_ids=input_ids, **cache_setting(model)).logits[:, :-1])
    if temperature != 1.0:
        logits = logits / temperature
    token_logprobs = torch.log_softmax(logits, dim=-1).gather(-1, input_ids[:, 1:, None]).squeeze(-1)
    entropy = token_entropy(logits) if with_entropy else None
    return token_logprobs, entropy, response_mask


def cache_setting(model) -> dict:
    """The scoring forward's `use_cache`: transformers' default (a KV cache) for eager layers, none for compiled
    ones (`trainer.compile`). Handed a cache, a compiled layer recompiles on each layer's first write (its
    `is_initialized` guard) until TorchDynamo's limit of 16 leaves the rest eager (seen on an H200). Without a
    cache, transformers checks the position ids for packed rows with one host sync a forward
    (masking_utils.find_packed_sequence_indices), which the eager update keeps out (benchmarks/update_ops.py)."""
    decoder = getattr(model, "get_decoder", None)  # a module that only wraps a policy (a test's) keeps the default
    layers = getattr(decoder(), "layers", ()) if decoder is not None else ()
    compiled = len(layers) > 0 and getattr(layers[0], "_compiled_call_impl", None) is not None
    return {"use_cache": False} if compiled else {}


def fused_response_token_stats(model, sequences, input_ids, response_mask, with_entropy: bool, temperature: float):
    """`response_token_stats` computing the output head on response positions only, in bf16-sized memory.

    The decoder runs on every position, the vocabulary projection only where a response token
    is predicted (prompt positions are a third of the sequence at the paper's shapes), and
    log-probs and entropies come from `token_logprobs_and_entropy`, which keeps no fp32
    [tokens, V] tensor for the backward pass. Values equal the plain path's to fp32 rounding;
    they are laid out in the same padded [rows, width - 1] form. The CPU tensors go to the device
    with the response positions (into [rows, width]: the hidden states; into [rows, width - 1]:
    the values' layout) and the targets, so no boolean mask is indexed on the device.
    """
    width = input_ids.shape[1]
    targets = torch.tensor([token for _, response in sequences for token in response], dtype=torch.long)
    input_ids, response_mask, predicting, placed, targets = on_device(
        next(model.parameters()).device, input_ids, response_mask, response_positions(sequences, width),
        response_positions(sequences, width - 1), targets)
    hidden = final_hidden_states(model, input_ids=input_ids, **cache_setting(model))
    chosen, entropy = response_head(model)(hidden.flatten(0, 1), predicting, targets, temperature)
    token_logprobs = laid_out(chosen, placed, response_mask.shape)
    return token_logprobs, (laid_out(entropy, placed, response_mask.shape) if with_entropy else None), response_mask


def autocast_context(model, dtype: str | None):
    """torch.autocast on the model's device for `dtype` ("bfloat16"), or a no-op: also where the model's weights are
    in `dtype` already (the update's compute weights, `src.policy.compute_weights`), which need no casts."""
    parameter = next(model.parameters())
    if not dtype or parameter.dtype == getattr(torch, dtype):
        return contextlib.nullcontext()
    return torch.autocast(device_type=parameter.device.type, dtype=getattr(torch, dtype))


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


def place_tokens(chunk, values, out: torch.Tensor) -> torch.Tensor:
    """`out` with each row's per-response-token values at its response positions and zeros elsewhere in the row
    (None: the row as `out` has it).

    Laid out on the CPU and sent in one copy (`on_device`), not one copy a row: each was a host sync."""
    kept = [tokens is not None for tokens in values]
    if not any(kept):
        return out
    width = out.shape[1]
    flat = [0.0] * (len(chunk) * width)
    for row, tokens in enumerate(values):
        if tokens is not None:
            start = row * width + len(chunk[row][0]) - 1  # position t predicts token t + 1
            flat[start : start + len(tokens)] = tokens.tolist() if isinstance(tokens, torch.Tensor) else tokens
    placed = torch.tensor(flat, dtype=out.dtype).view(out.shape)
    if all(kept):
        return on_device(out.device, placed)[0]
    placed, kept = on_device(out.device, placed, torch.tensor(kept))
    return torch.where(kept[:, None], placed, out)


def row_values(values: torch.Tensor, mask: torch.Tensor) -> list[tuple[float, ...]]:
    """Each row's values at its response positions, as plain tuples (on the CPU)."""
    values, mask = upcast(values.detach()).cpu(), mask.bool().cpu()
    return [tuple(values[row][mask[row]].tolist()) for row in range(values.shape[0])]


class Forward:
    """The forward-pass settings of a run (pad id, micro-batch sizes, autocast, fused head, packing) in one object.

    `pack` (`trainer.pack_rows`): each micro-batch's rows are packed end to end (`src.policy.packing`),
    and `micro_batch_tokens` counts real tokens instead of rows x longest row. `autocast`
    (`hardware.autocast`): passes outside an update run under torch.autocast on the fp32 weights; an
    update runs on copies of them in that dtype, made once (`compute_weights`).
    """

    def __init__(self, pad_id: int, micro_batch_size: int, micro_batch_tokens: int | None = None,
                 autocast: str | None = None, fused: bool = False, pack: bool = False) -> None:
        self.pad_id = int(pad_id)
        self.micro_batch_size = int(micro_batch_size)
        self.micro_batch_tokens = micro_batch_tokens
        self.autocast = autocast
        self.fused = bool(fused)
        self.pack = bool(pack)

    def compute_weights(self, policy, reference=None) -> ComputeWeights:
        """The update's weights: `autocast`'s dtype copies of fp32 `policy` and `reference`, held for the update
        (`src.policy.compute_weights`); without autocast the models as they are."""
        return ComputeWeights(getattr(torch, self.autocast) if self.autocast else None, policy, reference)

    def batches(self, sequences) -> list[list[int]]:
        split = packed_micro_batches if self.pack else micro_batches
        return split(sequences, self.micro_batch_size, self.micro_batch_tokens)

    def stats(self, model, chunk, with_entropy: bool, temperature: float = 1.0):
        """(token log-probs, entropies or None, response mask) of a micro-batch, padded or packed (no autocast)."""
        if self.pack:
            return packed_response_token_stats(model, chunk, with_entropy, temperature, self.fused, self.pad_id)
        return response_token_stats(model, chunk, self.pad_id, with_entropy, temperature, self.fused)

    def token_stats(self, model, chunk, with_entropy: bool, temperature: float = 1.0):
        """(token log-probs, entropies or None, response mask) of a micro-batch, under the run's autocast."""
        with autocast_context(model, self.autocast):
            return self.stats(model, chunk, with_entropy, temperature)

    def reference_tokens(self, reference, chunk, cached, like: torch.Tensor) -> torch.Tensor:
        """Per-token log pi_ref laid out like the policy's `like`; a forward pass only for rows not `cached`."""
        out = torch.zeros_like(upcast(like))
        missing = [row for row, tokens in enumerate(cached) if tokens is None]
        if missing:
            with torch.no_grad(), autocast_context(reference, self.autocast):
                computed, _, _ = self.stats(reference, [chunk[row] for row in missing], with_entropy=False)
            # Both layouts start each row at position 0, so a row's positions agree whatever the batch width.
            computed = torch.nn.functional.pad(computed.to(out.dtype), (0, out.shape[1] - computed.shape[1]))
            if len(missing) == len(chunk):
                out = computed
            else:
                out = out.index_copy(0, on_device(out.device, torch.tensor(missing))[0], computed)
        return place_tokens(chunk, cached, out)

    @torch.no_grad()
    def sampled_token_logprobs(self, model, sequences, temperature: float) -> list[tuple[float, ...]]:
        """Per-response-token log mu of `sequences` under `model` at `temperature`: a no-grad forward pass."""
        out: list[tuple[float, ...]] = [()] * len(sequences)
        was_training = model.training
        model.eval()
        try:
            for index in self.batches(sequences):
                token_logprobs, _, mask = self.token_stats(model, [sequences[i] for i in index], False, temperature)
                for i, tokens in zip(index, row_values(token_logprobs, mask)):
                    out[i] = tokens
        finally:
            model.train(was_training)
        return out

    def with_reference_logprobs(self, groups: list[Group], reference) -> list[Group]:
        """Copies of `groups` carrying log pi_ref per response token (the trainer's `reference_tokens` reads them)."""
        sequences = [(group.prompt_ids, ids) for group in groups for ids in group.response_ids]
        tokens = self.sampled_token_logprobs(reference, sequences, 1.0)
        out, start = [], 0
        for group in groups:
            out.append(group.with_behaviour_logprobs(group.behaviour_logprobs, tokens[start : start + group.size],
                                                     group.behaviour_token_logprobs))
            start += group.size
        return out

    def with_sampled_logprobs(self, groups: list[Group], model, temperature: float) -> list[Group]:
        """Copies of `groups` carrying log mu (per response and per token) under `model` at `temperature`."""
        sequences = [(group.prompt_ids, ids) for group in groups for ids in group.response_ids]
        tokens = self.sampled_token_logprobs(model, sequences, temperature)
        out, start = [], 0
        for group in groups:
            group_tokens = tokens[start : start + group.size]
            out.append(group.with_behaviour_logprobs([sum(t) for t in group_tokens], group.reference_logprobs,
                                                     group_tokens))
            start += group.size
        return out
