"""A Hydra sweeper that launches each cell of a study once and never reruns a finished one.

It is Hydra's basic sweeper (cartesian product of `hydra.sweeper.params` and the command
line) with these additions, selected for every multirun by `conf/config.yaml`:

- `grids`: a study may be the union of several grids (the ratio study is its rho x c grid
  plus the fresh-only baseline; `paper` is every study), all sent as one launch, so on SLURM
  the whole sweep goes out as one job array.
- Before launching anything it composes and validates every job's config, computes the
  cell identity (`src.study.sweep.cell_identity`), and looks the cells up in MLflow: finished
  cells are skipped, a job whose cell an earlier job of the sweep already has is "same cell
  as" that job and runs once, a cell whose newest run failed or was killed resumes from its
  checkpoint, and a cell trained by a live job elsewhere is skipped. The plan is printed with
  each cell's planned fresh-evaluation budget. Each launched job claims its cell again when it
  starts (`src.runs.claim`), so two sweeps started together still train a cell once.
- `dry_run=true` prints that plan and launches nothing, with each job's estimated time on this machine
  from the store's finished runs of its shape, or with `probe=true` (the reproductions set it) from one
  training step timed here (`src.study.timing`); `skip_finished=false` launches finished cells again
  (their jobs get `trainer.rerun=true`).
- With the SLURM launcher: no `sbatch`/`srun` on this machine stops a launch in one line (exit 2)
  before anything is read; the plan adds each job's request, warnings on an unset partition or
  account, and the sweep's GPU-hours from the committed step benchmark (`src.study.slurm`).

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
    probe: bool = False  # a dry run times one training step here for a shape no finished run in the store has
    planned_seeds: Optional[int] = None  # training seeds fixed before the runs (conf/reproduce/); more are refused


ConfigStore.instance().store(group="hydra/sweeper", name="skip_finished", node=SkipFinishedSweeperConf,
                             provider="replay-rloo")


class SkipFinishedSweeper(Sweeper):
    def __init__(self, max_batch_size: Optional[int] = None, params: Optional[Dict[str, Any]] = None,
                 grids: Optional[List[Dict[str, Any]]] = None, dry_run: bool = False, skip_finished: bool = True,
                 probe: bool = False, planned_seeds: Optional[int] = None):
        super().__init__()
        self.max_batch_size = max_batch_size
        self.params = dict(params or {})
        self.grids = [dict(grid) for grid in grids] if grids else [{}]
        self.dry_run = dry_run
        self.skip_finished = skip_finished
        self.probe = probe
        self.planned_seeds = planned_seeds
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
        from src.study.slurm import missing_slurm, slurm_plan_lines, uses_slurm
        from src.runs.cells import CellRuns
        from src.study.sweep import plan_cells, record_membership

        started = time.perf_counter()
        if not self.dry_run and missing_slurm(self.config):  # before any config is composed or store read
            stop(missing_slurm(self.config), 2)
        unplanned = more_seeds_than_planned(self.job_overrides(arguments), self.planned_seeds)
        if unplanned:  # before any config is composed
            stop(unplanned, 2)
        jobs = self.composed_jobs(arguments)
        known = self.known_runs() if self.skip_finished else CellRuns({}, {})
        planned = plan_cells(jobs, known, rerun=not self.skip_finished)
        tracking = self.config.tracking
        checked_s = time.perf_counter() - started
        times = self.plan_times(planned, jobs) if self.dry_run and not uses_slurm(self.config) else None
        print_plan(planned, tracking, checked_s, self.dry_run, times)
        if self.dry_run:
            say(f"sweep folder, made at launch: {self.config.hydra.sweep.dir}")
        to_launch = [index for index, cell in enumerate(planned) if cell.status in ("launch", "resume")]
        if uses_slurm(self.config):
            for line in slurm_plan_lines(self.config, [jobs[index][1] for index in to_launch]):
                say(line)
        if self.skip_finished and not self.dry_run:
            with planning_timeouts():
                record_membership(tracking.uri, planned, tracking.sweep)
        if self.dry_run or not to_launch:
            return []
        return self.launch_planned(planned, to_launch)

    def composed_jobs(self, arguments: List[str]) -> List[tuple]:
        """Every job's (overrides, validated task config); a bad cell stops the sweep in one line, exit 2."""
        from src.command.config import ConfigError, validate
        from src.study.slurm import memory_refusal, uses_slurm

        jobs = []
        for overrides in self.job_overrides(arguments):
            cfg = self.hydra_context.config_loader.load_sweep_config(self.config, list(overrides))
            task_cfg = OmegaConf.masked_copy(cfg, [key for key in cfg if key != "hydra"])
            try:
                validate(task_cfg, check_device=False)  # a bad cell stops the sweep before anything runs
            except ConfigError as error:
                stop(f"cell {' '.join(overrides)}: {error}", 2)
            # A job whose GPUs cannot hold the cell's policy is refused before submission, not after its queue wait.
            hardware = OmegaConf.select(cfg, "hydra.runtime.choices.hardware", default="cpu")
            refusal = memory_refusal(task_cfg, cfg.hydra.launcher, hardware) if uses_slurm(cfg) else None
            if refusal:
                stop(f"cell {' '.join(overrides)}: {refusal}", 2)
            jobs.append((overrides, task_cfg))
        return jobs

    def plan_times(self, planned: list, jobs: List[tuple]):
        """The dry run's wall-time estimates (src/study/timing.py); a store it cannot read leaves the probe."""
        from src.study.timing import plan_times

        tracking = self.config.tracking
        with planning_timeouts():
            return plan_times(planned, [cfg for _, cfg in jobs], tracking.uri, tracking.experiment, self.probe)

    def known_runs(self):
        """What the store knows about the sweep's cells; an unreachable store stops a launch (exit 2), not a dry run."""
        from src.runs.cells import CellRuns, cell_runs
        from src.runs.store import ensure_experiment, sqlite_store_lock

        tracking = self.config.tracking
        try:
            with planning_timeouts(), sqlite_store_lock(tracking.uri):  # jobs starting together must not
                if not self.dry_run:  # race to create the store, nor look it up while it is being created
                    ensure_experiment(tracking.uri, tracking.experiment, tracking.artifact_location)
                return cell_runs(tracking.uri, tracking.experiment,
                                 heartbeat_timeout_s=self.config.trainer.heartbeat_timeout_s)
        except Exception as error:  # noqa: BLE001  (an unreachable server must not hide the plan)
            reason = f"{error.__class__.__name__}: {str(error).splitlines()[0][:200] if str(error) else ''}"
            if not self.dry_run:
                stop(f"cannot reach the MLflow store tracking.uri={tracking.uri} to check for finished cells "
                     f"({reason}). Start it (make mlflow-server) or set tracking.uri / MLFLOW_TRACKING_URI", 2)
            log.warning("MLflow store %s unreachable (%s): finished cells not marked", tracking.uri, reason)
            return CellRuns({}, {})

    def launch_planned(self, planned: list, to_launch: List[int]) -> Any:
        """Launch the planned jobs (in-process one at a time, on a cluster as one array) and report as they end."""
        from pathlib import Path

        sweep_dir = Path(self.config.hydra.sweep.dir)
        sweep_dir.mkdir(parents=True, exist_ok=True)
        OmegaConf.save(self.config, sweep_dir / "multirun.yaml")
        to_run = [launch_overrides(planned[index], rerun_all=not self.skip_finished) for index in to_launch]
        in_process = type(self.launcher).__name__ == "BasicLauncher"  # one job after the other, in this process
        # In-process cells launch one at a time, so each gets its "cell i of N" line; a cluster launch
        # stays one job array.
        size = 1 if in_process and not self.max_batch_size else (self.max_batch_size or len(to_run))
        tally = SweepTally(total=len(to_run), skipped=sum(cell.status == "finished" for cell in planned),
                           same=sum(cell.status == "duplicate" for cell in planned),
                           running=sum(cell.status == "running" for cell in planned))
        returns: List[Sequence[JobReturn]] = []
        failed = []
        for start in range(0, len(to_run), size):
            batch = to_run[start : start + size]
            if in_process:
                say(tally.before(start, planned[to_launch[start]].cell))
                with without_launch_listing():
                    results = self.launcher.launch(batch, initial_job_idx=start)
            else:
                results = launch_watching_slurm(self.launcher, batch, start, sweep_dir)
            tally.finished(results)
            failed += [result for result in results if result.status != JobStatus.COMPLETED]
            returns.append(results)
        say(tally.summary())
        if failed:
            lines = [f"  {' '.join(result.overrides or [])}: {result._return_value!r}" for result in failed]
            stop(f"{len(failed)} of {len(to_run)} cells failed. Relaunching the sweep resumes each from its last "
                 "checkpoint where it wrote one and starts the others afresh:\n" + "\n".join(lines), 1)
        return returns


class _Drop(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        return False


# Hydra's in-process launcher logs "Launching 1 jobs locally" and the job's whole override list at INFO for
# every cell (hydra/_internal/core_plugins/basic_launcher.py:62-67); the line `say` prints names the cell.
BASIC_LAUNCHER_LOGGER = "hydra._internal.core_plugins.basic_launcher"


@contextmanager
def without_launch_listing() -> Iterator[None]:
    """Hydra's basic launcher, without its per-job listing of the overrides (a filter: it reconfigures levels)."""
    logger, drop = logging.getLogger(BASIC_LAUNCHER_LOGGER), _Drop()
    logger.addFilter(drop)
    try:
        yield
    finally:
        logger.removeFilter(drop)


def launch_overrides(cell, rerun_all: bool) -> List[str]:
    """A job's overrides; a finished cell launched again (`skip_finished=false`) gets `trainer.rerun=true`, so its
    job trains it into a new run instead of stopping at the FINISHED one."""
    rerun = (cell.rerun or rerun_all) and not any(override.startswith("trainer.rerun=") for override in cell.overrides)
    return list(cell.overrides) + (["trainer.rerun=true"] if rerun else [])


def more_seeds_than_planned(jobs: List[List[str]], planned: Optional[int]) -> Optional[str]:
    """One line when the sweep's jobs (their overrides) train more training seeds than the study was planned
    for: adding seeds after seeing a verdict is optional stopping, which raises the false-agreement rate above
    the tests' 5 % (docs/reproductions.md, "Seed counts, fixed before the runs"). A job without a
    `trainer.seed` override trains the config's own seed."""
    if planned is not None and planned < 1:
        return (f"hydra.sweeper.planned_seeds={planned}: a study is planned for at least 1 training seed (the "
                "reproductions' counts are in conf/reproduce/)")
    seeds = sorted({next((word.split("=", 1)[1] for word in overrides if word.startswith("trainer.seed=")), "its own")
                    for overrides in jobs}, key=lambda seed: (not seed.isdigit(), int(seed) if seed.isdigit() else 0))
    if planned is None or len(seeds) <= planned:
        return None
    return (f"trainer.seed={','.join(map(str, seeds))}: {len(seeds)} training seeds, but this study was planned "
            f"for {planned} before its runs (hydra.sweeper.planned_seeds); run at most {planned} (make "
            f"reproduce-NAME SEEDS={planned}, the default) and judge it only at its planned looks")


def stop(message: str, code: int) -> None:
    """End the sweep with one message and an exit status, no traceback (Hydra would print one for an exception)."""
    import sys

    from src.runs.progress import console

    console.print(f"[bold red]error:[/bold red] {message}", soft_wrap=True, highlight=False)
    sys.exit(code)


def say(line: str) -> None:
    """A complete progress line on stderr (the training display's console)."""
    from src.runs.progress import console

    console.print(line, soft_wrap=True, highlight=False, markup=False)


class SweepTally:
    """Counts and times of a sweep's cells, for its progress lines.

    `skipped`: finished before; `same`: the same cell as an earlier job of this sweep; `running`: trained by
    a job elsewhere. A launched job that found its cell finished or taken meanwhile (it returns
    `src.study.sweep.Skipped`) moves to those counts instead of "finished".
    """

    def __init__(self, total: int, skipped: int, clock=time.monotonic, same: int = 0, running: int = 0):
        self.total, self.skipped, self.same, self.running, self.clock = total, skipped, same, running, clock
        self.done = self.failed = self.trained = 0
        self.started = clock()

    def finished(self, results: Sequence[JobReturn]) -> None:
        from src.study.sweep import Skipped

        for result in results:
            self.done += 1
            if result.status != JobStatus.COMPLETED:
                self.failed += 1
            elif isinstance(result.return_value, Skipped):
                self.skipped += result.return_value.kind == "finished"
                self.running += result.return_value.kind == "running"
            else:
                self.trained += 1

    def eta_s(self) -> Optional[float]:
        from src.runs.progress import eta_seconds

        return eta_seconds(self.done, self.total, self.clock() - self.started)

    def before(self, index: int, cell: str) -> str:
        from src.runs.progress import format_duration

        return (f"sweep: cell {index + 1} of {self.total} ({cell}); {self.counts()}; "
                f"elapsed {format_duration(self.clock() - self.started)}, ETA {format_duration(self.eta_s())}")

    def counts(self) -> str:
        extra = (f"{self.same} same cell as another job, " if self.same else "") + \
                (f"{self.running} running elsewhere (skipped), " if self.running else "")
        return f"{self.trained} finished, {self.skipped} skipped (done before), {extra}{self.failed} failed"

    def summary(self) -> str:
        from src.runs.progress import format_duration

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


def print_plan(planned, tracking, seconds: float, dry_run: bool, times=None) -> None:
    """The launch plan as a table: cell, planned fresh evaluations, its estimated time (`times`, a dry run's
    `src.study.timing.PlanTimes`), what happens to it."""
    from rich.console import Console
    from rich.table import Table

    from src.study.timing import duration

    counts = {status: sum(cell.status == status for cell in planned)
              for status in ("launch", "resume", "finished", "running", "duplicate")}
    table = Table(title=("DRY RUN: nothing launched. " if dry_run else "") + f"{len(planned)} jobs, "
                  f"{counts['launch']} to launch, {counts['resume']} to resume, {counts['finished']} finished "
                  f"(skipped), " + (f"{counts['running']} running elsewhere (skipped), " if counts["running"] else "")
                  + f"{counts['duplicate']} same cell as another job (skipped)")
    several_seeds = len({cell.seed for cell in planned}) > 1  # training-seed repeats: each (cell, seed) is a job
    timed = ["est. time"] if times is not None and times.seconds else []
    for heading in ("#", "cell", *(["seed"] if several_seeds else []), "planned fresh evals", *timed, "status",
                    "overrides"):
        table.add_column(heading, justify="left" if heading in ("cell", "status", "overrides") else "right")
    # Overrides every job shares are printed once, below the table; the column shows what varies.
    hidden = ("+sweep=", "trainer.resume_from=")
    common = set.intersection(*(set(cell.overrides) for cell in planned)) if planned else set()
    shown = [" ".join(o for o in cell.overrides if o not in common and not o.startswith(hidden)) for cell in planned]
    for index, cell in enumerate(planned):
        estimate = [duration(times.seconds[index]) if index in times.seconds else "-"] if timed else []
        table.add_row(str(index), cell.cell, *([str(cell.seed)] if several_seeds else []), ("≥ " if cell.budget_is_floor else "≤ " if cell.budget_is_ceiling else "") + f"{cell.fresh_evaluations:,}", *estimate, plan_status(cell, shown), shown[index])
    console = Console(width=max(Console().width, 140))
    console.print(table)
    shared = [o for o in planned[0].overrides if o in common and not o.startswith(hidden)] if planned else []
    if shared:
        console.print("every cell also has: " + " ".join(shared))
    console.print(f"checked {len(planned)} cells against {tracking.uri} (experiment '{tracking.experiment}') "
                  f"in {seconds:.1f} s")
    for line in times.lines if times is not None else ():
        console.print(line, highlight=False)


def plan_status(cell, shown: List[str]) -> str:
    """The plan's status column for one job; `shown` is every job's varying overrides, to name the twin of a duplicate."""
    if cell.status == "duplicate":
        return f"same cell as #{cell.same_as} ({shown[cell.same_as] or 'the same overrides'}), skip"
    if cell.status == "launch" and cell.rerun:
        return f"launch again (finished run {cell.previous[:8]}; rerun)"
    return {"finished": f"finished, skip (run {cell.previous[:8] if cell.previous else ''})", "launch": "launch",
            "resume": f"resume from {cell.previous}", "running": f"running elsewhere, skip: {cell.previous}"}[cell.status]
