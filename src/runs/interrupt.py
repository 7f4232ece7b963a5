"""Stopping a run cleanly: Ctrl-C, pre-emption and time limits end with a checkpoint, never a traceback.

SLURM pre-emption and `scontrol requeue` send SIGTERM; submitit's time-limit warning is
SIGUSR2 (`--signal=USR2@<signal_delay_s>`), SIGUSR1 on some sites; Ctrl-C sends SIGINT. Stopping
mid-step would leave the policy, buffer and RNGs inconsistent, so during a training step (or a
checkpoint or store write) the handler only records the signal; the training loop checks it after
every step, checkpoints, marks the MLflow run KILLED and hands the signal to whoever handled it
before (submitit requeues the job), or exits with 128 + the signal number (130 for Ctrl-C).

Work that is simply redone on the next start (loading the model, an evaluation) is *abandonable*:
a signal there raises StopRequested at once, so nobody waits minutes for an evaluation to end.
A second Ctrl-C exits at once, mid-write if need be, after at most END_AT_ONCE_S to mark the run KILLED:
a checkpoint is only renamed into place once complete, so the run resumes from its last complete one.
"""

from __future__ import annotations

import logging
import os
import shlex
import signal
import sys
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from types import FrameType

log = logging.getLogger(__name__)

STOP_SIGNALS = (signal.SIGTERM, signal.SIGUSR1, signal.SIGUSR2, signal.SIGINT)
END_AT_ONCE_S = 5.0  # a second Ctrl-C waits this long at most for the store to mark the run KILLED

# The MLflow run this process trains or has claimed, (tracking uri, run id), from its claim until its end is
# recorded: a second Ctrl-C, which skips every other cleanup, still ends it KILLED rather than RUNNING.
_held: list[tuple[str, str]] = []


def hold_run(uri: str, run_id: str) -> None:
    _held[:] = [(uri, run_id)]


def release_run() -> None:
    _held.clear()


def held_run() -> tuple[str, str] | None:
    return _held[0] if _held else None


def end_held_run(status: str = "KILLED", timeout_s: float = END_AT_ONCE_S) -> bool:
    """Mark the held run `status` in its store, waiting `timeout_s` at most (the store may be what hangs);
    False when it could not be done in time. The run keeps its folder and checkpoints: the next start resumes it."""
    if not _held:
        return True
    uri, run_id = _held[0]
    done = threading.Event()

    def end() -> None:
        from mlflow.tracking import MlflowClient

        try:
            MlflowClient(uri).set_terminated(run_id, status)
            done.set()
        except Exception:  # noqa: BLE001  (the heartbeat still tells the next start that this run died)
            pass

    worker = threading.Thread(target=end, name="end-run", daemon=True)
    worker.start()
    worker.join(timeout_s)
    if done.is_set():
        _held.clear()
    return done.is_set()


class Interrupted(SystemExit):
    """Raised after the checkpoint is written; the exit code is 128 + the signal number, as a shell reports it."""

    def __init__(self, signum: int):
        super().__init__(128 + signum)
        self.signum = signum


class StopRequested(BaseException):
    """A stop signal came during abandonable work, or the step it waited for is done: stop the run now.

    A BaseException, as KeyboardInterrupt is, so that no library's `except Exception` swallows it."""

    def __init__(self, signum: int, mid_step: bool = False):
        super().__init__(signal.Signals(signum).name)
        self.signum = signum
        self.mid_step = mid_step  # the step broke off half done: its state must not be checkpointed


def same_command(argv: list[str] | None = None) -> str:
    """The command line this process was started with, as a user types it again to resume."""
    argv = sys.argv if argv is None else argv
    program = Path(argv[0]).name if argv else "python -m src.run"
    if program in ("run.py", "__main__.py", "-c", ""):
        program = "python -m src.run"
    return " ".join([program, *map(shlex.quote, argv[1:])])


def signal_name(signum: int) -> str:
    return "Ctrl-C" if signum == signal.SIGINT else signal.Signals(signum).name


class StopOnSignal:
    """Context manager: while active, the stop signals set `requested` instead of killing the process.

    Nested in another StopOnSignal (the command line's, around a sweep), it takes over a signal the outer one
    recorded: a Ctrl-C while a sweep composes its next cell stops that cell before it loads anything."""

    def __init__(self, signals: tuple[int, ...] = STOP_SIGNALS, until: str = "after this step, with a checkpoint"):
        self.signals, self.until = signals, until
        self.requested: int | None = None
        self._previous: dict[int, object] = {}
        self._abandonable = 0
        self._command = same_command()

    def __enter__(self) -> "StopOnSignal":
        for signum in self.signals:
            self._previous[signum] = signal.signal(signum, self._record)
            outer = getattr(self._previous[signum], "__self__", None)
            if isinstance(outer, StopOnSignal) and outer.requested == signum:
                self.requested = signum
        return self

    def __exit__(self, *exc) -> None:
        for signum, handler in self._previous.items():
            signal.signal(signum, handler)
        self._previous = {}

    @contextmanager
    def abandonable(self) -> Iterator[None]:
        """Work that a stop signal cuts short at once (raising StopRequested): it is redone on the next start."""
        if self.requested is not None:
            raise StopRequested(self.requested)
        self._abandonable += 1
        try:
            yield
        finally:
            self._abandonable -= 1

    def _record(self, signum: int, frame: FrameType | None) -> None:
        if self.requested is not None:
            if signum == signal.SIGINT:
                self._exit_now()
            return
        self.requested = signum
        if self._abandonable:
            raise StopRequested(signum)
        log.warning("%s: stopping %s%s", signal_name(signum), self.until,
                    " (Ctrl-C again stops at once)" if signum == signal.SIGINT else "")

    def _exit_now(self) -> None:
        """The second Ctrl-C: no cleanup but marking the run KILLED (bounded: the store may be what hangs);
        the last complete checkpoint stays."""
        held = held_run()
        try:
            ended = held is None or end_held_run()
        except BaseException:  # noqa: BLE001  (exit at once whatever happens)
            ended = False
        said = ("" if held is None else f"MLflow run {held[1]} marked KILLED. " if ended else
                f"MLflow run {held[1]} could not be marked KILLED in {END_AT_ONCE_S:g} s (it shows RUNNING until "
                "the next start). ")
        line = (f"\nCtrl-C again: stopped at once. {said}The run resumes from its last complete checkpoint: "
                f"{self._command}\n")
        if sys.stderr.isatty():
            line = "\x1b[?25h" + line  # a live progress bar hid the cursor
        try:
            os.write(2, line.encode())  # straight to the descriptor: no lock a half-done print may hold
        finally:
            os._exit(128 + signal.SIGINT)

    def hand_on(self) -> None:
        """Restore the earlier handlers and pass the signal on (submitit requeues); then stop this process."""
        signum = self.requested
        previous = self._previous.get(signum)
        self.__exit__()
        # Python's own SIGINT handler would raise KeyboardInterrupt, with its traceback: ours exits quietly.
        if callable(previous) and signum != signal.SIGINT:
            previous(signum, None)  # submitit's handler requeues the job and exits; a bypass returns
        if signum == signal.SIGINT and previous is signal.default_int_handler:
            # The process ends now. A Ctrl-C during its exit would raise KeyboardInterrupt inside whatever
            # finalizer runs then, with that traceback: from here on a Ctrl-C exits at once.
            signal.signal(signal.SIGINT, lambda *_: self._exit_now())
        raise Interrupted(signum)

    def finish_line(self) -> str:
        """How to continue, for the stop message."""
        return f"run the same command to continue: {self._command}"
