"""Start an MLflow server process (`make ui`, `make mlflow-server`) and stop it as a whole.

    python -m src.runs.serve --name "MLflow UI" --host 127.0.0.1 --port 5050 --knob PORT --target ui \
        --store sqlite:///mlruns.db --experiment replay-rloo -- python -m src.runs.ui_app ui ...

Before anything starts, the port is tried: one taken by another program is refused with one line
naming the port and the make variable that picks another (MLflow itself would log "Address already
in use" and exit 0, leaving the address to the other program). A host other than the loopback gets
MLflow's basic-auth app (src/runs/auth.py: a password, made on first use, that clients read from MLflow's own
credentials file) unless `--auth off` says otherwise on purpose; `--auth on` asks for it on the loopback too.

`mlflow ui` / `mlflow server` start uvicorn (or gunicorn) workers and job-runner consumers, several
processes deep. The command runs in its own process group; Ctrl-C, SIGTERM, SIGHUP or the death of
the parent (make killed on its own) sends the signal to that whole group, and whatever is left of it
after a grace period is killed, so no worker survives and the port is free when this returns.
"""

from __future__ import annotations

import argparse
import errno
import ipaddress
import os
import signal
import socket
import sqlite3
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Callable
from contextlib import closing
from pathlib import Path

from src.runs import auth

GRACE_S = 10.0  # how long the server's processes get to shut down before they are killed
LOOPBACK_NAMES = ("localhost",)
STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)


class PortError(RuntimeError):
    """The server cannot listen where asked; the message is the one line to print."""


def is_loopback(host: str) -> bool:
    """True for 127.0.0.0/8, ::1 and localhost: only this machine can reach a server bound there."""
    if host in LOOPBACK_NAMES:
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def _family(host: str) -> socket.AddressFamily:
    return socket.AF_INET6 if ":" in host else socket.AF_INET


def port_free(host: str, port: int) -> bool:
    """Whether a server could listen on host:port now (a listener on it, or on all interfaces, takes it).

    SO_REUSEADDR as uvicorn and gunicorn set it, so connections of a server stopped a moment ago
    (TIME_WAIT) do not count as taking the port.
    """
    with socket.socket(_family(host), socket.SOCK_STREAM) as probe:
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            probe.bind((host, port))
        except OSError as error:
            if error.errno == errno.EADDRINUSE:
                return False
            raise
    return True


def check_port(host: str, port: int, knob: str, host_knob: str, target: str) -> None:
    """Raise PortError (one line: the port, the fix) unless a server can listen on host:port."""
    if not 1 <= port <= 65535:
        raise PortError(f"{knob}={port}: a port is a number from 1 to 65535, e.g. make {target} {knob}=5051")
    try:
        free = port_free(host, port)
    except OSError as error:
        raise PortError(f"{host_knob}={host}: cannot listen on this address ({error.strerror}); use 127.0.0.1 "
                        f"(this machine only), 0.0.0.0 (all interfaces) or one of this machine's addresses") from None
    if not free:
        spare = next((p for p in range(port + 1, min(port + 50, 65536)) if _quietly_free(host, p)), None)
        example = f", e.g. make {target} {knob}={spare}" if spare else ""
        raise PortError(f"port {port} on {host} is already in use by another program: pass {knob}=<a free port>"
                        f"{example}")


def _quietly_free(host: str, port: int) -> bool:
    try:
        return port_free(host, port)
    except OSError:
        return False


def _group_alive(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # a member we may not signal still exists
        return True
    return True


def _signal_group(pgid: int, signum: int) -> None:
    try:
        os.killpg(pgid, signum)
    except (ProcessLookupError, PermissionError):
        pass


def answers(url: str, timeout_s: float = 1.0) -> bool:
    """True once an HTTP server answers at `url` (any status: it is up)."""
    try:
        urllib.request.urlopen(url, timeout=timeout_s).close()
        return True
    except urllib.error.HTTPError:
        return True
    except (OSError, ValueError):
        return False


def supervise(command: list[str], grace_s: float = GRACE_S, ready_url: str | None = None,
              on_ready: Callable[[], None] | None = None) -> int:
    """Run `command` in its own process group until it exits or a stop signal comes; then end the group.
    `on_ready` is called once the server answers at `ready_url`.

    The group is sent SIGTERM for any stop signal: Python ends on it without a word, where a SIGINT would
    raise KeyboardInterrupt in every process still importing MLflow (a traceback each); uvicorn treats the two
    alike. Returns 0 when stopped by a signal (or by the parent's death) and the group ended; the command's own
    exit code, or 1 when it was 0, when the command stopped by itself: a server that exits unasked failed.
    """
    child = subprocess.Popen(command, start_new_session=True)
    stop = {"signal": None, "at": None}

    def on_signal(signum, _frame):
        stop["signal"], stop["at"] = signum, stop["at"] or time.monotonic()
        _signal_group(child.pid, signal.SIGTERM)

    previous = {signum: signal.signal(signum, on_signal) for signum in STOP_SIGNALS}
    parent, waiting = os.getppid(), ready_url is not None
    try:
        while child.poll() is None:
            try:
                child.wait(timeout=0.5)
            except subprocess.TimeoutExpired:
                if stop["signal"] is None and os.getppid() != parent:  # make was killed alone
                    on_signal(signal.SIGTERM, None)
                elif stop["at"] is not None and time.monotonic() - stop["at"] > grace_s:
                    _signal_group(child.pid, signal.SIGKILL)  # a graceful shutdown that does not end
                elif waiting and stop["signal"] is None and answers(ready_url):
                    waiting = False
                    if on_ready is not None:
                        on_ready()
        _end_group(child.pid, grace_s)
    finally:
        for signum, handler in previous.items():
            signal.signal(signum, handler)
    if stop["signal"] is not None:
        return 0
    return child.returncode or 1


def _end_group(pgid: int, grace_s: float) -> None:
    """Wait for the group's remaining processes (workers, job runners) to exit; kill those that do not."""
    _signal_group(pgid, signal.SIGTERM)
    deadline = time.monotonic() + grace_s
    while _group_alive(pgid) and time.monotonic() < deadline:
        time.sleep(0.1)
    if _group_alive(pgid):
        _signal_group(pgid, signal.SIGKILL)
        while _group_alive(pgid) and time.monotonic() < deadline + 5:
            time.sleep(0.1)


def base_address(host: str, port: int) -> str:
    shown = "127.0.0.1" if host in ("0.0.0.0", "::") else host
    return f"http://{'[' + shown + ']' if ':' in shown else shown}:{port}"


def store_runs(store: str, experiment: str) -> int | None:
    """How many runs the experiment holds in a SQLite store (0: no such file or experiment); None when the store
    is not a SQLite file, or cannot be read without MLflow (a server: it answers for itself)."""
    if not store.startswith("sqlite:///"):
        return None
    path = Path(store.removeprefix("sqlite:///"))
    if not path.is_file():
        return 0
    try:
        with closing(sqlite3.connect(f"file:{path}?mode=ro", uri=True, timeout=5)) as db:
            return db.execute("SELECT count(*) FROM runs JOIN experiments ON runs.experiment_id = "
                              "experiments.experiment_id WHERE experiments.name = ? AND runs.lifecycle_stage = "
                              "'active'", (experiment,)).fetchone()[0]
    except sqlite3.Error:
        return None


def describe_store(name: str, store: str, experiment: str) -> str:
    """The line naming the store a server opens and how many runs it holds, before it starts."""
    runs, where = store_runs(store, experiment), store.removeprefix("sqlite:///")
    if runs is None:
        return f"{name}: store {store}, experiment '{experiment}'; starting (its address follows once it answers)"
    if runs == 0:
        missing = "" if Path(where).is_file() else " (the file does not exist: no run ever wrote there)"
        return (f"{name}: store {where} holds no run of experiment '{experiment}'{missing}. A run writes there "
                f"with out={Path(where).parent}; another folder's store: make ui OUT=<the folder a run's out= named>")
    return f"{name}: store {where}, {runs} run(s) in experiment '{experiment}'; starting (its address follows once " \
           "it answers)"


def with_auth(command: list[str], mode: str, host: str, store: str | None) -> tuple[list[str], auth.Credentials | None]:
    """`command` with MLflow's basic-auth app where `mode` asks for it (`auth.wanted`), its secrets put in this
    process's environment for the server to inherit; raises AuthError (one line) where it cannot start."""
    if not auth.wanted(mode, is_loopback(host)):
        return command, None
    auth.check_installed()
    credentials, made = auth.load_or_make()
    if made:
        print(f"made {credentials.path} (mode 600, yours alone): the admin's name and password, which MLflow's "
              "clients on machines sharing this home folder read themselves", flush=True)
    path = Path(store.removeprefix("sqlite:///")) if store and store.startswith("sqlite:///") else None
    folder, stem = (path.parent, path.stem) if path else (Path.cwd(), "mlflow-server")
    os.environ.update(auth.server_settings(credentials, folder, stem))
    return [*command, "--app-name", "basic-auth"], credentials


def announce(name: str, host: str, port: int, store: str | None, experiment: str | None,
             credentials: auth.Credentials | None = None) -> None:
    """The address to open (the experiment's runs table when a store is given) and who may come in."""
    address = base_address(host, port)
    if store and experiment:
        try:
            from src.runs.links import ui_url

            address = ui_url(address, store, experiment)
        except Exception:  # noqa: BLE001  (the address without the experiment is still right)
            pass
    elsewhere = f" (from other machines: http://{socket.gethostname()}:{port})" if host in ("0.0.0.0", "::") else ""
    print(f"{name} (Ctrl-C stops it): {address}{elsewhere}", flush=True)
    if credentials is not None:
        print(f"sign in as {credentials.username} with the password in {credentials.path}; a request without it is "
              "refused (401). A colleague's own user: docs/mlflow.md", flush=True)
    elif not is_loopback(host):
        print(f"warning: listening on {host} with MLFLOW_AUTH=off: anyone who can reach this machine on port "
              f"{port} can read, change and delete every run", flush=True)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--name", default="MLflow server", help="what to call the server in the printed lines")
    parser.add_argument("--host", required=True)
    parser.add_argument("--port", required=True)
    parser.add_argument("--knob", default="PORT", help="the make variable that sets the port")
    parser.add_argument("--host-knob", default="HOST", help="the make variable that sets the host")
    parser.add_argument("--target", default="ui", help="the make target, for the printed example")
    parser.add_argument("--store", help="tracking URI whose experiment's runs table the printed address opens")
    parser.add_argument("--experiment", help="the experiment the printed address and the home page open")
    parser.add_argument("--grace", type=float, default=GRACE_S,
                        help="seconds the server's processes get to exit after a stop signal before they are killed")
    parser.add_argument("--check", action="store_true",
                        help="only try the port: print the problem on stdout (nothing when it is free); exit 0")
    parser.add_argument("--auth", default="auto", help="auto (a password beyond the loopback), on or off")
    parser.add_argument("command", nargs=argparse.REMAINDER, help="-- then the server's command line")
    args = parser.parse_args(argv)
    command = args.command[1:] if args.command[:1] == ["--"] else args.command
    if not command and not args.check:
        parser.error("give the server's command after --")
    credentials = None
    try:
        try:
            port = int(args.port)
        except ValueError:
            raise PortError(f"{args.knob}={args.port}: a port is a number from 1 to 65535, "
                            f"e.g. make {args.target} {args.knob}=5051") from None
        check_port(args.host, port, args.knob, args.host_knob, args.target)
        if not args.check:
            command, credentials = with_auth(command, args.auth, args.host, args.store)
    except (PortError, auth.AuthError) as error:
        if args.check:
            print(error)
            return 0
        print(f"error: {error}", file=sys.stderr, flush=True)
        return 2
    if args.check:
        return 0
    if args.store and args.experiment:
        print(describe_store(args.name, args.store, args.experiment), flush=True)
    if args.experiment:  # src/runs/ui_app.py opens the home page on this experiment's runs table
        os.environ["REPLAY_RLOO_EXPERIMENT"] = args.experiment
    # The address once the server answers: MLflow takes seconds to import, and a page opened before shows an error.
    code = supervise(command, args.grace, f"{base_address(args.host, port)}/health",
                     lambda: announce(args.name, args.host, port, args.store, args.experiment, credentials))
    if code:
        print(f"error: the {args.name} stopped by itself (exit code {code}); its messages are above", file=sys.stderr,
              flush=True)
    return code


if __name__ == "__main__":
    sys.exit(main())
