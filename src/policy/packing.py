"""Packed micro-batches (`trainer.pack_rows`): rows laid end to end, each attending only within itself.

A padded micro-batch costs rows x its longest row, and every padded position goes through the decoder.
Packed, a micro-batch holds rows up to a budget of real tokens, laid end to end into lanes as long as
its longest row (`lanes`): a lane holds one long row or several short ones, and only a lane's tail is
padding. Position ids restart at 0 on each row and no attention mask is passed; from restarting
position ids transformers builds block-diagonal causal attention itself (its packed-sequence format:
SDPA with a document mask, flex_attention's block mask or flash-attention's varlen kernel, whichever
the model was loaded with), so no row sees another. Lanes no longer than the longest row keep SDPA's
dense-mask attention at the padded path's cost per token; one sequence of the whole budget would
make it quadratic in the budget. The values are the padded path's to float rounding
(tests/unit/test_packing.py), laid out the same way: [rows, longest row - 1], row-major, zeros off the
response.
"""

from __future__ import annotations

import itertools

import torch

from src.policy.token_stats import (final_hidden_states, laid_out, on_device, response_head, response_positions,
                                    token_entropy, upcast)


def packed_micro_batches(sequences, max_rows: int, max_tokens: int | None) -> list[list[int]]:
    """Row indices of micro-batches of at most `max_rows` rows and `max_tokens` real tokens (None: rows only).

    First fit by decreasing length, so few micro-batches are left part-empty. A row longer than the
    budget gets a micro-batch of its own. The loss does not depend on the grouping.
    """
    lengths = [len(prompt) + len(response) for prompt, response in sequences]
    return first_fit_decreasing(lengths, lambda load, rows, length: rows < max_rows and (
        max_tokens is None or load + length <= max_tokens))


def lanes(lengths: list[int]) -> list[list[int]]:
    """Rows (indices into `lengths`) laid into lanes as long as the longest row, first fit by decreasing length."""
    width = max(lengths)
    return first_fit_decreasing(lengths, lambda load, rows, length: load + length <= width)


def first_fit_decreasing(lengths: list[int], fits) -> list[list[int]]:
    """Indices into `lengths`, longest first (equal lengths in their order), each into the first bin for which
    `fits(load, rows, length)` holds, else into a new bin; a bin's load is the sum of its rows' lengths."""
    bins: list[list[int]] = []
    loads: list[int] = []
    for i in sorted(range(len(lengths)), key=lambda i: -lengths[i]):
        b = next((n for n, load in enumerate(loads) if fits(load, len(bins[n]), lengths[i])), None)
        if b is None:
            bins.append([])
            loads.append(0)
            b = len(bins) - 1
        bins[b].append(i)
        loads[b] += lengths[i]
    return bins


def packed_layout(sequences, pad_id: int = 0) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(token ids [lanes, W], position ids [lanes, W], the flat positions that predict a response token, mask).

    W is the longest row; shorter rows share a lane (`lanes`), and a lane's unused tail is pad tokens with
    positions of their own from 0 (a document no row attends to). The predicting positions index the
    flattened [lanes * W] ids and run row by row, in the order of the mask's true entries ([rows, W - 1],
    row-major), so values taken at them fill the mask in its order (`laid_out`). A row's last position would
    predict the next row's first token; it predicts no response token, so it is never read.
    """
    lengths = [len(prompt) + len(response) for prompt, response in sequences]
    width = max(lengths)
    ids, positions, start = [], [], [0] * len(sequences)
    for lane, rows in enumerate(lanes(lengths)):
        tokens = [token for i in rows for token in (*sequences[i][0], *sequences[i][1])]
        used = len(tokens)
        ids.append(tokens + [pad_id] * (width - used))
        positions.append([p for i in rows for p in range(lengths[i])] + list(range(width - used)))
        for i, offset in zip(rows, [0] + list(itertools.accumulate(lengths[i] for i in rows))):
            start[i] = lane * width + offset
    # Position t predicts token t + 1: response tokens are predicted from len(prompt) - 1 on.
    mask = torch.tensor([[len(prompt) - 1 <= t < len(prompt) + len(response) - 1 for t in range(width - 1)]
                         for prompt, response in sequences], dtype=torch.bool)
    predicting = [p for row, (prompt, _) in enumerate(sequences)
                  for p in range(start[row] + len(prompt) - 1, start[row] + lengths[row] - 1)]
    return torch.tensor(ids), torch.tensor(positions), torch.tensor(predicting, dtype=torch.long), mask


def packed_response_token_stats(model, sequences, with_entropy: bool, temperature: float = 1.0,
                                fused: bool = False, pad_id: int = 0):
    """`response_token_stats` of a packed micro-batch: (token log-probs, entropies or None, response mask).

    `fused` computes the output head on the predicting positions only, as `fused_response_token_stats`
    (no fp32 vocabulary tensor kept for backward); the plain path takes the model's own logits. The layout,
    the targets and where each value goes are built on the CPU and sent together (`on_device`).
    """
    ids, positions, predicting, mask = packed_layout(sequences, pad_id)
    targets = torch.tensor([token for _, response in sequences for token in response], dtype=torch.long)
    ids, positions, predicting, mask, placed, targets = on_device(
        next(model.parameters()).device, ids, positions, predicting, mask,
        response_positions(sequences, mask.shape[1]), targets)
    inputs = {"input_ids": ids, "position_ids": positions, "use_cache": False}
    if fused:
        hidden = final_hidden_states(model, **inputs).flatten(0, 1)
        chosen, entropy = response_head(model)(hidden, predicting, targets, temperature)
        entropy = entropy if with_entropy else None
    else:
        logits = upcast(model(**inputs).logits.flatten(0, 1)[predicting])
        if temperature != 1.0:
            logits = logits / temperature
        chosen = torch.log_softmax(logits, dim=-1).gather(-1, targets[:, None]).squeeze(-1)
        entropy = token_entropy(logits) if with_entropy else None
    return (laid_out(chosen, placed, mask.shape), (laid_out(entropy, placed, mask.shape) if entropy is not None
                                                   else None), mask)
