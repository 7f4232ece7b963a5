"""`mlflow ui` / `mlflow server` serving a landing page that opens on the study (`make ui`, `make mlflow-server`).

    python -m src.runs.ui_app ui --backend-store-uri sqlite:///mlruns.db --port 5050 ...   # any `mlflow` arguments

The MLflow UI opens in its GenAI mode (traces, prompts) unless the URL or the browser's saved choice
says otherwise, and its runs table shows no knob or result column. The project's links carry both (see
`src.runs.links.experiment_page`); this app makes the bare address do the same: the server's page gets a
few lines of script that save, where the browser has no choice of its own, model-training mode and the
study's columns for the project's experiment (`REPLAY_RLOO_EXPERIMENT`, set by `src.runs.serve`), and send
the home route to that experiment's runs table. Everything else is MLflow's own app, unchanged.
"""

from __future__ import annotations

import json
import os
import sys
import warnings
from pathlib import Path

EXPERIMENT_ENV = "REPLAY_RLOO_EXPERIMENT"  # the experiment whose study view the home route opens
MLFLOW_APP = "mlflow.server.fastapi_app:app"
THIS_APP = "src.runs.ui_app:create_app"
# Runs before MLflow's script on every page load (the UI routes after `#`): the UI reads its mode, and an
# experiment's runs-table view, from local storage when the URL has none; a browser's own choices stay.
OPENING = """<script>(function () {
  var saved = %s, page = %s, first = %s;
  for (var key in saved) if (window.localStorage.getItem(key) === null) window.localStorage.setItem(key, saved[key]);
  if (page && (window.location.hash === "" || window.location.hash === "#" || window.location.hash === "#/"))
    window.location.replace("#/" + page);
  function rank(name) {
    for (var i = 0; i < first.length; i++) if (name === first[i] || name.indexOf(first[i] + "/") === 0) return i;
    return first.length;
  }
  function reorder() {
    for (var i = 0; i < window.localStorage.length; i++) {
      var key = window.localStorage.key(i);
      if (!/^MLflowLocalStorage-1\\.1-RunPage-.*-model-chartUIState$/.test(key)) continue;
      var state = JSON.parse(window.localStorage.getItem(key));
      if (state.isAccordionReordered || !state.compareRunSections) continue;
      state.compareRunSections = state.compareRunSections.map(function (section, index) {
        return [rank(section.name), index, section];
      }).sort(function (a, b) { return a[0] - b[0] || a[1] - b[1]; }).map(function (ranked) { return ranked[2]; });
      state.isAccordionReordered = true;
      window.localStorage.setItem(key, JSON.stringify(state));
      window.location.reload();
      return;
    }
  }
  var tries = 0, timer = window.setInterval(function () { if (++tries > 100) window.clearInterval(timer); reorder(); }, 300);
})();</script>"""
# A run page's chart sections come in alphabetical order (batch, budget, buffer, ... train): once MLflow has laid
# them out, the script moves these first, as if dragged there by hand (a reader's own order stays). The run's
# headline metrics (pass_at_1, ...: links.SUMMARY_COLUMNS) have no prefix: MLflow puts them in "Model metrics".
FIRST_SECTIONS = ["train/reward", "train", "Model metrics", "canonical", "quick", "seed001-pass1", "seed001-passk", "probe"]
# The assistant panel opens by itself on a first visit, over a third of the page: closed, as if closed by hand.
ASSISTANT_CLOSED = {"mlflow.assistant.panelOpen_v1": "false", "mlflow.assistant.fab.autoOpenedOnFirstLoad_v1": "true"}
# The runs-table view MLflow 3.17 saves per experiment (what its Columns menu writes), with the study's columns.
VIEW_KEY = 'MLflowLocalStorage-1.1-ExperimentPage-["%s"]-ReactComponentState'
VIEW = {"searchFilter": "", "orderByKey": "attributes.start_time", "orderByAsc": False, "startTime": "ALL",
        "lifecycleFilter": "Active", "datasetsFilter": [], "modelVersionFilter": "All Runs", "columnOrder": [],
        "columnWidths": {}, "runsExpanded": {}, "runsPinned": [], "runsHidden": [], "runsVisibilityMap": {},
        "runsHiddenMode": "FIRST_10_RUNS", "viewMaximized": False, "runListHidden": False,
        "isAccordionReordered": False, "useGroupedValuesInCharts": True, "hideEmptyCharts": True, "groupBy": None,
        "groupsExpanded": {}, "autoRefreshEnabled": True,
        "globalLineChartConfig": {"xAxisKey": "step", "lineSmoothness": 0, "selectedXAxisMetricKey": ""}}


# MLflow gives every column 100 px: the knobs and k (a number or two) get less, the longer headline names more,
# so a 1600 px window shows the knobs and every result whole.
COLUMN_WIDTHS = {**{column: 64 for column in ["params.`rho`", "params.`L`", "params.`c`", "metrics.`k`"]},
                 **{column: 124 for column in ["metrics.`final_reward`", "metrics.`fresh_evals`",
                                               "metrics.`wall_time_min`"]}}


def landing_page(index_html: str, experiment_id: str | None) -> str:
    """MLflow's index.html with the opening script first in its head: model-training mode, and for the
    project's experiment (when given) the study's columns and the home route sent to its runs table."""
    from src.runs.links import experiment_page, study_columns

    saved = {"mlflow.workflowType_v1": json.dumps("machine_learning"), **ASSISTANT_CLOSED}
    if experiment_id is not None:
        saved[VIEW_KEY % experiment_id] = json.dumps({**VIEW, "selectedColumns": study_columns(),
                                                      "columnOrder": study_columns(), "columnWidths": COLUMN_WIDTHS})
    page = experiment_page(experiment_id) if experiment_id is not None else None
    opening = OPENING % (json.dumps(saved), json.dumps(page), json.dumps(FIRST_SECTIONS))
    return index_html.replace("<head>", "<head>" + opening, 1)


def study_experiment() -> str | None:
    """The id of the configured experiment in this server's store; None without one."""
    from mlflow.server import BACKEND_STORE_URI_ENV_VAR
    from mlflow.tracking import MlflowClient

    name, store = os.environ.get(EXPERIMENT_ENV), os.environ.get(BACKEND_STORE_URI_ENV_VAR)
    if not name or not store:
        return None
    try:
        found = MlflowClient(store).get_experiment_by_name(name)
    except Exception:  # noqa: BLE001  (no store yet: the home route stays MLflow's)
        return None
    return found.experiment_id if found is not None else None


def create_app():
    """MLflow's ASGI app, with GET / answered by the landing page (uvicorn calls this in each worker)."""
    # MLflow's app imports starlette.middleware.wsgi, which warns (a UserWarning, so shown) in each of the 4
    # workers that its module is deprecated: nothing a user of `make ui` can act on.
    warnings.filterwarnings("ignore", message="starlette.middleware.wsgi is deprecated", category=UserWarning)
    import mlflow.server
    from mlflow.server.fastapi_app import app as mlflow_app
    from starlette.responses import HTMLResponse

    index = (Path(mlflow.server.__file__).parent / "js" / "build" / "index.html").read_text()
    prefix = os.environ.get(mlflow.server.STATIC_PREFIX_ENV_VAR, "").rstrip("/")
    home = {prefix + "/", prefix or "/"}

    async def app(scope, receive, send):
        if scope["type"] == "http" and scope["method"] in ("GET", "HEAD") and scope["path"] in home:
            response = HTMLResponse(landing_page(index, study_experiment()), headers={"Cache-Control": "no-cache"})
            await response(scope, receive, send)
        else:
            await mlflow_app(scope, receive, send)

    return app


# MLflow's server runs GenAI jobs (scorers, prompt optimisation, issue detection, GenAI evaluation:
# mlflow/server/jobs/__init__.py, `_SUPPORTED_JOB_FUNCTION_LIST`) in a job runner and one Huey consumer process
# per kind of job, each importing MLflow: about 30 s of CPU at every start and seven processes the whole time,
# for features no run of this project uses. Off unless the user's environment turns them on.
JOB_EXECUTION_ENV = "MLFLOW_SERVER_ENABLE_JOB_EXECUTION"


def without_job_runners(environ: dict) -> None:
    """Turn MLflow's job execution off in `environ`, unless it already says."""
    environ.setdefault(JOB_EXECUTION_ENV, "false")


def one_worker_for_the_ui(argv: list[str]) -> list[str]:
    """`mlflow ui` with no worker count gets one: a browser on this machine, where MLflow would start four uvicorn
    workers, each importing its server (seconds of CPU and hundreds of MB apiece). `mlflow server` keeps MLflow's."""
    given = any(word in ("--workers", "-w") or word.startswith("--workers=") for word in argv)
    return [*argv, "--workers", "1"] if argv[:1] == ["ui"] and not given else argv


def main(argv: list[str]) -> None:
    """The `mlflow` command line, with this app in place of MLflow's own in the uvicorn command it builds."""
    without_job_runners(os.environ)
    argv = one_worker_for_the_ui(argv)
    import mlflow.server
    from mlflow.cli import cli

    build = mlflow.server._build_uvicorn_command  # the one place `mlflow server` names the app it runs

    def with_this_app(uvicorn_opts, host, port, workers, app_name, env_file=None, is_factory=False):
        if app_name == MLFLOW_APP:
            app_name, is_factory = THIS_APP, True
        return build(uvicorn_opts, host, port, workers, app_name, env_file, is_factory)

    mlflow.server._build_uvicorn_command = with_this_app
    cli.main(args=argv, prog_name="mlflow")


if __name__ == "__main__":
    main(sys.argv[1:])
