"""MLflow in one place: one run per training job, with its config, per-step metrics and evaluations.

Runs are named `<study>/<cell>[/seed<k>]`, carry a description (the cell in words and the launch
command), `overrides.yaml` and Hydra's composed config as artifacts, and the experiment is tagged
as a model-training experiment, so the MLflow UI opens on its runs table.

Everything a later analysis needs is in the run: the resolved config as params and as a
YAML artifact, tags naming the study (`sweep`) and the grid cell (rho, L, c), per-step
metrics (SPEC 6), evaluation summaries as metrics and the per-prompt / per-repeat tables
as CSV artifacts. A run that raises is closed as FAILED with the reason in its `failure_reason` tag, a
stopped one (Ctrl-C, pre-emption) as KILLED, never left RUNNING; if the store refuses even that (full,
gone), `run_end.json` in the run folder says how it ended, for the next start of the cell.
"""

from __future__ import annotations

import fcntl
import logging
import math
import random
import socket
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import mlflow
from mlflow.entities import Metric
from mlflow.exceptions import MlflowException
from mlflow.tracking import MlflowClient
from omegaconf import DictConfig, OmegaConf

from src.paths import PROJECT_ROOT, is_source_checkout, workspace_root
from src.runs.diskspace import DiskFull, failed_path, out_of_space, writing
from src.runs.lifecycle import clear_run_end, write_run_end
from src.task.base import task_class
from src.settings import TrackingSettings

log = logging.getLogger(__name__)
FAILURE_TAG = "failure_reason"  # why a FAILED run could not continue (one line)
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


def run_tags(cfg: DictConfig, *, cell: str, cell_id: str, cell_key: str, variant: str) -> dict[str, str]:
    """Tags that name the study and the cell, so runs can be filtered without parsing params.

    The cell's name, identity and variant label come from the caller (`src.run` computes them with
    `src.study.sweep`): tracking only records what it is given.
    """
    task = task_class(cfg.get("task"))
    return {
        "sweep": str(cfg.tracking.sweep),
        "sweeps": f",{cfg.tracking.sweep},",  # every study this cell belongs to; the sweeper appends shared ones
        "cell": cell,
        "cell_id": cell_id,
        "cell_key": cell_key,  # the same for every training seed of the cell (analysis/seeds.py groups by it)
        "seed": str(cfg.trainer.seed),
        **paper_knobs(cfg),
        "buffer": str(cfg.buffer.name),
        "clip": str(cfg.clip.name),
        "loss": str(cfg.loss.name),
        "sampling": str(cfg.sampling.name),
        "behaviour": str(cfg.behaviour.name),
        "curriculum": str(cfg.curriculum.name),
        "variant": variant,
        "policy": str(cfg.policy.name_or_path),
        "hardware": str(cfg.hardware.name),
        "evaluation": str(cfg.evaluation.name),
        "runtime": str(cfg.runtime.name),
        "task": task.name,
        "task_suffix": task.cell_suffix,  # what the task adds to a grid cell's name ("-math"; Countdown: "")
    }


def paper_knobs(cfg: DictConfig) -> dict[str, str]:
    """The cell's knobs by the paper's names (rho, L, c), as tags and as params: the runs table's columns by
    those names, beside the config's own `buffer.ratio`, `buffer.max_age`, `clip.ceiling`."""
    return {"rho": f"{cfg.buffer.ratio:g}", "L": str(cfg.buffer.max_age), "c": f"{cfg.clip.ceiling:g}"}


# The experiment tag the MLflow UI (3.x) reads to choose between its GenAI view (traces, token usage)
# and its model-training view (the runs table); "custom_model_development" is the training kind.
EXPERIMENT_KIND_TAG = "mlflow.experimentKind"
TRAINING_EXPERIMENT_KIND = "custom_model_development"
# MLflow shows this tag as the run's description (the "Description" box of a run page).
DESCRIPTION_TAG = "mlflow.note.content"
DEFAULT_SEED = 0  # every trainer preset's seed: a run name carries /seed<k> only for another one


def run_name(study: str, cell: str, seed: int) -> str:
    """`<study>/<cell>` (e.g. `ratio/rho1-L2-c1`), with `/seed<k>` when the training seed is not the default 0."""
    return f"{study}/{cell}" + (f"/seed{seed}" if seed != DEFAULT_SEED else "")


def run_description(cell: str, variant: str, cfg: DictConfig, command: str) -> str:
    """The run page's description: the cell in words and the command that launched (and relaunches) it."""
    trainer = cfg.trainer
    replay = (f"rho = {cfg.buffer.ratio:g} reused groups per fresh group, max age L = {cfg.buffer.max_age}, "
              f"clip c = {cfg.clip.ceiling:g}" if cfg.buffer.ratio > 0 else "fresh-only (rho = 0)")
    return (f"**{variant}**, cell `{cell}` of study `{cfg.tracking.sweep}`: {replay}; loss {cfg.loss.name}, "
            f"{trainer.groups_per_step} groups x {trainer.group_size} responses, {trainer.steps} steps, "
            f"seed {trainer.seed}, policy `{cfg.policy.name_or_path}`, evaluation `{cfg.evaluation.name}`.\n\n"
            f"Launched with:\n\n```\n{command}\n```\n\n(the same command resumes it; `overrides.yaml` "
            "among the artifacts lists the overrides, `hydra/` the composed config)")


def flat_params(cfg: DictConfig) -> dict[str, str]:
    """The resolved config flattened to dotted keys (MLflow params are strings), without the `_target_`
    class paths: the runs table shows what a researcher set; `config.yaml` keeps the whole config."""
    flat: dict[str, str] = {}

    def walk(node, prefix: str) -> None:
        if isinstance(node, dict):
            for key, value in node.items():
                if key != "_target_":
                    walk(value, f"{prefix}{key}.")
        else:
            flat[prefix[:-1]] = str(node)

    walk(OmegaConf.to_container(cfg, resolve=True), "")
    return flat


def run_params(cfg: DictConfig) -> dict[str, str]:
    """A new run's params: the flat config without the launch-only `tracking.*` settings (config.yaml has
    them), and the paper's knobs by their short names."""
    params = {key: value for key, value in flat_params(cfg).items() if not key.startswith("tracking.")}
    return {**params, **paper_knobs(cfg)}


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


# Sample completions as MLflow tables (`mlflow.log_table` appends to an existing file); analysis/ reads
# these names and columns.
TRAIN_COMPLETIONS = "completions/train.json"
EVAL_COMPLETIONS = "completions/eval.json"
TRAIN_COLUMNS = ("step", "problem", "prompt", "response", "reward", "reason", "category", "source", "age", "weight")
EVAL_COLUMNS = ("step", "problem", "prompt", "response", "reward", "reason", "category")


def completion_rows(collection, task, count: int, max_new_tokens: int) -> list[dict]:
    """Up to `count` trained responses of a step (`src.train.Collection` after `learn`), one row each.

    The rows are a seeded draw over the batch's rows (the same ones when a resumed run redoes the step).
    The reward is the one trained on; the verifier's reason and the failure category (empty for a correct
    response) come from verifying the response again; the weight is the importance weight the gradient used
    (the mean over tokens where the objective weights tokens), NaN when nothing was trained.
    """
    batch, update, step = collection.batch, collection.update, collection.step
    entries = [(entry, j) for entry in batch.entries for j in entry.trained] if update is not None else \
        [(BatchEntry(group), j) for group in collection.collected.generated for j in range(group.size)]
    picked = sorted(random.Random(step).sample(range(len(entries)), min(count, len(entries))))
    rows = []
    for row in picked:
        entry, j = entries[row]
        group, response = entry.group, entry.group.responses[j]
        instance = task.instance_of(group)
        verdict = task.verify(response, instance)
        correct = group.rewards[j] == task.correct_reward
        truncated = len(group.response_ids[j]) >= max_new_tokens
        rows.append({"step": step, "problem": task.brief(instance), "prompt": group.prompt, "response": response,
                     "reward": group.rewards[j], "reason": verdict.reason,
                     "category": "" if correct else task.classify_failure(response, verdict, truncated),
                     "source": entry.source, "age": entry.age, "weight": row_weight(update, row)})
    return rows


def completion_line(row: dict, width: int = 160) -> str:
    """One completion row as console lines: the step (counted from 1, as the progress bar counts), the reward and
    where the response came from, then the prompt's end and the response, each cut to `width` characters."""
    def cut(text: str) -> str:
        text = " ".join(str(text).split())
        return text if len(text) <= width else text[: width - 3] + "..."

    reason = f", {row['category']}" if row["category"] else ""
    return (f"completion, step {row['step'] + 1}: reward {row['reward']:g} ({row['source']}, age {row['age']}{reason})"
            f"\n  prompt: ...{cut(row['prompt'][-width:])}\n  response: {cut(row['response'])}")


@dataclass(frozen=True)
class BatchEntry:
    """A generated group that no update trained on (its rows in the completions table)."""

    group: object
    source: str = "fresh"
    age: int = 0


def row_weight(update, row: int) -> float:
    """The importance weight an update used for a batch row; NaN without an update."""
    if update is None:
        return float("nan")
    if update.token_weights is not None:
        return float(update.token_weights[row].float().mean()) if len(update.token_weights[row]) else float("nan")
    return float(update.weights[row])


def log_completions(run_id: str, rows: list[dict], artifact_file: str) -> None:
    """Append rows to a run's completions table (MLflow reads the existing file and writes it back longer)."""
    if rows:
        import pandas as pd

        MlflowClient().log_table(run_id, data=pd.DataFrame(rows), artifact_file=artifact_file)


# The run page renders the description as markdown, folded to its first few lines: the latest step's completions
# go first, so a researcher reads what the policy writes without opening the artifacts; a rule parts them from
# the cell in words.
LATEST_HEADING = "**Latest completions**"
SECTION_END = "\n\n---\n\n"
RESPONSE_CHARS = 240  # a response's end in the description: the answer is there
# At most this many rows there: a row is up to about 500 characters, and MLflow keeps 8000 in a tag
# (MAX_TAG_VAL_LENGTH, mlflow/utils/validation.py:73), the cell's own description included.
DESCRIPTION_ROWS = 8


def markdown_cell(text, limit: int, tail: bool = False) -> str:
    """Text for one markdown table cell: one line, cut to `limit` characters (its end with `tail`), with the
    characters markdown or the page's HTML would take (`|`, `<think>`) written as entities."""
    text = " ".join(str(text).split())
    if len(text) > limit:
        text = "…" + text[-limit:] if tail else text[:limit] + "…"
    return text.replace("&", "&amp;").replace("<", "&lt;").replace(">", "&gt;").replace("|", "&#124;")


def completions_markdown(rows: list[dict]) -> str:
    """A step's completion rows (`completion_rows`) as the description's markdown section."""
    lines = [f"{LATEST_HEADING} (step {rows[0]['step']}; every step's are in `{TRAIN_COMPLETIONS}`)", "",
             "| problem | reward | verifier | source | response (its end) |", "|---|---|---|---|---|"]
    for row in rows[:DESCRIPTION_ROWS]:
        source = row["source"] + (f", age {row['age']}" if row["source"] != "fresh" else "")
        lines.append(f"| {markdown_cell(row['problem'], 120)} | {row['reward']:g} | {markdown_cell(row['reason'], 60)} "
                     f"| {source} | {markdown_cell(row['response'], RESPONSE_CHARS, True)} |")
    return "\n".join(lines)


def eval_completion_rows(result, step: int) -> list[dict]:
    """The evaluation's sample completions (`EvalResult.samples`) as rows of the eval completions table."""
    samples = getattr(result, "samples", None)
    if samples is None or samples.empty:
        return []
    return [{"step": step, **{column: record[column] for column in EVAL_COLUMNS[1:]}}
            for record in samples.to_dict("records")]


def summary_metrics(run_id: str, result, state, ks) -> dict[str, float]:
    """The run's headline results (SUMMARY_COLUMNS, the runs table's default columns): the final held-out
    evaluation's mean reward, pass@1 and pass@k at its largest k (`k`: one column for every protocol), the
    fresh verifier evaluations spent, and the wall time in minutes since the run was first opened (a resumed
    run's includes the time it was down), to a tenth of a minute.

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


def failure_reason(error: BaseException) -> str:
    """One line for the `failure_reason` tag: the error's class and first line."""
    first = (str(error).strip().splitlines() or [""])[0]
    text = first if isinstance(error, DiskFull) else f"{error.__class__.__name__}: {first}"
    return text[:500]


def close_active_run(run_id: str, status: str, reason: str | None = None) -> Exception | None:
    """End the active run `run_id` as `status`, the reason (if any) as its `failure_reason` tag.

    Returns the store's error if it refused (the run then stays RUNNING there); None if done, or if the run
    was no longer active. The run leaves MLflow's active stack either way, so nothing marks it FINISHED at exit."""
    active = mlflow.active_run()
    if active is None or active.info.run_id != run_id:
        return None
    problem = None
    if reason:
        try:
            mlflow.set_tag(FAILURE_TAG, reason)
        except Exception as error:  # noqa: BLE001  (still end it below)
            problem = error
    try:
        mlflow.end_run(status)  # pops the run first, then writes its status
    except Exception as error:  # noqa: BLE001
        problem = error
    return problem


def mark_failed(uri: str, run_id: str, reason: str) -> bool:
    """Close a run that is not this process's active one as FAILED, with `reason`; False if the store refused."""
    client = MlflowClient(uri)
    try:
        client.set_tag(run_id, FAILURE_TAG, reason[:500])
        if client.get_run(run_id).info.status != "FAILED":
            client.set_terminated(run_id, "FAILED")
        return True
    except Exception:  # noqa: BLE001  (a full or unreachable store: the caller reports the original problem)
        return False


def store_file(uri: str) -> str:
    """The SQLite file of a store URI, else the URI itself."""
    return uri.removeprefix("sqlite:///") if uri.startswith("sqlite:///") else uri


def disk_full_error(error: BaseException, uri: str) -> DiskFull | None:
    """`error` as DiskFull naming the path and the space needed, when it is a full disk; else None."""
    if isinstance(error, DiskFull) or not out_of_space(error):
        return error if isinstance(error, DiskFull) else None
    path = failed_path(error)
    if path is not None:
        return DiskFull("a file", path, None)
    return DiskFull("the MLflow store", store_file(uri), STORE_WRITE_BYTES)


def record_end(error: BaseException, run_id: str, folder: Path | None) -> None:
    """Close the active run after `error`: KILLED for a stop, else FAILED with the reason as a tag."""
    status = "FAILED" if isinstance(error, Exception) else "KILLED"
    reason = failure_reason(error) if status == "FAILED" else f"stopped ({error.__class__.__name__})"
    problem = close_active_run(run_id, status, reason if status == "FAILED" else None)
    if problem is not None:
        leave_run_end(run_id, status, reason, problem, folder)


def leave_run_end(run_id: str, status: str, reason: str, problem: Exception, folder: Path | None) -> None:
    """The store refused to record the run's end: say so in one line and leave `run_end.json` in its folder."""
    left = folder is not None and write_run_end(folder, run_id, status, reason)
    log.warning("the MLflow store refused to mark run %s %s (%s): it shows RUNNING until the next start of this "
                "cell, which %s", run_id, status, failure_reason(problem)[:200],
                f"reads {folder}/run_end.json" if left else "finds its process gone")


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


def ensure_experiment(uri: str, name: str, artifact_location: str | None) -> str:
    """The experiment id, creating the store and the experiment (with its artifact folder) on first use."""
    mlflow.set_tracking_uri(uri)
    with sqlite_store_lock(uri):
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


# MLflow 3.17's UI picks its GenAI or model-training navigation from a global switch: the `workflowType` URL
# parameter, else the browser's saved choice (local storage `mlflow.workflowType_v1`), GenAI at first
# (server/js/build/static/js/main.*.js, module 7975), not from the experiment's kind tag.
TRAINING_MODE = "workflowType=machine_learning"
# The runs table's columns come from the browser's saved view of the experiment, else Source, Models and
# Dataset: `make ui` (src/runs/ui_app.py) saves the study's columns where a browser has no view of its own.
# The cell's knobs are params (rho, L, c, then the buffer, the loss, the runtime), the results `summary_metrics`:
# the paper's knobs, then the results, then the names, so a 1600 px window shows the knobs and the results.
KNOB_COLUMNS = ("rho", "L", "c")
NAME_COLUMNS = ("buffer.name", "loss.name", "runtime.name")
SUMMARY_COLUMNS = ("pass_at_1", "pass_at_k", "k", "final_reward", "fresh_evals", "wall_time_min")


def study_columns() -> list[str]:
    """The runs table's columns in the study view, as the UI names them (`<type>.\`<key>\``)."""
    return ["attributes.`Source`", *[f"params.`{key}`" for key in KNOB_COLUMNS],
            *[f"metrics.`{key}`" for key in SUMMARY_COLUMNS], *[f"params.`{key}`" for key in NAME_COLUMNS]]


def experiment_page(experiment_id: str) -> str:
    """The UI route (after `#/`) of an experiment's runs table, in model-training mode."""
    return f"experiments/{experiment_id}/runs?{TRAINING_MODE}"


def run_page(experiment_id: str, run_id: str) -> str:
    """The UI route (after `#/`) of a run's page, in model-training mode."""
    return f"experiments/{experiment_id}/runs/{run_id}?{TRAINING_MODE}"


UI_PORT = 5050  # the Makefile's PORT
UI_ADDRESS = f"http://127.0.0.1:{UI_PORT}"  # where `make ui` serves the embedded store


def run_link(uri: str, run_id: str) -> str:
    """A run's page in the MLflow UI, in model-training mode: on the tracking server when runs go to one,
    else where `make ui` serves the store."""
    base = uri.rstrip("/") if uri.startswith(("http://", "https://")) else UI_ADDRESS
    return f"{base}/#/{run_page(MlflowClient().get_run(run_id).info.experiment_id, run_id)}"


def ui_command(uri: str, artifact_location: str | None, out: str) -> str | None:
    """The command that serves this store at UI_ADDRESS, typed in the working directory; None for a tracking
    server, which serves its own UI. A store laid out as `out` lays it out needs only OUT=; the project's own
    store nothing. Outside the project folder make is pointed at its Makefile (-C)."""
    if uri.startswith(("http://", "https://")):
        return None
    if not is_source_checkout(PROJECT_ROOT):  # an installed package has no Makefile
        artifacts = f" --default-artifact-root {artifact_location}" if artifact_location else ""
        return f"python -m src.runs.ui_app ui --backend-store-uri {uri}{artifacts} --port {UI_PORT}"
    if uri == f"sqlite:///{out}/mlruns.db" and artifact_location == f"{out}/mlartifacts":
        variables = "" if Path(out) == workspace_root() else f" OUT={out}"
    else:
        variables = f" UI_STORE={uri}" + (f" UI_ARTIFACTS={artifact_location}" if artifact_location else "")
    make = "make" if Path.cwd().resolve() == PROJECT_ROOT else f"make -C {PROJECT_ROOT}"
    return f"{make} ui{variables}"


def ui_url(base: str, uri: str, experiment: str) -> str:
    """The MLflow UI address of the experiment's runs table, in model-training mode; the
    experiments list when the store has no such experiment yet."""
    found = MlflowClient(uri).get_experiment_by_name(experiment) if Path(uri.removeprefix("sqlite:///")).exists() \
        or not uri.startswith("sqlite:///") else None
    page = experiment_page(found.experiment_id) if found is not None else f"experiments?{TRAINING_MODE}"
    return f"{base.rstrip('/')}/#/{page}"


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

    try:
        requests.get(uri.rstrip("/") + "/health", timeout=timeout_s)  # any HTTP answer means a server is there
    except requests.RequestException as error:
        raise StoreUnreachable(
            f"tracking.uri={uri}: no MLflow server answers within {timeout_s:g} s ({error.__class__.__name__}). "
            "Start it (make mlflow-server), or set tracking.uri to a running server or a "
            "sqlite:///path/mlruns.db file") from None


@dataclass
class RunLabels:
    """What names a run in MLflow, computed by the caller: tags, the run name and the description, and what a new
    run logs once: its params and its resolved config (config.yaml)."""

    tags: dict[str, str]
    name: str
    description: str
    params: dict[str, str]
    config: str


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
