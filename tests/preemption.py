"""Preempting a training run the way SLURM does: SIGTERM once its first checkpoint is written."""

from __future__ import annotations

import signal
import subprocess
import time
from pathlib import Path

from src.paths import PROJECT_ROOT


def sigterm_after_first_checkpoint(command: list[str], checkpoint: Path, wait: float = 300) -> tuple[int, str]:
    """Start `command`, send SIGTERM as soon as `checkpoint` exists; its exit status and stdout + stderr."""
    process = subprocess.Popen(command, cwd=PROJECT_ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    deadline = time.time() + wait
    while not checkpoint.exists() and process.poll() is None and time.time() < deadline:
        time.sleep(0.05)
    process.send_signal(signal.SIGTERM)
    stdout, stderr = process.communicate(timeout=300)
    return process.returncode, stdout + stderr


def relaunch_resumes_the_killed_run(command: list[str], store: str, steps: int) -> None:
    """The store's one run, left RUNNING by a SIGKILL: `command` again continues it into the same MLflow run, each
    redone step equal to what was logged before the kill (else "RESUME MISMATCH"), every step logged once."""
    import mlflow
    from mlflow.tracking import MlflowClient

    mlflow.set_tracking_uri(store)
    killed = mlflow.search_runs(experiment_names=["replay-rloo"])
    assert list(killed["status"]) == ["RUNNING"]  # as SIGKILL leaves it
    again = subprocess.run(command, cwd=PROJECT_ROOT, capture_output=True, text=True, timeout=900)
    log = again.stdout + again.stderr
    assert again.returncode == 0, log[-3000:]
    assert f"resuming run {killed.run_id[0]}" in log and "RESUME MISMATCH" not in log, log[-3000:]
    runs = mlflow.search_runs(experiment_names=["replay-rloo"])
    assert list(runs["status"]) == ["FINISHED"] and runs.run_id[0] == killed.run_id[0]
    history = MlflowClient(store).get_metric_history(runs.run_id[0], "train/reward")
    assert sorted(m.step for m in history) == list(range(steps))  # every step once: none lost, none twice
