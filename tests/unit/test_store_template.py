"""A new SQLite store starts as a copy of the empty store MLflow made once (src/runs/store.py,
`copy_empty_store`): the same tables and Default experiment as MLflow's own, runs log and read back, and a
damaged template or no cache folder leaves MLflow to make the store."""

from __future__ import annotations

import sqlite3

import pytest
from mlflow.tracking import MlflowClient

from src.paths import CACHE_ENV
from src.runs import store


def experiments(db) -> list[tuple]:
    with sqlite3.connect(db) as connection:
        return connection.execute("SELECT experiment_id, name, artifact_location, lifecycle_stage FROM experiments "
                                  "ORDER BY experiment_id").fetchall()


def tables(db) -> dict[tuple, list[str]]:
    """Each table's and index's definition, as a sorted list of its lines: MLflow's migrations order a table's
    CHECK constraints differently from one new store to the next in one process."""
    with sqlite3.connect(db) as connection:
        rows = connection.execute("SELECT type, name, sql FROM sqlite_master").fetchall()
    return {(kind, name): sorted(line.strip().rstrip(",") for line in (sql or "").splitlines())
            for kind, name, sql in rows}


@pytest.fixture
def cache(tmp_path, monkeypatch):
    monkeypatch.setenv(CACHE_ENV, str(tmp_path / "cache"))
    monkeypatch.chdir(tmp_path)
    return tmp_path / "cache"


def test_a_copied_store_is_the_store_mlflow_makes_and_takes_runs(cache, tmp_path, monkeypatch):
    store.ensure_experiment(f"sqlite:///{tmp_path / 'first.db'}", "replay-rloo", None)  # makes the template
    assert [path.name for path in cache.iterdir()] == [f"mlflow-{store.mlflow.__version__}-empty-store.db"]
    elsewhere = tmp_path / "elsewhere"  # another working directory: MLflow's Default experiment follows it
    elsewhere.mkdir()
    monkeypatch.chdir(elsewhere)
    monkeypatch.setenv(CACHE_ENV, "")
    own, copied = elsewhere / "own.db", elsewhere / "copied.db"
    store.ensure_experiment(f"sqlite:///{own}", "replay-rloo", str(tmp_path / "art"))
    monkeypatch.setenv(CACHE_ENV, str(cache))
    experiment = store.ensure_experiment(f"sqlite:///{copied}", "replay-rloo", str(tmp_path / "art"))
    assert experiments(copied) == experiments(own) and tables(copied) == tables(own)
    assert experiments(copied)[0][2] == str(elsewhere / "mlruns" / "0")
    client = MlflowClient(f"sqlite:///{copied}")
    run = client.create_run(experiment)
    client.log_metric(run.info.run_id, "train/reward", 0.5, step=1)
    assert [m.value for m in client.get_metric_history(run.info.run_id, "train/reward")] == [0.5]


def test_a_damaged_template_is_made_again_and_mlflow_makes_that_store(cache, tmp_path):
    cache.mkdir()
    template = cache / f"mlflow-{store.mlflow.__version__}-empty-store.db"
    template.write_bytes(b"not a database" * 100)
    db = tmp_path / "mlruns.db"
    store.ensure_experiment(f"sqlite:///{db}", "replay-rloo", str(tmp_path / "art"))
    assert [name for _, name, _, _ in experiments(db)] == ["Default", "replay-rloo"]
    assert not template.exists()  # made again by the next new store


def test_no_cache_folder_no_template(tmp_path, monkeypatch):
    monkeypatch.setenv(CACHE_ENV, "")
    db = tmp_path / "mlruns.db"
    store.ensure_experiment(f"sqlite:///{db}", "replay-rloo", None)
    assert [name for _, name, _, _ in experiments(db)] == ["Default", "replay-rloo"]
    assert sorted(path.name for path in tmp_path.iterdir()) == ["mlruns.db", "mlruns.db.lock"]
