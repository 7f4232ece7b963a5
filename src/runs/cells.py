"""A cell's runs in the tracking store, and the cell a run trains for (names given by the study wing).

`cell_runs` reads which runs of an experiment (or of one cell) finished, are alive, or died and can
resume; `src.runs.resume` decides a run's start from it, and the study wing's sweeper plans cells with it.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path

from mlflow.tracking import MlflowClient

from src.runs import store  # noqa: F401  (MLflow's store logger quieted before `cell_runs` opens a store)
from src.runs.lifecycle import Liveness, checkpoint_files, run_liveness
from src.runs.naming import RunLabels


@dataclass(frozen=True)
class Cell:
    """What a run trains for, as the study wing names it (`src.study.labels.cell_of`): the cell's id, its name
    for messages, and the run's MLflow labels."""

    identity: str
    name: str
    labels: RunLabels


@dataclass
class CellRuns:
    """What the tracking store knows about the cells of one experiment: the newest run of a cell decides.

    A cell whose newest run is FINISHED is finished; one whose newest run is dead (FAILED, KILLED, or
    RUNNING with a dead heartbeat) and left a checkpoint resumes from it, even when an older run of
    the cell finished (a killed rerun resumes like any other run). Any live RUNNING run makes the cell
    busy: nobody else trains it.
    """

    finished: dict[str, str]  # cell_id -> run id of its newest FINISHED run
    resumable: dict[str, str]  # cell_id -> checkpoint of its newest run, when that run is dead and left one
    resumable_runs: dict[str, str] = field(default_factory=dict)  # cell_id -> that run's id
    alive: dict[str, str] = field(default_factory=dict)  # cell_id -> which live run trains it, for the message
    alive_runs: dict[str, list[tuple[int, str]]] = field(default_factory=dict)  # cell_id -> (start ms, run id) live
    dead_running: dict[str, list[tuple[str, str, bool]]] = field(default_factory=dict)  # (run id, why dead, has ckpt)

    def busy(self, identity: str) -> bool:
        return identity in self.alive

    def unresumed_dead(self, identity: str) -> list[tuple[str, str]]:
        """The cell's dead RUNNING runs nobody will resume, each with why: to be marked FAILED."""
        resumed = self.resumable_runs.get(identity)
        return [(run_id, f"dead ({why}), not resumable: " + ("a newer run of the cell replaced it" if checkpoint
                                                              else "no checkpoint in its folder"))
                for run_id, why, checkpoint in self.dead_running.get(identity, []) if run_id != resumed]


def slurm_job_key() -> str | None:
    """This process's SLURM job (array job and task), the same across a requeue; None outside SLURM."""
    if "SLURM_ARRAY_JOB_ID" in os.environ:
        return f"{os.environ['SLURM_ARRAY_JOB_ID']}_{os.environ.get('SLURM_ARRAY_TASK_ID', '')}"
    return os.environ.get("SLURM_JOB_ID")


def cell_runs(uri: str, experiment: str, cell_id: str | None = None, heartbeat_timeout_s: float = 300.0) -> CellRuns:
    """Finished, resumable, alive and silently dead cells of the experiment (or of one cell), with one paged search.

    A RUNNING run is dead when its heartbeat timed out, its process is gone from this host, its
    SLURM job no longer runs, or it is this same SLURM job's earlier attempt (a requeued job whose
    first attempt was killed outright). A dead run resumes from the newest checkpoint in its folder.
    """
    client = MlflowClient(uri)
    found = client.get_experiment_by_name(experiment)
    known = CellRuns({}, {})
    if found is None:
        return known
    query = f"tags.cell_id = '{cell_id}'" if cell_id else ""
    page_token = None
    while True:  # oldest first, so the newest run of a cell decides
        page = client.search_runs([found.experiment_id], filter_string=query, max_results=1000,
                                  order_by=["attributes.start_time ASC"], page_token=page_token)
        for run in page:
            if run.data.tags.get("cell_id") is not None:
                _judge_run(known, run, heartbeat_timeout_s)
        page_token = page.token
        if not page_token:
            return known


def _judge_run(known: CellRuns, run, heartbeat_timeout_s: float) -> None:
    """Fold one run (runs come oldest first) into what is known about its cell."""
    identity, status, tags, run_id = run.data.tags["cell_id"], run.info.status, run.data.tags, run.info.run_id
    if status == "FINISHED":
        known.finished[identity] = run_id
        known.resumable.pop(identity, None)
        known.resumable_runs.pop(identity, None)
        return
    folder = Path(tags["output_dir"]) if tags.get("output_dir") else None
    if status == "RUNNING":
        why_dead = running_run_death(run, folder, heartbeat_timeout_s)
        if isinstance(why_dead, Liveness):  # alive
            known.alive[identity] = (f"run {run_id} ({running_job(tags, why_dead)}) is training it: wait "
                                     f"{why_dead.wait_s:.0f} s for its heartbeat to time out if it died")
            known.alive_runs.setdefault(identity, []).append((run.info.start_time, run_id))
            return
    elif status not in ("FAILED", "KILLED"):
        return
    checkpoints = checkpoint_files(folder) if folder is not None else []
    if status == "RUNNING":
        known.dead_running.setdefault(identity, []).append((run_id, why_dead, bool(checkpoints)))
    known.resumable.pop(identity, None)
    known.resumable_runs.pop(identity, None)
    if checkpoints:
        known.resumable[identity] = str(checkpoints[0])
        known.resumable_runs[identity] = run_id


def running_run_death(run, folder: Path | None, heartbeat_timeout_s: float) -> "str | Liveness":
    """Why a RUNNING run is dead, or its `Liveness` when it is alive."""
    tags, this_job = run.data.tags, slurm_job_key()
    if this_job is not None and tags.get("slurm_job") == this_job:
        return f"an earlier attempt of this SLURM job {this_job}"
    liveness = run_liveness(run.info.run_id, folder, run.info.start_time / 1000, tags.get("slurm_job"),
                            heartbeat_timeout_s)
    return liveness if liveness.alive else liveness.reason


def running_job(tags: dict, liveness: Liveness) -> str:
    """Where a live run runs, for a message: its process and host from the heartbeat, and its SLURM job."""
    slurm = tags.get("slurm_job")
    return liveness.reason + (f", SLURM job {slurm}" if slurm and slurm != "-" else "")
