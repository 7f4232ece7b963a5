"""The MLflow store: created with its experiment on first use, read for runs.

Tracking settings that cannot work are refused before MLflow loads (`src.runs.store_check`). A SQLite store is created under a file lock, so runs
launched together do not race on its schema. Importing this module quiets MLflow's store logger (a full disk
is reported once, by the run: `src.runs.ending`, not as a traceback per failed statement; a new store's schema
is routine), so a module whose client may be a process's first to open a store imports this one first.
"""

from __future__ import annotations

import fcntl
import logging
import os
import shutil
import sqlite3
import tempfile
from collections.abc import Iterator
from contextlib import closing, contextmanager
from pathlib import Path

import mlflow
from mlflow.exceptions import MlflowException
from mlflow.tracking import MlflowClient

from src.paths import cache_folder
from src.runs.diskspace import out_of_space
from src.runs.store_check import StoreUnreachable

# A store write needs room for SQLite's journal and new pages; a new store's schema alone is about 1 MB.
STORE_WRITE_BYTES = 2**20


class OutOfSpaceFilter(logging.Filter):
    """MLflow logs every failed SQL statement with its traceback; a full disk is reported once, by us."""

    def filter(self, record: logging.LogRecord) -> bool:
        error = record.exc_info[1] if record.exc_info else None
        return not ((error is not None and out_of_space(error)) or out_of_space(Exception(record.getMessage())))


logging.getLogger("mlflow.store.db.utils").addFilter(OutOfSpaceFilter())
# Every new store would print "Creating initial MLflow database tables..." and "Updating database tables" at
# INFO (mlflow/store/db/utils.py:88 and :295): routine, not news. Its warnings and errors still show.
logging.getLogger("mlflow.store.db.utils").setLevel(logging.WARNING)


_LOCKS_HELD: set[Path] = set()  # re-entrant within a process: flock on a second open() would wait on itself


@contextmanager
def sqlite_store_lock(uri: str) -> Iterator[None]:
    """Serialise the first uses of a SQLite store across processes.

    MLflow creates the schema (alembic migrations) on a process's first use of a new file; runs
    launched together would race on it (`table latest_metrics already exists`). Creating the
    store and the experiment, and the lookups that follow (which run to resume), happen under
    this lock.
    """
    if not uri.startswith("sqlite:///"):
        yield
        return
    lock_path = Path(uri.removeprefix("sqlite:///") + ".lock").resolve()
    if lock_path in _LOCKS_HELD:
        yield
        return
    lock_path.parent.mkdir(parents=True, exist_ok=True)
    with open(lock_path, "w") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        _LOCKS_HELD.add(lock_path)
        try:
            yield
        finally:
            _LOCKS_HELD.discard(lock_path)
            fcntl.flock(handle, fcntl.LOCK_UN)


def copy_empty_store(db: Path) -> None:
    """Start a new SQLite store as a copy of an empty one that MLflow made once for its version, in the cache
    folder (src/paths.py, `cache_folder`): MLflow's schema migrations take about 3 s on each new file, the copy a
    hundredth of that. The copy's Default experiment then gets the artifact folder MLflow gives a new store (the
    working directory's `mlruns/0`). No cache folder, or one that cannot be written: MLflow makes the store."""
    folder = cache_folder()
    if folder is None:
        return
    template = folder / f"mlflow-{mlflow.__version__}-empty-store.db"
    try:
        if not template.is_file():
            folder.mkdir(parents=True, exist_ok=True)
            with tempfile.TemporaryDirectory(dir=folder) as scratch:
                MlflowClient(f"sqlite:///{scratch}/empty.db").search_experiments()
                os.replace(f"{scratch}/empty.db", template)  # whole or not at all, for a process doing the same
        shutil.copyfile(template, db)
        with closing(sqlite3.connect(db)) as store, store:
            store.execute("UPDATE experiments SET artifact_location = ? WHERE experiment_id = 0",
                          (str(Path.cwd().resolve() / "mlruns" / "0"),))
    except sqlite3.Error:  # not a store (a damaged file): made again next time; MLflow makes this one
        db.unlink(missing_ok=True)
        template.unlink(missing_ok=True)
    except (OSError, MlflowException):
        db.unlink(missing_ok=True)  # MLflow makes it itself


# The experiment tag the MLflow UI (3.x) reads to choose between its GenAI view (traces, token usage)
# and its model-training view (the runs table); "custom_model_development" is the training kind.
EXPERIMENT_KIND_TAG = "mlflow.experimentKind"
TRAINING_EXPERIMENT_KIND = "custom_model_development"


def ensure_experiment(uri: str, name: str, artifact_location: str | None) -> str:
    """The experiment id, creating the store and the experiment (with its artifact folder) on first use."""
    mlflow.set_tracking_uri(uri)
    with sqlite_store_lock(uri):
        if uri.startswith("sqlite:///") and not Path(uri.removeprefix("sqlite:///")).exists():
            copy_empty_store(Path(uri.removeprefix("sqlite:///")))
        client = MlflowClient(uri)
        experiment = client.get_experiment_by_name(name)
        if experiment is not None:
            if EXPERIMENT_KIND_TAG not in experiment.tags:  # created before this tag existed, or by hand
                client.set_experiment_tag(experiment.experiment_id, EXPERIMENT_KIND_TAG, TRAINING_EXPERIMENT_KIND)
            return experiment.experiment_id
        location = artifact_location
        if artifact_location and "://" not in artifact_location:
            location = Path(artifact_location).as_uri()
        try:
            return client.create_experiment(name, artifact_location=location,
                                            tags={EXPERIMENT_KIND_TAG: TRAINING_EXPERIMENT_KIND})
        except MlflowException as error:  # a server experiment another job created a moment ago
            experiment = client.get_experiment_by_name(name)
            if experiment is None:
                raise error
            return experiment.experiment_id


def finished_runs_tagged(uri: str, experiment: str, tag: str, value: str) -> list:
    """The experiment's FINISHED runs whose tag `tag` is `value`, newest first."""
    client = MlflowClient(uri)
    found = client.get_experiment_by_name(experiment)
    if found is None or "'" in value:
        return []
    return list(client.search_runs([found.experiment_id], max_results=100, order_by=["attributes.start_time DESC"],
                                   filter_string=f"attributes.status = 'FINISHED' and tags.{tag} = '{value}'"))


def extend_run(uri: str, run_id: str, tags: dict[str, str], config: str) -> None:
    """A FINISHED run continued to more steps (src/runs/resume.py, `extend_finished`): its new tags and config."""
    client = MlflowClient(uri)
    for key, value in tags.items():
        client.set_tag(run_id, key, value)
    client.log_text(run_id, config, "config.yaml")
