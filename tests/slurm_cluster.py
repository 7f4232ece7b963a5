"""A real SLURM cluster for tests (launch/local_slurm.sh under pytest): two nodes of this one machine, so that a
job may ask for two nodes as a cell over nodes does (each node its own slurmd; they share the cores).

    with local_slurm(tmp_dir) as cluster:          # installs slurm-wlm + munge if missing
        subprocess.run(["sbatch", "--wrap", "true"], env=cluster.env, check=True)
        with cluster.activated():                  # os.environ too, for in-process submitit/Hydra
            submitit.AutoExecutor(folder=..., cluster="slurm")...

Fixtures: `slurm_cluster` (session-scoped: one cluster for the whole run, stopped at the end
even when tests fail) and `slurm_env` (per test: the same cluster with SLURM_CONF/PATH set in
os.environ through monkeypatch, so submitit and Hydra's submitit_slurm launcher find it). Make
them visible with this line in tests/conftest.py (or in a test module):

    from tests.slurm_cluster import slurm_cluster, slurm_env  # noqa: F401

Importing them in several places still starts one cluster per pytest process.

Tests skip (with the reason) when not root, or when slurm is missing and apt-get is not there to
install it; an install or start that fails is a test error, not a skip.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from tests.ports import free_port

PROJECT_ROOT = Path(__file__).resolve().parent.parent
SCRIPT = PROJECT_ROOT / "launch" / "local_slurm.sh"
# The daemons' binaries; all four must be on PATH (or in /usr/sbin) for the cluster to start.
_NEEDED = ("slurmctld", "slurmd", "munged", "sbatch")
_SYSTEM_PATH = ("/usr/sbin", "/usr/bin", "/sbin", "/bin")
# AF_UNIX socket paths are limited to 108 bytes; the munge socket lives in the state folder.
_MAX_STATE_DIR = 80


@dataclass(frozen=True)
class LocalSlurm:
    """A running local cluster: where it lives and the environment its clients need."""

    state_dir: Path
    slurm_conf: Path
    partition: str = "debug"
    nodes: int = 1
    # What a subprocess needs on top of os.environ: SLURM_CONF, and a PATH with the slurm
    # client tools and this interpreter's folder first (so `python` in a job is this venv's).
    extra_env: dict[str, str] = field(default_factory=dict)

    @property
    def env(self) -> dict[str, str]:
        """A full environment for subprocess.run(..., env=cluster.env)."""
        return {**os.environ, **self.extra_env}

    def run(self, *cmd: str, **kwargs) -> subprocess.CompletedProcess:
        """Run a client command (sbatch, squeue, scontrol, ...) against this cluster."""
        kwargs.setdefault("capture_output", True)
        kwargs.setdefault("text", True)
        kwargs.setdefault("timeout", 60)
        return subprocess.run(list(cmd), env=self.env, **kwargs)

    @contextlib.contextmanager
    def activated(self) -> Iterator[LocalSlurm]:
        """Set SLURM_CONF/PATH in os.environ for the block (in-process submitit or Hydra)."""
        saved = {key: os.environ.get(key) for key in self.extra_env}
        os.environ.update(self.extra_env)
        try:
            yield self
        finally:
            for key, value in saved.items():
                if value is None:
                    os.environ.pop(key, None)
                else:
                    os.environ[key] = value


def _script(*args: str, timeout: float, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    return subprocess.run(
        ["bash", str(SCRIPT), *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        env=env,
        stdin=subprocess.DEVNULL,
    )


def _have_slurm() -> bool:
    path = os.pathsep.join([os.environ.get("PATH", ""), *_SYSTEM_PATH])
    return all(shutil.which(name, path=path) for name in _NEEDED)


def ensure_installed() -> None:
    """Skip unless we can have slurm + munge; install them (apt-get) when missing."""
    if not sys.platform.startswith("linux"):
        pytest.skip("local SLURM cluster: Linux only")
    if os.geteuid() != 0:
        pytest.skip("local SLURM cluster: needs root (apt-get install, daemons run as root)")
    if _have_slurm():
        return
    if shutil.which("apt-get") is None:
        pytest.skip("local SLURM cluster: slurm-wlm/munge not installed and no apt-get to install them")
    result = _script("install", timeout=1200)
    if result.returncode != 0:
        pytest.fail(f"launch/local_slurm.sh install failed:\n{result.stdout}\n{result.stderr}")


@contextlib.contextmanager
def local_slurm(tmp_dir: str | os.PathLike, nodes: int = 1) -> Iterator[LocalSlurm]:
    """Install if needed, start a cluster of `nodes` nodes with its state in tmp_dir, yield it, always stop it.

    Ports are picked free at start, so this cluster can run beside a developer's own
    `launch/local_slurm.sh start` (default ports 6817/6818).
    """
    ensure_installed()
    state_dir = Path(tmp_dir).resolve()
    own_tmp = None
    if len(str(state_dir)) > _MAX_STATE_DIR:  # keep the munge socket path under 108 bytes
        own_tmp = state_dir = Path(tempfile.mkdtemp(prefix="slurm-", dir="/tmp"))
    state_dir.mkdir(parents=True, exist_ok=True)

    env = {
        **os.environ,
        "LOCAL_SLURM_CTLD_PORT": str(free_port()),
        "LOCAL_SLURM_D_PORT": str(free_port(nodes)),
        "LOCAL_SLURM_NODES": str(nodes),
    }
    try:
        started = _script("start", str(state_dir), timeout=180, env=env)
        if started.returncode != 0:
            raise RuntimeError(
                f"launch/local_slurm.sh start {state_dir} failed (exit {started.returncode}):\n"
                f"{started.stdout}\n{started.stderr}"
            )
        slurm_conf = state_dir / "slurm.conf"
        path_parts = [os.path.dirname(sys.executable), os.environ.get("PATH", ""), *_SYSTEM_PATH]
        cluster = LocalSlurm(
            state_dir=state_dir,
            slurm_conf=slurm_conf,
            nodes=nodes,
            extra_env={
                "SLURM_CONF": str(slurm_conf),
                "PATH": os.pathsep.join(p for p in path_parts if p),
            },
        )
        yield cluster
    finally:
        # Stops only the daemons whose pids the script recorded in state_dir (and cancels the
        # cluster's jobs first); safe to call when start failed half-way.
        stopped = _script("stop", str(state_dir), timeout=120)
        if own_tmp is not None:
            shutil.rmtree(own_tmp, ignore_errors=True)
        if stopped.returncode != 0:
            print(f"launch/local_slurm.sh stop failed:\n{stopped.stdout}\n{stopped.stderr}", file=sys.stderr)


# The session cluster's nodes: two, so a test may submit a job over two nodes (tests/e2e/test_slurm_sweep.py).
SESSION_NODES = 2

# One cluster per process even when the fixture is imported into several test modules (pytest
# then holds one session fixture per module): the first user starts it, the last one stops it.
_shared: dict = {}


@pytest.fixture(scope="session")
def slurm_cluster(tmp_path_factory) -> Iterator[LocalSlurm]:
    """One local SLURM cluster for the whole test session (started on first use)."""
    if not _shared:
        stack = contextlib.ExitStack()
        cluster = stack.enter_context(local_slurm(tmp_path_factory.mktemp("slurm"), nodes=SESSION_NODES))
        _shared.update(cluster=cluster, stack=stack, users=0)
    _shared["users"] += 1
    try:
        yield _shared["cluster"]
    finally:
        _shared["users"] -= 1
        if _shared["users"] == 0:
            stack = _shared["stack"]
            _shared.clear()
            stack.close()


@pytest.fixture
def slurm_env(slurm_cluster: LocalSlurm, monkeypatch) -> LocalSlurm:
    """The session cluster, with SLURM_CONF and PATH set in os.environ for this test."""
    for key, value in slurm_cluster.extra_env.items():
        monkeypatch.setenv(key, value)
    return slurm_cluster
