"""A Ray cluster of several nodes for the async pipeline (`runtime.address`), started and stopped from a folder.

    python -m src.runtime.ray_cluster start --dir /tmp/rc --nodes 2 --cpus 2   # prints the head's host:port
    python -m src.run runtime=async runtime.address=127.0.0.1:PORT ...        # the run joins it, leaves it up
    python -m src.runtime.ray_cluster stop --dir /tmp/rc                       # stops those nodes, and only them

`start` runs `ray start --block` once for the head and once for each further node on this machine, each node with
its own CPUs and a resource named after it (`node2`, ...), as nodes of a cluster over several machines have. The
folder keeps each node's log and the process ids, so `stop` ends exactly these nodes: SIGTERM to each `ray start
--block`, which stops what it started (ray/_private/node.py:629-664 in Ray 2.60), then SIGKILL to any process
still naming the folder. `ray stop` would end every Ray process of the machine, another run's included.

Inside a SLURM job of several nodes (`hardware.nodes=N` under runtime=async, one task a node) the run starts the
same cluster itself: the first node's task runs the head and the driver (`lead_cluster`), every other task joins
and serves until the run ends (`serve_node`); the head's address passes through the job's shared folder.

The nodes run with RAY_AUTH_MODE=disabled unless it is set: Ray 2.60 turns token authentication on wherever it
finds a token file (ray/_private/authentication/authentication_token_setup.py:55-68), and a driver that joins by
address sends a token only when told to, so the cluster and its runs must agree.
"""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import json
import os
import re
import signal
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator

PIDS = "nodes.json"
WORKER_PORTS = 2000  # each node's own range of worker ports, so two raylets on one machine never race for one


def free_port() -> int:
    """A TCP port no process on this machine listens on now, on any of its addresses (a head or a rendezvous
    other nodes reach)."""
    with socket.socket() as probe:
        probe.bind(("", 0))
        return probe.getsockname()[1]


def ray_command() -> list[str]:
    return [str(Path(sys.executable).with_name("ray"))]


def node_command(index: int, head: str, port: int, cpus: int, first_worker_port: int) -> list[str]:
    """`ray start --block` for node `index` of a cluster whose head (node 0) listens on head:port: each node with a
    resource named after it (`node2`, ...) and its own range of worker ports (two nodes may share a machine)."""
    low = first_worker_port + index * WORKER_PORTS
    shared = ["--block", f"--num-cpus={cpus}", "--disable-usage-stats", "--dashboard-agent-listen-port=0",
              f"--min-worker-port={low}", f"--max-worker-port={low + WORKER_PORTS - 1}"]
    if index == 0:
        own = ["--head", f"--port={port}", "--include-dashboard=false"]
        own += [] if head == "127.0.0.1" else [f"--node-ip-address={head}"]  # else Ray's own pick: one machine
    else:
        own = [f"--address={head}:{port}", f"--resources={json.dumps({f'node{index + 1}': 1})}"]
    return [*ray_command(), "start", *own, *shared]


def node_commands(nodes: int, cpus: int, port: int, first_worker_port: int) -> list[list[str]]:
    """`ray start --block` for the head and each further node of one machine."""
    return [node_command(index, "127.0.0.1", port, cpus, first_worker_port) for index in range(nodes)]


def alive_nodes(address: str, env: dict) -> int:
    """Nodes `ray status` lists as active (0 while the head is not up)."""
    done = subprocess.run([*ray_command(), "status", f"--address={address}"], capture_output=True, text=True,
                          env=env, timeout=60)
    return len(re.findall(r"^\s*1 node_", done.stdout, flags=re.MULTILINE)) if done.returncode == 0 else 0


def start(folder: Path, nodes: int, cpus: int, port: int | None, timeout_s: float = 120.0) -> str:
    """Start the nodes, wait until all are active, and return the head's host:port."""
    folder.mkdir(parents=True, exist_ok=True)
    if (folder / PIDS).exists():
        raise SystemExit(f"--dir {folder}: a cluster was started from it ({PIDS}); stop it first "
                         f"(python -m src.runtime.ray_cluster stop --dir {folder})")
    port = port or free_port()
    address = f"127.0.0.1:{port}"
    env = {**os.environ, "RAY_AUTH_MODE": os.environ.get("RAY_AUTH_MODE", "disabled"),
           "RAY_GRACEFUL_SHUTDOWN_DRAIN_TIMEOUT_S": "0", "RAY_TMPDIR": str(folder)}
    pids = []
    for index, command in enumerate(node_commands(nodes, cpus, port, first_worker_port=20_000)):
        with open(folder / f"node{index + 1}.log", "w") as log:
            process = subprocess.Popen([*command, f"--temp-dir={folder / 'ray'}"], stdout=log, stderr=subprocess.STDOUT,
                                       env=env, start_new_session=True)
        pids.append(process.pid)
        (folder / PIDS).write_text(json.dumps({"address": address, "pids": pids}))
        deadline = time.monotonic() + timeout_s
        while alive_nodes(address, env) < index + 1:
            if process.poll() is not None or time.monotonic() > deadline:
                stop(folder)
                raise SystemExit(f"ray node {index + 1} of {nodes} did not come up; its log: {folder}/node{index + 1}.log")
            time.sleep(1.0)
    return address


def stop(folder: Path, grace_s: float = 30.0) -> int | None:
    """Stop the nodes started from `folder`; returns how many processes had to be killed outright (None: no cluster
    was started from it)."""
    record = folder / PIDS
    if not record.exists():
        return None
    for pid in reversed(json.loads(record.read_text())["pids"]):
        _signal(pid, signal.SIGTERM)
        deadline = time.monotonic() + grace_s
        while _alive(pid) and time.monotonic() < deadline:
            time.sleep(0.2)
    leftovers = [pid for pid in _processes_naming(folder) if pid != os.getpid()]
    for pid in leftovers:
        _signal(pid, signal.SIGKILL)
    record.unlink()
    return len(leftovers)


def _processes_naming(folder: Path) -> list[int]:
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            command = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
        except OSError:
            continue
        if str(folder) in command:
            found.append(int(entry.name))
    return found


def _alive(pid: int) -> bool:
    try:
        waited, _ = os.waitpid(pid, os.WNOHANG)  # our own child: reap it
        if waited == pid:
            return False
    except ChildProcessError:
        pass
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


def _signal(pid: int, signum: int) -> None:
    try:
        os.kill(pid, signum)
    except ProcessLookupError:
        pass


# ---- over the nodes of one SLURM job: `hardware.nodes=N` under runtime=async, one task a node ----

HEAD = "head"          # in the job's folder: the head's host:port, once it is up
STOPPED = "stopped"    # in the job's folder: the run has ended, the further nodes leave
PR_SET_PDEATHSIG = 1   # prctl(2): the signal a process gets when the one that started it dies
HEAD_GONE_S = 10       # a further node leaves once the head has not answered this long


@dataclass(frozen=True)
class Allocation:
    """This task's place in a SLURM job of several nodes, one task a node (submitit's job environment)."""

    index: int        # this task's node: 0 runs the head and the run's driver, the others serve
    nodes: int
    tasks: int
    folder: Path      # shared by the job's nodes: the head's address, each node's log
    scratch: Path     # on this node: Ray's session files and sockets (never on a shared file system)


def slurm_allocation() -> Allocation | None:
    """The allocation this process runs in, when submitit started it in a SLURM job of two nodes or more; else None.

    A requeued job keeps its id, so each attempt (SLURM_RESTART_COUNT) has a folder of its own."""
    if os.environ.get("SUBMITIT_EXECUTOR") != "slurm":
        return None
    from submitit import JobEnvironment

    job = JobEnvironment()
    if job.num_nodes < 2:
        return None
    attempt = f"ray-{job.job_id}-{os.environ.get('SLURM_RESTART_COUNT', '0')}"
    return Allocation(job.global_rank, job.num_nodes, job.num_tasks, Path(job.paths.folder).resolve() / attempt,
                      Path(tempfile.gettempdir()) / attempt)


def _spawn(command: list[str], log: Path, env: dict) -> subprocess.Popen:
    """`command`, stopped by SIGTERM when this process dies however it dies (a SIGKILL included: PR_SET_PDEATHSIG)."""
    libc = ctypes.CDLL(None, use_errno=True)
    with open(log, "a") as handle:
        return subprocess.Popen(command, stdout=handle, stderr=subprocess.STDOUT, env=env,
                                preexec_fn=lambda: libc.prctl(PR_SET_PDEATHSIG, signal.SIGTERM))


def _finish(process: subprocess.Popen, grace_s: float = 30.0) -> None:
    """SIGTERM, which `ray start --block` answers by stopping what it started; SIGKILL after `grace_s`."""
    if process.poll() is None:
        process.terminate()
        try:
            process.wait(grace_s)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()


def _node_env(allocation: Allocation) -> dict:
    # Ray's raylet waits 60 s by default for a lost GCS to come back; a further node waits no longer than its task.
    return {**os.environ, "RAY_AUTH_MODE": os.environ.get("RAY_AUTH_MODE", "disabled"),
            "RAY_GRACEFUL_SHUTDOWN_DRAIN_TIMEOUT_S": "0", "RAY_gcs_rpc_server_reconnect_timeout_s": "10",
            "RAY_TMPDIR": str(allocation.scratch)}


def _node_ip() -> str:
    import ray.util

    return ray.util.get_node_ip_address()


def without_gpu(env: dict, gpu: int | None) -> dict:
    """`env` for a node's `ray start` that offers Ray every GPU the job gave the node but the driver's `gpu` (an index
    into CUDA_VISIBLE_DEVICES, or into the node's devices where that is unset). Ray counts and hands out the GPUs
    its raylet sees (ray/_private/accelerators/nvidia_gpu.py:37-53, resource_and_label_spec.py:355-373)."""
    if gpu is None:
        return env
    visible = env.get("CUDA_VISIBLE_DEVICES")
    if visible is None:
        import torch

        visible = ",".join(str(index) for index in range(torch.cuda.device_count()))
    ids = [item for item in visible.split(",") if item.strip()]
    return {**env, "CUDA_VISIBLE_DEVICES": ",".join(item for index, item in enumerate(ids) if index != gpu)}


@contextlib.contextmanager
def lead_cluster(allocation: Allocation, cpus: int, driver_gpu: int | None = None,
                 timeout_s: float = 300.0) -> Iterator[str]:
    """On the job's first node: start the head, wait until every node of the allocation has joined, and give the
    head's host:port; the cluster stops when the body ends, and with this process if it is killed outright. The
    head offers Ray the node's GPUs but the driver's (`driver_gpu`), which holds the driver's copy of the policy."""
    allocation.folder.mkdir(parents=True, exist_ok=True)
    allocation.scratch.mkdir(parents=True, exist_ok=True)
    env, host, port = without_gpu(_node_env(allocation), driver_gpu), _node_ip(), free_port()
    address = f"{host}:{port}"
    head = _spawn([*node_command(0, host, port, cpus, 20_000), f"--temp-dir={allocation.scratch}"],
                  allocation.folder / "node1.log", env)
    try:
        _wait_for_nodes(address, env, 1, head, allocation, timeout_s)
        (allocation.folder / HEAD).write_text(address)  # the further nodes join through it
        _wait_for_nodes(address, env, allocation.nodes, head, allocation, timeout_s)
        yield address
    finally:
        (allocation.folder / STOPPED).write_text("")
        _finish(head)


def _wait_for_nodes(address: str, env: dict, count: int, head: subprocess.Popen, allocation: Allocation,
                    timeout_s: float) -> None:
    from src.runtime.pipeline import PipelineError

    deadline = time.monotonic() + timeout_s
    while alive_nodes(address, env) < count:
        if head.poll() is not None or time.monotonic() > deadline:
            raise PipelineError(f"the Ray cluster over the job's {allocation.nodes} nodes has "
                                f"{alive_nodes(address, env)} of {count} up after {timeout_s:g} s; the nodes' logs: "
                                f"{allocation.folder}/node*.log")
        time.sleep(2.0)  # each look is a `ray status` process


def serve_node(allocation: Allocation, cpus: int, timeout_s: float = 300.0) -> int:
    """On a further node of the job: join the head the first node starts and serve until the run ends there (or the
    head is gone); returns `ray start`'s exit status."""
    from src.runtime.pipeline import PipelineError

    deadline = time.monotonic() + timeout_s
    while not (allocation.folder / HEAD).exists():
        if time.monotonic() > deadline or (allocation.folder / STOPPED).exists():
            raise PipelineError(f"node {allocation.index + 1} of the job: no Ray head came up in {timeout_s:g} s "
                                f"(its log: {allocation.folder}/node1.log)")
        time.sleep(0.5)
    head, _, port = (allocation.folder / HEAD).read_text().rpartition(":")
    allocation.scratch.mkdir(parents=True, exist_ok=True)
    node = _spawn([*node_command(allocation.index, head, int(port), cpus, 20_000),
                   f"--node-ip-address={_node_ip()}", f"--temp-dir={allocation.scratch}"],
                  allocation.folder / f"node{allocation.index + 1}.log", _node_env(allocation))
    unreachable = 0  # seconds the head has not answered: a killed driver's head is gone, and so is the run
    while node.poll() is None and not (allocation.folder / STOPPED).exists() and unreachable < HEAD_GONE_S:
        time.sleep(1.0)
        unreachable = 0 if _answers(head, int(port)) else unreachable + 1
    _finish(node)
    return node.returncode


def _answers(host: str, port: int) -> bool:
    try:
        with socket.create_connection((host, port), timeout=1.0):
            return True
    except OSError:
        return False


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m src.runtime.ray_cluster", description=__doc__.splitlines()[0])
    parser.add_argument("action", choices=("start", "stop"))
    parser.add_argument("--dir", required=True, type=Path, help="the cluster's folder: logs, process ids, Ray's files")
    parser.add_argument("--nodes", type=int, default=2, help="nodes on this machine, the head included (default 2)")
    parser.add_argument("--cpus", type=int, default=2, help="CPUs each node offers Ray (default 2)")
    parser.add_argument("--port", type=int, default=None, help="the head's port (default: a free one)")
    args = parser.parse_args(argv)
    folder = args.dir.resolve()
    if args.action == "stop":
        killed = stop(folder)
        if killed is None:
            print(f"no cluster was started from {folder} (no {PIDS} there): nothing to stop")
        else:
            print(f"stopped the cluster of {folder}" + (f" ({killed} process(es) killed outright)" if killed else ""))
        return 0
    if args.nodes < 1 or args.cpus < 1:
        parser.error(f"--nodes={args.nodes} --cpus={args.cpus}: each must be at least 1")
    print(start(folder, args.nodes, args.cpus, args.port))
    return 0


if __name__ == "__main__":
    sys.exit(main())
