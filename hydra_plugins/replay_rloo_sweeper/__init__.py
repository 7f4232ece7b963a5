"""A Hydra sweeper that launches each cell of a study once and never reruns a finished one.

It is Hydra's basic sweeper (cartesian product of `hydra.sweeper.params` and the command
line) with three additions, selected for every multirun by `conf/config.yaml`:

- `grids`: a study may be the union of several grids (the ratio study is its rho x c grid
  plus the fresh-only baseline; `paper` is every study), all sent as one launch, so on SLURM
  the whole sweep goes out as one job array.
- Before launching anything it composes and validates every job's config, computes the
  cell identity (`src.sweep.cell_identity`), and looks the cells up in MLflow: finished
  cells are skipped, a cell repeated within the sweep runs once, and a cell whose last run
  failed or was killed resumes from its checkpoint. The plan is printed with each cell's
  planned fresh-evaluation budget.
- `dry_run=true` prints that plan and launches nothing.

While the cells run it reports progress: with the in-process launcher, a line before each cell
("cell 3 of 9", finished/skipped/failed so far, an ETA from the finished cells' mean time); with
a SLURM launcher, the job array's states from `squeue` whenever they change while it waits.
"""


import logging
import os
import time
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, Dict, Iterator, List, Optional, Sequence
from unittest import mock

from hydra.core.config_store import ConfigStore
from hydra.core.override_parser.overrides_parser import OverridesParser
from hydra.core.utils import JobReturn, JobStatus
from hydra.errors import HydraException
from hydra.plugins.sweeper import Sweeper
from hydra.types import HydraContext, TaskFunction
from omegaconf import DictConfig, OmegaConf

log = logging.getLogger(__name__)


@dataclass
class SkipFinishedSweeperConf:
    _target_: str = "hydra_plugins.replay_rloo_sweeper.SkipFinishedSweeper"
    max_batch_size: Optional[int] = None  # jobs per launch call (None: the whole sweep as one job array)
    params: Optional[Dict[str, Any]] = None  # swept like the basic sweeper: {key: "v1,v2"}
    grids: Optional[List[Dict[str, Any]]] = None  # several such grids, launched as their union
    dry_run: bool = False  # print the plan, launch nothing
    skip_finished: bool = True  # false: run every cell even if MLflow has it FINISHED


ConfigStore.instance().store(group="hydra/sweeper", name="skip_finished", node=SkipFinishedSweeperConf,
                             provider="replay-rloo")


class SkipFinishedSweeper(Sweeper):
    def __init__(self, max_batch_size: Optional[int] = None, params: Optional[Dict[str, Any]] = None,
                 grids: Optional[List[Dict[str, Any]]] = None, dry_run: bool = False, skip_finished: bool = True):
        super().__init__()
        self.max_batch_size = max_batch_size
        self.params = dict(params or {})
        self.grids = [dict(grid) for grid in grids] if grids else [{}]
        self.dry_run = dry_run
        self.skip_finished = skip_finished
        self.hydra_context: Optional[HydraContext] = None
        self.config: Optional[DictConfig] = None
        self.launcher = None

    def setup(self, *, hydra_context: HydraContext, task_function: TaskFunction, config: DictConfig) -> None:
        from hydra.core.plugins import Plugins

        self.hydra_context, self.config = hydra_context, config
        self.launcher = Plugins.instance().instantiate_launcher(hydra_context=hydra_context,
                                                               task_function=task_function, config=config)

    def job_overrides(self, arguments: List[str]) -> List[List[str]]:
        """Every job of every grid: grid params first, then the command line (which wins on a shared key)."""
        from hydra._internal.core_plugins.basic_sweeper import BasicSweeper

        parser = OverridesParser.create(config_loader=self.hydra_context.config_loader)
        jobs: List[List[str]] = []
        for grid in self.grids:
            params = {**self.params, **grid}
            parsed = parser.parse_overrides([f"{key}={value}" for key, value in params.items()] + list(arguments))
            jobs += BasicSweeper.split_arguments(parsed, None)[0]
        return jobs

    def sweep(self, arguments: List[str]) -> Any:
        from pathlib import Path

        from src.config import ConfigError, validate
        from src.sweep import CellRuns, cell_runs, plan_cells, record_membership
        from src.tracking import ensure_experiment, sqlite_store_lock

        started = time.perf_counter()
        jobs = []
        for overrides in self.job_overrides(arguments):
            cfg = self.hydra_context.config_loader.load_sweep_config(self.config, list(overrides))
            task_cfg = OmegaConf.masked_copy(cfg, [key for key in cfg if key != "hydra"])
            try:
                validate(task_cfg, check_device=False)  # a bad cell stops the sweep before anything runs
            except ConfigError as error:
                raise HydraException(f"cell {' '.join(overrides)}: {error}") from None
            jobs.append((overrides, task_cfg))

        tracking = self.config.tracking
        known = CellRuns({}, {})
        if self.skip_finished:
            try:
                with planning_timeouts(), sqlite_store_lock(tracking.uri):  # jobs starting together must not
                    if not self.dry_run:  # race to create the store, nor look it up while it is being created
                        ensure_experiment(tracking.uri, tracking.experiment, tracking.artifact_location)
                    known = cell_runs(tracking.uri, tracking.experiment,
                                      heartbeat_timeout_s=self.config.trainer.heartbeat_timeout_s)
            except Exception as error:  # noqa: BLE001  (an unreachable server must not hide the plan)
                if not self.dry_run:
                    raise HydraException(f"cannot reach the MLflow store {tracking.uri} to check for finished "
                                         f"cells ({error.__class__.__name__}: {error}). Start it (make "
                                         "mlflow-server) or set tracking.uri / MLFLOW_TRACKING_URI") from None
                log.warning("MLflow store %s unreachable (%s): finished cells not marked", tracking.uri, error)
        planned = plan_cells(jobs, known)
        print_plan(planned, tracking, time.perf_counter() - started, self.dry_run)
        if self.skip_finished and not self.dry_run:
            with planning_timeouts():
                record_membership(tracking.uri, planned, tracking.sweep)
        to_run = [cell.overrides for cell in planned if cell.status in ("launch", "resume")]
        if self.dry_run or not to_run:
            return []

        sweep_dir = Path(self.config.hydra.sweep.dir)
        sweep_dir.mkdir(parents=True, exist_ok=True)
        OmegaConf.save(self.config, sweep_dir / "multirun.yaml")
        in_process = type(self.launcher).__name__ == "BasicLauncher"  # one job after the other, in this process
        # In-process cells launch one at a time, so each gets its "cell i of N" line; a cluster launch
        # stays one job array.
        size = 1 if in_process and not self.max_batch_size else (self.max_batch_size or len(to_run))
        names = {tuple(cell.overrides): cell.cell for cell in planned}
        tally = SweepTally(total=len(to_run), skipped=len(planned) - len(to_run))
        returns: List[Sequence[JobReturn]] = []
        failed = []
        for start in range(0, len(to_run), size):
            batch = to_run[start : start + size]
            if in_process:
                say(tally.before(start, names.get(tuple(batch[0]), "?")))
                results = self.launcher.launch(batch, initial_job_idx=start)
            else:
                results = launch_watching_slurm(self.launcher, batch, start, sweep_dir)
            tally.finished(results)
            failed += [result for result in results if result.status != JobStatus.COMPLETED]
            returns.append(results)
        say(tally.summary())
        if failed:
            lines = [f"  {' '.join(result.overrides or [])}: {result._return_value!r}" for result in failed]
            raise HydraException(f"{len(failed)} of {len(to_run)} cells failed. Relaunching the sweep resumes each "
                                 "from its last checkpoint where it wrote one and starts the others afresh:\n"
                                 + "\n".join(lines))
        return returns


def say(line: str) -> None:
    """A complete progress line on stderr (the training display's console)."""
    from src.progress import console

    console.print(line, soft_wrap=True, highlight=False, markup=False)


class SweepTally:
    """Counts and times of a sweep's cells, for its progress lines."""

    def __init__(self, total: int, skipped: int, clock=time.monotonic):
        self.total, self.skipped, self.clock = total, skipped, clock
        self.done = self.failed = 0
        self.started = clock()

    def finished(self, results: Sequence[JobReturn]) -> None:
        self.done += len(results)
        self.failed += sum(result.status != JobStatus.COMPLETED for result in results)

    def eta_s(self) -> Optional[float]:
        from src.progress import eta_seconds

        return eta_seconds(self.done, self.total, self.clock() - self.started)

    def before(self, index: int, cell: str) -> str:
        from src.progress import format_duration

        return (f"sweep: cell {index + 1} of {self.total} ({cell}); {self.counts()}; "
                f"elapsed {format_duration(self.clock() - self.started)}, ETA {format_duration(self.eta_s())}")

    def counts(self) -> str:
        return (f"{self.done - self.failed} finished, {self.skipped} skipped (done before), "
                f"{self.failed} failed")

    def summary(self) -> str:
        from src.progress import format_duration

        return f"sweep done: {self.total} cell(s) run: {self.counts()}; took {format_duration(self.clock() - self.started)}"


SLURM_POLL_S = 30.0


def launch_watching_slurm(launcher, batch: List[List[str]], start: int, sweep_dir, poll_s: float = SLURM_POLL_S):
    """Launch on a cluster launcher and, while it waits for the jobs, report their SLURM states when they change.

    submitit's launcher blocks in `job.results()` until every job ends, silently; the launch runs in
    a thread here while this one reads `squeue` for the job ids submitit's folder names.
    """
    from concurrent.futures import ThreadPoolExecutor, TimeoutError as Pending

    last = ""
    with ThreadPoolExecutor(max_workers=1) as pool:
        future = pool.submit(launcher.launch, batch, initial_job_idx=start)
        while True:
            try:
                return future.result(timeout=poll_s)
            except Pending:
                line = slurm_state_line(submitted_job_ids(sweep_dir), len(batch))
                if line and line != last:
                    say(line)
                    last = line


def submitted_job_ids(sweep_dir) -> List[str]:
    """SLURM job ids submitit has written folders for (`<sweep>/.submitit/<array>_<task>`)."""
    from pathlib import Path

    folder = Path(sweep_dir) / ".submitit"
    return sorted(path.name for path in folder.iterdir() if path.is_dir() and path.name[0].isdigit()) \
        if folder.is_dir() else []


def slurm_state_line(job_ids: List[str], expected: int, squeue=None) -> str:
    """'SLURM: 2 PENDING, 1 RUNNING, 3 left the queue (of 6 jobs)' from squeue; '' when nothing is known yet."""
    import subprocess

    if not job_ids:
        return f"SLURM: submitting {expected} job(s)..."
    if squeue is None:
        try:
            squeue = subprocess.run(["squeue", "-h", "-r", "-o", "%i %T", "-j", ",".join(job_ids)], capture_output=True,
                                    text=True, timeout=20).stdout
        except (OSError, subprocess.SubprocessError):
            return ""
    return "SLURM: " + summarize_states(squeue, job_ids, expected)


def summarize_states(squeue_output: str, job_ids: List[str], expected: int) -> str:
    """Count the jobs by their squeue state; jobs squeue no longer lists have left the queue (ended)."""
    from collections import Counter

    states = dict(line.split()[:2] for line in squeue_output.splitlines() if len(line.split()) >= 2)
    counts = Counter(states.get(job, "left the queue") for job in job_ids)
    order = sorted(counts, key=lambda state: (state == "left the queue", state))
    return ", ".join(f"{counts[state]} {state}" for state in order) + f" (of {expected} jobs)"


@contextmanager
def planning_timeouts() -> Iterator[None]:
    """A tracking server that is down should fail the plan in seconds, not after MLflow's minutes of retries.

    Scoped to the sweeper's own queries: the launched jobs (the basic launcher runs them in this
    very process) keep MLflow's patient defaults, so they ride out an outage of minutes. MLflow
    reads these variables at every request (mlflow/utils/rest_utils.py, http_request).
    """
    with mock.patch.dict(os.environ, PLANNING_TIMEOUTS):  # restores the environment as it was, on any exit
        yield


PLANNING_TIMEOUTS = {"MLFLOW_HTTP_REQUEST_MAX_RETRIES": "1", "MLFLOW_HTTP_REQUEST_TIMEOUT": "10"}


def print_plan(planned, tracking, seconds: float, dry_run: bool) -> None:
    """The launch plan as a table: cell, planned fresh evaluations, what happens to it."""
    from rich.console import Console
    from rich.table import Table

    counts = {status: sum(cell.status == status for cell in planned)
              for status in ("launch", "resume", "finished", "running", "duplicate")}
    table = Table(title=("DRY RUN: nothing launched. " if dry_run else "") + f"{len(planned)} jobs, "
                  f"{counts['launch']} to launch, {counts['resume']} to resume, {counts['finished']} finished "
                  f"(skipped), " + (f"{counts['running']} running elsewhere (skipped), " if counts["running"] else "")
                  + f"{counts['duplicate']} duplicate (skipped)")
    several_seeds = len({cell.seed for cell in planned}) > 1  # training-seed repeats: each (cell, seed) is a job
    for heading in ("#", "cell", *(["seed"] if several_seeds else []), "planned fresh evals", "status", "overrides"):
        table.add_column(heading, justify="right" if heading in ("#", "seed", "planned fresh evals") else "left")
    # Overrides every job shares are printed once, below the table; the column shows what varies.
    hidden = ("+sweep=", "trainer.resume_from=")
    common = set.intersection(*(set(cell.overrides) for cell in planned)) if planned else set()
    for index, cell in enumerate(planned):
        status = {"finished": f"finished, skip (run {cell.previous[:8] if cell.previous else ''})",
                  "duplicate": "duplicate, skip", "launch": "launch",
                  "resume": f"resume from {cell.previous}",
                  "running": f"running elsewhere, skip: {cell.previous}"}[cell.status]
        shown = [o for o in cell.overrides if o not in common and not o.startswith(hidden)]
        table.add_row(str(index), cell.cell, *([str(cell.seed)] if several_seeds else []), ("≥ " if cell.budget_is_floor else "≤ " if cell.budget_is_ceiling else "") + f"{cell.fresh_evaluations:,}", status, " ".join(shown))
    console = Console(width=max(Console().width, 140))
    console.print(table)
    shared = [o for o in planned[0].overrides if o in common and not o.startswith(hidden)] if planned else []
    if shared:
        console.print("every cell also has: " + " ".join(shared))
    console.print(f"checked {len(planned)} cells against {tracking.uri} (experiment '{tracking.experiment}') "
                  f"in {seconds:.1f} s")
