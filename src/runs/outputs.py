"""Output folders checked before anything is written there: `out` (the folder everything goes under,
conf/config.yaml), then Hydra's `hydra.run.dir` or `hydra.sweep.dir` before Hydra makes them. An unwritable
one is one line naming the key, the value and the fix, not an OSError traceback from inside Hydra."""

from __future__ import annotations

import sys

from hydra.experimental.callback import Callback
from omegaconf import DictConfig

from src.paths import folder_problem, out_problem


class CheckOutputFolders(Callback):
    """Registered in conf/config.yaml (`hydra.callbacks`); Hydra calls it before it creates the folders."""

    def on_run_start(self, config: DictConfig, **kwargs) -> None:
        _exit_if(_out_problem(config) or folder_problem("hydra.run.dir", config.hydra.run.dir))

    def on_multirun_start(self, config: DictConfig, **kwargs) -> None:
        # The sweeper makes the sweep folder as it launches: a dry run, or a sweep with every cell finished, none.
        _exit_if(_out_problem(config) or folder_problem("hydra.sweep.dir", config.hydra.sweep.dir, keep=False))


def _out_problem(config: DictConfig) -> str | None:
    """First, since the run and sweep folders derive from it: the message names the key the user typed."""
    return out_problem(config.out) if "out" in config else None  # a primary config without `out` (ziprc)


def _exit_if(problem: str | None) -> None:
    if problem is not None:
        print(f"error: {problem}", file=sys.stderr)
        sys.exit(2)  # SystemExit passes through Hydra's error report: one line, no traceback
