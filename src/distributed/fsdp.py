"""Sharding a policy with FSDP2 (`fully_shard`): each decoder layer is one FSDP unit, the root holds the
embeddings, the final norm and the (tied) output head.

Precision: on a GPU the forward and backward run in bf16 while the sharded parameters (the master
weights) and the optimizer state stay fp32 and gradients are reduced in fp32; on the CPU everything is
fp32, so a multi-rank run can be compared with a single-process one to fp32 rounding.

Gradients are summed over ranks, not averaged: each rank's loss is its share of the batch's loss
(normalised by batch-wide totals, see `src.loss.reducer`), so the sum is the one-process gradient.
"""

from __future__ import annotations

import functools

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard
from torch.utils.checkpoint import checkpoint


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


def compute_dtype(device_type: str) -> torch.dtype | None:
    """The dtype a policy sharded for `device_type` computes in (bf16 on GPUs); None: its own."""
    return mixed_precision(device_type).param_dtype


def is_sharded(model: torch.nn.Module) -> bool:
    return isinstance(model, FSDPModule)


def checkpoint_layers(layers: torch.nn.ModuleList) -> None:
    """Each layer's forward recomputed in the backward pass (non-reentrant `torch.utils.checkpoint`): a layer keeps
    only its inputs for backward instead of all its activations.

    The forward is replaced on each layer instance rather than the layer wrapped (torch's `checkpoint_wrapper`):
    a wrapper puts `_checkpoint_wrapped_module.` inside every parameter name, and the weight sync and checkpoints
    go by the policy's own names. FSDP's hooks stay outside the checkpointed call: the forward's all-gather runs
    once, and the recompute runs after the pre-backward all-gather of the same layer, as under torchtitan's order
    (checkpoint wrapper inside `fully_shard`)."""
    for layer in layers:
        layer.forward = functools.partial(checkpoint, layer.forward, use_reentrant=False)


def shard_policy(model: torch.nn.Module, activation_checkpointing: bool = False, mesh=None,
                 device_type: str | None = None) -> torch.nn.Module:
    """`model` sharded in place over the default process group (or `mesh`); returns it.

    `device_type` ("cuda", "cpu"): where the shards go and the precision they compute in; by default where the
    parameters are. A policy loaded on the host is sharded straight onto a GPU this way: `fully_shard` moves one
    unit's parameters to the mesh's device at a time (torch/distributed/fsdp/_fully_shard/_fsdp_init.py:369,
    `_move_states_to_device`), so the whole policy is never on the GPU.

    `activation_checkpointing` (`hardware.activation_checkpointing`) recomputes each decoder layer's activations in
    the backward pass (`checkpoint_layers`), keeping one layer's activations instead of all of them.
    Build the optimizer after this call: it must hold the sharded parameters.
    """
    layers = decoder_layers(model)
    if activation_checkpointing:
        # A key/value cache would grow again when a layer is recomputed; training never reads it.
        model.config.use_cache = False
        checkpoint_layers(layers)
    if device_type is not None and mesh is None:
        mesh = init_device_mesh(device_type, (dist.get_world_size(),))
    device_type = device_type or (mesh.device_type if mesh is not None else next(model.parameters()).device.type)
    settings = {"mp_policy": mixed_precision(device_type), "mesh": mesh}
    for layer in layers:
        fully_shard(layer, **settings)
    fully_shard(model, **settings)
    for unit in (*layers, model):
        unit.set_gradient_divide_factor(1.0)  # a sum over ranks: each rank's loss is already its share
        unit.set_force_sum_reduction_for_comms(True)  # plain SUM (gloo has no pre-multiplied sum)
    return model
