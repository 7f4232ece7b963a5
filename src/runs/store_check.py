"""Tracking settings that cannot work, refused in one line naming the key, the value and the fix, before MLflow,
torch or transformers load: `src.command.cli` runs `check_store` on the command line's config before those
imports, and the run checks again (a tracking server may have stopped in between). An unknown scheme, an
unwritable folder, a server that does not answer or asks for a password it was not given."""

from __future__ import annotations

import tempfile
from pathlib import Path


class StoreUnreachable(RuntimeError):
    """The tracking store cannot work (unknown scheme, unwritable folder, no server answering, no experiment
    name); raised before any model is loaded."""


# Stores this MLflow writes runs to. The file store (a bare path, file://) is read-only legacy in MLflow 3.
STORE_SCHEMES = ("sqlite", "http", "https", "postgresql", "mysql", "mssql", "databricks")
STORE_FIX = ("use sqlite:///<folder>/mlruns.db (the default keeps it in the project folder) or "
             "http://<host>:<port> of a running `make mlflow-server`")


def check_store(uri: str, experiment: str, artifact_location: str | None, timeout_s: float = 5.0) -> None:
    """Raise StoreUnreachable, naming the key, the value and the fix, when the tracking settings cannot work."""
    if not str(experiment).strip():
        raise StoreUnreachable(f"tracking.experiment='{experiment}': runs need an experiment name, "
                               "e.g. tracking.experiment=replay-rloo (the default)")
    scheme = uri.split("://", 1)[0].split("+", 1)[0].lower() if "://" in uri else ""
    if scheme not in STORE_SCHEMES:
        what = f"unknown scheme '{scheme}://'" if scheme else "not a store URI (no scheme)"
        raise StoreUnreachable(f"tracking.uri={uri}: {what}; {STORE_FIX}")
    if scheme == "sqlite":
        _check_writable_folder("tracking.uri", uri, Path(uri.removeprefix("sqlite:///")).parent,
                               f"point it at a folder you can write to; {STORE_FIX}")
    if artifact_location and (artifact_location.startswith("file://") or "://" not in artifact_location):
        _check_writable_folder("tracking.artifact_location", artifact_location,
                               Path(artifact_location.removeprefix("file://")),
                               "point it at a folder you can write to, or null to let the store decide")
    check_reachable(uri, timeout_s)


def _check_writable_folder(key: str, value: str, folder: Path, fix: str) -> None:
    """Create `folder` if needed and write a probe file in it; StoreUnreachable naming `key` when that fails."""
    try:
        folder.mkdir(parents=True, exist_ok=True)
        with tempfile.NamedTemporaryFile(dir=folder, prefix=".write-probe-"):
            pass
    except OSError as error:
        raise StoreUnreachable(f"{key}={value}: cannot write in {folder} ({error.strerror or error}); {fix}") from None


def check_reachable(uri: str, timeout_s: float = 5.0) -> None:
    """Fail in seconds, not after MLflow's minutes of retries, when an HTTP tracking server does not answer."""
    if not uri.startswith(("http://", "https://")):
        return
    import requests

    from src.runs.auth import client_credentials

    credentials = client_credentials()
    try:
        requests.get(uri.rstrip("/") + "/health", timeout=timeout_s)  # any HTTP answer means a server is there
        # A server behind a password (src/runs/auth.py) answers 401 where the client's credentials are missing or
        # wrong: say so now, not after MLflow's retries.
        answer = requests.get(uri.rstrip("/") + "/api/2.0/mlflow/experiments/search", params={"max_results": 1},
                              auth=credentials, timeout=timeout_s)
    except requests.RequestException as error:
        raise StoreUnreachable(
            f"tracking.uri={uri}: no MLflow server answers within {timeout_s:g} s ({error.__class__.__name__}). "
            "Start it (make mlflow-server), or set tracking.uri to a running server or a "
            "sqlite:///path/mlruns.db file") from None
    if answer.status_code in (401, 403):
        sent = f"refused the password of user '{credentials[0]}'" if credentials else "asks for a password, and none was found"
        raise StoreUnreachable(
            f"tracking.uri={uri}: the server {sent} (HTTP {answer.status_code}); set MLFLOW_TRACKING_USERNAME and "
            "MLFLOW_TRACKING_PASSWORD, or put them in ~/.mlflow/credentials (docs/mlflow.md, \"A server behind a "
            "password\")")
