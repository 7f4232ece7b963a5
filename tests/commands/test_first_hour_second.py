"""A researcher's first hour, second pass: what a new user types on a fresh clone, as typed.

Previews that preview (`make ... DRY_RUN=1`), a study without `-m`, a base config, Hydra's own errors (a lexer
error, a group without `+`, a key given twice, another trainer's key names) and a missing policy, store or sweep
on every entry point: each answered in one line, before torch (or MLflow, for the analysis commands) loads.
"""

from __future__ import annotations

import os
import re
import shlex
import socket
import sqlite3
import subprocess
import sys
from pathlib import Path

import pytest

from src.paths import PROJECT_ROOT
from src.validate.schema import SchemaError
from src.validate.suggest import check_command_line

ROOT = PROJECT_ROOT
ENV = {**{key: value for key, value in os.environ.items() if key not in ("MAKEFLAGS", "MFLAGS", "MAKELEVEL")},
       "PYTHONPATH": str(ROOT), "HYDRA_FULL_ERROR": "0", "COLUMNS": "400"}
# make without installing: this interpreter's environment is the project's.
MAKE = ["make", "--no-print-directory", "-o", ".venv/.installed", f"PY={sys.executable}"]
LOADED = "loaded:"


def as_main(module: str, heavy: tuple[str, ...]) -> list[str]:
    """`python -m MODULE`, naming on its last stderr line the modules of `heavy` it holds as it exits."""
    return [sys.executable, "-c", "import atexit, runpy, sys; atexit.register(lambda: print('loaded:', *[m for m in "
            f"{heavy!r} if m in sys.modules], file=sys.stderr)); runpy.run_module({module!r}, run_name='__main__', "
            "alter_sys=True)"]


def installed(command: str, heavy: tuple[str, ...]) -> list[str]:
    """The installed console script `command` (pyproject's [project.scripts]) run as its own file is, naming the
    modules of `heavy` it holds as it exits, like `as_main`."""
    script = str(Path(sys.executable).parent / command)
    return [sys.executable, "-c", "import atexit, runpy, sys; atexit.register(lambda: print('loaded:', *[m for m in "
            f"{heavy!r} if m in sys.modules], file=sys.stderr)); sys.argv[0] = {script!r}; "
            f"runpy.run_path({script!r}, run_name='__main__')"]


def one_line(done: subprocess.CompletedProcess, *expected: str, status: int = 2) -> str:
    """The one error line of a refused command (no traceback) holding each of `expected`; nothing heavy loaded."""
    lines = done.stderr.splitlines()
    assert lines and lines[-1] == LOADED, done.stderr  # none of the heavy modules
    error = "\n".join(lines[:-1])
    assert done.returncode == status and done.stdout == "", done.stdout + done.stderr
    assert error.count("\n") == 0 and error.startswith("error: "), error
    for words in expected:
        assert words in error, error
    return error


def run_all(commands: list[list[str]], cwd: Path = ROOT) -> list[subprocess.CompletedProcess]:
    """The commands at once (each is mostly Python start-up); a command that trains instead stops with the test."""
    procs = [subprocess.Popen(command, cwd=cwd, env=ENV, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for command in commands]
    try:
        outputs = [proc.communicate(timeout=300) for proc in procs]
        return [subprocess.CompletedProcess(proc.args, proc.returncode, *output) for proc, output in zip(procs, outputs)]
    finally:
        for proc in procs:
            proc.kill()


def runs_in(store: Path) -> int:
    """The runs an MLflow SQLite store holds (0 for no store)."""
    if not store.exists():
        return 0
    with sqlite3.connect(store) as db:
        return db.execute("SELECT COUNT(*) FROM runs").fetchone()[0]


# --------------------------------------------------------------------------- 1. previews that preview
TRAINING_TARGETS = ["demo", "reproduce-seed000", "reproduce-seed004", "sweep-ratio", "sweep-async"]


@pytest.mark.parametrize("target", TRAINING_TARGETS)
def test_make_n_with_dry_run_passes_it_to_the_run_and_reads_no_results(target, tmp_path):
    done = subprocess.run([*MAKE, "-n", target, "DRY_RUN=1", f"OUT={tmp_path}"], cwd=ROOT, env=ENV,
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    runs = [line for line in done.stdout.splitlines() if " -m src.run " in line]
    assert len(runs) == 1 and "hydra.sweeper.dry_run=true" in runs[0].split(), done.stdout
    assert " -m analysis." not in done.stdout  # no summary, report or verdict of runs that were not trained


def test_make_without_dry_run_trains_and_args_win_without_a_key_given_twice(tmp_path):
    done = subprocess.run([*MAKE, "-n", "demo", f"OUT={tmp_path}", "ARGS=clip=mid evaluation.repeats=1"], cwd=ROOT,
                          env=ENV, capture_output=True, text=True, timeout=60)
    run = next(line for line in done.stdout.splitlines() if " -m src.run " in line).split()
    assert "hydra.sweeper.dry_run=false" in run and " -m analysis.report " in done.stdout
    assert [word for word in run if word.startswith("clip=")] == ["clip=mid"]
    assert [word for word in run if word.startswith("evaluation.repeats=")] == ["evaluation.repeats=1"]


def test_a_dry_run_value_make_cannot_read_is_one_line(tmp_path):
    done = subprocess.run([*MAKE, "-n", "reproduce-seed004", "DRY_RUN=yes-please"], cwd=ROOT, env=ENV,
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 2 and done.stdout == "" and done.stderr.count("\n") == 1, done.stdout + done.stderr
    assert "DRY_RUN=yes-please: DRY_RUN=1 prints the plan" in done.stderr


@pytest.mark.slow
def test_make_reproduce_dry_run_prints_the_plan_and_trains_nothing(tmp_path):
    done = subprocess.run([*MAKE, "reproduce-seed004", "DRY_RUN=1", f"OUT={tmp_path}"], cwd=ROOT, env=ENV,
                          capture_output=True, text=True, timeout=600)
    out = " ".join((done.stdout + done.stderr).split())
    assert done.returncode == 0, out[-3000:]
    assert "DRY RUN: nothing launched" in out and "rho0-frontier" in out, out[-3000:]
    # 3. the time of each cell and of the study, from one step timed here (a new store has no past run)
    minutes = r"(\d+ min|\d+ h \d\d min)"
    assert re.search(rf"│ 0 │ rho0-frontier │ 0 │ 30,720 │ {minutes} │ launch", out), out[-3000:]
    # its planned 14 training seeds (hydra.sweeper.planned_seeds) times 2 cells
    assert re.search(rf"estimated time on this machine: about {minutes} for 28 job\(s\)", out), out[-3000:]
    assert "from a probe here: rho0-frontier's model built in" in out, out[-3000:]
    assert runs_in(tmp_path / "mlruns.db") == 0 and not (tmp_path / "outputs" / "runs").exists()
    assert not (tmp_path / "reports").exists()


def test_more_seeds_than_a_study_was_planned_for_are_refused_in_one_line(tmp_path):
    """Seeds added after a verdict are optional stopping: SEEDS above the plan is refused before any config is
    composed, naming the seeds, the plan and the fix."""
    done = subprocess.run([*MAKE, "reproduce-seed004", "SEEDS=15", "DRY_RUN=1", f"OUT={tmp_path}"], cwd=ROOT,
                          env=ENV, capture_output=True, text=True, timeout=600)
    out = done.stdout + done.stderr
    assert done.returncode == 2, out[-3000:]
    line = [text for text in out.splitlines() if text.startswith("error:")]
    assert line == [f"error: trainer.seed={','.join(map(str, range(15)))}: 15 training seeds, but this study was "
                    "planned for 14 before its runs (hydra.sweeper.planned_seeds); run at most 14 (make "
                    "reproduce-NAME SEEDS=14, the default) and judge it only at its planned looks"], out[-3000:]
    assert "Traceback" not in out and runs_in(tmp_path / "mlruns.db") == 0


# --------------------------------------------------------------------------- 2, 7, 8. src.run's command line
HEAVY = ("torch", "transformers", "mlflow")
# (the command line after `python -m src.run`, what its one line must say)
REFUSED = [
    (["+reproduce=seed000"], ["+reproduce=seed000 belongs to a sweep", "Run: python -m src.run -m +reproduce=seed000"]),
    (["reproduce=seed000"], ["python -m src.run -m +reproduce=seed000"]),
    (["policy=base"], ["policy=base: conf/policy/base.yaml is what every policy option shares", "tiny"]),
    (["trainer=base"], ["trainer=base: conf/trainer/base.yaml", "choose one of paper, smoke, tiny"]),
    (["experiment=seed000-countdown-tiny"], ["added with +: +experiment=seed000-countdown-tiny"]),
    (["task=math", "task.data=~/data/openr1-math"],
     ["task.data=~/data/openr1-math: Hydra's override grammar cannot read '~'", """'task.data="~/data/openr1-math"'""",
      "task.data=$HOME/data/openr1-math"]),
    (["model=qwen2.5-0.5b"], ["(did you mean policy=qwen2.5-0.5b?)"]),
    (["+model=qwen2.5-0.5b"], ["(did you mean policy=qwen2.5-0.5b?)"]),
    (["trainer.steps=5", "trainer.steps=6"], ["trainer.steps is given twice (trainer.steps=5 and trainer.steps=6)"]),
    (["trainer.lr=1e-5"], ["trainer.lr=1e-5: unknown key; this project calls it trainer.learning_rate"]),
    (["lr=1e-5"], ["e.g. trainer.learning_rate=1e-5"]),
    (["num_generations=8"], ["this project calls it trainer.group_size", "e.g. trainer.group_size=8"]),
    (["trainer.max_steps=5"], ["this project calls it trainer.steps"]),
    (["per_device_train_batch_size=4"], ["this project calls it trainer.micro_batch_size"]),
]


@pytest.fixture(scope="module")
def refused(tmp_path_factory):
    folder = tmp_path_factory.mktemp("refused")
    store = [f"tracking.uri=sqlite:///{folder}/m.db", f"hydra.run.dir={folder}/run", f"hydra.sweep.dir={folder}/sweep"]
    return folder, run_all([[*as_main("src.run", HEAVY), *argv, *store] for argv, _ in REFUSED])


@pytest.mark.parametrize("index", range(len(REFUSED)), ids=[" ".join(argv) for argv, _ in REFUSED])
def test_src_run_refuses_in_one_line_before_torch(refused, index):
    folder, done = refused
    one_line(done[index], *REFUSED[index][1])
    assert not (folder / "m.db").exists() and not (folder / "run").exists()


def test_tracking_settings_and_a_resume_file_that_cannot_work_are_refused_before_torch(tmp_path):
    """A store URI without a scheme, a server that does not answer, a resume file that is no checkpoint: each one
    line in about a second, before torch, transformers and MLflow load (the run checks the store again)."""
    with socket.socket() as sock:  # a port nothing listens on once the socket is closed
        sock.bind(("127.0.0.1", 0))
        closed = sock.getsockname()[1]
    store = f"tracking.uri=sqlite:///{tmp_path}/m.db"
    cases = [(["tracking.uri=garbage"], ["tracking.uri=garbage: not a store URI (no scheme)"]),
             ([f"tracking.uri=http://127.0.0.1:{closed}"], ["no MLflow server answers", "make mlflow-server"]),
             (["trainer.resume_from=/etc/hostname", store], ["trainer.resume_from=/etc/hostname is not a training "
                                                             "checkpoint (not a torch archive)"]),
             (["trainer.resume_from=/no/such/checkpoint.pt", store], ["trainer.resume_from=/no/such/checkpoint.pt: "
                                                                      "no such file"])]
    done = run_all([[*as_main("src.run", HEAVY), *argv, f"hydra.run.dir={tmp_path}/run"] for argv, _ in cases])
    for result, (_, words) in zip(done, cases):
        one_line(result, *words)
    assert not (tmp_path / "m.db").exists() and not (tmp_path / "run").exists()


def test_option_lists_offer_no_base_config():
    with pytest.raises(SchemaError) as near:
        check_command_line(["policy=tiyn"])
    assert "(did you mean policy=tiny" in str(near.value) and "base" not in str(near.value)
    with pytest.raises(SchemaError) as near:
        check_command_line(["trainer=papr"])
    assert "its options: paper, smoke, tiny" in str(near.value)


def test_the_same_value_twice_and_an_added_experiment_still_pass():
    check_command_line(["trainer.steps=5", "trainer.steps=5", "+experiment=seed000-countdown-tiny", "-m",
                        "buffer=age1,age2", "hydra/launcher=submitit_local"])


def test_an_experiment_preset_without_m_is_its_one_cell_and_a_study_is_refused():
    """An experiment preset carries its study's grid, yet its header runs one cell of it without -m."""
    from src.command.cli import CommandLineError, check_multirun

    for preset in sorted((ROOT / "conf" / "experiment").glob("*.yaml")):
        check_multirun([f"+experiment={preset.stem}", "trainer.steps=1"])
    for study in ("+reproduce=seed000", "+sweep=ratio"):
        with pytest.raises(CommandLineError, match="belongs to a sweep"):
            check_multirun([study])


def test_a_python_without_the_projects_packages_is_told_to_use_the_venv_in_one_line():
    """A bare `python` (here: the venv's, without its site-packages) running the README's "What next" command."""
    done = subprocess.run([sys.executable, "-S", "-m", "src.run", "buffer=age2", "clip=tight"], cwd=ROOT,
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 2 and done.stdout == "" and done.stderr.count("\n") == 1, done.stderr
    assert done.stderr.startswith("error: ") and "source .venv/bin/activate" in done.stderr, done.stderr


def test_every_src_run_command_in_the_docs_is_one_hydra_can_read():
    """Commands copied from the docs reach the checks, not Hydra's lexer (docs/math.md's `~` path)."""
    from src.validate.suggest import parse_problem

    for page in [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]:
        for line in page.read_text().splitlines():
            command = line.split("  #", 1)[0].strip()
            if not command.startswith("python -m src.run "):
                continue
            try:
                words = shlex.split(command)
            except ValueError:
                continue
            for word in words[3:]:
                assert parse_problem(word) is None, f"{page.name}: {command}"


# --------------------------------------------------------------------------- 3, 11. every entry point
def test_version_and_help_of_every_entry_point_load_no_model_library():
    modules = ["src.run", "src.eval", "analysis.report", "analysis.summary", "analysis.reproduce",
               "analysis.async_report", "src.help"]
    heavy = ("torch", "mlflow", "pandas")
    done = run_all([[*as_main(module, heavy), flag] for module in modules for flag in ("--version", "--help")])
    from src.paths import project_version

    for index, module in enumerate(modules):
        version, page = done[2 * index], done[2 * index + 1]
        assert version.returncode == 0 and version.stdout.strip().endswith(project_version()), version
        assert page.returncode == 0 and "usage" in page.stdout.lower() and module.split(".")[-1] in page.stdout, page
        assert version.stderr.splitlines()[-1] == page.stderr.splitlines()[-1] == LOADED, (module, page.stderr)


@pytest.fixture(scope="module")
def missing(tmp_path_factory):
    """What a user names that is not there, on each entry point, with an empty folder as `out`."""
    folder = tmp_path_factory.mktemp("missing")
    out = f"out={folder / 'nothing-here'}"
    commands = {
        "eval policy": ("src.eval", ["--policy", "checkpoints/nope"], 2,
                        ["--policy checkpoints/nope: no such folder", "point --policy at an intact folder"]),
        "eval checkpoint": ("src.eval", ["--checkpoint", str(folder / "nope.pt")], 2, ["--checkpoint", "no such file"]),
        "eval sweep": ("src.eval", ["--sweep", "ratio", out], 1, ["no MLflow store at sqlite:///"]),
        "report": ("analysis.report", ["--sweep", "ratio", out], 1, ["no MLflow store at sqlite:///"]),
        "summary": ("analysis.summary", ["--sweep", "demo", out], 1, ["no MLflow store at sqlite:///"]),
        "reproduce": ("analysis.reproduce", ["seed000", out], 1, ["no MLflow store", "make reproduce-seed000"]),
        "async report": ("analysis.async_report", ["--uri", f"sqlite:///{folder}/nothing-here/mlruns.db"], 1,
                         ["no MLflow store at sqlite:///"]),
        "installed evaluate": ("replay-rloo-evaluate", ["--policy", "checkpoints/nope"], 2,
                               ["--policy checkpoints/nope: no such folder"]),
        "installed report": ("replay-rloo-report", ["--sweep", "ratio", out], 1, ["no MLflow store at sqlite:///"]),
    }
    done = run_all([(installed if module.startswith("replay-rloo") else as_main)(module, ("torch", "mlflow")) + argv
                    for module, argv, _, _ in commands.values()])
    return folder, dict(zip(commands, zip(commands.values(), done)))


@pytest.mark.parametrize("name", ["eval policy", "eval checkpoint", "eval sweep", "report", "summary", "reproduce",
                                  "async report", "installed evaluate", "installed report"])
def test_a_missing_policy_store_or_sweep_is_one_line_before_torch_and_mlflow(missing, name):
    folder, results = missing
    (_, _, status, expected), done = results[name]
    one_line(done, *expected, status=status)
    assert not (folder / "nothing-here").exists()  # no store created where none was


def test_a_sweep_not_in_the_store_names_the_sweeps_there(tmp_path):
    store = tmp_path / "mlruns.db"
    with sqlite3.connect(store) as db:  # MLflow's tables, as far as the check reads them
        db.executescript(
            "CREATE TABLE experiments (experiment_id INTEGER, name TEXT, lifecycle_stage TEXT);"
            "CREATE TABLE runs (run_uuid TEXT, experiment_id INTEGER, lifecycle_stage TEXT);"
            "CREATE TABLE tags (key TEXT, value TEXT, run_uuid TEXT);"
            "INSERT INTO experiments VALUES (1, 'replay-rloo', 'active');"
            "INSERT INTO runs VALUES ('a', 1, 'active'), ('b', 1, 'active');"
            "INSERT INTO tags VALUES ('sweep', 'ratio', 'a'), ('sweep', 'ratio', 'b');")
    done = run_all([as_main("analysis.report", ("mlflow",)) + ["--sweep", "ratoi", f"out={tmp_path}"],
                    as_main("src.eval", ("torch", "mlflow")) + ["--sweep", "ratio", "tracking.experiment=nope",
                                                                 f"out={tmp_path}"]])
    one_line(done[0], "no runs found in experiment 'replay-rloo'", "with sweep 'ratoi' (did you mean ratio?)",
             "the sweeps there: ratio (2 runs)", status=1)
    one_line(done[1], "experiment 'nope' not found", "(experiments there: replay-rloo)", status=1)


def test_make_report_of_a_store_that_is_not_there_is_the_commands_one_line(tmp_path):
    done = subprocess.run([*MAKE, "-s", "report", "SWEEP=ratio", f"OUT={tmp_path}"], cwd=ROOT, env=ENV,
                          capture_output=True, text=True, timeout=120)
    lines = [line for line in done.stderr.splitlines() if not re.match(r"make: \*\*\* \[", line)]
    assert done.returncode != 0 and lines and len(lines) == 1 and "no MLflow store at" in lines[0], done.stderr
    assert not (tmp_path / "mlruns.db").exists()


# --------------------------------------------------------------------------- 11. completions in the terminal
@pytest.mark.slow
def test_print_completions_shows_each_steps_completions_under_its_progress_line(tmp_path):
    done = subprocess.run([sys.executable, "-m", "src.run", "trainer=smoke", "tracking.print_completions=2",
                           "hardware.threads=1", "evaluation.at_start=false", f"out={tmp_path}"], cwd=ROOT,
                          capture_output=True, text=True, timeout=600)
    out = done.stdout + done.stderr
    assert done.returncode == 0, out[-3000:]
    shown = re.findall(r"completion, step (\d+): reward [-\d.e]+ \((fresh|replay), age \d+", out)
    assert [step for step, _ in shown] == ["1", "1", "2", "2"], out[-3000:]
    assert out.count("  prompt: ...") == 4 and out.count("  response: ") == 4


# --------------------------------------------------------------------------- 4. threads on a busy machine
def test_a_busy_machine_names_hardware_threads_and_a_quiet_one_says_nothing(monkeypatch):
    from src import build

    monkeypatch.setattr(build.os, "sched_getaffinity", lambda pid: {0, 1}, raising=False)
    monkeypatch.setattr(build.os, "getloadavg", lambda: (2.1, 1.0, 0.5))
    assert "load 2.1 on 2 cores" in build.busy_cpu_hint() and "hardware.threads=1" in build.busy_cpu_hint()
    monkeypatch.setattr(build.os, "getloadavg", lambda: (0.3, 1.0, 0.5))
    assert build.busy_cpu_hint() is None
    monkeypatch.setattr(build.os, "sched_getaffinity", lambda pid: {0}, raising=False)
    monkeypatch.setattr(build.os, "getloadavg", lambda: (5.0, 1.0, 0.5))
    assert build.busy_cpu_hint() is None  # one core: no threads to contend
