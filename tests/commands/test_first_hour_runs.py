"""A researcher's first hour, as typed: the quick check's folder, log and report; refusals that leave nothing
behind; stops that end the MLflow run; `make ui` that names its store and answers when it says so."""

from __future__ import annotations

import os
import re
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest
from mlflow.tracking import MlflowClient

from src.paths import PROJECT_ROOT

ROOT = PROJECT_ROOT
QUICK_CHECK = [sys.executable, "-m", "src.run", "trainer=smoke", "hardware.threads=1"]
# make runs the project's .venv; a checkout without one (a worktree) runs this interpreter the same way.
MAKE = ["make", "-s", "--no-print-directory", "-o", ".venv/.installed", f"PY={sys.executable}"]
ENV = {**{key: value for key, value in os.environ.items() if key not in ("MAKEFLAGS", "MFLAGS", "MAKELEVEL")},
       "PYTHONPATH": str(ROOT), "HYDRA_FULL_ERROR": "0", "COLUMNS": "200"}


def run(command: list[str], timeout: float = 600) -> subprocess.CompletedProcess:
    return subprocess.run(command, cwd=ROOT, env=ENV, capture_output=True, text=True, timeout=timeout)


def run_folders(out: Path) -> list[Path]:
    return sorted((out / "outputs" / "runs").glob("*/*"))


def runs_of(out: Path, deleted: bool = True) -> list:
    client = MlflowClient(f"sqlite:///{out}/mlruns.db")
    found = client.get_experiment_by_name("replay-rloo")
    return [] if found is None else client.search_runs([found.experiment_id], run_view_type=3 if deleted else 1)


def printed_folder(text: str) -> list[str]:
    return re.findall(r"^run folder: (\S+)$", text, re.M)


@pytest.fixture(scope="module")
def quick_check(tmp_path_factory) -> tuple[Path, subprocess.CompletedProcess]:
    """The README's quick check, `python -m src.run trainer=smoke`, into its own `out` folder."""
    out = tmp_path_factory.mktemp("quick")
    # docs/install.md's REPLAY_RLOO_CACHE=DIR, as typed before the command: an empty folder of its own
    done = subprocess.run([*QUICK_CHECK, f"out={out}"], cwd=ROOT, capture_output=True, text=True, timeout=600,
                          env={**ENV, "REPLAY_RLOO_CACHE": str(out / "cache")})
    assert done.returncode == 0, done.stderr[-3000:]
    return out, done


@pytest.mark.slow
def test_the_quick_check_keeps_its_generated_prompts_and_empty_store_in_the_cache_folder_it_is_given(quick_check):
    out, _ = quick_check
    kept = sorted(path.name.split("-")[0] for path in (out / "cache").iterdir())
    assert kept == ["countdown", "mlflow"], kept  # the generated sets and MLflow's empty store, nothing half-written


# --------------------------------------------------------------------------- trap 9: the run's folder
@pytest.mark.slow
def test_the_quick_check_prints_its_folder_at_start_and_end_and_its_run_log_holds_the_run(quick_check):
    out, done = quick_check
    (folder,) = run_folders(out)
    assert printed_folder(done.stderr) == [str(folder)]  # at the start, among the progress lines
    assert printed_folder(done.stdout) == [str(folder)]  # at the end, under the result table
    log = (folder / "run.log").read_text()
    for line in (f"run folder: {folder}", "evaluate start (smoke, step 0)", "train rho0: 2/2 steps",
                 "evaluate final (smoke, step 2)", "after RL", "mean_reward", "run page"):
        assert line in log, line


@pytest.mark.slow
def test_a_finished_cell_started_again_and_a_refused_config_leave_no_folder(quick_check):
    out, _ = quick_check
    again = run([*QUICK_CHECK, f"out={out}", "trainer.rerun=false"])  # trainer=smoke reruns a finished cell
    assert again.returncode == 0 and "already has FINISHED run" in again.stderr, again.stderr[-2000:]
    refused = run([*QUICK_CHECK, f"out={out}", "evaluation.ks=[100]"])
    assert refused.returncode == 2 and refused.stderr.startswith("error: evaluation.ks"), refused.stderr[-2000:]
    assert len(run_folders(out)) == 1


def test_a_refused_config_makes_no_folder(tmp_path):
    refused = run([*QUICK_CHECK, f"out={tmp_path}", "evaluation.ks=[100]"], timeout=300)
    assert refused.returncode == 2 and "Traceback" not in refused.stderr, refused.stderr[-2000:]
    assert refused.stderr.count("\n") == 1, refused.stderr
    assert run_folders(tmp_path) == [] and not [path for path in tmp_path.rglob("*") if path.is_file()]


# --------------------------------------------------------------------------- trap 6: the quick check's report
@pytest.mark.slow
def test_make_report_on_the_quick_check_reads_its_final_evaluation(quick_check):
    out, done = quick_check
    made = run([*MAKE, "report", f"OUT={out}"])
    assert made.returncode == 0, made.stderr[-3000:]
    report = (out / "reports" / "replay-rloo" / "report.md").read_text()
    (logged,) = runs_of(out, deleted=False)
    reward = logged.data.metrics["smoke/final/mean_reward"]
    assert "finished without a final evaluation" not in report
    row = next(line for line in report.splitlines() if line.startswith("| Fresh-only | (0, -, -) | rho0 |"))
    assert "| smoke |" in row and f"| {reward:.3f} |" in row, row
    assert "│ mean_reward     │" in done.stdout and f"{reward:.3f} │" in done.stdout


# --------------------------------------------------------------------------- trap 10: stops end the run
def _start(command: list[str]) -> subprocess.Popen:
    return subprocess.Popen(command, cwd=ROOT, env=ENV, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True)  # its own group: the Ctrl-C goes to it as a terminal's would


def _ctrl_c(process: subprocess.Popen) -> None:
    os.killpg(process.pid, signal.SIGINT)


@pytest.mark.slow
def test_a_double_ctrl_c_ends_the_run_killed_and_the_same_command_resumes_it_in_its_folder(tmp_path):
    # Step 2 made long enough (64 rollouts, about 2 s; the quick check's 8 take 0.2 s) that both Ctrl-Cs land in it
    # however busy the machine: with the quick check's own step the run could end between the two, and the second
    # then hit the interpreter's shutdown.
    command = [*QUICK_CHECK, f"out={tmp_path}", "evaluation.at_start=false", "trainer.checkpoint_every=1",
               "trainer.groups_per_step=32"]
    process, lines = _start(command), []
    for line in process.stdout:
        lines.append(line)
        if line.startswith("train rho0: 1/2 steps"):  # step 2 runs now
            time.sleep(0.3)
            _ctrl_c(process)
        elif "Ctrl-C: stopping after this step" in line:  # the first one was taken mid-step: again, once its
            time.sleep(0.05)  # handler has written run.log too, and before the step (a tiny one) ends the process
            _ctrl_c(process)
    output = "".join(lines)
    assert process.wait(60) == 130, output
    assert "Ctrl-C again: stopped at once" in output and "Traceback" not in output, output
    (killed,) = runs_of(tmp_path)
    assert killed.info.status == "KILLED", output
    again = run(command)
    assert again.returncode == 0, again.stderr[-3000:]
    assert f"resuming run {killed.info.run_id}" in again.stderr
    (finished,) = runs_of(tmp_path)
    assert (finished.info.run_id, finished.info.status) == (killed.info.run_id, "FINISHED")
    (folder,) = run_folders(tmp_path)  # the resumed run wrote into its folder, and no other was made
    assert printed_folder(again.stdout) == [str(folder)]
    log = (folder / "run.log").read_text()
    assert "Ctrl-C: stopping after this step" in log and "resuming run" in log and "train rho0: 2/2 steps" in log


@pytest.mark.slow
def test_ctrl_c_before_the_first_step_leaves_no_run_running_even_among_deleted_ones(tmp_path):
    process, lines = _start([*QUICK_CHECK, f"out={tmp_path}"]), []
    for line in process.stdout:
        lines.append(line)
        if line.startswith("run folder:"):  # the run is claimed; the model loads now
            _ctrl_c(process)
    output = "".join(lines)
    assert process.wait(60) == 130 and "Ctrl-C before training began: nothing to save" in output, output
    assert [run.info.status for run in runs_of(tmp_path)] in ([], ["KILLED"]), output
    assert runs_of(tmp_path, deleted=False) == []  # the claim nothing was logged to is withdrawn


def test_ctrl_c_while_the_libraries_load_is_one_line_not_a_traceback(tmp_path):
    process = _start([*QUICK_CHECK, f"out={tmp_path}"])
    time.sleep(2.0)  # the command line is checked; torch, transformers and MLflow are loading
    _ctrl_c(process)
    output, _ = process.communicate(timeout=120)
    assert process.returncode == 130, output
    assert "Traceback" not in output and len(output.strip().splitlines()) <= 2, output
    assert all(not run.info.status == "RUNNING" for run in runs_of(tmp_path)) if (tmp_path / "mlruns.db").exists() \
        else True


def test_a_ctrl_c_inside_python_a_library_runs_through_the_c_api_still_exits_130(tmp_path):
    # CPython marks a KeyboardInterrupt raised in code run by PyRun_* as unhandled even once it is caught, and a
    # normal exit then ends the process by SIGINT (-2): the Ctrl-C above met it once in 80 runs, at random.
    wrapper = tmp_path / "interrupted_load.py"
    wrapper.write_text(f"""
import ctypes, runpy, sys
sys.path.insert(0, {str(ROOT)!r})
import src.command.cli

def interrupted_load():  # a library's import runs Python through the C API, and the Ctrl-C lands there
    run = ctypes.pythonapi.PyRun_StringFlags
    run.restype = ctypes.py_object
    run.argtypes = [ctypes.c_char_p, ctypes.c_int, ctypes.py_object, ctypes.py_object, ctypes.c_void_p]
    namespace = {{"__builtins__": __builtins__}}
    run(b"raise KeyboardInterrupt", 257, namespace, namespace, None)  # 257: Py_file_input

src.command.cli.cli = interrupted_load
sys.argv = ["src.run"]
runpy.run_module("src.run", run_name="__main__", alter_sys=True)
""")
    # By -m, as `python -m src.run` runs: a script's SystemExit leaves at once, before CPython reads that mark.
    result = subprocess.run([sys.executable, "-m", wrapper.stem], cwd=tmp_path, env=ENV, capture_output=True,
                            text=True, timeout=60, start_new_session=True)
    assert result.returncode == 130, (result.returncode, result.stderr)
    assert result.stderr.strip() == "Ctrl-C before the run began: nothing to save", result.stderr


@pytest.mark.slow
def test_a_dry_run_estimates_a_cells_time_from_the_stores_finished_run_of_its_shape(quick_check):
    out, _ = quick_check  # a finished fresh-only cell: the replay cell has its shape and is estimated from it
    done = run([sys.executable, "-m", "src.run", "-m", "trainer=smoke", "hardware.threads=1", f"out={out}",
                "buffer=none,age1", "hydra.sweeper.dry_run=true"])
    text = " ".join(done.stdout.split())
    assert done.returncode == 0, done.stderr[-3000:]
    # trainer=smoke reruns a finished cell; the replay cell generates 12 of the fresh cell's 16
    assert re.search(r"│ 0 │ rho0 │ 16 │ \d+ s │ launch again", text), text
    assert re.search(r"│ 1 │ rho1-L1-c10 │ 12 │ \d+ s │ launch", text), text
    assert "estimated time on this machine: about" in text and "for 2 job(s)" in text, text
    assert "from the store's 1 finished run(s) of this shape: median" in text, text
    assert "timing one training step" not in done.stderr  # no probe: the store had the answer


@pytest.mark.slow
def test_trainer_extend_continues_a_finished_run_to_more_steps_in_the_same_mlflow_run(tmp_path):
    short, long_ = tmp_path / "short", tmp_path / "long"
    fresh = subprocess.Popen([*QUICK_CHECK, f"out={long_}", "trainer.steps=4"], cwd=ROOT, env=ENV, text=True,
                             stdout=subprocess.PIPE, stderr=subprocess.STDOUT)  # the 4-step run, for comparison
    first = run([*QUICK_CHECK, f"out={short}"])
    assert first.returncode == 0 and fresh.wait(600) == 0, first.stderr[-3000:] + fresh.stdout.read()[-3000:]
    (finished,) = runs_of(short)
    more = run([*QUICK_CHECK, f"out={short}", "trainer.steps=4", "trainer.extend=true"])
    assert more.returncode == 0, more.stderr[-3000:]
    assert f"continuing FINISHED run {finished.info.run_id} of cell rho0 from step 2 to 4 (trainer.extend)" \
        in more.stderr, more.stderr[-3000:]
    (extended,), (reference,) = runs_of(short), runs_of(long_)
    assert (extended.info.run_id, extended.info.status) == (finished.info.run_id, "FINISHED")
    assert extended.data.tags["extended_to"] == "4" and extended.data.params["trainer.steps"] == "2"
    for tag in ("cell_id", "cell_key", "cell_family"):  # it is now the 4-step cell's run
        assert extended.data.tags[tag] == reference.data.tags[tag], tag
    assert len(run_folders(short)) == 1  # it trained on in its own folder
    client = MlflowClient(f"sqlite:///{short}/mlruns.db")
    history = {p.step: p.value for p in client.get_metric_history(extended.info.run_id, "train/reward")}
    steps = [p.step for p in client.get_metric_history(extended.info.run_id, "train/reward")]
    assert sorted(steps) == [0, 1, 2, 3]  # each step logged once (a step's metrics at its index from 0)
    expected = {p.step: p.value for p in MlflowClient(f"sqlite:///{long_}/mlruns.db").get_metric_history(
        reference.info.run_id, "train/reward")}
    assert history == pytest.approx(expected, rel=1e-6)  # the steps a 4-step run of the cell takes


# --------------------------------------------------------------------------- trap 10: make ui
def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def _answers(port: int) -> bool:
    try:
        # A loaded machine (parallel workers, the UI's own four starting) may take seconds to answer; a refused
        # connection still says "no" at once.
        urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=15).close()
        return True
    except OSError:
        return False


@pytest.mark.slow
def test_make_ui_names_an_empty_store_and_prints_its_url_once_the_server_answers(tmp_path):
    port, typo = _free_port(), tmp_path / "no-such-out"
    typo.mkdir()
    process, lines = _start([*MAKE, "ui", f"OUT={typo}", f"PORT={port}"]), []
    deadline = time.monotonic() + 240
    for line in process.stdout:
        lines.append(line)
        if line.startswith("MLflow UI (Ctrl-C stops it): http://127.0.0.1"):
            assert _answers(port), "".join(lines)  # printed once the server answers, not before
            break
        assert time.monotonic() < deadline, "".join(lines)
    _ctrl_c(process)
    rest, _ = process.communicate(timeout=60)
    output = "".join(lines) + rest
    assert lines and f"store {typo}/mlruns.db holds no run of experiment 'replay-rloo'" in lines[0], output
    assert "Traceback" not in output, output
    # Its 4 workers started and stopped: still nothing but log lines (no library's warning, once a worker).
    assert [line for line in output.strip().splitlines()[1:] if not UI_LOG_LINE.match(line)] == [], output


# What `make ui` may print: our own lines, MLflow's and uvicorn's INFO logs.
UI_LOG_LINE = re.compile(r"\d{4}/\d\d/\d\d \d\d:\d\d:\d\d INFO[: ]|Registry store URI|\[MLflow\] "
                         r"|MLflow UI: |MLflow UI \(Ctrl-C stops it\): http")


@pytest.mark.slow
def test_ctrl_c_while_make_ui_starts_is_quiet(tmp_path):
    port = _free_port()
    process = _start([*MAKE, "ui", f"OUT={tmp_path}", f"PORT={port}"])
    time.sleep(4.0)  # MLflow's processes are importing
    _ctrl_c(process)
    output, _ = process.communicate(timeout=60)
    assert "Traceback" not in output and "KeyboardInterrupt" not in output, output
    # Quiet: our own lines and MLflow's and uvicorn's INFO logs (how many depends on whether the Ctrl-C came
    # before or after its 4 workers started: 16 lines after), nothing else.
    assert all(UI_LOG_LINE.match(line) for line in output.strip().splitlines()), output
    assert not _answers(port)


def test_a_withdrawn_claim_is_ended_killed_before_it_is_deleted(tmp_path):
    from src.runs import claim

    uri = f"sqlite:///{tmp_path}/mlruns.db"
    client = MlflowClient(uri)
    run_id = client.create_run(client.create_experiment("replay-rloo")).info.run_id
    claim.withdraw_claim(uri, run_id)
    withdrawn = client.get_run(run_id)
    assert (withdrawn.info.status, withdrawn.info.lifecycle_stage) == ("KILLED", "deleted")
