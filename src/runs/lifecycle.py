"""Is a run alive? A heartbeat file the run renews, read back by whoever wants to resume its cell.

A job can die without a word (SIGKILL from the OOM killer, a lost node, `scancel` after the
grace period): its MLflow run then stays RUNNING forever. So a training run keeps
`heartbeat.json` in its folder (next to its checkpoints), rewritten every
`trainer.heartbeat_every_s` seconds by a background thread (a long step or evaluation does not
starve it). A RUNNING run is dead when its heartbeat is older than `trainer.heartbeat_timeout_s`,
when its process is gone from this very host, or when its SLURM job no longer runs; otherwise it
is alive and nobody may resume it. Clocks of different nodes only need to agree to well within
the timeout.

Files of a run folder are written whole under a temporary name that holds the writer's pid and host,
then renamed; a start of the folder deletes the temporaries of writers that are gone. When the
tracking store refuses to record how a run ended, `run_end.json` records it beside the checkpoints.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import socket
import subprocess
import threading
import time
import uuid
import zipfile
from dataclasses import dataclass
from pathlib import Path

HEARTBEAT_FILE = "heartbeat.json"
# The end a run's process meant to record (FAILED and why) when the tracking store refused to record it
# (full, unreachable): the next start of the cell reads it (src.runs.resume) instead of waiting for the heartbeat.
RUN_END_FILE = "run_end.json"
# A run folder keeps two checkpoint generations (src.runs.checkpoint.save_checkpoint): a new checkpoint is
# written whole under a unique temporary name, then the latest becomes the previous and the new one
# the latest, so a kill at any moment leaves a complete checkpoint; a latest damaged anyway (disk
# full, truncated copy) falls back to the previous one.
LATEST_CHECKPOINT, PREVIOUS_CHECKPOINT = "checkpoint.pt", "checkpoint.prev.pt"


@dataclass(frozen=True)
class Liveness:
    alive: bool
    reason: str  # why we think so, for the message
    wait_s: float = 0.0  # alive: seconds until the heartbeat would time out if the run died now


def checkpoint_files(folder: Path) -> list[Path]:
    """The checkpoints of a run folder that exist, newest generation first."""
    return [path for path in (folder / LATEST_CHECKPOINT, folder / PREVIOUS_CHECKPOINT) if path.is_file()]


def temporary_path(path: Path) -> Path:
    """A unique sibling to write `path` whole before renaming it into place: `<name>.<pid>@<host>.<8 hex>.tmp`.

    Unique per writer, so two processes writing into one folder by mistake never mix their bytes, and named
    after the writer, so a later start can tell a killed writer's leftover from a live writer's file."""
    return path.with_name(f"{path.name}.{os.getpid()}@{socket.gethostname()}.{uuid.uuid4().hex[:8]}.tmp")


TEMPORARY_NAME = re.compile(r"^.+\.(?P<pid>\d+)(?:@(?P<host>.+))?\.[0-9a-f]{8}\.tmp$")


def remove_stale_temporaries(folder: Path, timeout_s: float, now: float | None = None) -> list[Path]:
    """Delete the half-written `*.tmp` files that killed writers left in a run folder; returns them.

    A writer on this host is gone when its process is; one on another host (a shared file system) when its
    file has not changed for `timeout_s`. A live writer's file stays."""
    now = time.time() if now is None else now
    removed = []
    for path in folder.glob("*.tmp") if folder.is_dir() else []:
        match = TEMPORARY_NAME.match(path.name)
        if match is None or not path.is_file():
            continue
        try:
            if match["host"] in (None, socket.gethostname()):
                stale = process_gone(int(match["pid"]))
            else:
                stale = now - path.stat().st_mtime > timeout_s
            if stale:
                path.unlink()
                removed.append(path)
        except OSError:  # gone already (another start cleaned it), or not ours to delete: leave it
            continue
    return removed


def write_heartbeat(folder: Path, run_id: str) -> None:
    """Record that `run_id` is alive in this process now (written whole, then renamed)."""
    beat = {"run_id": run_id, "host": socket.gethostname(), "pid": os.getpid(), "time": time.time()}
    write_json(folder / HEARTBEAT_FILE, beat)


def write_json(path: Path, data: dict) -> None:
    """`data` as JSON at `path`, written whole under a temporary name, then renamed."""
    path.parent.mkdir(parents=True, exist_ok=True)
    temporary = temporary_path(path)
    try:
        temporary.write_text(json.dumps(data))
        os.replace(temporary, path)
    finally:
        temporary.unlink(missing_ok=True)


def write_run_end(folder: Path, run_id: str, status: str, reason: str) -> bool:
    """Leave `run_end.json` saying how `run_id` ended, for the next start of its cell; False if even that fails."""
    end = {"run_id": run_id, "status": status, "reason": reason, "host": socket.gethostname(), "pid": os.getpid(),
           "time": time.time()}
    try:
        write_json(folder / RUN_END_FILE, end)
        return True
    except OSError:
        return False


def read_run_end(folder: Path) -> dict | None:
    """The end recorded in a run folder by a process the store refused (`write_run_end`), or None."""
    try:
        end = json.loads((folder / RUN_END_FILE).read_text())
        return end if isinstance(end, dict) and isinstance(end.get("run_id"), str) else None
    except (OSError, ValueError):
        return None


def clear_run_end(folder: Path, run_id: str) -> None:
    """Forget a recorded end of `run_id` (the store holds the run's status again)."""
    end = read_run_end(folder)
    if end is not None and end["run_id"] == run_id:
        (folder / RUN_END_FILE).unlink(missing_ok=True)


def read_heartbeat(folder: Path) -> dict | None:
    """The last heartbeat in a run folder, or None if there is none (or it cannot be read)."""
    try:
        beat = json.loads((folder / HEARTBEAT_FILE).read_text())
        return beat if isinstance(beat, dict) and isinstance(beat.get("time"), (int, float)) else None
    except (OSError, ValueError):
        return None


class Heartbeat:
    """Context manager: renews the run's heartbeat every `every_s` seconds until the block ends.

    `run_id` may be None until MLflow has opened the run (`beat_for`); nothing is written before.
    """

    def __init__(self, folder: Path, run_id: str | None, every_s: float):
        self.folder, self.run_id, self.every_s = folder, run_id, every_s
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._beat, name="heartbeat", daemon=True)

    def __enter__(self) -> "Heartbeat":
        if self.run_id is not None:
            write_heartbeat(self.folder, self.run_id)
        self._thread.start()
        return self

    def beat_for(self, run_id: str) -> None:
        """From now on (and at once) beat for this run."""
        self.run_id = run_id
        write_heartbeat(self.folder, run_id)

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()

    def _beat(self) -> None:
        while not self._stop.wait(self.every_s):
            if self.run_id is None:
                continue
            try:
                write_heartbeat(self.folder, self.run_id)
            except OSError:  # a full or briefly unavailable disk: the next beat tries again
                pass


def process_gone(pid: int) -> bool:
    """True if no process `pid` runs on this host (a zombie counts as gone: it will never beat again)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    except PermissionError:
        return False
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] == "Z"
    except (OSError, IndexError):
        return False


def slurm_job_gone(job: str) -> bool:
    """True if SLURM answers that `job` (id or array_task) is not pending or running; False if unsure."""
    if not job or job == "-" or shutil.which("squeue") is None:
        return False
    try:
        answer = subprocess.run(["squeue", "-h", "-j", job, "-o", "%T"], capture_output=True, text=True, timeout=10)
    except (OSError, subprocess.SubprocessError):
        return False
    # squeue exits non-zero with "Invalid job id" once the job has left its memory.
    return (answer.returncode == 0 and not answer.stdout.strip()) or "Invalid job id" in answer.stderr


def run_liveness(run_id: str, folder: Path | None, started_s: float, slurm_job: str | None, timeout_s: float,
                 now: float | None = None) -> Liveness:
    """Whether the RUNNING MLflow run `run_id`, whose folder is `folder`, is still alive somewhere."""
    now = time.time() if now is None else now
    beat = read_heartbeat(folder) if folder is not None else None
    if beat is not None and beat.get("run_id") == run_id:
        age = now - beat["time"]
        if beat.get("host") == socket.gethostname() and isinstance(beat.get("pid"), int) and process_gone(beat["pid"]):
            return Liveness(False, f"its process {beat['pid']} on {beat['host']} is gone")
        where = f"process {beat.get('pid')} on {beat.get('host')}"
    else:  # died before its first heartbeat (or a run of an older version): judge by its start time
        age, where = now - started_s, "no heartbeat yet"
    if age > timeout_s:
        return Liveness(False, f"last sign of life {age:.0f} s ago ({where}), over trainer.heartbeat_timeout_s="
                               f"{timeout_s:g}")
    if slurm_job_gone(slurm_job or ""):
        return Liveness(False, f"its SLURM job {slurm_job} no longer runs")
    return Liveness(True, f"{where}, last heartbeat {age:.0f} s ago", wait_s=timeout_s - age)


class CheckpointError(RuntimeError):
    """No checkpoint of a run folder loads, or the one found belongs to another run or cell."""


def check_resume_from(path: str | None) -> None:
    """`trainer.resume_from` names a checkpoint file; CheckpointError naming the key, the value and the fix.

    Cheap on purpose (no unpickling): a folder, a missing file or a file that is not a torch archive is
    refused before any model loads; a damaged archive is named when it is read.
    """
    if not path:
        return
    file, key = Path(path), f"trainer.resume_from={path}"
    if file.is_dir():
        inside = [candidate for candidate in checkpoint_files(file) if candidate.is_file()]
        fix = (f"name the checkpoint file inside it: trainer.resume_from={inside[0]}" if inside else
               f"it holds no {LATEST_CHECKPOINT}: name a run folder's {LATEST_CHECKPOINT}")
        raise CheckpointError(f"{key} is a folder; {fix}")
    if not file.is_file():
        raise CheckpointError(f"{key}: no such file; name a run folder's {LATEST_CHECKPOINT}")
    if not zipfile.is_zipfile(file):
        raise CheckpointError(f"{key} is not a training checkpoint (not a torch archive); name a run folder's "
                              f"{LATEST_CHECKPOINT}, or drop trainer.resume_from to resume this cell's own run")
