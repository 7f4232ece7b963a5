"""One Ray session per run (SPEC 11): `ray.init(num_cpus=...)` on this machine, shut down when the run ends, or the
driver's connection to a Ray cluster already running over several nodes (`runtime.address`: `ray start` on each,
e.g. `python -m src.runtime.ray_cluster start`), which the run leaves running.

Inside a SLURM job the session is started the same way, on the job's node. A session that is
already running in this process (a test's shared session, or a cluster the caller connected to)
is used as it is and left running. Ray's own failures (a session that cannot start, a worker that
died more often than `runtime.max_restarts`, an error raised inside an actor) surface as one
`PipelineError` line naming the cause, not as Ray's multi-screen traceback.
"""

from __future__ import annotations

import contextlib
import logging
import os
import signal
from typing import Iterator

from src.runs.interrupt import STOP_SIGNALS
from src.paths import PROJECT_ROOT
from src.runtime.pipeline import PipelineError

log = logging.getLogger(__name__)

# Ray starts its workers at niceness 15 (its `worker_niceness`, so that a driver keeps the CPU). Here the workers
# and the trainer actor are the run's compute and the driver mostly waits on them; at 15 they got a few percent of
# a core beside any other busy process (a test suite's 3 workers on 2 cores: the one-loop test of
# tests/e2e/test_runtime_ray.py took 497 s there, 44 s alone).
SYSTEM_CONFIG = {"worker_niceness": 0}


def first_line(error: BaseException) -> str:
    """The line of a Ray error that says what happened (its cause for an error raised inside a task)."""
    cause = getattr(error, "cause", None)
    if isinstance(cause, BaseException):
        error = cause
    lines = [line.strip() for line in str(error).splitlines() if line.strip()]
    text = next((line for line in reversed(lines) if "Error" in line or "error" in line), lines[0] if lines else "")
    return f"{type(error).__name__}: {text[:300]}"


@contextlib.contextmanager
def own_process_group() -> Iterator[None]:
    """Start Ray's daemons in a process group of their own, then rejoin this process's group if it is still there.

    `timeout`, a terminal's Ctrl-C and `kill -- -PGID` signal a whole process group. Were the raylet in
    ours, it would die with the signal and take the trainer and buffer actors with it before the run
    has finished its step and pulled their state for the checkpoint. Outside our group only this
    process gets the signal; `ray.shutdown()` then stops the daemons, and Ray's fate sharing still
    ends them if this process is killed outright. A session leader cannot change group: Ray then
    starts in ours, as before.
    """
    group = os.getpgrp()
    try:
        os.setpgid(0, 0)
    except OSError:
        yield
        return
    try:
        yield
    finally:
        try:
            os.setpgid(0, group)
        except PermissionError:
            # Our group is gone: its leader exited (a shell's `( run & )`) and we were its last member, so no
            # signal can be sent to it any more. The run stays in the group it made for Ray.
            pass


@contextlib.contextmanager
def ray_session(num_cpus: int, num_gpus: int = 0, address: str | None = None) -> Iterator[None]:
    """A Ray session for the body (`address`: join that cluster's head instead of starting one here); Ray's errors
    inside it are re-raised as one-line PipelineErrors."""
    import ray
    from ray.exceptions import RayError

    started = not ray.is_initialized()
    if started:
        # Workers import `src` from this checkout whatever folder they start in.
        path = os.pathsep.join(p for p in (str(PROJECT_ROOT), os.environ.get("PYTHONPATH")) if p)
        # ray.init installs its own SIGTERM handler, which would kill the run mid-step: keep the run's
        # (src.runs.interrupt.StopOnSignal: finish the step, checkpoint, then stop).
        handlers = {signum: signal.getsignal(signum) for signum in (signal.SIGINT, *STOP_SIGNALS)}
        runtime_env = {"env_vars": {"PYTHONPATH": path, "TOKENIZERS_PARALLELISM": "false"}}
        try:
            if address is not None:  # the cluster's daemons are not ours: its nodes set their own niceness
                ray.init(address=address, log_to_driver=False, runtime_env=runtime_env)
            else:
                with own_process_group():
                    ray.init(num_cpus=num_cpus, num_gpus=num_gpus, include_dashboard=False, log_to_driver=False,
                             runtime_env=runtime_env, _system_config=SYSTEM_CONFIG)
        except Exception as error:  # noqa: BLE001  (Ray raises many types when it cannot start)
            raise PipelineError(_not_started(error, num_cpus, num_gpus, address)) from None
        finally:
            for signum, handler in handlers.items():
                if handler is not None:
                    signal.signal(signum, handler)
    try:
        yield
    except RayError as error:
        raise PipelineError(f"the async pipeline failed in Ray: {first_line(error)} (runtime.max_restarts bounds "
                            "worker restarts; the run resumes from its last checkpoint)") from None
    finally:
        if started:
            ray.shutdown()  # a cluster's driver disconnects; the cluster runs on


def _not_started(error: BaseException, num_cpus: int, num_gpus: int, address: str | None) -> str:
    if address is None:
        return (f"Ray could not start a session with runtime.num_cpus={num_cpus}, {num_gpus} GPUs "
                f"({first_line(error)}); check that this machine can run Ray (`python -c 'import ray; ray.init(num_cpus=1)'`)")
    # Ray 2.60 turns token authentication on where a token is found (ray/_private/authentication/
    # authentication_token_setup.py:55-68), and a driver given an address sends none unless told to.
    return (f"runtime.address={address}: Ray could not join the cluster there ({first_line(error)}); start it with "
            "`python -m src.runtime.ray_cluster start`, or give the head's host:port, and run the cluster and this run "
            "with the same RAY_AUTH_MODE (and RAY_AUTH_TOKEN where it is token)")
