"""The suite's own tools, as docs/testing.md types them: `python -m tests.durations` (where the time goes) and
`python -m tests.coverage_floor` (what the suite checks, in lines), and the rule that spreads the suite over
parallel workers (tests/conftest.py: which tests share a worker)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import GROUPS_ENV, worker_group

ROOT = Path(__file__).resolve().parents[2]
# A measured child must not be measured again by a `make coverage` around this test.
ENV = {key: value for key, value in os.environ.items() if not key.startswith("COVERAGE")}


def run(*argv: str, cwd: Path = ROOT) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, *argv], cwd=cwd, env=ENV, capture_output=True, text=True, timeout=120)


def test_python_m_tests_durations_prints_the_slowest_tests_and_records_them(tmp_path):
    """The slowest tests first with their docstring's first line and CPU-seconds where the report has them
    (tests/conftest.py writes them), the files' totals, and the record of every test over half a second that
    tests/conftest.py orders the workers' tests by."""
    report = tmp_path / "venv.xml"
    this = "test_python_m_tests_durations_prints_the_slowest_tests_and_records_them"
    report.write_text(
        '<?xml version="1.0" encoding="utf-8"?><testsuites><testsuite name="pytest">'
        f'<testcase classname="tests.commands.test_suite_tools" name="{this}" time="0.7"/>'
        '<testcase classname="tests.unit.test_countdown" name="test_slow_one[a]" time="12.5">'
        '<properties><property name="cpu_seconds" value="20.4"/></properties></testcase>'
        '<testcase classname="tests.unit.test_countdown" name="test_quick" time="0.2"><skipped/></testcase>'
        '<testcase classname="tests.unit.test_buffer" name="test_broken" time="3.0"><failure message="x"/></testcase>'
        "</testsuite></testsuites>")
    record = tmp_path / "durations.json"
    done = run("-m", "tests.durations", "--top", "2", "--write", str(record), str(report))
    assert done.returncode == 0, done.stderr
    assert "venv.xml: 4 tests, 0.3 min of test time, 0.3 CPU-min (1 failed)" in done.stdout
    rows = [line for line in done.stdout.splitlines() if line.startswith("| 1 ") or line.startswith("| 2 ")]
    assert rows[0].startswith("| 1 | 12.5 | 20 | `tests/unit/test_countdown.py::test_slow_one[a]` | slow one |"), rows
    assert rows[1].startswith("| 2 | 3.0 |  | `tests/unit/test_buffer.py::test_broken` |"), rows
    # The file's total, skipped test included; its CPU is blank, since one of its tests has no figure.
    assert "| `tests/unit/test_countdown.py` | 13 |  |" in done.stdout
    assert json.loads(record.read_text()) == {"tests/unit/test_countdown.py::test_slow_one[a]": 12.5,
                                              "tests/unit/test_buffer.py::test_broken": 3.0,
                                              f"tests/commands/test_suite_tools.py::{this}": 0.7}
    top = run("-m", "tests.durations", "--top", "1", str(report)).stdout
    assert "| 1 |" in top and "| 2 |" not in top and "The slowest tests first" not in top


def test_python_m_tests_durations_shows_how_busy_the_workers_were(tmp_path):
    """From the start time and worker each test's record keeps (tests/conftest.py): the span, each worker's busy
    minutes, and the tail after the first worker ran out of tests, with the tests still running in it."""
    def case(name: str, worker: str, started: float, seconds: float) -> str:
        return (f'<testcase classname="tests.unit.test_x" name="{name}" time="{seconds}"><properties>'
                f'<property name="started" value="{started}"/><property name="worker" value="{worker}"/>'
                "</properties></testcase>")
    report = tmp_path / "venv.xml"
    report.write_text('<?xml version="1.0" encoding="utf-8"?><testsuites><testsuite name="pytest">'
                      + case("test_a", "gw0", 1000.0, 30.0) + case("test_b", "gw0", 1030.0, 30.0)
                      + case("test_long", "gw1", 1000.0, 120.0) + "</testsuite></testsuites>")
    done = run("-m", "tests.durations", "--top", "1", str(report))
    assert done.returncode == 0, done.stderr
    assert "span 2.0 min; each worker's busy minutes: gw0 1.0, gw1 2.0" in done.stdout, done.stdout
    tail = done.stdout.split("tail: 1.0 min after the first worker ran out of tests, still running then:\n", 1)
    assert len(tail) == 2 and tail[1].splitlines()[0].split() == ["gw1", "0", "s", "+", "120.0", "s",
                                                                  "tests/unit/test_x.py::test_long"], done.stdout


@pytest.mark.parametrize("argv, said", [
    (["--top", "0", "x.xml"], "--top 0: give a whole number of tests >= 1"),
    (["nothing.xml"], "no such report: nothing.xml (pytest --junitxml=FILE writes one"),
])
def test_python_m_tests_durations_refuses_bad_input_in_one_line(argv, said):
    done = run("-m", "tests.durations", *argv)
    assert done.returncode == 2 and said in done.stderr and "Traceback" not in done.stderr, done.stderr


def measured_tree(tmp_path: Path) -> tuple[Path, Path]:
    """A checkout of four trees whose one module ran under coverage.py with one of its five lines missed."""
    root = tmp_path / "checkout"
    for tree in ("src", "analysis", "launch", "hydra_plugins"):
        (root / tree).mkdir(parents=True)
    (root / "src" / "module.py").write_text(
        "def used():\n    return 1\n\n\ndef unused():\n    return 2\n\n\nused()\n")
    data = tmp_path / "data"
    data.mkdir()
    done = run("-m", "coverage", "run", f"--data-file={data}/.coverage.one", f"--source={root}",
               str(root / "src" / "module.py"), cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    return root, data


def test_python_m_tests_coverage_floor_counts_lines_and_refuses_a_fall(tmp_path):
    """Every file of the four trees counts (a file never run has all its lines missed), and a tree below its
    recorded floor fails the command; --record writes the floor."""
    root, data = measured_tree(tmp_path)
    (root / "launch" / "never_run.py").write_text("x = 1\ny = 2\n")
    floor = tmp_path / "floor.json"
    recorded = run("-m", "tests.coverage_floor", str(data), "--root", str(root), "--floor", str(floor), "--record")
    assert recorded.returncode == 0, recorded.stderr
    assert "src             80.0 %       4 of      5 lines" in recorded.stdout, recorded.stdout
    assert "launch           0.0 %       0 of      2 lines" in recorded.stdout
    assert "total           57.1 %       4 of      7 lines" in recorded.stdout
    assert json.loads(floor.read_text())["src"] == {"statements": 5, "covered": 4}
    same = run("-m", "tests.coverage_floor", str(data), "--root", str(root), "--floor", str(floor))
    assert same.returncode == 0 and "(floor 80.0 %, 4 lines)" in same.stdout, same.stdout + same.stderr
    floor.write_text(json.dumps({"src": {"statements": 5, "covered": 5}}))  # a floor the suite once reached
    fell = run("-m", "tests.coverage_floor", str(data), "--root", str(root), "--floor", str(floor))
    assert fell.returncode == 1 and "below the floor: src:" in fell.stderr, fell.stdout + fell.stderr


def test_the_guard_counts_commands_tested_as_typed_and_tests_left_to_long(tmp_path):
    """The documented commands with a test as typed may not fall below the floor's count, and the tests marked
    `long` (one collect-only listing per environment, counted once) may not grow past it."""
    from tests.commands.test_commands import DOCUMENTED

    root, data = measured_tree(tmp_path)
    venv, vllm = tmp_path / "venv.txt", tmp_path / "vllm.txt"
    venv.write_text("tests/e2e/test_a.py::test_one\ntests/e2e/test_a.py::test_two\n\n2/9 tests collected\n")
    vllm.write_text("tests/e2e/test_a.py::test_two\ntests/e2e/test_v.py::test_three\n")
    floor = tmp_path / "floor.json"
    floor.write_text(json.dumps({"documented_commands_at_least": len(DOCUMENTED), "long_tests_at_most": 3}))
    held = run("-m", "tests.coverage_floor", str(data), "--root", str(root), "--floor", str(floor),
               "--long", str(venv), str(vllm))
    assert held.returncode == 0, held.stdout + held.stderr
    assert f"{len(DOCUMENTED)} documented commands tested as typed (at least {len(DOCUMENTED)})" in held.stdout
    assert "3 tests marked long, left to make test-long (at most 3)" in held.stdout
    floor.write_text(json.dumps({"documented_commands_at_least": len(DOCUMENTED) + 1, "long_tests_at_most": 2}))
    moved = run("-m", "tests.coverage_floor", str(data), "--root", str(root), "--floor", str(floor),
                "--long", str(venv), str(vllm))
    assert moved.returncode == 1, moved.stdout + moved.stderr
    assert "below the floor: commands tested as typed, tests moved to long:" in moved.stderr


def test_python_m_tests_coverage_floor_refuses_a_folder_without_data(tmp_path):
    done = run("-m", "tests.coverage_floor", str(tmp_path / "none"))
    assert done.returncode == 2 and "none: no such folder (make coverage writes .coverage-data)" in done.stderr
    empty = run("-m", "tests.coverage_floor", str(tmp_path))
    assert empty.returncode == 1 and "no coverage data in" in empty.stderr and "Traceback" not in empty.stderr


class _Fixture:
    def __init__(self, scope: str, params=None):
        self.scope, self.params = scope, params


class _Info:
    def __init__(self, scopes: dict[str, str], params: dict):
        self.name2fixturedefs = {name: [_Fixture(scope, [params[name]] if name in params else None)]
                                 for name, scope in scopes.items()}


class _Item:
    def __init__(self, nodeid: str, scopes: dict[str, str], params: dict | None = None):
        self.nodeid, self.fixturenames, self._fixtureinfo = nodeid, list(scopes), _Info(scopes, params or {})
        if params:
            self.callspec = type("CallSpec", (), {"params": params})()


def test_a_test_that_uses_a_fixture_built_once_per_module_shares_its_modules_worker():
    """A module-scoped fixture is built once per worker that runs one of its tests: its tests go together; the
    local SLURM cluster's tests go together whatever their module; the rest go anywhere."""
    assert worker_group(_Item("tests/test_a.py::test_x", {"store": "module", "tmp_path": "function"})) == \
        "tests/test_a.py"
    assert worker_group(_Item("tests/test_b.py::test_y", {"slurm_env": "function"})) == "slurm"
    assert worker_group(_Item("tests/test_c.py::test_z", {"random_policy_dir": "session",
                                                          "tmp_path": "function"})) is None
    # A module fixture built once per CPU code path: each path's tests together, the paths apart.
    assert worker_group(_Item("tests/test_d.py::test_w[avx2]", {"computed": "module"}, {"computed": "avx2"})) == \
        "tests/test_d.py::computed=avx2"


@pytest.mark.parametrize("knob", ["TEST_WORKERS", "VLLM_TEST_WORKERS"])
def test_make_test_refuses_a_worker_count_that_is_not_a_whole_number(knob):
    """`make test TEST_WORKERS=x` (or the vLLM half's VLLM_TEST_WORKERS=x) is one line naming the knob and its fix,
    before anything runs (`-n`: nothing would run anyway; the refusal comes while make reads the recipe)."""
    env = {key: value for key, value in ENV.items() if key not in ("MAKEFLAGS", "MFLAGS", "MAKELEVEL")}
    done = subprocess.run(["make", "-n", "-B", "--no-print-directory", "test", f"{knob}=x", "TORCH_INDEX="],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 2, done.stdout + done.stderr
    assert f"{knob}=x: how many pytest-xdist workers per half, a whole number" in done.stderr
    assert "-m pytest" not in done.stdout  # no half of the suite was planned


SHARED_MODULE = '''
import os, time, pytest

@pytest.fixture(scope="module")
def built(tmp_path_factory):
    with open(os.environ["PROBE_LOG"], "a") as log:
        log.write(f"built {os.environ['PYTEST_XDIST_WORKER']}\\n")

@pytest.mark.parametrize("n", range(6))
def test_shared(built, n):
    with open(os.environ["PROBE_LOG"], "a") as log:
        log.write(f"shared {os.environ['PYTEST_XDIST_WORKER']}\\n")
    time.sleep(0.2)  # both workers ask for more meanwhile
'''


@pytest.mark.parametrize("dist, together", [("loadgroup", True), ("load", False)])
def test_a_modules_shared_fixture_is_built_once_over_two_workers_with_loadgroup(tmp_path, dist, together):
    """`make test TEST_WORKERS=2`'s scheduling, in a folder of its own: the six tests of a module with a
    module-scoped fixture run on one worker, which builds it once, while the free tests spread. xdist's `load`
    splits the module (the fixture built on both workers), which shows that the check can fail."""
    # The shared module first (tests/conftest.py also hands the heaviest unit out first): xdist's `load` then gives
    # each worker two of its tests in its first batch (xdist/scheduler/load.py, `schedule`), so it is split for sure.
    (tmp_path / "test_a_shared.py").write_text(SHARED_MODULE)
    (tmp_path / "test_b_free.py").write_text("import pytest\n\n@pytest.mark.parametrize('n', range(12))\n"
                                             "def test_free(n):\n    pass\n")
    log = tmp_path / "probe.log"
    # Not this run's own workers' variables (when the suite itself runs under xdist): a run of its own.
    env = {key: value for key, value in ENV.items() if not key.startswith("PYTEST_") and key != GROUPS_ENV}
    done = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "tests.conftest", "-n", "2", "--dist", dist,
                           "--no-loadscope-reorder", "--rootdir", str(tmp_path), "-c", os.devnull, str(tmp_path)],
                          cwd=ROOT, env={**env, "PROBE_LOG": str(log), "PYTHONPATH": str(ROOT)},
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0 and "18 passed" in done.stdout, done.stdout[-2000:] + done.stderr[-2000:]
    lines = log.read_text().splitlines()
    built, shared = [line for line in lines if line.startswith("built")], [line for line in lines
                                                                            if line.startswith("shared")]
    assert len(shared) == 6
    if together:
        assert len(built) == 1 and set(shared) == {built[0].replace("built", "shared")}, lines
    else:
        assert len(built) == 2, lines


THREADS_MODULE = '''
import os, subprocess, sys

def test_threads(tmp_path):
    child = subprocess.run([sys.executable, "-c", "import os; print(os.environ.get('OMP_NUM_THREADS'))"],
                           capture_output=True, text=True, check=True).stdout.strip()
    with open(os.environ["PROBE_LOG"], "a") as log:
        log.write(f"{os.environ.get('OMP_NUM_THREADS')} {child}\\n")
'''


@pytest.mark.parametrize("given", [None, "3"])
def test_each_worker_and_what_it_starts_get_their_share_of_the_cores(tmp_path, given):
    """Under xdist each worker sets OMP_NUM_THREADS to its share of the cores (tests/conftest.py,
    `share_the_cores`) and the processes it starts inherit it; a value the caller set is kept."""
    (tmp_path / "test_threads.py").write_text(THREADS_MODULE)
    log = tmp_path / "probe.log"
    env = {key: value for key, value in ENV.items()
           if not key.startswith("PYTEST_") and key not in (GROUPS_ENV, "OMP_NUM_THREADS")}
    done = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "tests.conftest", "-n", "2", "--rootdir",
                           str(tmp_path), "-c", os.devnull, str(tmp_path)],
                          cwd=ROOT, env={**env, "PROBE_LOG": str(log), "PYTHONPATH": str(ROOT),
                                         **({"OMP_NUM_THREADS": given} if given else {})},
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    share = given or str(max(1, len(os.sched_getaffinity(0)) // 2))
    assert log.read_text().split() == [share, share]


SIGNALS_MODULE = '''
import signal

def test_a_leaves_a_handler():
    signal.signal(signal.SIGINT, lambda *_: None)  # as a run stopped by Ctrl-C in this process leaves one

def test_b_finds_pythons_own():
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler
'''


@pytest.mark.parametrize("plugin, passes", [("tests.conftest", True), ("no:cacheprovider", False)])
def test_a_signal_handler_a_test_leaves_is_gone_before_the_next(tmp_path, plugin, passes):
    """Every test gets the signal handlers it started with back (tests/conftest.py, `signal_handlers_kept`): in
    one process, a SIGINT handler one test leaves does not reach the next. Without the conftest the second fails,
    which shows the check can fail."""
    (tmp_path / "test_signals.py").write_text(SIGNALS_MODULE)
    env = {key: value for key, value in ENV.items() if not key.startswith("PYTEST_") and key != GROUPS_ENV}
    done = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:xdist", "-p", plugin, "--rootdir",
                           str(tmp_path), "-c", os.devnull, str(tmp_path)],
                          cwd=ROOT, env={**env, "PYTHONPATH": str(ROOT)}, capture_output=True, text=True, timeout=300)
    assert (done.returncode == 0) == passes, done.stdout[-2000:] + done.stderr[-2000:]
    assert ("2 passed" if passes else "1 failed, 1 passed") in done.stdout, done.stdout[-2000:]
