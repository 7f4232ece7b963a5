"""A run's folder: one per run, holding its checkpoints, heartbeat, final policy and `run.log`.

Hydra makes a new folder for every start before the job runs (hydra/core/utils.py:149, `run_job`), points
its log file there (core/utils.py:176 configures `hydra.job_logging`, whose `file` handler writes
`${hydra.runtime.output_dir}/${hydra.job.name}.log`: hydra/conf/hydra/job_logging/default.yaml:11-15) and saves
the composed config under `.hydra/` (core/utils.py:178-184). Two starts need that folder undone:

- a config refused (or a cell with nothing to train) never uses it: `discard_unused` removes it;
- a resumed run keeps the folder it started in (its checkpoints are there): `move_log` points the log file at
  that folder's `run.log`, with what was logged so far, and removes the new one.

`run.log` holds the run's story: the log records, and (`to_log_file`) the lines the terminal shows its own way
(progress bars, the result table).
"""

from __future__ import annotations

import logging
import shutil
from pathlib import Path

HYDRA_FILES = {".hydra", "run.log"}  # what Hydra writes into a new run folder before the job runs


def log_files(folder: Path | None = None) -> list[logging.FileHandler]:
    """The root logger's file handlers (Hydra's `run.log`), those writing into `folder` when given."""
    return [handler for handler in logging.getLogger().handlers if isinstance(handler, logging.FileHandler)
            and (folder is None or Path(handler.baseFilename).parent == Path(folder))]


def to_log_file(message: str) -> None:
    """A line for `run.log` only: the terminal shows it its own way (a progress bar, the result table)."""
    record = logging.LogRecord("run", logging.INFO, __file__, 0, message, None, None)
    for handler in log_files():
        if record.levelno >= handler.level:
            handler.handle(record)


def only_hydra_wrote(folder: Path) -> bool:
    """True when the folder holds nothing but what Hydra put there before the job ran."""
    try:
        return folder.is_dir() and all(entry.name in HYDRA_FILES for entry in folder.iterdir())
    except OSError:
        return False


def discard_unused(folder: Path) -> bool:
    """Remove a run folder only Hydra wrote into (its log closed first), and the day's folder when it is empty."""
    folder = Path(folder)
    if not only_hydra_wrote(folder):
        return False
    for handler in log_files(folder):
        logging.getLogger().removeHandler(handler)
        handler.close()
    shutil.rmtree(folder, ignore_errors=True)
    try:
        folder.parent.rmdir()  # outputs/runs/<day>, when this was its only run
    except OSError:
        pass
    return True


def move_log(new: Path, kept: Path) -> None:
    """Log into `kept/run.log` from now on (appended, after what this start logged so far), and drop `new`
    when only Hydra wrote there: a resumed run keeps one folder."""
    new, kept = Path(new), Path(kept)
    if new.resolve() == kept.resolve():
        return
    root = logging.getLogger()
    for handler in log_files(new):
        handler.flush()
        so_far = Path(handler.baseFilename).read_text() if Path(handler.baseFilename).is_file() else ""
        moved = logging.FileHandler(kept / Path(handler.baseFilename).name, mode="a", encoding=handler.encoding)
        moved.setLevel(handler.level)
        moved.setFormatter(handler.formatter)
        moved.stream.write(so_far)
        root.removeHandler(handler)
        handler.close()
        root.addHandler(moved)
    discard_unused(new)
