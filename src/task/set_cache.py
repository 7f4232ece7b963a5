"""Generated task sets kept on disk between runs, so that each run does not generate them again.

Countdown's generator draws and solves every one of its 20,000 training prompts in pure Python: about 4 seconds
per run on a laptop core, paid by every run, every evaluation and every test that builds the task. The sets it
made are written once as JSON under `REPLAY_RLOO_CACHE` (default `$XDG_CACHE_HOME/replay-rloo`, else
`~/.cache/replay-rloo`; `REPLAY_RLOO_CACHE=` empty turns the cache off), in a file named by a hash of the
generator's settings and of the source file that holds the generator: a change to either gives a new file.

A file read back is data from outside this process: it is parsed as JSON, never executed or unpickled, and used
only when its shape and counts match what was asked; otherwise the sets are generated again and the file
replaced. A folder that cannot be written leaves the sets uncached, with nothing said: the cache only saves time.
"""

from __future__ import annotations

import hashlib
import json
import os
import tempfile
from pathlib import Path
from typing import Any, Callable

from src.paths import cache_folder

Rows = list[list[Any]]


def cache_file(kind: str, settings: dict, source: Path) -> Path | None:
    """The file for `kind`'s sets made with `settings` by the code in `source`."""
    folder = cache_folder()
    if folder is None:
        return None
    digest = hashlib.sha256(json.dumps(settings, sort_keys=True).encode() + source.read_bytes()).hexdigest()
    return folder / f"{kind}-{digest[:24]}.json"


def read_sets(path: Path, sizes: dict[str, int], row_ok: Callable[[Any], bool]) -> dict[str, Rows] | None:
    """The sets in `path` when each has its size and every row passes `row_ok`; None otherwise."""
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    if not isinstance(data, dict) or set(data) != set(sizes):
        return None
    for name, size in sizes.items():
        rows = data[name]
        if not isinstance(rows, list) or len(rows) != size or not all(row_ok(row) for row in rows):
            return None
    return data


def write_sets(path: Path, sets: dict[str, Rows]) -> None:
    """Write atomically (a reader sees the whole file or none); a folder that cannot be written is skipped."""
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        handle, temporary = tempfile.mkstemp(dir=path.parent, prefix=path.stem, suffix=".tmp")
    except OSError:
        return
    try:
        with os.fdopen(handle, "w") as stream:
            json.dump(sets, stream, separators=(",", ":"))
        os.replace(temporary, path)
    except OSError:  # a full disk mid-write: no half file left behind
        Path(temporary).unlink(missing_ok=True)


def cached_sets(kind: str, settings: dict, source: Path, sizes: dict[str, int], row_ok: Callable[[Any], bool],
                make: Callable[[], dict[str, Rows]]) -> dict[str, Rows]:
    """`make()`'s sets (JSON rows), read from the cache when it holds them, else made and written there."""
    path = cache_file(kind, settings, source)
    if path is not None:
        found = read_sets(path, sizes, row_ok)
        if found is not None:
            return found
    sets = make()
    if path is not None:
        write_sets(path, sets)
    return sets
