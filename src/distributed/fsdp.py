"""Sharding a policy with FSDP2 (`fully_shard`): each decoder layer is one FSDP unit, the root holds the
embeddings, the final norm and the (tied) output head.

Precision: on a GPU the forward and backward run in bf16 while the sharded parameters (the master
weights) and the optimizer state stay fp32 and gradients are reduced in fp32; on the CPU everything is
fp32, so a multi-rank run can be compared with a single-process one to fp32 rounding.

Gradients are summed over ranks, not averaged: each rank's loss is its share of the batch's loss
(normalised by batch-wide totals, see `src.loss.reducer`), so the sum is the one-process gradient.
"""

from __future__ import annotations

import torch
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard


def decoder_layers(model: torch.nn.Module) -> torch.nn.ModuleList:
    """The model's stack of decoder layers (Llama, Qwen2, Qwen3: `model.model.layers`)."""
    layers = getattr(getattr(model, "model", None), "layers", None)
    if not isinstance(layers, torch.nn.ModuleList):
        raise ValueError(f"{type(model).__name__} has no model.layers stack of decoder layers to shard; "
                         "FSDP data parallelism supports decoder-only Hugging Face models (Llama, Qwen2, Qwen3)")
    return layers


def mixed_precision(device_type: str) -> MixedPrecisionPolicy:
    """bf16 compute over fp32 master weights with fp32 gradient reduction on GPUs; plain fp32 elsewhere."""
    if device_type == "cuda":
        return MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    return MixedPrecisionPolicy()


def shard_policy(model: torch.nn.Module, activation_checkpointing: bool = False, mesh=None) -> torch.nn.Module:
    """`model` sharded in place over the default process group (or `mesh`); returns it.

    `activation_checkpointing` recomputes each decoder layer's activations in the backward pass
    (non-reentrant `torch.utils.checkpoint`), keeping one layer's activations instead of all of them.
    Build the optimizer after this call: it must hold the sharded parameters.
    """
    layers = decoder_layers(model)
    if activation_checkpointing:
        # A key/value cache would grow again when a layer is recomputed; training never reads it.
        model.config.use_cache = False
        for index, layer in enumerate(layers):
            layers[index] = checkpoint_wrapper(layer)
    device_type = next(model.parameters()).device.type
    settings = {"mp_policy": mixed_precision(device_type), "mesh": mesh}
    for layer in layers:
        fully_shard(layer, **settings)
    fully_shard(model, **settings)
    for unit in (*layers, model):
        unit.set_gradient_divide_factor(1.0)  # a sum over ranks: each rank's loss is already its share
        unit.set_force_sum_reduction_for_comms(True)  # plain SUM (gloo has no pre-multiplied sum)
    return model
