"""Policy models: the tiny CPU policy and loading any policy by name or path.

The tiny policy is a Llama-architecture decoder (the same pre-norm RoPE/GQA/SwiGLU block as
Qwen2, minus the qkv bias). Not Qwen2 itself: transformers 5 maps the qwen2 model type to
`Qwen2Tokenizer` whatever `tokenizer_config.json` says, which would silently swap the project's
own tokenizer for a byte-level BPE on load; for llama it honours the saved tokenizer class.
"""

from __future__ import annotations

from typing import Iterator

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerBase

from src.policy import DTYPE_NAMES
from src.paths import resolve_policy_path

DTYPES = {name: getattr(torch, name) for name in DTYPE_NAMES}


def build_tiny_model(tokenizer: PreTrainedTokenizerBase, hidden_size: int = 128, layers: int = 4,
                     heads: int = 4, kv_heads: int = 2, max_positions: int = 512, seed: int = 0) -> LlamaForCausalLM:
    """A randomly initialised decoder sized for the Countdown tokenizer (about 1 M parameters)."""
    torch.manual_seed(seed)
    config = LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=hidden_size,
        intermediate_size=3 * hidden_size,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        max_position_embeddings=max_positions,
        tie_word_embeddings=True,
        pad_token_id=tokenizer.pad_token_id,
        eos_token_id=tokenizer.eos_token_id,
        bos_token_id=None,
    )
    return LlamaForCausalLM(config)


def load_policy(name_or_path: str, device: str = "cpu", dtype: str = "float32"):
    """Load (model, tokenizer) through `from_pretrained`, the same path for hub models and local folders."""
    source = resolve_policy_path(name_or_path)
    try:
        tokenizer = AutoTokenizer.from_pretrained(source)
        model = AutoModelForCausalLM.from_pretrained(source, dtype=DTYPES[dtype])
    except OSError as error:
        raise FileNotFoundError(
            f"policy '{name_or_path}' could not be loaded ({error.__class__.__name__}). On this machine the hub "
            "may be unreachable: point policy.name_or_path at a local folder that holds the weights, or run "
            "`make sft-tiny` to rebuild the tiny CPU policy."
        ) from error
    if tokenizer.pad_token is None:  # base Qwen tokenizers ship without a pad token
        tokenizer.pad_token = tokenizer.eos_token
    return model.to(device), tokenizer


def compile_layers(model: torch.nn.Module, **options) -> torch.nn.Module:
    """`trainer.compile`: each decoder layer's forward through `torch.compile`, in place; returns `model`.

    In place (`Module.compile`), so the parameters, state-dict keys, checkpoints and weight syncs are the
    module's own; per layer (as torchtitan compiles), and the fused head (`trainer.fused_logprobs`: the output
    projection, log-probs and entropies) as one more region (`src.policy.token_stats.compile_head`). Compiling
    happens at a layer's first call; a new micro-batch shape recompiles once, with dynamic shapes. `options` go
    to `torch.compile` (tests pick a quick backend). Call it after any `frozen_copy`: a deep copy of a
    compiled layer would call the original's weights.
    """
    from src.policy.token_stats import compile_head

    for layer in model.get_decoder().layers:
        layer.compile(**options)
    compile_head(model, **options)
    return model


def frozen_copy(model: torch.nn.Module) -> torch.nn.Module:
    """A frozen, eval-mode copy of the model: the reference policy pi_ref for the KL term."""
    import copy

    reference = copy.deepcopy(model).eval()
    for parameter in reference.parameters():
        parameter.requires_grad_(False)
    return reference


# Wrapper prefixes that torch.compile and DistributedDataParallel put in front of parameter names.
WRAPPER_PREFIXES = ("_orig_mod.", "module.")


def trainer_names(model: torch.nn.Module) -> Iterator[tuple[str, torch.nn.Parameter]]:
    """The policy's parameters under their checkpoint names (wrapper prefixes dropped); a tied embedding once."""
    for name, parameter in model.named_parameters():
        while name.startswith(WRAPPER_PREFIXES):
            name = name.split(".", 1)[1]
        yield name, parameter


def trainer_weights(model: torch.nn.Module, dtype: torch.dtype | None = None) -> Iterator[tuple[str, torch.Tensor]]:
    """The trainer's parameters under their checkpoint names, which is what vLLM's `load_weights` expects and what
    the asynchronous trainer publishes.

    `named_parameters()` lists a tied embedding once (as the input embedding), and vLLM ties its
    LM head to that same tensor. Buffers are left out: vLLM computes its own (e.g. rotary tables).
    A parameter sharded over data-parallel ranks (FSDP2's DTensor) is gathered whole when its turn
    comes, one at a time, so no rank holds the whole model twice; every rank must then go through it together.
    `dtype` (a vLLM engine's bf16): each shard is cast before it is gathered, so the ranks exchange, and the engine
    copies, half the bytes of the fp32 master weights.
    """
    for name, parameter in trainer_names(model):
        tensor = parameter.detach()
        if dtype is not None:
            tensor = tensor.to(dtype)  # a DTensor casts its local shard
        yield name, tensor.full_tensor() if hasattr(tensor, "full_tensor") else tensor
