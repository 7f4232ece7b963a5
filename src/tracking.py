"""MLflow in one place: one run per training job, with its config, per-step metrics and evaluations.

Everything a later analysis needs is in the run: the resolved config as params and as a
YAML artifact, tags naming the study (`sweep`) and the grid cell (rho, L, c), per-step
metrics (SPEC 6), evaluation summaries as metrics and the per-prompt / per-repeat tables
as CSV artifacts. A run that raises is closed as FAILED, never left RUNNING.
"""

from __future__ import annotations

import fcntl
import math
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import mlflow
from mlflow.entities import Metric
from mlflow.tracking import MlflowClient
from omegaconf import DictConfig, OmegaConf

from src.sweep import cell_identity, cell_name, variant_label


def run_tags(cfg: DictConfig) -> dict[str, str]:
    """Tags that name the study and the cell, so runs can be filtered without parsing params."""
    return {
        "sweep": str(cfg.tracking.sweep),
        "sweeps": f",{cfg.tracking.sweep},",  # every study this cell belongs to; the sweeper appends shared ones
        "cell": cell_name(cfg),
        "cell_id": cell_identity(cfg),
        "rho": f"{cfg.buffer.ratio:g}",
        "L": str(cfg.buffer.max_age),
        "c": f"{cfg.clip.ceiling:g}",
        "buffer": str(cfg.buffer.name),
        "clip": str(cfg.clip.name),
        "loss": str(cfg.loss.name),
        "sampling": str(cfg.sampling.name),
        "behaviour": str(cfg.behaviour.name),
        "curriculum": str(cfg.curriculum.name),
        "variant": variant_label(cfg),
        "policy": str(cfg.policy.name_or_path),
        "hardware": str(cfg.hardware.name),
        "evaluation": str(cfg.evaluation.name),
    }


def flat_params(cfg: DictConfig) -> dict[str, str]:
    """The resolved config flattened to dotted keys (MLflow params are strings)."""
    flat: dict[str, str] = {}

    def walk(node, prefix: str) -> None:
        if isinstance(node, dict):
            for key, value in node.items():
                walk(value, f"{prefix}{key}.")
        else:
            flat[prefix[:-1]] = str(node)

    walk(OmegaConf.to_container(cfg, resolve=True), "")
    return flat


def metric_key(name: str) -> str:
    """MLflow metric names cannot hold '@': pass@16 is logged as pass_at_16."""
    return name.replace("@", "_at_")


def finite(metrics: dict[str, float]) -> dict[str, float]:
    """Finite values only, under MLflow-safe names (a NaN half-width with one repeat is simply absent)."""
    return {metric_key(key): float(value) for key, value in metrics.items()
            if value is not None and math.isfinite(value)}


def log_evaluation(run_id: str, result, stage: str, step: int) -> None:
    """Summary metrics as `<protocol>/<stage>/<metric>`, the seed range as a tag, tables as CSV artifacts.

    Goes through the client, not the active run, so `src.evaluate` can add results to a
    finished run without reopening it (a failed evaluation never marks that run FAILED).
    """
    client = MlflowClient()
    timestamp = int(time.time() * 1000)
    prefix = f"{result.name}/{stage}"
    summary = finite({f"{prefix}/{key}": value for key, value in result.summary.items()})
    client.log_batch(run_id, metrics=[Metric(key, value, timestamp, step) for key, value in summary.items()])
    seeds = result.per_repeat["seed"].astype(int)
    client.set_tag(run_id, f"eval.{result.name}.seeds", f"{seeds.min()}-{seeds.max()}")
    with tempfile.TemporaryDirectory() as folder:
        for table_name, table in (("per_prompt", result.per_prompt), ("per_repeat", result.per_repeat)):
            # Learning-curve evaluations happen at several steps: keep each one's tables.
            label = f"{stage}_step{step}" if stage == "during" else stage
            path = Path(folder) / f"{result.name}_{label}_{table_name}.csv"
            table.to_csv(path, index=False)
            client.log_artifact(run_id, str(path), artifact_path="evaluation")


class Tracker:
    """Logging calls the training loop makes; a thin layer over the active MLflow run."""

    def __init__(self, run_id: str):
        self.run_id = run_id

    def log_step(self, metrics: dict[str, float], step: int) -> None:
        mlflow.log_metrics(finite(metrics), step=step)

    def log_evaluation(self, result, stage: str, step: int) -> None:
        log_evaluation(self.run_id, result, stage, step)

    def set_tags(self, tags: dict[str, str]) -> None:
        mlflow.set_tags(tags)


def end_run(status: str) -> None:
    """End the active run with this status (e.g. KILLED on pre-emption: the run resumes later)."""
    mlflow.end_run(status)


@contextmanager
def sqlite_store_lock(uri: str) -> Iterator[None]:
    """Serialise creating a SQLite store and its experiment: runs launched together would race on the schema."""
    if not uri.startswith("sqlite:///"):
        yield
        return
    lock_path = Path(uri.removeprefix("sqlite:///") + ".lock")
    lock_path.parent.mkdir(parents=True, exist_ok=True)
    with open(lock_path, "w") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def ensure_experiment(uri: str, name: str, artifact_location: str | None) -> str:
    """The experiment id, creating the store and the experiment (with its artifact folder) on first use."""
    mlflow.set_tracking_uri(uri)
    with sqlite_store_lock(uri):
        client = MlflowClient(uri)
        experiment = client.get_experiment_by_name(name)
        if experiment is not None:
            return experiment.experiment_id
        location = artifact_location
        if artifact_location and "://" not in artifact_location:
            location = Path(artifact_location).as_uri()
        return client.create_experiment(name, artifact_location=location)


@contextmanager
def start_run(cfg: DictConfig, resume_run_id: str | None = None) -> Iterator[Tracker]:
    """Open (or reopen, when resuming) the MLflow run for this job; FAILED if the body raises."""
    experiment_id = ensure_experiment(cfg.tracking.uri, cfg.tracking.experiment, cfg.tracking.artifact_location)
    run_name = cfg.tracking.run_name or cell_name(cfg)
    if resume_run_id:
        context = mlflow.start_run(run_id=resume_run_id)
    else:
        context = mlflow.start_run(experiment_id=experiment_id, run_name=run_name, tags=run_tags(cfg))
    with context as run:
        if not resume_run_id:
            mlflow.log_params(flat_params(cfg))
            mlflow.log_text(OmegaConf.to_yaml(cfg, resolve=True), "config.yaml")
        yield Tracker(run.info.run_id)
