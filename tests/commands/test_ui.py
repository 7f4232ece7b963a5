"""`make ui` in a real browser: headless Chromium (Debian's chromium + chromium-driver, installed with apt-get
when missing) opens the landing page and a run's page of a store holding a 1-step run; the runs table shows
the cell's knobs (rho, L, c) and the run's headline results, in model-training mode, each header whole in a
1600 px window. Screenshots go to the test's
folder (and to $UI_SCREENSHOTS when set, to look at them)."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest

from mlflow.tracking import MlflowClient

from src.runs import links
from src.runs.store import ensure_experiment
from src.paths import PROJECT_ROOT
from tests.ports import free_port

BROWSER_PACKAGES = ("chromium", "chromium-driver")
FLAGS = ("--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
         "--disable-background-networking", "--disable-component-update", "--disable-sync",
         "--window-size=1600,900")  # a laptop-wide window: the runs table renders only the columns in view
TRAINING_ONLY = "Model registry"  # the side bar's entry in model-training mode (MLflow 3.17 hides it in GenAI mode)


def ensure_browser() -> tuple[str, str]:
    """Chromium and its driver, installed with apt-get when missing (idempotent); skip only without apt-get."""
    found = shutil.which("chromium"), shutil.which("chromedriver")
    if all(found):
        return found
    if shutil.which("apt-get") is None or os.geteuid() != 0:
        pytest.skip(f"headless Chromium: {' and '.join(BROWSER_PACKAGES)} missing and no apt-get (as root) to "
                    "install them")
    env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
    install = ["apt-get", "install", "-y", "-q", "--no-install-recommends", *BROWSER_PACKAGES]
    if subprocess.run(install, env=env, capture_output=True).returncode != 0:  # a fresh machine: no package lists
        subprocess.run(["apt-get", "update", "-q"], env=env, capture_output=True, check=True)
        subprocess.run(install, env=env, capture_output=True, text=True, check=True)
    return shutil.which("chromium"), shutil.which("chromedriver")


def one_step_run(tmp_path, random_policy_dir, compose_config) -> tuple[str, str]:
    """A store holding one finished 1-step run; (store URI, run id)."""
    from hydra.core.hydra_config import HydraConfig
    from omegaconf import open_dict

    import src.run

    store = f"sqlite:///{tmp_path}/mlruns.db"
    cfg = compose_config(f"policy.name_or_path={random_policy_dir}", "trainer.steps=1", "trainer.groups_per_step=2",
                         "trainer.group_size=2", "policy.max_new_tokens=4", "evaluation.prompts=2",
                         "evaluation.samples_per_prompt=2", "evaluation.ks=[1,2]", "evaluation.at_start=false",
                         f"tracking.uri={store}", "tracking.sweep=ui", f"tracking.artifact_location={tmp_path}/art",
                         f"hydra.run.dir={tmp_path}/run", hydra=True)
    cfg.hydra.runtime.output_dir = str(tmp_path / "run")
    HydraConfig.instance().set_config(cfg)
    with open_dict(cfg):
        del cfg["hydra"]
    src.run.train(cfg)
    runs = MlflowClient(store).search_runs([MlflowClient(store).get_experiment_by_name(
        "replay-rloo").experiment_id])
    return store, runs[0].info.run_id


def start_ui(store: str, artifacts: Path, port: int, wait: bool = True) -> subprocess.Popen:
    """`make ui`'s command line (src.runs.serve supervising src.runs.ui_app), one worker; returns once it answers."""
    command = [sys.executable, "-m", "src.runs.serve", "--name", "MLflow UI", "--host", "127.0.0.1", "--port", str(port),
               "--store", store, "--experiment", "replay-rloo", "--", sys.executable, "-m", "src.runs.ui_app", "ui",
               "--backend-store-uri", store, "--default-artifact-root", str(artifacts), "--host", "127.0.0.1",
               "--port", str(port), "--workers", "1"]
    with open(artifacts.parent / "server.log", "w") as log:  # a file: a pipe nobody reads would fill and block it
        server = subprocess.Popen(command, cwd=PROJECT_ROOT, stdout=log, stderr=subprocess.STDOUT)
    if wait:
        wait_for(server, port)
    return server


def wait_for(server: subprocess.Popen, port: int) -> None:
    """Until the server answers (it fails the test if it exits, or is stopped after 60 s of silence)."""
    log = Path(server.args[server.args.index("--default-artifact-root") + 1]).parent / "server.log"
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        try:
            urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=1)
            return
        except OSError:
            if server.poll() is not None:
                pytest.fail(f"the UI server exited: {log.read_text()[-3000:]}")
            time.sleep(0.3)
    server.terminate()
    pytest.fail("the UI server did not answer within 60 s")


def browser(chromium: str, driver: str, profile: Path):
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service

    options = webdriver.ChromeOptions()
    options.binary_location = chromium
    for flag in FLAGS:
        options.add_argument(flag)
    options.add_argument(f"--user-data-dir={profile}")
    return webdriver.Chrome(service=Service(driver), options=options)


def page_text_with(page, words: tuple[str, ...], timeout_s: float = 30) -> str:
    """The page's text once every word is in it (the runs table loads after the page); its last text if not."""
    deadline, text = time.monotonic() + timeout_s, ""
    while time.monotonic() < deadline:
        text = page.execute_script("return document.body.innerText")
        if all(word in text for word in words):
            break
        time.sleep(0.3)
    return text


def shown_headers(page, names: tuple[str, ...]) -> list[str]:
    """The runs table's column headers among `names` drawn whole inside the window: not cut to their column's
    width (MLflow ends a cut header with an ellipsis) and not scrolled out of view."""
    return page.execute_script("""
        return arguments[0].filter(function (name) {
          var label = document.querySelector('[data-testid="sort-header-' + name + '"]');
          if (!label) return false;
          var cell = label.closest('[role="columnheader"]'), box = label.getBoundingClientRect();
          var holder = label.parentElement;  // the box MLflow cuts the label in
          return holder.scrollWidth <= holder.clientWidth + 1 && box.right <= cell.getBoundingClientRect().right
            && box.right <= window.innerWidth;
        });""", list(names))


def chart_sections(page, timeout_s: float = 45) -> list[str]:
    """The run page's chart sections in the order it shows them (MLflow keeps it in local storage), once the
    page has put reward and evaluation first; [] if it never did."""
    import json

    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        states = page.execute_script("return Object.keys(window.localStorage).filter(function (k) {"
                                     " return k.indexOf('-model-chartUIState') > 0; }).map(function (k) {"
                                     " return window.localStorage.getItem(k); })")
        for state in map(json.loads, states):
            if state.get("isAccordionReordered") and state.get("compareRunSections"):
                return [section["name"] for section in state["compareRunSections"]]
        time.sleep(0.5)
    return []


def shoot(page, tmp_path: Path, name: str) -> None:
    page.save_screenshot(str(tmp_path / name))
    if os.environ.get("UI_SCREENSHOTS"):
        Path(os.environ["UI_SCREENSHOTS"]).mkdir(parents=True, exist_ok=True)
        shutil.copy(tmp_path / name, Path(os.environ["UI_SCREENSHOTS"]) / name)


def test_the_landing_page_saves_training_mode_and_the_study_columns_where_the_browser_has_none():
    import json

    from src.runs.ui_app import VIEW_KEY, landing_page

    page = landing_page("<!doctype html><html><head><title>MLflow</title></head><body></body></html>", "7")
    script = page[page.index("<head>") + len("<head>"):page.index("</script>")]
    assert page.index("<script>") < page.index("<title>")  # before MLflow's own code reads local storage
    saved = json.loads(script[script.index("var saved = ") + len("var saved = "):script.index(", page = ")])
    assert json.loads(saved["mlflow.workflowType_v1"]) == "machine_learning"
    view = json.loads(saved[VIEW_KEY % "7"])
    assert view["selectedColumns"] == links.study_columns() and "params.`rho`" in view["selectedColumns"]
    assert '"experiments/7/runs?workflowType=machine_learning"' in script
    assert "getItem(key) === null" in script  # a browser's own choice stays
    bare = landing_page("<html><head></head></html>", None)  # no experiment yet: the mode only, no redirect
    assert VIEW_KEY.split("[")[0] not in bare and ", page = null," in bare


def test_mlflows_genai_job_runners_are_off_unless_the_environment_says():
    """`make ui` and `make mlflow-server` start no job runner (tests/commands/test_commands.py checks the processes
    of a running server); a user's MLFLOW_SERVER_ENABLE_JOB_EXECUTION stays."""
    from src.runs.ui_app import JOB_EXECUTION_ENV, without_job_runners

    environ = {}
    without_job_runners(environ)
    assert environ == {JOB_EXECUTION_ENV: "false"}
    chosen = {JOB_EXECUTION_ENV: "true"}
    without_job_runners(chosen)
    assert chosen == {JOB_EXECUTION_ENV: "true"}


def test_the_ui_gets_one_worker_unless_told_and_the_tracking_server_mlflows_count():
    from src.runs.ui_app import one_worker_for_the_ui

    assert one_worker_for_the_ui(["ui", "--port", "5050"]) == ["ui", "--port", "5050", "--workers", "1"]
    for told in (["ui", "--workers", "3"], ["ui", "--workers=3"], ["ui", "-w", "3"], ["server", "--port", "5000"]):
        assert one_worker_for_the_ui(told) == told


@pytest.mark.slow
def test_make_ui_opens_on_the_runs_table_with_knob_and_summary_columns(tmp_path, random_policy_dir,
                                                                          compose_config):
    chromium, driver = ensure_browser()
    store = f"sqlite:///{tmp_path}/mlruns.db"
    ensure_experiment(store, "replay-rloo", str(tmp_path / "art"))  # the store's schema, before the server
    port = free_port()
    server = start_ui(store, tmp_path / "art", port, wait=False)  # starts while the run trains
    page = None
    try:
        _, run_id = one_step_run(tmp_path, random_policy_dir, compose_config)
        wait_for(server, port)
        page = browser(chromium, driver, tmp_path / "profile")
        page.get(f"http://127.0.0.1:{port}/")  # the bare address, as a researcher types it
        headers = (*links.KNOB_COLUMNS, *links.SUMMARY_COLUMNS)
        text = page_text_with(page, ("ui/", *headers))
        shoot(page, tmp_path, "landing.png")
        missing = [header for header in headers if header not in text]
        assert not missing, f"runs table without the columns {missing}:\n{text[:3000]}"
        shown = shown_headers(page, headers)  # in the 1600 px window, each header whole
        assert shown == list(headers), f"headers cut or out of view: {sorted(set(headers) - set(shown))}"
        assert page.execute_script("return window.localStorage.getItem('mlflow.workflowType_v1')") == \
            '"machine_learning"'
        assert TRAINING_ONLY in text.split("\n"), text[:2000]

        experiment_id = MlflowClient(store).get_run(run_id).info.experiment_id
        page.get(f"http://127.0.0.1:{port}/#/{links.run_page(experiment_id, run_id)}")
        text = page_text_with(page, ("final_reward", "ui/", "Latest completions"))
        shoot(page, tmp_path, "run.png")
        assert "final_reward" in text and "Overview" in text
        # The description, rendered: the latest step's completions as a table, each problem in the task's words.
        cells = page.execute_script("""
            var more = Array.from(document.querySelectorAll('button, a, span')).filter(function (element) {
              return element.innerText === 'Show more'; })[0];
            var fold = more ? more.getBoundingClientRect().top : window.innerHeight;
            return Array.from(document.querySelectorAll('td')).filter(function (cell) {
              return cell.getBoundingClientRect().bottom <= fold;  // above the fold of the description
            }).map(function (cell) { return cell.innerText; });""")
        assert "Latest completions (step 0;" in text and any(re.match(r"numbers \d+(, \d+)+; target \d+$", cell)
                                                            for cell in cells), cells
        assert TRAINING_ONLY in text.split("\n"), text[:2000]

        metrics_page = links.run_page(experiment_id, run_id).replace("?", "/model-metrics?", 1)
        page.get(f"http://127.0.0.1:{port}/#/{metrics_page}")
        sections = chart_sections(page)
        assert sections[:2] == ["train/reward", "train"] and sections.index("Model metrics") < sections.index("batch"), \
            sections
        text = page_text_with(page, ("train/reward", "batch"))  # as drawn after the reload
        shoot(page, tmp_path, "charts.png")
        assert 0 <= text.find("train/reward") < text.find("batch"), text[:2000]
    finally:
        if page is not None:
            page.quit()
        server.terminate()
        server.wait(timeout=30)
