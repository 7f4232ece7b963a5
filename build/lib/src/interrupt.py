"""Pre-emption and time limits: a signal ends the current step, a checkpoint is written, then the job stops.

SLURM pre-emption and `scontrol requeue` send SIGTERM; submitit's time-limit warning is
SIGUSR2 (`--signal=USR2@<signal_delay_s>`), SIGUSR1 on some sites. Stopping mid-step would
leave the policy, buffer and RNGs inconsistent, so the handler only records the signal; the
training loop checks it after every step, checkpoints, marks the MLflow run KILLED and hands
the signal to whoever handled it before (submitit requeues the job), or exits.
"""

from __future__ import annotations

import logging
import signal
from types import FrameType

log = logging.getLogger(__name__)

STOP_SIGNALS = (signal.SIGTERM, signal.SIGUSR1, signal.SIGUSR2)


class Interrupted(SystemExit):
    """Raised after the checkpoint is written; the exit code is 128 + the signal number, as a shell reports it."""

    def __init__(self, signum: int):
        super().__init__(128 + signum)
        self.signum = signum


class StopOnSignal:
    """Context manager: while active, SIGTERM/SIGUSR1/SIGUSR2 set `requested` instead of killing the process."""

    def __init__(self) -> None:
        self.requested: int | None = None
        self._previous: dict[int, object] = {}

    def __enter__(self) -> "StopOnSignal":
        for signum in STOP_SIGNALS:
            self._previous[signum] = signal.signal(signum, self._record)
        return self

    def __exit__(self, *exc) -> None:
        for signum, handler in self._previous.items():
            signal.signal(signum, handler)

    def _record(self, signum: int, frame: FrameType | None) -> None:
        if self.requested is None:
            log.warning("caught %s: stopping after this step, with a checkpoint", signal.Signals(signum).name)
        self.requested = signum

    def hand_on(self) -> None:
        """Restore the earlier handlers and pass the signal on (submitit requeues); then stop this process."""
        signum = self.requested
        previous = self._previous.get(signum)
        self.__exit__()
        if callable(previous):
            previous(signum, None)  # submitit's handler requeues the job and exits; a bypass returns
        raise Interrupted(signum)
