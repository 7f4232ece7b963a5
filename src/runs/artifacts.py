"""Files a run keeps as MLflow artifacts beside its metrics: how to rerun it, the async pipeline's logs, and
the trained policy (uploaded when small, else named by host and path)."""

from __future__ import annotations

import socket
from pathlib import Path

from mlflow.tracking import MlflowClient
from omegaconf import OmegaConf

from src.runs.diskspace import writing


def artifact_folder(run_id: str) -> Path:
    """The run's artifact folder (a local path for a file store; the URI otherwise, for messages)."""
    uri = MlflowClient().get_run(run_id).info.artifact_uri
    return Path(uri.removeprefix("file://")) if uri.startswith(("file://", "/")) else Path(uri)


def overrides_yaml(overrides: list[str]) -> str:
    """The job's overrides as Hydra writes them (`.hydra/overrides.yaml`), with the command that reruns it."""
    command = " ".join(["python -m src.run", *overrides])
    return f"# rerun (or resume) with:\n#   {command}\n" + OmegaConf.to_yaml(OmegaConf.create(list(overrides)))


def log_run_artifact(run_id: str, path: Path, folder: str) -> None:
    """One file as an artifact of the run, under `folder` (the async pipeline's event log and distributions)."""
    MlflowClient().log_artifact(run_id, str(path), artifact_path=folder)


def log_final_policy(run_id: str, folder: Path, max_artifact_mb: float) -> dict[str, str]:
    """Make the trained policy findable from the run: upload it when small, else point at shared storage.

    A remote reader of the tracking server cannot open a local path, so a policy up to
    `max_artifact_mb` is logged as the run's `policy/` artifact (`mlflow artifacts download -r <id>
    -a policy`); a larger one (Qwen at fp32 is GBs) stays on disk and the tags name the host and
    path. Returns the tags set.
    """
    size = sum(path.stat().st_size for path in folder.rglob("*") if path.is_file())
    size_mb = size / 2**20
    tags = {"final_policy": str(folder), "final_policy_host": socket.gethostname(),
            "final_policy_mb": f"{size_mb:.1f}"}
    if size_mb <= max_artifact_mb:
        with writing("the final policy's artifact copy", artifact_folder(run_id), size):
            MlflowClient().log_artifacts(run_id, str(folder), artifact_path="policy")
        tags["final_policy_artifact"] = f"runs:/{run_id}/policy"
    else:
        tags["final_policy_artifact"] = (f"not uploaded ({size_mb:.0f} MB > tracking.policy_artifact_max_mb="
                                         f"{max_artifact_mb:g}): {socket.gethostname()}:{folder}")
    client = MlflowClient()
    for key, value in tags.items():
        client.set_tag(run_id, key, value)
    return tags
