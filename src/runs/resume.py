"""Where a training job starts: the checkpoint `trainer.resume_from` names, this cell's newest dead run, or a new
run it claims (`src.runs.claim`); or nowhere, when the cell is finished or another job trains it.

Decided before the model loads (`src.run` calls `choose_start` first), so a bad checkpoint, a
finished cell or a run alive elsewhere costs seconds, not a model load.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from pathlib import Path


from src.runs import claim

from src.runs.ending import mark_failed
from src.runs.store import ensure_experiment, extend_run, finished_runs_tagged, sqlite_store_lock
from src.runs.checkpoint import CheckpointError, read_checkpoint, read_latest_checkpoint
from src.runs.lifecycle import LATEST_CHECKPOINT, write_heartbeat
from src.runs.cells import Cell, CellRuns, cell_runs
from src.settings import RunSettings

log = logging.getLogger(__name__)


@dataclass
class Start:
    """Where a job starts: its claimed new run in its own output folder, or a dead run's folder, run and checkpoint."""

    folder: Path  # checkpoints, heartbeat and final policy live here for the run's whole life
    run_id: str | None = None
    checkpoint: dict | None = None


class NothingToTrain(RuntimeError):
    """The job has nothing to train: its cell is finished, or another job trains it."""


class RunAlive(NothingToTrain):
    """The cell has a run alive elsewhere: training it too would make two writers of one cell."""


class CellFinished(NothingToTrain):
    """The cell has a FINISHED run and `trainer.rerun` is false."""


def choose_start(run: RunSettings, cell: Cell, output_dir: Path) -> Start:
    """Resume what `trainer.resume_from` names, or this cell's newest run when it is dead and left a checkpoint;
    else refuse a finished cell (unless `trainer.rerun`), else claim a new run. Raises RunAlive when another
    job trains the cell. `trainer.auto_resume=false` skips the lookup: a separate run, not claimed."""
    trainer, where, identity = run.trainer, run.tracking, cell.identity
    uri = where.uri
    claim.forget_unopened_claim()
    if trainer.resume_from:
        path = Path(trainer.resume_from)
        payload, path = (read_latest_checkpoint(path.parent) if path.name == LATEST_CHECKPOINT
                         else (read_checkpoint(path), path))
        check_checkpoint_owner(payload, path, identity)
        return Start(path.parent, payload["run_id"], payload)
    if not trainer.auto_resume:
        return Start(output_dir)
    locked = claim.store_has_lock(uri)
    with sqlite_store_lock(uri):  # lookup and claim at once: jobs started together train a cell once
        ensure_experiment(uri, where.experiment, where.artifact_location)
        known = cell_runs(uri, where.experiment, identity, trainer.heartbeat_timeout_s)
        if known.busy(identity):
            raise RunAlive(busy_message(cell, known.alive[identity]))
        for run_id, reason in known.unresumed_dead(identity):
            retire(uri, cell, run_id, reason)
        start = resume_newest(uri, cell, known, locked)
        if start is None and trainer.extend and identity not in known.finished:
            start = extend_finished(uri, where.experiment, cell, trainer.steps, locked)
        if start is not None:
            return start
        if identity in known.finished and not trainer.rerun:
            raise CellFinished(f"cell {cell.name} (cell_id {identity}) already has FINISHED run "
                               f"{known.finished[identity]} in experiment '{where.experiment}': not "
                               "training it again. Set trainer.rerun=true to train it again into a new run")
        claimed_at = time.monotonic()
        run_id = claim.create_claim_run(where, output_dir, cell.labels)
    if not locked:  # a store without a lock: the earliest of the claims made together trains
        rival = claim.earliest_claim(where, trainer.heartbeat_timeout_s, identity, run_id, claimed_at)
        if rival is not None:
            claim.withdraw_claim(uri, run_id)
            raise RunAlive(busy_message(cell, rival[1]))
    return Start(output_dir, run_id)


def busy_message(cell: Cell, alive: str) -> str:
    return (f"cell {cell.name} (cell_id {cell.identity}): {alive}. Not training it twice: relaunch after that, "
            "or set trainer.auto_resume=false to start a separate run of this cell")


def retire(uri: str, cell: Cell, run_id: str, reason: str) -> None:
    """Mark a dead run that nobody will resume FAILED with the reason, in one log line."""
    mark_failed(uri, run_id, reason)
    log.warning("run %s of cell %s marked FAILED: %s", run_id, cell.name, reason)


def resume_newest(uri: str, cell: Cell, known: CellRuns, locked: bool) -> Start | None:
    """Claim and load the newest run of the cell when it is dead and left a checkpoint; None when there is none,
    or its checkpoints do not load (the run is then marked FAILED, and the cell starts afresh)."""
    identity = cell.identity
    if identity not in known.resumable:
        return None
    run_id = known.resumable_runs[identity]
    folder = Path(known.resumable[identity]).parent
    claimed_at, token = time.monotonic(), None if locked else claim.tag_resume_claim(uri, run_id)
    try:
        payload, path = read_latest_checkpoint(folder)
    except CheckpointError as error:
        retire(uri, cell, run_id, f"dead, not resumable: {str(error).split('. Start the cell afresh')[0]}")
        return None
    check_checkpoint_owner(payload, path, identity, run_id)
    if token is not None:
        holder = claim.resume_claim_holder(uri, run_id, token, claimed_at)
        if holder is not None:
            raise RunAlive(busy_message(cell, f"run {run_id} is being resumed by {holder}"))
    write_heartbeat(folder, run_id)  # claimed: a relaunch racing this one now sees the run alive
    log.warning("resuming run %s of cell %s from %s at step %d", run_id, cell.name, path,
                payload["state"]["step"])
    return Start(folder, run_id, payload)


EXTENDED_TAG = "extended_to"  # the steps a FINISHED run was continued to (its trainer.steps param stays as logged)


def extend_finished(uri: str, experiment: str, cell: Cell, steps: int, locked: bool) -> Start | None:
    """`trainer.extend`: the newest FINISHED run of this cell at fewer steps (its `cell_family` tag), reopened
    from its final checkpoint to train on to `steps` in the same MLflow run; None when there is none.

    Its tags then name the longer cell (cell_id, cell_key; `extended_to` the steps), so a sweep counts it
    finished at `steps`; its params keep the steps it was started with (MLflow never changes a param), and
    config.yaml is logged again with the new count."""
    shorter = [run for run in finished_runs_tagged(uri, experiment, "cell_family", cell.labels.tags["cell_family"])
               if trained_steps(run) < steps]
    if not shorter:
        log.warning("trainer.extend: cell %s has no FINISHED run at fewer than %d steps; training it from step 0",
                    cell.name, steps)
        return None
    run = shorter[0]  # newest first
    run_id, folder = run.info.run_id, Path(run.data.tags.get("output_dir", ""))
    claimed_at, token = time.monotonic(), None if locked else claim.tag_resume_claim(uri, run_id)
    payload, path = read_latest_checkpoint(folder)
    check_checkpoint_owner(payload, path, run.data.tags.get("cell_id", ""), run_id)
    if token is not None:
        holder = claim.resume_claim_holder(uri, run_id, token, claimed_at)
        if holder is not None:
            raise RunAlive(busy_message(cell, f"run {run_id} is being extended by {holder}"))
    payload["cell_id"] = cell.identity  # its later checkpoints are the longer cell's
    extend_run(uri, run_id, {"cell_id": cell.identity, "cell_key": cell.labels.tags["cell_key"],
                             EXTENDED_TAG: str(steps)}, cell.labels.config)
    write_heartbeat(folder, run_id)
    log.warning("continuing FINISHED run %s of cell %s from step %d to %d (trainer.extend), in its folder %s",
                run_id, cell.name, payload["state"]["step"], steps, folder)
    return Start(folder, run_id, payload)


def trained_steps(run) -> int:
    """The steps a FINISHED run trained: its trainer.steps param, or the steps it was extended to."""
    return int(run.data.tags.get(EXTENDED_TAG) or run.data.params.get("trainer.steps", 0))


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
