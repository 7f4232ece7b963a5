"""Hydra's output folders checked before Hydra makes them: an unwritable `hydra.run.dir` or `hydra.sweep.dir`
is one line naming the key, the value and the fix, not an OSError traceback from inside Hydra."""

from __future__ import annotations

import sys
import tempfile
from pathlib import Path

from hydra.experimental.callback import Callback
from omegaconf import DictConfig


def folder_problem(key: str, folder: str) -> str | None:
    """Why `folder` (the value of `key`) cannot hold a job's outputs, or None when it can (it is made here)."""
    try:
        Path(folder).mkdir(parents=True, exist_ok=True)
        with tempfile.NamedTemporaryFile(dir=folder, prefix=".write-probe-"):
            pass
    except OSError as error:
        return (f"{key}={folder}: cannot write there ({error.strerror or error}); point {key} at a folder you can "
                "write to (the default is outputs/ in the working directory)")
    return None


class CheckOutputFolders(Callback):
    """Registered in conf/config.yaml (`hydra.callbacks`); Hydra calls it before it creates the folders."""

    def on_run_start(self, config: DictConfig, **kwargs) -> None:
        _exit_if(folder_problem("hydra.run.dir", config.hydra.run.dir))

    def on_multirun_start(self, config: DictConfig, **kwargs) -> None:
        _exit_if(folder_problem("hydra.sweep.dir", config.hydra.sweep.dir))


def _exit_if(problem: str | None) -> None:
    if problem is not None:
        print(f"error: {problem}", file=sys.stderr)
        sys.exit(2)  # SystemExit passes through Hydra's error report: one line, no traceback
