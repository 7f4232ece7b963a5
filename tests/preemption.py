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
