"""Claiming a cell before its model loads, so two jobs started at the same moment never train it twice.

A job that will train a cell first creates the MLflow run it will train into (the claim: tags,
params and config as `src.runs.tracking.start_run` would log them) and writes its heartbeat; a job
that resumes a dead run claims that run by its heartbeat. Any other job of the cell then finds a
live RUNNING run and leaves the cell alone. Whether two claims can both succeed depends on the store:

- SQLite (`sqlite:///...`, one machine): the lookup and the claim happen under the store's file
  lock (`src.runs.store.sqlite_store_lock`), so whoever takes the lock second sees the first claim.
  Exact.
- A tracking server (or any store without that lock): there is no atomic check-and-create, so
  every job creates its claim, waits `CLAIM_SETTLE_S`, then lists the cell's live runs, and only
  the earliest (start time, then run id) trains; the others delete their claim. A resume claim is a
  tag (`claim`) written on the dead run, read back after the same wait: the last writer resumes.
  Exact when the jobs' clocks agree to better than `CLAIM_SETTLE_S` and every job's claim reaches
  the server within `CLAIM_SETTLE_S` of its lookup.

A claim is live while its heartbeat is (`src.runs.lifecycle`): a job that dies holding one does not
block the cell; the next start of the cell marks it FAILED with a `failure_reason` tag.
"""

from __future__ import annotations

import logging
import os
import socket
import time
import uuid
from pathlib import Path

from mlflow.entities import Param
from mlflow.tracking import MlflowClient
from mlflow.tracking.context.registry import resolve_tags
from mlflow.utils.mlflow_tags import MLFLOW_RUN_NAME

from src.runs.ending import mark_failed
from src.runs.naming import DESCRIPTION_TAG, RunLabels
from src.runs.store import ensure_experiment
from src.runs.lifecycle import write_heartbeat
from src.runs.cells import cell_runs, slurm_job_key
from src.settings import TrackingSettings

log = logging.getLogger(__name__)

CLAIM_SETTLE_S = 2.0  # a store without a lock: how long claims made at about the same moment take to meet
CLAIM_TAG = "claim"  # on a resumed run: which process resumes it (host:pid:random), last writer wins

_unopened: list[tuple[str, str]] = []  # (uri, run id) of this process's newest claim, until the job ends


def store_has_lock(uri: str) -> bool:
    """True where `src.runs.store.sqlite_store_lock` makes lookup-then-claim atomic (a SQLite file)."""
    return uri.startswith("sqlite:///")


def create_claim_run(where: TrackingSettings, folder: Path, labels: RunLabels) -> str:
    """The run this job will train into, created now with the tags, params and config a new run gets."""
    uri = where.uri
    experiment_id = ensure_experiment(uri, where.experiment, where.artifact_location)
    name = where.run_name or labels.name
    tags = resolve_tags({**labels.tags, DESCRIPTION_TAG: labels.description, MLFLOW_RUN_NAME: name,
                         "output_dir": str(folder), "slurm_job": slurm_job_key() or "-"})
    client = MlflowClient(uri)
    run_id = client.create_run(experiment_id, tags=tags, run_name=name).info.run_id
    _unopened[:] = [(uri, run_id)]  # at once: a stop from here on withdraws it
    write_heartbeat(folder, run_id)  # from now on the claim is live, and dead at once if this process dies
    client.log_batch(run_id, params=[Param(key, value) for key, value in labels.params.items()])
    client.log_text(run_id, labels.config, "config.yaml")
    return run_id


def earliest_claim(where: TrackingSettings, timeout_s: float, identity: str, run_id: str,
                   since: float) -> tuple[str, str] | None:
    """After the settle time, the live run that came first, (run id, where it runs), when it is not `run_id`
    (a run silent for `timeout_s` is dead)."""
    time.sleep(max(0.0, CLAIM_SETTLE_S - (time.monotonic() - since)))
    known = cell_runs(where.uri, where.experiment, identity, timeout_s)
    live = sorted(known.alive_runs.get(identity, []))
    if not live or live[0][1] == run_id:
        return None
    return live[0][1], known.alive[identity]


def withdraw_claim(uri: str, run_id: str) -> None:
    """Delete a claim that lost or was stopped: it never trained, and a deleted run is invisible to every lookup.
    It is ended KILLED first: a deleted run keeps its status, and a store's deleted runs should show none RUNNING."""
    client = MlflowClient(uri)
    client.set_terminated(run_id, "KILLED")
    client.delete_run(run_id)
    _unopened.clear()


def claim_token() -> str:
    return f"{socket.gethostname()}:{os.getpid()}:{uuid.uuid4().hex[:8]}"


def tag_resume_claim(uri: str, run_id: str) -> str:
    """Write this process's claim on a dead run (stores without a lock); returns the token written."""
    token = claim_token()
    MlflowClient(uri).set_tag(run_id, CLAIM_TAG, token)
    return token


def resume_claim_holder(uri: str, run_id: str, token: str, since: float) -> str | None:
    """After the settle time, who holds the claim on `run_id` when it is not this process (None: we do)."""
    time.sleep(max(0.0, CLAIM_SETTLE_S - (time.monotonic() - since)))
    holder = MlflowClient(uri).get_run(run_id).data.tags.get(CLAIM_TAG)
    return None if holder == token else holder


def fail_unopened_claim(error: BaseException) -> None:
    """A job that raised before its claimed run opened: end that run FAILED rather than leave it RUNNING.

    A run the job had opened was ended by MLflow already (`tracking.start_run`), so only a claim
    still RUNNING is touched.
    """
    if not _unopened:
        return
    uri, run_id = _unopened.pop()
    try:
        if MlflowClient(uri).get_run(run_id).info.status == "RUNNING":
            mark_failed(uri, run_id, f"{error.__class__.__name__}: {error}".splitlines()[0])
    except Exception as cleanup_error:  # noqa: BLE001  (the next start of the cell cleans it up instead)
        log.warning("could not mark the claimed run %s FAILED (%s); the next start of its cell will", run_id,
                    cleanup_error)


def withdraw_unopened_claim() -> bool:
    """A job stopped before its claimed run opened: delete that empty run (nothing was logged to it), so the
    next start of the cell finds the store as it was. False when this job holds no such claim."""
    if not _unopened:
        return False
    uri, run_id = _unopened[0]
    try:
        withdraw_claim(uri, run_id)
    except Exception as error:  # noqa: BLE001  (the next start of the cell retires it instead)
        log.warning("could not withdraw the claimed run %s (%s); the next start of its cell will retire it",
                    run_id, error)
    return True


def forget_unopened_claim() -> None:
    _unopened.clear()
