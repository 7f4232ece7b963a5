"""A write that fails for lack of space (a full disk, an exceeded quota) becomes one line naming the path and the
space it needs, never a page of tracebacks.

Libraries report a full disk in their own words: an OSError with errno ENOSPC or EDQUOT, safetensors' "No space
left on device (os error 28)", SQLite's "database or disk is full" (through SQLAlchemy and MLflow), and torch's
zip writer an "unexpected pos" RuntimeError raised while the OSError is being handled. `out_of_space` reads all
of them; `writing` turns them into `DiskFull` at the write that knows its path and size.
"""

from __future__ import annotations

import errno
import logging
import shutil
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

OUT_OF_SPACE_ERRNOS = frozenset({errno.ENOSPC, errno.EDQUOT})
OUT_OF_SPACE_WORDS = ("no space left on device", "disk quota exceeded", "database or disk is full")


class DiskFull(RuntimeError):
    """A write failed for lack of space; the message names what, where, and how much space it needs."""

    def __init__(self, what: str, path: Path | str, needed_bytes: int | None):
        self.what, self.path, self.needed_bytes = what, Path(path), needed_bytes
        self.free_bytes = free_bytes(self.path)
        free = "unknown" if self.free_bytes is None else size_text(self.free_bytes)
        needed = f"needs about {size_text(needed_bytes)} free" if needed_bytes else "needs more free space"
        super().__init__(f"no space left to write {what} at {self.path}: it {needed}, {free} is free there. Free "
                         "space on that disk (or raise its quota), then run the same command again: the run "
                         "resumes from its last complete checkpoint, if it wrote one")


def size_text(count: int) -> str:
    """A byte count for a person: '512 B', '2.1 MB', '3.4 GB' (powers of 1024)."""
    for unit, scale in (("GB", 2**30), ("MB", 2**20), ("KB", 2**10)):
        if count >= scale:
            return f"{count / scale:.1f} {unit}"
    return f"{count} B"


def free_bytes(path: Path) -> int | None:
    """Free bytes on the filesystem holding `path` (or its nearest existing parent); None if unknown."""
    for folder in (path, *path.parents):
        if folder.exists():
            try:
                return shutil.disk_usage(folder).free
            except OSError:
                return None
    return None


def causes(error: BaseException) -> Iterator[BaseException]:
    """`error` and every exception it was raised from or while handling."""
    pending, seen = [error], set()
    while pending:
        current = pending.pop()
        if current is None or id(current) in seen:
            continue
        seen.add(id(current))
        yield current
        pending += [current.__cause__, current.__context__]


def out_of_space(error: BaseException) -> bool:
    """Whether `error`, or one of its causes, says the disk is full or the quota exceeded."""
    for cause in causes(error):
        if isinstance(cause, DiskFull):
            return True
        if isinstance(cause, OSError) and cause.errno in OUT_OF_SPACE_ERRNOS:
            return True
        if any(words in str(cause).lower() for words in OUT_OF_SPACE_WORDS):
            return True
    return False


def failed_path(error: BaseException) -> str | None:
    """The file an out-of-space OSError among the causes names, if any."""
    for cause in causes(error):
        if isinstance(cause, OSError) and cause.errno in OUT_OF_SPACE_ERRNOS and cause.filename:
            return str(cause.filename)
    return None


@contextmanager
def writing(what: str, path: Path, needed_bytes: int) -> Iterator[None]:
    """Raise DiskFull naming `path` and `needed_bytes` if the block fails for lack of space.

    A writer that loses the errno (a C++ stream) still counts as out of space when the disk holds less than
    `needed_bytes`."""
    try:
        yield
    except DiskFull:
        raise
    except Exception as error:
        free = free_bytes(path) if Path(path).is_absolute() else None
        if out_of_space(error) or (free is not None and free < needed_bytes):
            raise DiskFull(what, path, needed_bytes) from None
        raise


def quiet_log_files_when_full() -> None:
    """Log files on a full disk fail every record; print nothing for those instead of a traceback per record
    (the terminal still shows each record through the console handler)."""
    for handler in logging.getLogger().handlers:
        if isinstance(handler, logging.FileHandler) and not getattr(handler, "_quiet_when_full", False):
            handler.handleError = _quiet_handle_error(handler.handleError)
            handler._quiet_when_full = True


def _quiet_handle_error(handle_error):
    def handle(record: logging.LogRecord) -> None:
        error = sys.exc_info()[1]
        if error is None or not out_of_space(error):
            handle_error(record)

    return handle
