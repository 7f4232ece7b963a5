"""One MLflow run per training job: opened (or reopened) for it, its per-step metrics and evaluations logged into
it, closed as it ends.

A run carries its labels (`src.runs.naming`), `overrides.yaml` and Hydra's composed config as artifacts, per-step
metrics (SPEC 6), evaluation summaries as metrics and the per-prompt / per-repeat tables as CSV artifacts, and
its sample completions (`src.runs.completions`). A resumed run does not log the steps it redoes again; it
compares them with the logged values. A run that raises is closed as FAILED, a stopped one as KILLED
(`src.runs.ending`).
"""

from __future__ import annotations

import logging
import math
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import mlflow
from mlflow.entities import Metric
from mlflow.tracking import MlflowClient

from src.runs.artifacts import artifact_folder, overrides_yaml
from src.runs.completions import (EVAL_COMPLETIONS, LATEST_HEADING, SECTION_END, TRAIN_COMPLETIONS,
                                  completions_markdown, eval_completion_rows, log_completions)
from src.runs.diskspace import writing
from src.runs.ending import FAILURE_TAG, close_active_run, disk_full_error, failure_reason, leave_run_end, record_end
from src.runs.lifecycle import clear_run_end
from src.runs.naming import DESCRIPTION_TAG, RunLabels
from src.runs.store import ensure_experiment
from src.settings import TrackingSettings

log = logging.getLogger(__name__)


def metric_key(name: str) -> str:
    """MLflow metric names cannot hold '@': pass@16 is logged as pass_at_16."""
    return name.replace("@", "_at_")


def finite(metrics: dict[str, float]) -> dict[str, float]:
    """Finite values only, under MLflow-safe names (a NaN half-width with one repeat is simply absent)."""
    return {metric_key(key): float(value) for key, value in metrics.items()
            if value is not None and math.isfinite(value)}


def log_evaluation(run_id: str, result, stage: str, step: int) -> None:
    """Summary metrics as `<protocol>/<stage>/<metric>`, the seed range as a tag, tables as CSV artifacts,
    the sample completions (`result.samples`) appended to `completions/eval.json`.

    Goes through the client, not the active run, so `src.eval.standalone` can add results to a
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
            with writing("an evaluation table", artifact_folder(run_id) / "evaluation", path.stat().st_size):
                client.log_artifact(run_id, str(path), artifact_path="evaluation")
    log_completions(run_id, eval_completion_rows(result, step), EVAL_COMPLETIONS)


def summary_metrics(run_id: str, result, state, ks) -> dict[str, float]:
    """The run's headline results (SUMMARY_COLUMNS in src/runs/links.py, the runs table's default columns): the
    final held-out evaluation's mean reward, pass@1 and pass@k at its largest k (`k`: one column for every
    protocol), the fresh verifier evaluations spent, and the wall time in minutes since the run was first opened
    (a resumed run's includes the time it was down), to a tenth of a minute.

    Short names, without a shared prefix: the runs table cuts a header to its column's width, and
    `summary/pass_at_1` and `summary/pass_at_k` both read `summary/pass_…` there."""
    started = MlflowClient().get_run(run_id).info.start_time
    k = max(ks)
    values = {"pass_at_1": result.summary.get("pass@1"), "pass_at_k": result.summary.get(f"pass@{k}"), "k": k,
              "final_reward": result.summary.get("mean_reward"), "fresh_evals": state.fresh_evaluations,
              "wall_time_min": round((time.time() - started / 1000) / 60, 1)}
    return finite(values)


# Metrics that measure the machine, not the computation: a redone step may differ in them.
UNREPEATABLE = ("time/",)


class Tracker:
    """Logging calls the training loop makes; a thin layer over the active MLflow run.

    A resumed run redoes the steps between its checkpoint and its death, and MLflow keeps every
    value ever logged, so those steps (up to `logged_until`) are not logged again; their values
    are compared with the logged ones instead (they are equal by construction: generation seeds
    come from (seed, step)), and a difference is reported loudly.
    """

    def __init__(self, run_id: str, logged_until: int = -1):
        self.run_id = run_id
        self.logged_until = logged_until
        self.redone_mismatches: list[str] = []
        self._history: dict[str, dict[int, float]] = {}
        self._description: str | None = None  # the run's description without its completions section

    def log_step(self, metrics: dict[str, float], step: int) -> None:
        values = finite(metrics)
        if step > self.logged_until:
            mlflow.log_metrics(values, step=step)
            return
        for key, value in values.items():
            if key.startswith(UNREPEATABLE):
                continue
            logged = self._logged(key).get(step)
            if logged is None or not math.isclose(logged, value, rel_tol=1e-9, abs_tol=1e-12):
                self.redone_mismatches.append(f"{key} at step {step}: logged {logged}, recomputed {value}")
                log.error("RESUME MISMATCH in run %s: %s at step %d was logged as %s before the restart but "
                          "recomputes as %s; the logged value is kept (is this the same code, config and "
                          "hardware?)", self.run_id, key, step, logged, value)

    def _logged(self, key: str) -> dict[int, float]:
        if key not in self._history:
            history = MlflowClient().get_metric_history(self.run_id, key)
            self._history[key] = {metric.step: metric.value for metric in history}
        return self._history[key]

    def has_metric_at(self, key: str, step: int) -> bool:
        """Whether the run already holds `key` at `step` (a redone evaluation is skipped, not logged twice)."""
        return step <= self.logged_until + 1 and step in self._logged(metric_key(key))

    def log_evaluation(self, result, stage: str, step: int) -> None:
        log_evaluation(self.run_id, result, stage, step)

    def log_completions(self, rows: list[dict], step: int) -> None:
        """A step's sample completions, after its metrics: a step a resumed run redoes is not logged again.
        They go to the completions table and, in place of the previous step's, into the run's description."""
        if step > self.logged_until and rows:
            log_completions(self.run_id, rows, TRAIN_COMPLETIONS)
            if self._description is None:
                described = MlflowClient().get_run(self.run_id).data.tags.get(DESCRIPTION_TAG, "")
                self._description = described.split(SECTION_END, 1)[-1] if described.startswith(LATEST_HEADING) \
                    else described
            MlflowClient().set_tag(self.run_id, DESCRIPTION_TAG,
                                   completions_markdown(rows) + SECTION_END + self._description)

    def log_summary(self, result, state, ks) -> None:
        """The headline metrics at the run's last step (see `summary_metrics`)."""
        mlflow.log_metrics(summary_metrics(self.run_id, result, state, ks), step=state.step)

    def set_tags(self, tags: dict[str, str]) -> None:
        mlflow.set_tags(tags)


def last_logged_step(run_id: str, key: str = "train/reward") -> int:
    """The highest step of `key` in the run's history; -1 if it has none."""
    return max((metric.step for metric in MlflowClient().get_metric_history(run_id, key)), default=-1)


@contextmanager
def start_run(where: TrackingSettings, labels: RunLabels, resume_run_id: str | None = None,
              hydra_output_dir: Path | None = None, overrides: list[str] | None = None,
              folder: Path | None = None) -> Iterator[Tracker]:
    """Open (or reopen, when resuming) the MLflow run for this job; FAILED with its reason if the body raises,
    KILLED if it is stopped (SystemExit, KeyboardInterrupt), FINISHED otherwise.

    `hydra_output_dir` (the job's folder, holding Hydra's `.hydra/`) and `overrides` (the job's
    command-line overrides) are logged as artifacts, so the run says how to rerun it. `folder` is the
    run's own folder (checkpoints, heartbeat): where `run_end.json` goes if the store refuses the end.
    A full disk (store, artifacts, checkpoint) is raised as DiskFull naming the path and the space needed.
    """
    experiment_id = ensure_experiment(where.uri, where.experiment, where.artifact_location)
    logged_until = last_logged_step(resume_run_id) if resume_run_id else -1
    if resume_run_id:
        run = mlflow.start_run(run_id=resume_run_id)
    else:
        run = mlflow.start_run(experiment_id=experiment_id, run_name=where.run_name or labels.name,
                               tags={**labels.tags, DESCRIPTION_TAG: labels.description})
    run_id = run.info.run_id
    try:
        if FAILURE_TAG in run.data.tags:  # it continues: the earlier failure is over
            MlflowClient().delete_tag(run_id, FAILURE_TAG)
        if folder is not None:
            clear_run_end(folder, run_id)
        if not resume_run_id:
            mlflow.log_params(labels.params)
            mlflow.log_text(labels.config, "config.yaml")
        if overrides is not None:
            mlflow.log_text(overrides_yaml(overrides), "overrides.yaml")
        if hydra_output_dir is not None and (hydra_output_dir / ".hydra").is_dir():
            mlflow.log_artifacts(str(hydra_output_dir / ".hydra"), artifact_path="hydra")
        yield Tracker(run_id, logged_until)
    except BaseException as error:
        full = disk_full_error(error, where.uri) if isinstance(error, Exception) else None
        record_end(full or error, run_id, folder)
        if full is not None and full is not error:
            raise full from None
        raise
    problem = close_active_run(run_id, "FINISHED")
    if problem is not None:  # done but not recorded: the next start redoes the end from the final checkpoint
        problem = disk_full_error(problem, where.uri) or problem
        leave_run_end(run_id, "FAILED", f"the store refused FINISHED: {failure_reason(problem)}", problem, folder)
        raise problem
