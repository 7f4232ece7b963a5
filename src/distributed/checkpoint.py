"""Sharded checkpoints of the policy and its optimizer (torch.distributed.checkpoint, DCP).

Each rank writes its own shards and DCP records how they tile each tensor, so a checkpoint written by
T ranks loads on any other number of ranks, a single process with an unsharded model included: the
reader takes the slices its own parameters cover. Keys are the parameters' names without FSDP's or
activation checkpointing's wrappers, so sharded and plain models read each other's checkpoints.
The rest of a run's state (buffer, sampler, counters, RNGs) is small and the same on every rank: rank 0
keeps it in the run's ordinary checkpoint (`src.runs.checkpoint`).
"""

from __future__ import annotations

from pathlib import Path

import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import (StateDictOptions, get_model_state_dict, get_state_dict,
                                                     set_model_state_dict, set_state_dict)


def save_sharded(folder: Path, policy, optimizer) -> None:
    """Write this rank's shards of the policy and optimizer state to `folder` (every rank calls it)."""
    model_state, optimizer_state = get_state_dict(policy, optimizer)
    dcp.save({"policy": model_state, "optimizer": optimizer_state}, checkpoint_id=str(folder))


def load_sharded(folder: Path, policy, optimizer) -> None:
    """Read `folder` into the policy and optimizer as they are sharded here (every rank calls it).

    The optimizer's state is created first (zero moments) so that DCP has tensors to read into.
    """
    if not (Path(folder) / ".metadata").is_file():
        raise FileNotFoundError(f"{folder} holds no sharded checkpoint (no .metadata): name the folder "
                                "save_sharded wrote")
    model_state, optimizer_state = get_state_dict(policy, optimizer)
    state = {"policy": model_state, "optimizer": optimizer_state}
    dcp.load(state, checkpoint_id=str(folder))
    set_state_dict(policy, optimizer, model_state_dict=state["policy"], optim_state_dict=state["optimizer"])


def load_whole(policy, optimizer, model_state: dict, optimizer_state: dict) -> None:
    """Load one process's checkpoint (whole tensors; `optimizer.state_dict()`, keyed by parameter position) into
    a sharded policy and its optimizer: every rank passes the whole tensors and keeps the slices it holds.

    Both optimizers are built alike (`src.build.build_optimizer`), so position k of the one-process optimizer is
    the k-th parameter of this one's groups, whose names `get_state_dict` lists in that order."""
    if not optimizer_state["state"]:  # an optimizer that has not stepped (see `whole_state`): the weights only
        set_model_state_dict(policy, model_state, options=StateDictOptions(full_state_dict=True))
        return
    _, keyed = get_state_dict(policy, optimizer)
    names = [name for group in keyed["param_groups"] for name in group["params"]]
    positions = [index for group in optimizer_state["param_groups"] for index in group["params"]]
    if len(names) != len(positions):
        raise ValueError(f"the checkpoint's optimizer holds {len(positions)} parameters and this policy has "
                         f"{len(names)}: it was written for another model")
    name_of = dict(zip(positions, names))
    by_name = {"state": {name_of[index]: moments for index, moments in optimizer_state["state"].items()},
               "param_groups": [{**group, "params": [name_of[index] for index in group["params"]]}
                                for group in optimizer_state["param_groups"]]}
    set_state_dict(policy, optimizer, model_state_dict=model_state, optim_state_dict=by_name,
                   options=StateDictOptions(full_state_dict=True))


def whole_state(policy, optimizer=None) -> tuple[dict, dict | None]:
    """The sharded policy's (and `optimizer`'s) state as one process holds it, on rank 0's CPU: whole tensors,
    the optimizer keyed by parameter position as `optimizer.state_dict()` keys it (`load_whole` reads it
    back). Every rank calls it (it gathers); the other ranks get empty dicts."""
    options = StateDictOptions(full_state_dict=True, cpu_offload=True)
    if optimizer is None or not optimizer.state:
        # DCP would give an optimizer that has not stepped a state by taking a step at lr 0 (torch's
        # `_init_optim_state`): its AdamW would then count one step too many. Its positions need no gathering.
        return get_model_state_dict(policy, options=options), None if optimizer is None else optimizer.state_dict()
    model_state, keyed = get_state_dict(policy, optimizer, options=options)
    if not keyed:
        return model_state, {}
    position = {name: k for k, name in enumerate(name for group in keyed["param_groups"] for name in group["params"])}
    return model_state, {"state": {position[name]: moments for name, moments in keyed["state"].items()},
                         "param_groups": [{**group, "params": [position[name] for name in group["params"]]}
                                          for group in keyed["param_groups"]]}


def load_sharded_policy(folder: Path, policy) -> None:
    """Read only the policy's weights from `folder` (an evaluation needs no optimizer state)."""

    if not (Path(folder) / ".metadata").is_file():
        raise FileNotFoundError(f"{folder} holds no sharded checkpoint (no .metadata): name the folder "
                                "save_sharded wrote")
    state = {"policy": get_model_state_dict(policy)}
    dcp.load(state, checkpoint_id=str(folder))
    set_model_state_dict(policy, state["policy"])
