"""How a run's end is recorded: FAILED with the reason as its `failure_reason` tag, KILLED when stopped, never
left RUNNING; if the store refuses even that (full, gone), `run_end.json` in the run folder says how it ended, for
the next start of the cell. A full disk becomes DiskFull naming the path and the space needed.
"""

from __future__ import annotations

import logging
from pathlib import Path

import mlflow
from mlflow.tracking import MlflowClient

from src.runs.diskspace import DiskFull, failed_path, out_of_space
from src.runs.lifecycle import write_run_end
from src.runs.store import STORE_WRITE_BYTES

log = logging.getLogger(__name__)
FAILURE_TAG = "failure_reason"  # why a FAILED run could not continue (one line)


def failure_reason(error: BaseException) -> str:
    """One line for the `failure_reason` tag: the error's class and first line."""
    first = (str(error).strip().splitlines() or [""])[0]
    text = first if isinstance(error, DiskFull) else f"{error.__class__.__name__}: {first}"
    return text[:500]


def close_active_run(run_id: str, status: str, reason: str | None = None) -> Exception | None:
    """End the active run `run_id` as `status`, the reason (if any) as its `failure_reason` tag.

    Returns the store's error if it refused (the run then stays RUNNING there); None if done, or if the run
    was no longer active. The run leaves MLflow's active stack either way, so nothing marks it FINISHED at exit."""
    active = mlflow.active_run()
    if active is None or active.info.run_id != run_id:
        return None
    problem = None
    if reason:
        try:
            mlflow.set_tag(FAILURE_TAG, reason)
        except Exception as error:  # noqa: BLE001  (still end it below)
            problem = error
    try:
        mlflow.end_run(status)  # pops the run first, then writes its status
    except Exception as error:  # noqa: BLE001
        problem = error
    return problem


def mark_failed(uri: str, run_id: str, reason: str) -> bool:
    """Close a run that is not this process's active one as FAILED, with `reason`; False if the store refused."""
    client = MlflowClient(uri)
    try:
        client.set_tag(run_id, FAILURE_TAG, reason[:500])
        if client.get_run(run_id).info.status != "FAILED":
            client.set_terminated(run_id, "FAILED")
        return True
    except Exception:  # noqa: BLE001  (a full or unreachable store: the caller reports the original problem)
        return False


def store_file(uri: str) -> str:
    """The SQLite file of a store URI, else the URI itself."""
    return uri.removeprefix("sqlite:///") if uri.startswith("sqlite:///") else uri


def disk_full_error(error: BaseException, uri: str) -> DiskFull | None:
    """`error` as DiskFull naming the path and the space needed, when it is a full disk; else None."""
    if isinstance(error, DiskFull) or not out_of_space(error):
        return error if isinstance(error, DiskFull) else None
    path = failed_path(error)
    if path is not None:
        return DiskFull("a file", path, None)
    return DiskFull("the MLflow store", store_file(uri), STORE_WRITE_BYTES)


def record_end(error: BaseException, run_id: str, folder: Path | None) -> None:
    """Close the active run after `error`: KILLED for a stop, else FAILED with the reason as a tag."""
    status = "FAILED" if isinstance(error, Exception) else "KILLED"
    reason = failure_reason(error) if status == "FAILED" else f"stopped ({error.__class__.__name__})"
    problem = close_active_run(run_id, status, reason if status == "FAILED" else None)
    if problem is not None:
        leave_run_end(run_id, status, reason, problem, folder)


def leave_run_end(run_id: str, status: str, reason: str, problem: Exception, folder: Path | None) -> None:
    """The store refused to record the run's end: say so in one line and leave `run_end.json` in its folder."""
    left = folder is not None and write_run_end(folder, run_id, status, reason)
    log.warning("the MLflow store refused to mark run %s %s (%s): it shows RUNNING until the next start of this "
                "cell, which %s", run_id, status, failure_reason(problem)[:200],
                f"reads {folder}/run_end.json" if left else "finds its process gone")
