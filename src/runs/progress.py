"""One progress display for everything a user waits on: training steps, evaluations, sweep cells.

On a terminal it is a rich progress bar with elapsed time and an ETA (rich's
`TimeRemainingColumn`, which estimates from the recent speed). When stderr is not a terminal (a
SLURM log, `| tee`, CI), a live bar would be redrawn into the file as cut fragments (`0:02:…`),
so the same object prints plain, complete lines instead: one per training step, one per
`PLAIN_EVERY_PERCENT` of an evaluation, each with the ETA worked out the same way.

Library bars (transformers' "Loading weights", Hugging Face hub downloads) are silenced, since
they would interleave with this display; `silence_library_bars` is called once per process.
"""

from __future__ import annotations

import logging
import os
import sys
import time
from contextlib import contextmanager
from typing import Iterator

from rich.console import Console
from rich.progress import (BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn,
                           TimeRemainingColumn)

from src.runs.folder import to_log_file

log = logging.getLogger(__name__)
console = Console(stderr=True)
PLAIN_EVERY_PERCENT = 10


def silence_library_bars() -> None:
    """Turn off transformers', huggingface_hub's and MLflow's own tqdm bars (they would cut through the display;
    MLflow's shows each step, when `log_table` downloads the completions table it appends to)."""
    os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")  # read by processes started later, e.g. vLLM's
    os.environ.setdefault("MLFLOW_ENABLE_ARTIFACTS_PROGRESS_BAR", "false")  # MLflow reads it at each transfer
    try:
        import transformers

        transformers.utils.logging.disable_progress_bar()
    except ImportError:  # pragma: no cover - transformers is a dependency
        pass
    try:
        from huggingface_hub.utils import disable_progress_bars

        disable_progress_bars()
    except ImportError:  # pragma: no cover
        pass


def format_duration(seconds: float | None) -> str:
    """'1:02:03' / '4:05' for an ETA or an elapsed time; '?' while unknown."""
    if seconds is None or seconds != seconds or seconds < 0:
        return "?"
    seconds = int(round(seconds))
    hours, rest = divmod(seconds, 3600)
    minutes, secs = divmod(rest, 60)
    return f"{hours}:{minutes:02d}:{secs:02d}" if hours else f"{minutes}:{secs:02d}"


def eta_seconds(done: float, total: float, elapsed_s: float) -> float | None:
    """Remaining time at the average speed so far; None before anything is done."""
    if done <= 0 or total <= 0:
        return None
    return max(0.0, elapsed_s * (total - done) / done)


class Bar:
    """A task in the live display, or plain lines when the output is not a terminal.

    `update(done, info)` sets the count of finished units (steps, samples) and the text after the
    bar. In plain mode a line is printed when `done` crosses the next multiple of `plain_every`.
    """

    def __init__(self, description: str, total: int, unit: str, *, done: int = 0, plain_every: int = 1,
                 out: Console | None = None, live: bool | None = None):
        self.description, self.total, self.unit = description, total, unit
        self.out = out or console
        self.live = self.out.is_terminal if live is None else live
        self.plain_every = max(1, plain_every)
        self.done = done
        self._start_done = done  # a resumed run: the ETA counts only this session's speed
        self._started = time.monotonic()
        self._next_line = done + self.plain_every
        self._progress: Progress | None = None
        self._task = None
        self._rerouted: list[tuple[logging.StreamHandler, object]] = []

    def __enter__(self) -> "Bar":
        if self.live:
            streams = (sys.stdout, sys.stderr)
            # rich estimates the speed from the updates of the last `speed_estimate_period` seconds (30 by
            # default): a Qwen step can take minutes, so the window is an hour.
            self._progress = Progress(TextColumn("[bold]{task.description}"), BarColumn(bar_width=24),
                                      MofNCompleteColumn(), TextColumn("{task.fields[unit]}"), TimeElapsedColumn(),
                                      TextColumn("ETA"), TimeRemainingColumn(), TextColumn("{task.fields[info]}"),
                                      console=self.out, transient=False, speed_estimate_period=3600)
            self._progress.start()
            # rich routes sys.stdout/stderr above the bar while it is live; the log handlers (Hydra's, MLflow's)
            # hold the streams from before, and a warning (Ctrl-C: stopping after this step) would be glued
            # onto the end of the bar's line.
            self._rerouted = reroute_log_handlers(dict(zip(streams, (sys.stdout, sys.stderr))))
            self._task = self._progress.add_task(self.description, total=self.total, completed=self.done,
                                                 unit=self.unit, info="")
        return self

    def __exit__(self, *exc) -> None:
        for handler, stream in self._rerouted:
            handler.setStream(stream)
        self._rerouted = []
        if self._progress is not None:
            self._progress.stop()

    def update(self, done: int, info: str = "") -> None:
        self.done = done
        due = done >= self._next_line or done >= self.total
        if due:
            self._next_line = (done // self.plain_every + 1) * self.plain_every
            to_log_file(self.plain_line(info))  # run.log gets the plain lines, whatever the terminal shows
        if self._progress is not None:
            self._progress.update(self._task, completed=done, info=info)
        elif due:
            self.out.print(self.plain_line(info), soft_wrap=True, highlight=False, markup=False)

    def plain_line(self, info: str = "") -> str:
        elapsed = time.monotonic() - self._started
        eta = eta_seconds(self.done - self._start_done, self.total - self._start_done, elapsed)
        return (f"{self.description}: {self.done}/{self.total} {self.unit}  elapsed {format_duration(elapsed)}  "
                f"ETA {format_duration(eta)}" + (f"  {info}" if info else ""))


def reroute_log_handlers(moves: dict) -> list[tuple[logging.StreamHandler, object]]:
    """Point every log handler that writes to a stream in `moves` at its replacement; (handler, old stream) each."""
    loggers = [logging.getLogger(), *(logger for logger in logging.Logger.manager.loggerDict.values()
                                      if isinstance(logger, logging.Logger))]
    moved = []
    for handler in {handler for logger in loggers for handler in logger.handlers}:
        if isinstance(handler, logging.StreamHandler) and not isinstance(handler, logging.FileHandler):
            target = moves.get(handler.stream)
            if target is not None and target is not handler.stream:
                moved.append((handler, handler.setStream(target)))
    return moved


def evaluation_bar(description: str, prompts: int, samples_per_prompt: int, repeats: int) -> Bar:
    """Samples generated and scored; plain lines every PLAIN_EVERY_PERCENT of them."""
    total = prompts * samples_per_prompt * repeats
    return Bar(description, total, "samples", plain_every=max(1, total * PLAIN_EVERY_PERCENT // 100))


@contextmanager
def evaluation_progress(description: str, evaluation) -> Iterator:
    """A bar over an evaluation protocol's samples; yields the `on_repeat` callback that advances it."""
    per_repeat = evaluation.prompts * evaluation.samples_per_prompt
    with evaluation_bar(description, evaluation.prompts, evaluation.samples_per_prompt,
                        evaluation.repeats) as bar:
        started = f"{description}: {bar.total} samples ({evaluation.repeats} repeat(s) of {per_repeat})"
        to_log_file(started)
        if not bar.live:  # the first repeat may take minutes: say it started
            bar.out.print(started, soft_wrap=True, highlight=False, markup=False)
        yield lambda _: bar.update(bar.done + per_repeat)
