"""Output folders checked before anything is written there: `out` (the folder everything goes under,
conf/config.yaml), then Hydra's `hydra.run.dir` or `hydra.sweep.dir` before Hydra makes them. An unwritable
one is one line naming the key, the value and the fix, not an OSError traceback from inside Hydra."""

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
        return (f"{key}={folder}: cannot write there ({error.strerror or error}); give {key}= a folder you can "
                "write to (out=DIR moves the store and outputs/ under DIR; the default is the project folder)")
    return None


def out_problem(folder: str) -> str | None:
    """Why `out` cannot hold the store and outputs/, or None when it can (it is made here).

    Absolute only: the store's artifact folder becomes a file:// URI, which a relative path has none of
    (pathlib's as_uri raises), and every process would read a relative `out` from its own working directory."""
    if not Path(folder).is_absolute():  # `~` too: Hydra passes it on as it is
        return (f"out={folder}: give an absolute folder, e.g. out={Path.cwd() / Path(folder).expanduser()} "
                "(the store and outputs/ go under it)")
    return folder_problem("out", folder)


class CheckOutputFolders(Callback):
    """Registered in conf/config.yaml (`hydra.callbacks`); Hydra calls it before it creates the folders."""

    def on_run_start(self, config: DictConfig, **kwargs) -> None:
        _exit_if(_out_problem(config) or folder_problem("hydra.run.dir", config.hydra.run.dir))

    def on_multirun_start(self, config: DictConfig, **kwargs) -> None:
        _exit_if(_out_problem(config) or folder_problem("hydra.sweep.dir", config.hydra.sweep.dir))


def _out_problem(config: DictConfig) -> str | None:
    """First, since the run and sweep folders derive from it: the message names the key the user typed."""
    return out_problem(config.out) if "out" in config else None  # a primary config without `out` (ziprc)


def _exit_if(problem: str | None) -> None:
    if problem is not None:
        print(f"error: {problem}", file=sys.stderr)
        sys.exit(2)  # SystemExit passes through Hydra's error report: one line, no traceback
