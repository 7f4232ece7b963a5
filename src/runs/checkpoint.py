"""Training checkpoints: everything `restore_checkpoint` needs to continue a run exactly, written atomically
and read back with `weights_only=True` (tensors and plain data: a checkpoint named in a shared store
cannot run code).

A write goes to a temporary file named after its writer, is fsynced, and only then renamed into place, so a
kill or a full disk at any moment leaves the previous checkpoint the one that loads; a full disk deletes the
partial file at once and raises DiskFull, and a killed writer's leftover is removed by the next start of the
run folder (`src.runs.lifecycle.remove_stale_temporaries`)."""

from __future__ import annotations

import logging
import os
import pickle
from pathlib import Path

import torch

from src.runs.diskspace import writing
from src.runs.lifecycle import LATEST_CHECKPOINT, CheckpointError, PREVIOUS_CHECKPOINT, checkpoint_files, temporary_path
from src.components import Components
from src.batch import TrainState

log = logging.getLogger(__name__)


# What a checkpoint's layout is: 2 keeps a group's ground truth as the task's one opaque value and a runtime's
# state under "runtime". A file of another format is refused in one line rather than half restored.
CHECKPOINT_FORMAT = 2


def save_checkpoint(path: Path, parts: Components, state: TrainState, run_id: str, cell_id: str,
                    shards: Path | None = None, runtime: dict | None = None) -> None:
    """Model, optimizer, buffer, sampler and RNG states, step, MLflow run id and cell id; the previous generation
    stays as `checkpoint.prev.pt` next to `path` until this one is complete.

    `shards`: the DCP folder the ranks of a data-parallel run wrote the policy and optimizer to
    (`src.runs.ranks.Ranks.save`); the file then names it, relative to its own folder, instead of holding them.
    `runtime`: the runtime's own state (`src.runtime.runners`: the async pipeline's; None for the sync step).
    """
    payload = {
        "format": CHECKPOINT_FORMAT,
        "policy": None if shards else parts.policy.state_dict(),
        "optimizer": None if shards else parts.optimizer.state_dict(),
        "shards": str(shards.relative_to(path.parent)) if shards else None,
        "buffer": parts.buffer.state_dict(),
        "sampler": parts.curriculum.state_dict(),
        "behaviour": parts.behaviour.state_dict(),
        "runtime": runtime,
        "torch_rng": torch.get_rng_state(),
        "state": state.__dict__,
        "run_id": run_id,
        "cell_id": cell_id,
    }
    path.parent.mkdir(parents=True, exist_ok=True)
    temporary = temporary_path(path)
    with writing("a checkpoint", path, payload_bytes(payload)):
        try:
            with open(temporary, "wb") as handle:  # a file object keeps the OSError (and its errno) that torch's
                torch.save(payload, handle)        # own file writer would turn into a bare RuntimeError
                handle.flush()
                os.fsync(handle.fileno())  # on disk before it replaces anything
            if path.exists():
                os.replace(path, path.with_name(PREVIOUS_CHECKPOINT))
            os.replace(temporary, path)
        finally:
            temporary.unlink(missing_ok=True)  # a partial file must not fill the disk nor linger


def payload_bytes(payload, seen: set | None = None) -> int:
    """Bytes `torch.save` writes for a (nested) payload, give or take its metadata: each tensor storage once (tied
    weights share one), whole; a number or short string a few bytes."""
    seen = set() if seen is None else seen
    if isinstance(payload, torch.Tensor):
        storage = payload.untyped_storage()
        if storage.data_ptr() in seen:
            return 0
        seen.add(storage.data_ptr())
        return storage.nbytes()
    if isinstance(payload, dict):
        return sum(payload_bytes(key, seen) + payload_bytes(value, seen) for key, value in payload.items())
    if isinstance(payload, (list, tuple)):
        return sum(payload_bytes(value, seen) for value in payload)
    return len(payload) + 8 if isinstance(payload, (str, bytes)) else 8


def read_checkpoint(path: Path, map_location=None) -> dict:
    """The checkpoint's payload, unpickled with `weights_only=True`: tensors and plain types only, so a crafted
    file (a path read from a shared tracking store) cannot run code. Raises CheckpointError naming the file."""
    try:
        payload = torch.load(path, weights_only=True, map_location=map_location)
    except Exception as error:  # noqa: BLE001  (truncated zip, foreign pickle, missing file: one message each)
        raise CheckpointError(f"{path} {damage(error)}") from None
    if not isinstance(payload, dict) or not {"policy", "state", "run_id"} <= payload.keys():
        raise CheckpointError(f"{path} is not a training checkpoint (no policy, state and run id in it)")
    if payload.get("format", 1) != CHECKPOINT_FORMAT:
        raise CheckpointError(f"{path} has checkpoint format {payload.get('format', 1)}, written by another version "
                              f"of this project (this one reads format {CHECKPOINT_FORMAT}); resume it with that "
                              "version, or start the cell afresh")
    if payload.get("shards"):
        payload["shards"] = str(Path(path).parent / payload["shards"])
    return payload


def damage(error: Exception) -> str:
    """What is wrong with a file that `torch.load(weights_only=True)` refused, in our words.

    torch's own message suggests loading with `weights_only=False`, which would let the file run code: a
    checkpoint that needs it is refused, not retried."""
    if isinstance(error, FileNotFoundError):
        return "does not exist"
    if isinstance(error, IsADirectoryError):
        return "is a folder, not a checkpoint file"
    if isinstance(error, EOFError):
        return "is empty"
    if isinstance(error, pickle.UnpicklingError) and "unsupported global" in str(error).lower():
        return "holds objects other than tensors and plain data: refused, since loading it could run code"
    return f"is damaged: truncated, or not a PyTorch checkpoint ({error.__class__.__name__})"


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
            log.warning("%s; loaded the previous checkpoint %s (step %s) instead", failures[0][1], path,
                        payload["state"].get("step", "?") if isinstance(payload["state"], dict) else "?")
        return payload, path
    tried = ("; ".join(str(error) for _, error in failures)
             or f"no {LATEST_CHECKPOINT} or {PREVIOUS_CHECKPOINT} in {folder}")
    raise CheckpointError(f"no checkpoint in {folder} loads ({tried}). Start the cell afresh with "
                          "trainer.auto_resume=false, or move that folder's checkpoint files away")


def restore_checkpoint(payload: dict, parts: Components, sharded: bool = False) -> TrainState:
    """Restore everything `save_checkpoint` wrote into the components; returns the training state.

    Sharded weights (DCP) load into a plain or a sharded policy alike, so a run moves to any number of ranks;
    whole ones load as they are into a plain policy, and slice by slice into a `sharded` one (FSDP2).
    """
    if payload.get("shards") or sharded:
        from src.distributed import checkpoint as dcp  # torch.distributed.checkpoint: only when needed

        if payload.get("shards"):
            dcp.load_sharded(Path(payload["shards"]), parts.policy, parts.optimizer)
        else:
            dcp.load_whole(parts.policy, parts.optimizer, payload["policy"], payload["optimizer"])
    else:
        parts.policy.load_state_dict(payload["policy"])
        parts.optimizer.load_state_dict(payload["optimizer"])
    parts.buffer.load_state_dict(payload["buffer"])
    parts.curriculum.load_state_dict(payload["sampler"])
    parts.behaviour.load_state_dict(payload["behaviour"])
    # The engine was built from the policy's folder before these weights went in: without this the first
    # resumed step would sample from the folder's weights (the vLLM engine keeps its own copy).
    parts.engine.sync_weights(parts.policy)
    torch.set_rng_state(payload["torch_rng"])
    return TrainState(**payload["state"])


