"""Is a run alive? A heartbeat file the run renews, read back by whoever wants to resume its cell.

A job can die without a word (SIGKILL from the OOM killer, a lost node, `scancel` after the
grace period): its MLflow run then stays RUNNING forever. So a training run keeps
`heartbeat.json` in its folder (next to its checkpoints), rewritten every
`trainer.heartbeat_every_s` seconds by a background thread (a long step or evaluation does not
starve it). A RUNNING run is dead when its heartbeat is older than `trainer.heartbeat_timeout_s`,
when its process is gone from this very host, or when its SLURM job no longer runs; otherwise it
is alive and nobody may resume it. Clocks of different nodes only need to agree to well within
the timeout.
"""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import threading
import time
import uuid
from dataclasses import dataclass
from pathlib import Path

HEARTBEAT_FILE = "heartbeat.json"
# A run folder keeps two checkpoint generations (src.checkpoint.save_checkpoint): a new checkpoint is
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


def write_heartbeat(folder: Path, run_id: str) -> None:
    """Record that `run_id` is alive in this process now (written whole, then renamed)."""
    beat = {"run_id": run_id, "host": socket.gethostname(), "pid": os.getpid(), "time": time.time()}
    folder.mkdir(parents=True, exist_ok=True)
    temporary = folder / f"{HEARTBEAT_FILE}.{os.getpid()}.{uuid.uuid4().hex[:8]}.tmp"
    temporary.write_text(json.dumps(beat))
    os.replace(temporary, folder / HEARTBEAT_FILE)


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
