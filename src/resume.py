"""Where a training job starts: the checkpoint `trainer.resume_from` names, this cell's newest dead run, or afresh.

Decided before the model loads (`src.run` calls `choose_start` first), so a bad checkpoint or a
run still alive elsewhere costs seconds, not a model load.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path

from mlflow.tracking import MlflowClient
from omegaconf import DictConfig

from src import tracking
from src.checkpoint import CheckpointError, read_checkpoint, read_latest_checkpoint
from src.lifecycle import LATEST_CHECKPOINT, write_heartbeat
from src.sweep import cell_name, cell_runs

log = logging.getLogger(__name__)


@dataclass
class Start:
    """Where a job starts: a new MLflow run in its own output folder, or a dead run's folder, run and checkpoint."""

    folder: Path  # checkpoints, heartbeat and final policy live here for the run's whole life
    run_id: str | None = None
    checkpoint: dict | None = None


class RunAlive(RuntimeError):
    """The cell's newest run is alive elsewhere: resuming it would make two writers of one run."""


def choose_start(cfg: DictConfig, identity: str, output_dir: Path) -> Start:
    """Resume what `trainer.resume_from` names, or this cell's newest dead run (checked by run and cell id), or
    start afresh. Runs before the model loads, so a bad checkpoint or a live run costs seconds."""
    trainer, uri = cfg.trainer, cfg.tracking.uri
    if trainer.resume_from:
        path = Path(trainer.resume_from)
        payload, path = (read_latest_checkpoint(path.parent) if path.name == LATEST_CHECKPOINT
                         else (read_checkpoint(path), path))
        check_checkpoint_owner(payload, path, identity)
        return Start(path.parent, payload["run_id"], payload)
    if not trainer.auto_resume:
        return Start(output_dir)
    with tracking.sqlite_store_lock(uri):  # lookup and claim at once: jobs relaunched together resume it once
        tracking.ensure_experiment(uri, cfg.tracking.experiment, cfg.tracking.artifact_location)
        known = cell_runs(uri, cfg.tracking.experiment, identity, trainer.heartbeat_timeout_s)
        if identity in known.alive:
            raise RunAlive(f"cell {cell_name(cfg)} (cell_id {identity}): {known.alive[identity]}. Two jobs must "
                           "not write one run; relaunch after that, or set trainer.auto_resume=false to start a "
                           "separate run of this cell")
        dead = known.dead_without_checkpoint.get(identity)
        if dead and identity not in known.resumable:
            MlflowClient(uri).set_terminated(dead, "FAILED")
            log.warning("run %s of cell %s died before its first checkpoint: marked FAILED; starting the cell "
                        "afresh in a new run", dead, cell_name(cfg))
        if identity not in known.resumable:
            return Start(output_dir)
        run_id, folder = known.resumable_runs[identity], Path(known.resumable[identity]).parent
        payload, path = read_latest_checkpoint(folder)
        check_checkpoint_owner(payload, path, identity, run_id)
        write_heartbeat(folder, run_id)  # claimed: a relaunch racing this one now sees the run alive
    log.warning("resuming run %s of cell %s from %s at step %d", run_id, cell_name(cfg), path,
                payload["state"]["step"])
    return Start(folder, run_id, payload)


def check_checkpoint_owner(payload: dict, path: Path, cell_id: str, run_id: str | None = None) -> None:
    """Refuse a checkpoint of another cell, or of another MLflow run than the one whose folder it is in."""
    if payload.get("cell_id") != cell_id:
        raise CheckpointError(f"{path} belongs to cell_id {payload.get('cell_id')}, but this job is cell_id "
                              f"{cell_id}: not resuming another cell's checkpoint. Name this cell's checkpoint in "
                              "trainer.resume_from, or set trainer.auto_resume=false to start afresh")
    if run_id is not None and payload["run_id"] != run_id:
        raise CheckpointError(f"{path} holds MLflow run {payload['run_id']}, but its folder belongs to run {run_id}: "
                              "two runs wrote one folder; not resuming either. Set trainer.auto_resume=false to "
                              "start afresh")
