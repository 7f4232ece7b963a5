"""Per-token log-probabilities and entropies of chosen tokens without keeping fp32 vocabulary tensors.

At the paper's scale the vocabulary is 151,936 tokens: one micro-batch of 16k response tokens
has 2.5 G logits. `log_softmax(logits.float())` plus the exact entropy keeps three fp32 copies
of that for the backward pass (about 30 GB). `token_logprobs_and_entropy` keeps only the
logits autocast produced (bf16 on a GPU) and works through them in chunks of rows, forward
and backward, in fp32. The gradient is written out by hand from

    log p_y = z_y - lse(z),        H = lse(z) - sum_v p_v z_v,
    d log p_y / d z = onehot(y) - p,        d H / d z = -p * (log p + H),

so the result equals the autograd of the plain expressions to fp32 rounding (tested in float64
against autograd in tests/unit/test_token_stats.py).
"""

from __future__ import annotations

import warnings
import weakref

import torch
from torch import Tensor

CHUNK_ROWS = 4096  # rows of [rows, V] worked in fp32 at once: 4096 x 151,936 x 4 B = 2.5 GB per temporary


def token_entropy(logits: Tensor) -> Tensor:
    """Exact entropy of softmax(logits) at each position, [..., V] -> [...], differentiable."""
    logp = torch.log_softmax(logits, dim=-1)
    p = logp.exp()
    # Masked (-inf) logits have p = 0; zero their log-prob so 0 * -inf does not give nan.
    return -(p * logp.masked_fill(p == 0, 0.0)).sum(dim=-1)


def upcast(values: Tensor) -> Tensor:
    """`values` in at least fp32: half types are widened, fp32 and fp64 kept (a float64 run stays float64)."""
    return values.float() if values.dtype in (torch.float16, torch.bfloat16) else values


def chunk_forward(logits: Tensor, targets: Tensor, temperature: float) -> tuple[Tensor, Tensor, Tensor]:
    """(log p of the targets, entropy, logsumexp) of one chunk of rows, in fp32 (float64 stays float64)."""
    z = upcast(logits)
    z = z / temperature
    lse = torch.logsumexp(z, dim=-1, keepdim=True)
    logp = z - lse
    p = logp.exp()
    # Masked (-inf) logits have p = 0: their term p log p is 0, not 0 * -inf = nan.
    entropy = -torch.where(p > 0, p * logp, 0.0).sum(-1)
    chosen = logp.gather(-1, targets[:, None]).squeeze(-1)
    return chosen, entropy, lse.squeeze(-1)


def chunk_backward(logits: Tensor, targets: Tensor, temperature: float, lse: Tensor, entropy: Tensor,
                   grad_chosen: Tensor, grad_entropy: Tensor) -> Tensor:
    """d(loss)/d(logits) of one chunk from the saved logsumexp and entropy (module docstring)."""
    z = upcast(logits)
    logp = z / temperature - lse[:, None]
    p = logp.exp()
    grad = -p * (grad_chosen[:, None] + grad_entropy[:, None] * (torch.where(p > 0, logp, 0.0) + entropy[:, None]))
    onehot = torch.zeros_like(grad).scatter_(-1, targets[:, None], 1.0)
    return ((grad + onehot * grad_chosen[:, None]) / temperature).to(logits.dtype)


# On CUDA the chunk functions are compiled: eager PyTorch makes ~10 passes over each fp32
# [chunk, V] temporary (40 % of an update's GPU time at the paper's shapes, measured), the
# compiled kernels read the bf16 logits twice. The CPU keeps the eager functions.
_compiled: dict[str, object] = {}


def _kernels(device: torch.device):
    # Inside `compile_head`'s region the eager functions are traced into it and fused there.
    if device.type != "cuda" or torch.compiler.is_compiling():
        return chunk_forward, chunk_backward
    if not _compiled:
        _compiled["forward"] = torch.compile(chunk_forward, dynamic=True)
        _compiled["backward"] = torch.compile(chunk_backward, dynamic=True)
        try:  # compile now, on a small chunk, so a toolchain problem costs speed and not the run
            probe = torch.randn(3, 5, device=device, dtype=torch.bfloat16)
            targets, zeros = torch.zeros(3, dtype=torch.long, device=device), torch.zeros(3, device=device)
            _compiled["forward"](probe, targets, 1.0)
            _compiled["backward"](probe, targets, 1.0, zeros, zeros, zeros, zeros)
        except Exception as error:  # noqa: BLE001 - any compiler failure falls back to the same math, eagerly
            warnings.warn(f"torch.compile of the log-prob kernels failed ({type(error).__name__}: {error}); "
                          "using the eager functions (same values, slower)", stacklevel=2)
            _compiled.update(forward=chunk_forward, backward=chunk_backward)
    return _compiled["forward"], _compiled["backward"]


class _TokenLogprobEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits: Tensor, targets: Tensor, temperature: float, chunk_rows: int):
        forward, _ = _kernels(logits.device)
        if logits.shape[0] <= chunk_rows:  # one chunk: its results as they come, no copies into buffers
            chosen, entropy, lse = forward(logits, targets, temperature)
        else:
            out_dtype = torch.float64 if logits.dtype == torch.float64 else torch.float32
            chosen = logits.new_empty(logits.shape[0], dtype=out_dtype)
            entropy, lse = torch.empty_like(chosen), torch.empty_like(chosen)
            for start in range(0, logits.shape[0], chunk_rows):
                rows = slice(start, start + chunk_rows)
                chosen[rows], entropy[rows], lse[rows] = forward(logits[rows], targets[rows], temperature)
        ctx.save_for_backward(logits, targets, lse, entropy)
        ctx.temperature, ctx.chunk_rows = temperature, chunk_rows
        return chosen, entropy

    @staticmethod
    def backward(ctx, grad_chosen: Tensor, grad_entropy: Tensor):
        logits, targets, lse, entropy = ctx.saved_tensors
        _, backward = _kernels(logits.device)
        if logits.shape[0] <= ctx.chunk_rows:
            return backward(logits, targets, ctx.temperature, lse, entropy, grad_chosen, grad_entropy), None, None, None
        grad_logits = torch.empty_like(logits)
        for start in range(0, logits.shape[0], ctx.chunk_rows):
            rows = slice(start, start + ctx.chunk_rows)
            grad_logits[rows] = backward(logits[rows], targets[rows], ctx.temperature, lse[rows], entropy[rows],
                                         grad_chosen[rows], grad_entropy[rows])
        return grad_logits, None, None, None


def token_logprobs_and_entropy(logits: Tensor, targets: Tensor, temperature: float = 1.0,
                               chunk_rows: int = CHUNK_ROWS) -> tuple[Tensor, Tensor]:
    """log softmax(logits / T)[target] and the exact entropy of softmax(logits / T), per row of [N, V].

    Differentiable with respect to `logits`; the backward pass recomputes the softmax chunk by
    chunk from the saved logits instead of keeping fp32 copies. Returns fp32 (float64 for
    float64 input).
    """
    if logits.dim() != 2 or targets.shape != logits.shape[:1]:
        raise ValueError(f"logits must be [N, V] and targets [N]; got {tuple(logits.shape)} and "
                         f"{tuple(targets.shape)}")
    return _TokenLogprobEntropy.apply(logits, targets, float(temperature), int(chunk_rows))


def on_device(device: torch.device, *tensors: Tensor) -> tuple[Tensor, ...]:
    """CPU-built tensors on `device`. On CUDA from pinned memory without blocking: a pageable host-to-device copy
    waits for the stream (c10/cuda/CUDAFunctions.h, `memcpy_and_sync`), so each one was a host sync in the
    micro-batch loop."""
    if device.type != "cuda":
        return tuple(tensor.to(device) for tensor in tensors)
    return tuple(tensor.pin_memory().to(device, non_blocking=True) for tensor in tensors)


def response_positions(sequences, width: int) -> Tensor:
    """Flat indices into a [rows, width] row-major layout of the positions that predict a response token
    (position t predicts token t + 1: a response is predicted from len(prompt) - 1 on), row by row."""
    return torch.tensor([row * width + t for row, (prompt, response) in enumerate(sequences)
                         for t in range(len(prompt) - 1, len(prompt) + len(response) - 1)], dtype=torch.long)


def laid_out(values: Tensor, positions: Tensor, shape) -> Tensor:
    """`values` (one per response token) at their flat `positions` of a zero [rows, width] tensor, differentiably
    and without the host sync a boolean mask costs on a GPU (`masked_scatter` / `tensor[mask]` count it)."""
    flat = values.new_zeros(shape[0] * shape[1])
    return flat.index_copy(0, positions, values).view(shape)


def final_hidden_states(model, **inputs) -> torch.Tensor:
    """The decoder's last hidden states (after its final norm), taken by a hook during the model's own forward,
    whose head runs on one position only (`logits_to_keep=1`): a model sharded by FSDP2 gathers its root's
    parameters (embeddings, final norm, head) in that forward, which calling the decoder apart would skip.
    A hook rather than output_hidden_states, which would keep every layer's output alive in no-grad passes.
    Callers pass the forward's cache setting (`src.policy.forward.cache_setting`)."""
    kept = []
    hook = model.get_decoder().register_forward_hook(lambda module, args, output: kept.append(output.last_hidden_state))
    try:
        model(**inputs, logits_to_keep=1)
    finally:
        hook.remove()
    return kept[-1]


def fused_head(head: torch.nn.Module, hidden: Tensor, predicting: Tensor, targets: Tensor,
               temperature: float) -> tuple[Tensor, Tensor]:
    """The fused head: the output projection `head` of the flat hidden states at the `predicting` positions, then
    (log p of the `targets`, entropy) per position (`token_logprobs_and_entropy`)."""
    return token_logprobs_and_entropy(head(hidden.index_select(0, predicting)), targets, temperature)


# Models whose fused head `trainer.compile` compiled (`compile_head`), each with its compiled function.
_compiled_heads: "weakref.WeakKeyDictionary[torch.nn.Module, object]" = weakref.WeakKeyDictionary()


def compile_head(model: torch.nn.Module, **options) -> None:
    """`trainer.compile`: the fused head of `model` (projection, log-probs, entropies) through torch.compile with
    `options`, so one compiled region holds it where eager PyTorch ran each op (and each chunk) apart."""
    _compiled_heads[model] = torch.compile(fused_head, **options)


def response_head(model: torch.nn.Module):
    """`model`'s fused head as a function of (flat hidden states, predicting positions, targets, temperature):
    compiled where `compile_head` compiled it, else eager."""
    compiled = _compiled_heads.get(model)
    head = model.get_output_embeddings()
    if compiled is None:
        return lambda *args: fused_head(head, *args)
    return lambda *args: compiled(head, *args)
