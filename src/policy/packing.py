"""Packed micro-batches (`trainer.pack_rows`): rows laid end to end in one sequence, each attending only within itself.

A padded micro-batch costs rows x its longest row. At mixed response lengths (responses from a quarter
to all of the maximum) a third or more of that is padding, and every padded position goes through the
decoder. Packed, a micro-batch costs its real tokens: its rows sit end to end in one sequence of batch
size 1, position ids restart at 0 on each row, and no attention mask is passed. From restarting
position ids transformers builds block-diagonal causal attention itself (its packed-sequence format:
SDPA with a document mask, flex_attention's block mask or flash-attention's varlen kernel, whichever
the model was loaded with), so no row sees another. The values are the padded path's to float
rounding (tests/test_packing.py), laid out the same way: [rows, longest row - 1], row-major, zeros
off the response.
"""

from __future__ import annotations

import torch

from src.policy.token_stats import token_entropy, token_logprobs_and_entropy, upcast


def packed_micro_batches(sequences, max_rows: int, max_tokens: int | None) -> list[list[int]]:
    """Row indices of micro-batches of at most `max_rows` rows and `max_tokens` real tokens (None: rows only).

    First fit by decreasing length, so few micro-batches are left part-empty. A row longer than the
    budget gets a micro-batch of its own. The loss does not depend on the grouping.
    """
    lengths = [len(prompt) + len(response) for prompt, response in sequences]
    order = sorted(range(len(sequences)), key=lambda i: -lengths[i])  # stable: equal lengths keep their order
    batches: list[list[int]] = []
    loads: list[int] = []
    for i in order:
        fits = (b for b, batch in enumerate(batches)
                if len(batch) < max_rows and (max_tokens is None or loads[b] + lengths[i] <= max_tokens))
        b = next(fits, None)
        if b is None:
            batches.append([])
            loads.append(0)
            b = len(batches) - 1
        batches[b].append(i)
        loads[b] += lengths[i]
    return batches


def packed_layout(sequences) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(token ids [T], position ids [T], the packed positions that predict a response token, response mask).

    The predicting positions run row by row, in the order of the mask's true entries ([rows, width - 1],
    row-major), so values taken at them fill the mask with `masked_scatter`. A row's last position would
    predict the next row's first token; it predicts no response token, so it is never read.
    """
    lengths = [len(prompt) + len(response) for prompt, response in sequences]
    ids = torch.tensor([token for prompt, response in sequences for token in (*prompt, *response)], dtype=torch.long)
    positions = torch.cat([torch.arange(length) for length in lengths])
    mask = torch.zeros((len(sequences), max(lengths) - 1), dtype=torch.bool)
    predicting, start = [], 0
    for row, (prompt, response) in enumerate(sequences):
        # Position t predicts token t + 1: response tokens are predicted from len(prompt) - 1 on.
        mask[row, len(prompt) - 1 : len(prompt) + len(response) - 1] = True
        predicting.append(torch.arange(start + len(prompt) - 1, start + len(prompt) + len(response) - 1))
        start += lengths[row]
    return ids, positions, torch.cat(predicting), mask


def packed_response_token_stats(model, sequences, with_entropy: bool, temperature: float = 1.0,
                                fused: bool = False):
    """`response_token_stats` of a packed micro-batch: (token log-probs, entropies or None, response mask).

    The output head runs on the predicting positions only, on both paths: `fused` as
    `fused_response_token_stats` (no fp32 vocabulary tensor kept for backward), the plain path through
    the model's own head (`logits_to_keep`) and a full-vocabulary log-softmax.
    """
    device = next(model.parameters()).device
    ids, positions, predicting, mask = (tensor.to(device) for tensor in packed_layout(sequences))
    targets = ids[predicting + 1]
    inputs = {"input_ids": ids[None], "position_ids": positions[None], "use_cache": False}
    if fused:
        hidden = model.get_decoder()(**inputs).last_hidden_state[0, predicting]
        chosen, entropy = token_logprobs_and_entropy(model.get_output_embeddings()(hidden), targets, temperature)
        entropy = entropy if with_entropy else None
    else:
        logits = upcast(model(**inputs, logits_to_keep=predicting).logits[0])
        if temperature != 1.0:
            logits = logits / temperature
        chosen = torch.log_softmax(logits, dim=-1).gather(-1, targets[:, None]).squeeze(-1)
        entropy = token_entropy(logits) if with_entropy else None

    def laid_out(values: torch.Tensor) -> torch.Tensor:
        return torch.zeros(mask.shape, dtype=values.dtype, device=device).masked_scatter(mask, values)

    return laid_out(chosen), (laid_out(entropy) if entropy is not None else None), mask
