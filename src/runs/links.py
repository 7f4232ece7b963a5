"""Addresses in the MLflow UI: a run's page and an experiment's runs table, in model-training mode with the
study's columns, and the command that serves a store there (`make ui`)."""

from __future__ import annotations

from pathlib import Path

from mlflow.tracking import MlflowClient

from src.paths import PROJECT_ROOT, is_source_checkout, workspace_root
from src.runs import store  # noqa: F401  (MLflow's store logger quieted before `ui_url` opens a store)


# MLflow 3.17's UI picks its GenAI or model-training navigation from a global switch: the `workflowType` URL
# parameter, else the browser's saved choice (local storage `mlflow.workflowType_v1`), GenAI at first
# (server/js/build/static/js/main.*.js, module 7975), not from the experiment's kind tag.
TRAINING_MODE = "workflowType=machine_learning"
# The runs table's columns come from the browser's saved view of the experiment, else Source, Models and
# Dataset: `make ui` (src/runs/ui_app.py) saves the study's columns where a browser has no view of its own.
# The cell's knobs are params (rho, L, c, then the buffer, the loss, the runtime), the results `summary_metrics`
# (src/runs/tracking.py): the paper's knobs, then the results, then the names, so a 1600 px window shows the knobs
# and the results.
KNOB_COLUMNS = ("rho", "L", "c")
NAME_COLUMNS = ("buffer.name", "loss.name", "runtime.name")
SUMMARY_COLUMNS = ("pass_at_1", "pass_at_k", "k", "final_reward", "fresh_evals", "wall_time_min")


def study_columns() -> list[str]:
    """The runs table's columns in the study view, as the UI names them: the type, a dot, the key in backquotes
    (attributes.`Source`)."""
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
