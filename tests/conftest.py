"""Shared fixtures: composed configs and a tiny model saved to a local folder."""

from __future__ import annotations

import json
import os
import resource
import shutil
import signal
import sys
import tempfile
import time
from pathlib import Path

import pytest
from hydra import compose, initialize_config_dir

import src.command.config  # noqa: F401  (registers the ${root:} resolver)
from src.paths import CONFIG_DIR, PROJECT_ROOT

TINY_CHECKPOINT = PROJECT_ROOT / "checkpoints" / "tiny-countdown"

# A suite started in the background by a shell without job control (`make test &` in a script) inherits SIGINT
# ignored: Python then installs no Ctrl-C handler, and neither do the commands the tests start (an ignored signal
# stays ignored across exec), so every Ctrl-C test would test nothing. Python's own handler, as a terminal gives.
if signal.getsignal(signal.SIGINT) is signal.SIG_IGN:
    signal.signal(signal.SIGINT, signal.default_int_handler)


def share_the_cores() -> None:
    """Under pytest-xdist, each worker and every process it starts get their share of the cores as torch's
    intra-op threads (OMP_NUM_THREADS, which torch and MKL read), unless the caller set it. Two workers that
    each ran two OpenMP threads on 2 cores kept four spinning threads on two cores: `make reproduce-seed000`'s
    tiny study took 52 s beside a 2-thread torch process and 24 s with one thread each (23 s alone, idle)."""
    workers = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT") or 0)
    if not os.environ.get("PYTEST_XDIST_WORKER") or workers < 1 or "OMP_NUM_THREADS" in os.environ:
        return
    threads = max(1, len(os.sched_getaffinity(0)) // workers)
    os.environ["OMP_NUM_THREADS"] = str(threads)
    torch = sys.modules.get("torch")  # torch reads the variable when it first starts its threads
    if torch is not None:
        torch.set_num_threads(threads)


share_the_cores()


def through_checkpoint(store, empty, path):
    """`empty` after loading `store`'s state the way a training checkpoint does (torch.save, weights_only load)."""
    import torch

    torch.save(store.state_dict(), path)
    empty.load_state_dict(torch.load(path, weights_only=True))
    return empty


@pytest.fixture(autouse=True)
def default_dtype_kept():
    """Torch's default dtype back as it was after each test: a test that builds a hardware.dtype=float64 run in
    this process (`src.build` sets the default dtype, a process-wide setting) must not make later tests float64."""
    torch = sys.modules.get("torch")  # not imported here: tests that never load torch stay light
    before = torch.get_default_dtype() if torch is not None else None
    yield
    torch = sys.modules.get("torch")
    if torch is not None:
        torch.set_default_dtype(before or torch.float32)


KEPT_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP, signal.SIGUSR1, signal.SIGUSR2)


@pytest.fixture(autouse=True)
def signal_handlers_kept():
    """The signal handlers back as they were after each test: a run stopped in this process leaves a Ctrl-C
    handler that exits at once (`StopOnSignal.hand_on`, for a process that is ending), and the next test in the
    same worker would inherit it."""
    before = {signum: signal.getsignal(signum) for signum in KEPT_SIGNALS}
    yield
    for signum, handler in before.items():
        if handler is not None and signal.getsignal(signum) is not handler:
            signal.signal(signum, handler)


@pytest.fixture
def compose_config():
    """compose_config(*overrides, hydra=False) -> the composed DictConfig."""

    def _compose(*overrides: str, hydra: bool = False):
        with initialize_config_dir(str(CONFIG_DIR), version_base="1.3"):
            return compose("config", overrides=list(overrides), return_hydra_config=hydra)

    return _compose


@pytest.fixture(scope="session")
def random_policy_dir(tmp_path_factory):
    """A randomly initialised tiny policy + tokenizer written with save_pretrained (no training)."""
    from src.policy.model import build_tiny_model
    from src.policy.tokenizer import build_countdown_tokenizer, template_pieces
    from src.task import countdown

    folder = tmp_path_factory.mktemp("random-policy")
    template = countdown.DEFAULT_PROMPT_TEMPLATE
    demos = [countdown.demonstration(i) for i in countdown.generate_instances(50, seed=3)]
    tokenizer = build_countdown_tokenizer([template, *demos], template_pieces(template))
    model = build_tiny_model(tokenizer, hidden_size=32, layers=1, heads=2, kv_heads=1)
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return folder


from tests.slurm_cluster import slurm_cluster, slurm_env  # noqa: E402,F401  (the local SLURM fixtures)


def kill_tree(pid: int) -> None:
    """SIGKILL `pid` and every process below it at once, as a node failure would: no handler runs anywhere."""
    parents = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            parents[int(stat.parent.name)] = int(stat.read_text().rsplit(")", 1)[1].split()[1])
        except (OSError, IndexError, ValueError):  # ended while read
            continue
    tree, frontier = [pid], [pid]
    while frontier:
        frontier = [child for child, parent in parents.items() if parent in frontier]
        tree += frontier
    for member in tree:
        try:
            os.kill(member, signal.SIGKILL)
        except ProcessLookupError:
            pass


def wall_clock(key: str) -> bool:
    """A metric that measures wall time (the step phases' `time/*`, the run's `wall_time_min`): it differs
    between any two runs, so a comparison of two runs' numbers leaves it out."""
    return key.startswith("time/") or key == "wall_time_min"


# --------------------------------------------------------------------------- parallel workers
# `make test TEST_WORKERS=N` spreads the tests over pytest-xdist workers (`--dist loadgroup
# --no-loadscope-reorder`). A test that uses a fixture built once per module (a trained store, a Ray instance, a
# subprocess's output) runs on the worker that built it: every test of that module gets the module's group. The
# local SLURM cluster is one per machine in spirit (its daemons take minutes to install and start): its tests
# share the group "slurm". Every other test is a unit of its own. The units are handed out heaviest first, from
# the seconds each test took in the last `make test-durations` (tests/durations.json): a long unit started last
# would otherwise run alone at the end.
#
# xdist's own loadgroup reads a group from the test id, which it extends with "@group" on the worker; pytest 9
# builds `Item.nodeid` from `_id` (_pytest/nodes.py:292), so the extension never reaches the scheduler and no
# group holds. The workers write each test's unit to a file instead, and `GroupScheduling` (below) reads it.
GROUPS_ENV = "REPLAY_TEST_GROUPS"
DURATIONS = Path(__file__).with_name("durations.json")
SHARED_SCOPES = ("module", "class", "package")
SLURM_FIXTURES = ("slurm_cluster", "slurm_env")


def worker_group(item: pytest.Item) -> str | None:
    """The xdist group `item` must share a worker with, or None if it can run anywhere."""
    if any(name in item.fixturenames for name in SLURM_FIXTURES):
        return "slurm"
    definitions = getattr(item, "_fixtureinfo", None)
    shared = [(name, fixture) for name, defs in (definitions.name2fixturedefs.items() if definitions else ())
              for fixture in defs if fixture.scope in SHARED_SCOPES]
    if not shared:
        return None
    module = item.nodeid.split("::", 1)[0]
    # A parametrized module fixture is built once per value: each value's tests can go to a worker of their own.
    values = [f"{name}={item.callspec.params[name]}" for name, fixture in shared
              if getattr(fixture, "params", None) and name in getattr(getattr(item, "callspec", None), "params", {})]
    return f"{module}::{','.join(values)}" if values else module


def cpu_seconds() -> float:
    """CPU time of this process and of every child it has waited for (a command a test ran, and what that
    command waited for), user and system."""
    return sum(usage.ru_utime + usage.ru_stime
               for usage in map(resource.getrusage, (resource.RUSAGE_SELF, resource.RUSAGE_CHILDREN)))


CPU_STARTED = pytest.StashKey[float]()
WALL_STARTED = pytest.StashKey[float]()


def pytest_runtest_setup(item):
    item.stash[CPU_STARTED] = cpu_seconds()
    item.stash[WALL_STARTED] = time.time()


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    """Each test's CPU-seconds (setup to teardown, the commands it waited for included) as the `cpu_seconds`
    property of its JUnit record: `python -m tests.durations` ranks by them beside the wall seconds. Processes
    nothing waits for (Ray's actors, a server left to its own group) are not counted."""
    if call.when == "teardown" and CPU_STARTED in item.stash:
        item.user_properties.append(("cpu_seconds", round(cpu_seconds() - item.stash[CPU_STARTED], 2)))
        # when and where it ran: `python -m tests.durations --timeline` shows how busy the workers were
        item.user_properties.append(("started", round(item.stash[WALL_STARTED], 1)))
        item.user_properties.append(("worker", os.environ.get("PYTEST_XDIST_WORKER", "main")))
    yield


TIERS = ("unit", "e2e", "commands")  # tests/<tier>/: each test carries its folder's marker


def pytest_itemcollected(item):
    """Each test's tier marker, set as it is collected: `-m unit` selects by it."""
    tier = Path(str(item.path)).parent.name
    if tier in TIERS:
        item.add_marker(getattr(pytest.mark, tier))


def pytest_collection_modifyitems(config, items):
    worker = os.environ.get("PYTEST_XDIST_WORKER")
    if not worker:
        return  # one process: the files' own order
    recorded = json.loads(DURATIONS.read_text()) if DURATIONS.is_file() else {}
    unit_of, seconds, first = {}, {}, {}
    for index, item in enumerate(items):
        group = worker_group(item)
        unit = unit_of[item.nodeid] = group or item.nodeid
        seconds[unit] = seconds.get(unit, 0.0) + recorded.get(item.nodeid, 0.1)
        first.setdefault(unit, index)
    items.sort(key=lambda item: (-seconds[unit_of[item.nodeid]], first[unit_of[item.nodeid]]))
    if os.environ.get(GROUPS_ENV):  # before this worker reports its collection: the scheduler reads it then
        target = Path(os.environ[GROUPS_ENV]) / f"{worker}.json"
        target.with_suffix(".tmp").write_text(json.dumps(unit_of))
        target.with_suffix(".tmp").replace(target)


def pytest_configure(config):
    """On the controller of a loadgroup run: the folder where the workers write their tests' units."""
    if hasattr(config, "workerinput") or getattr(config.option, "dist", "no") != "loadgroup":
        return
    os.environ[GROUPS_ENV] = tempfile.mkdtemp(prefix="replay-test-groups-")


def pytest_unconfigure(config):
    if not hasattr(config, "workerinput") and os.environ.get(GROUPS_ENV):
        shutil.rmtree(os.environ.pop(GROUPS_ENV), ignore_errors=True)


@pytest.hookimpl(optionalhook=True)  # a hook of xdist's: unknown under -p no:xdist
def pytest_xdist_make_scheduler(config, log):
    """loadgroup with the units the workers wrote (GROUPS_ENV); any other --dist: xdist's own scheduler."""
    if config.option.dist != "loadgroup":
        return None
    from xdist.scheduler import LoadScopeScheduling

    class GroupScheduling(LoadScopeScheduling):
        """Whole units to a worker, in the workers' collection order (heaviest first): LoadScopeScheduling with
        the scope of a test read from the units its workers wrote."""

        units: dict[str, str] | None = None

        def _split_scope(self, nodeid: str) -> str:
            if self.units is None:  # every worker has reported its collection: each wrote its file before
                files = sorted(Path(os.environ[GROUPS_ENV]).glob("*.json"))
                assert files, f"no worker wrote its tests' units to {os.environ[GROUPS_ENV]}"
                self.units = json.loads(files[0].read_text())
            return self.units.get(nodeid, nodeid)

    return GroupScheduling(config, log)
