"""The one entry point: compose config groups, train one cell, evaluate it, log it all to MLflow.

    python -m src.run                                  # tiny CPU policy, fresh-only RLOO
    python -m src.run buffer=age2 clip=tight           # one Replay-RLOO cell
    python -m src.run -m buffer=age1,age2 clip=tight   # a sweep through the configured launcher
    python -m src.run buffer.ratio=2 trainer.steps=50  # any knob from the command line
"""

from __future__ import annotations

import os
import signal
import sys


def _ctrl_c_while_loading(*_) -> None:
    """SIGINT while torch, transformers and MLflow load: exit here, in the handler. Raised as KeyboardInterrupt it
    could cross C++ (a pybind11 callback during an import), which then aborts the process (SIGABRT) instead."""
    os.write(2, b"Ctrl-C before the run began: nothing to save\n")
    os._exit(130)


if __name__ == "__main__":
    # `python -m src.run` runs this file as __main__: the command line is checked (src/command/cli.py) before the imports
    # below load torch, transformers and MLflow. The run then goes through the importable module `src.run`, not
    # __main__: submitit pickles it for SLURM jobs, and a __main__ function would be pickled with this module's globals.
    try:
        from src.command.cli import cli

        if cli():  # --help answered, or the command line checked before torch, transformers and MLflow load
            signal.signal(signal.SIGINT, _ctrl_c_while_loading)
            from src import run

            signal.signal(signal.SIGINT, signal.default_int_handler)  # the run installs its own handlers
            run.launch()
    except KeyboardInterrupt:  # Ctrl-C while the libraries load, before any handler of ours is installed
        print("Ctrl-C before the run began: nothing to save", file=sys.stderr)
        # Not sys.exit: when the Ctrl-C lands in Python code that a library runs through the C API (PyRun_*),
        # CPython marks it unhandled though it was caught here, and its exit then ends the process by SIGINT
        # (-2 to a parent) instead of 130. No run exists yet, so nothing needs the interpreter's shutdown.
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(130)
    sys.exit()

import io  # noqa: E402  (the imports of the training itself)
import logging
import math
import shutil
from dataclasses import dataclass
from pathlib import Path

import hydra
from hydra.core.hydra_config import HydraConfig
from hydra.types import RunMode
from omegaconf import DictConfig
from rich.console import Console
from rich.table import Table

from src.runs import folder as run_folder
from src.runs import progress

from src.runs import tracking
from src.runs.artifacts import log_final_policy, log_run_artifact
from src.runs.completions import completion_line, completion_rows
from src.runs.ending import close_active_run, disk_full_error, leave_run_end
from src.runs.links import run_link, ui_command
from src.runs.store_check import StoreUnreachable, check_store
from src.study.budget import budget_is_floor, plan_for, replay_demand_met
from src.buffer.store import ReplayStore
from src.variant import described
from src.validate.checks import exit_with_message
from src.command.config import ConfigError, check_settings_take_effect, validate
from src.runs.diskspace import DiskFull, quiet_log_files_when_full, writing
from src.runs.lifecycle import LATEST_CHECKPOINT, Heartbeat, check_resume_from, remove_stale_temporaries
from src.eval.standalone import evaluate_policy
from src.runs.cells import Cell, slurm_job_key
from src.study.sweep import Skipped, cell_identity
from src.runs.interrupt import (StopOnSignal, StopRequested, end_held_run, held_run, hold_run, release_run,
                                 signal_name)
from src.paths import CONFIG_DIR
from src.task.base import TaskDataError, build_task
from src.build import build_components, build_runtime
from src.runtime.base import RunContext, Runtime, Steps
from src.runtime.runners import PipelineError
from src.study.labels import cell_of, hydra_job
from src.runs.checkpoint import CheckpointError, payload_bytes, save_checkpoint
from src.components import Components
from src.runs.claim import fail_unopened_claim, withdraw_unopened_claim
from src.runs.resume import NothingToTrain, RunAlive, choose_start
from src.runs.ranks import NoHeartbeat
from src.settings import RunSettings
from src.batch import TrainState

log = logging.getLogger(__name__)
console = Console(stderr=True)
results = Console()  # a run's result table and links: stdout, apart from the progress and the warnings on stderr


def train(cfg: DictConfig) -> dict[str, float]:
    """Train and evaluate one cell; returns the final evaluation summary."""
    validate(cfg)  # config mistakes fail here, before any model is loaded
    cell = cell_of(cfg, cell_identity(cfg))  # what the run trains for, as MLflow names it
    run = RunSettings(cfg)  # from here on the run's typed settings, not the config
    placement = described(run.groups["runtime"], Runtime)  # where the trainer sits, before anything is built
    run = run.on_device(placement.trainer_device(run.groups["runtime"], run))
    warn_short_replay_pool(run)
    runtime = build_runtime(run)  # conf/runtime: what supplies the steps (SPEC 3 here, or SPEC 11's pipeline)
    if runtime.serves(run, ConfigError):  # a further node of the run's Ray cluster: served while the first trained
        return {}
    with runtime.joined(run, ConfigError):  # the processes that run the loop: torchrun's ranks, or this one
        return train_joined(run, cell, runtime)


def train_joined(run: RunSettings, cell: Cell, runtime: Runtime) -> dict[str, float]:
    progress.silence_library_bars()
    quiet_log_files_when_full()
    runtime.lead_only(check_store, run.tracking.uri, run.tracking.experiment, run.tracking.artifact_location)
    check_resume_from(run.trainer.resume_from)
    with StopOnSignal() as stop:
        try:
            summary = train_cell(run, cell, stop, runtime)
        except StopRequested as request:  # before the MLflow run opened: nothing to save
            log.warning("%s before training began: nothing to save%s; %s", signal_name(request.signum),
                        end_unopened_run(), stop.finish_line())
            stop.hand_on()
        finally:
            release_run()
        if stop.requested == signal.SIGINT:  # a Ctrl-C as the run completed still stops a sweep here
            log.warning("Ctrl-C as the run completed: it is FINISHED; stopping")
            stop.hand_on()
    return summary


def end_unopened_run() -> str:
    """A stop before the run opened: a new claim is withdrawn (nothing was logged to it); a resumed run, which
    keeps its checkpoints for the next start, is marked KILLED. Returns what became of the run, for the message."""
    if withdraw_unopened_claim():
        release_run()
        return ""
    held = held_run()
    if held is None:
        return ""
    if end_held_run(timeout_s=30):
        return f"; MLflow run {held[1]} marked KILLED (the next start resumes it)"
    return f"; MLflow run {held[1]} could not be marked KILLED (the next start finds it dead)"


def warn_short_replay_pool(run: RunSettings) -> None:
    # A store without an age window (the FIFO) draws from every stored group of age >= 1: no L to fall short of.
    buffer, groups_per_step = run.groups["buffer"], run.trainer.groups_per_step
    window = described(buffer, ReplayStore).plan_window(buffer, run.trainer.steps)
    if window is not None and buffer.ratio > 0 and not replay_demand_met(groups_per_step, buffer.ratio, window):
        log.warning("B=%d, rho=%g, L=%d: rounding leaves the replay pool short of demand; gap fill will be "
                    "logged (batch/gap_fill_groups)", groups_per_step, buffer.ratio, window)


def train_cell(run: RunSettings, cell: Cell, stop: StopOnSignal, runtime: Runtime) -> dict[str, float]:
    """Find where the cell starts, load the model, and train it inside its MLflow run.

    The lead process decides where the cell starts and owns the MLflow run (src/runtime/base.py)."""
    with stop.abandonable():  # until the run opens, a stop loses nothing: the next start redoes it
        start = runtime.lead_only(choose_start, run, cell, Path(HydraConfig.get().runtime.output_dir))
    runtime.lead_only(open_folder, start, run)
    # A resumed run was claimed by its heartbeat: keep it alive through model loading (a new run gets its
    # id, and the heartbeat with it, once MLflow opens it).
    heartbeat = Heartbeat(start.folder, start.run_id, run.trainer.heartbeat_every_s)
    with runtime.lead_context(heartbeat, elsewhere=NoHeartbeat()) as beat:
        with stop.abandonable():
            task = build_task(run.groups["task"])
            train_set, heldout = task.splits()
            parts, state = runtime.place(build_components(run, train_set, task=task), start.checkpoint)
        start.checkpoint = None  # the policy holds it now; free the copy
        opened = tracking.start_run(run.tracking, cell.labels, start.run_id, *hydra_job(), folder=start.folder)
        with runtime.tracking(opened) as tracker:
            beat.beat_for(tracker.run_id)
            runtime.lead_only(hold_run, run.tracking.uri, tracker.run_id)
            cell_run = CellRun(run, cell, parts, runtime, state, heldout, tracker, start.folder, stop)
            try:
                return cell_run.run()
            except StopRequested as request:
                cell_run.stop_here(request)


def open_folder(start, run: RunSettings) -> None:
    """Rank 0's part before the model loads: the run's folder settled, its run held for a stop, and what a
    killed process left half-written there removed."""
    settle_folder(start.folder)
    if start.run_id is not None:
        hold_run(run.tracking.uri, start.run_id)
    for path in remove_stale_temporaries(start.folder, run.trainer.heartbeat_timeout_s):
        log.info("removed %s, left half-written by a process that was killed", path)


def settle_folder(folder: Path) -> None:
    """One folder a run: a resumed run logs into the folder it started in, and the one Hydra made for this start
    goes (src/runs/folder.py); then say where the run writes."""
    job = HydraConfig.get()
    if job.mode == RunMode.RUN:  # a sweep's job folder stays: the sweep's own record of its cells
        run_folder.move_log(Path(job.runtime.output_dir), folder)
        quiet_log_files_when_full()
    console.print(f"run folder: {folder}", soft_wrap=True, highlight=False, markup=False)
    run_folder.to_log_file(f"run folder: {folder}")


def discard_unused_folder() -> None:
    """A single run that refused its config, or had nothing to train, leaves no folder behind."""
    job = HydraConfig.get()
    if job.mode == RunMode.RUN:
        run_folder.discard_unused(Path(job.runtime.output_dir))


@dataclass
class CellRun:
    """One cell's training inside its open MLflow run: steps, checkpoints, evaluations, and a clean stop."""

    settings: RunSettings
    cell: Cell
    parts: Components
    runtime: Runtime                   # conf/runtime: what supplies the steps (src/runtime/base.py)
    state: TrainState
    heldout: list
    tracker: tracking.Tracker
    folder: Path
    stop: StopOnSignal
    saved_at: int = -1  # the step of the checkpoint this process last wrote
    steps: Steps | None = None  # the runtime's open session

    def run(self) -> dict[str, float]:
        run, tracker, state = self.settings, self.tracker, self.state
        plan = plan_for(run)
        tracker.set_tags({"output_dir": str(self.folder), "planned_fresh_evaluations": str(plan.fresh_evaluations),
                          "slurm_job": slurm_job_key() or "-"})
        before = None
        if run.evaluation.at_start and state.step == 0 and not tracker.has_metric_at(
                f"{run.evaluation.name}/start/mean_reward", 0):
            before = self.evaluate("start", step=0)
        self.train_steps()
        self.checkpoint()
        final_dir = self.save_policy()
        after = self.evaluate("final", step=state.step)
        # The generation work of this process's engine: over ranks with vLLM, rank 0's share of every call.
        tracker.set_tags({"fresh_evaluations": str(state.fresh_evaluations),
                          "engine_sequences": str(getattr(self.parts.engine, "generated", "-"))})
        tracker.log_summary(after, state, run.evaluation.ks)
        if not self.runtime.lead:
            return after.summary
        log_final_policy(tracker.run_id, final_dir, run.tracking.policy_artifact_max_mb)
        if tracker.redone_mismatches:
            tracker.set_tags({"resume_mismatches": str(len(tracker.redone_mismatches))})
            log.error("%d metric values of redone steps differ from the values logged before the restart "
                      "(first: %s)", len(tracker.redone_mismatches), tracker.redone_mismatches[0])
        _print_summary(run, self.cell.name, plan, state, before, after, tracker.run_id, self.folder)
        return after.summary

    def train_steps(self, until: int | None = None) -> None:
        """The one loop, whatever supplies the steps (conf/runtime: this process, its ranks, or the Ray pipeline):
        each step logged once, then a checkpoint and an evaluation when due, and a clean stop on a signal;
        until step `until` (default: the run's last). The runtime's session closes on the way out, its state
        kept for the checkpoint that follows."""
        steps, state = self.settings.trainer.steps, self.state
        last = steps if until is None else min(until, steps)
        context = RunContext(self.settings, self.parts, state, self.folder, self.log_artifact)
        bar = progress.Bar(f"train {self.cell.name}", steps, "steps", done=state.step)
        try:
            with self.runtime.session(context) as self.steps, bar:
                self.evaluate_if_due()  # a resumed run whose evaluation at this step was cut short
                while state.step < last:
                    self.train_one_step(bar)
        finally:
            self.steps = None  # closed: the driver holds the trained policy, the runtime its state

    def log_artifact(self, path: Path) -> None:
        """A runtime's file for the run (the async pipeline's event log and distributions), under runtime/."""
        log_run_artifact(self.tracker.run_id, path, "runtime")

    def train_one_step(self, bar: progress.Bar) -> None:
        """One step, logged; a checkpoint and an evaluation when due; StopRequested if a stop signal came."""
        run, state = self.settings, self.state
        try:
            outcome = self.steps.next()  # one trained step, from this process, the ranks or the pipeline
        except Exception:
            if self.stop.requested != signal.SIGINT:
                raise
            # Ctrl-C reaches the whole process group: a helper process (vLLM's engine) may have died of it.
            raise StopRequested(signal.SIGINT, mid_step=True) from None
        state.advance(outcome.counts)  # the one place a step is counted
        metrics = outcome.metrics
        self.tracker.log_step(metrics, state.step - 1)
        self.log_completions(outcome.completions)
        state.history.append({key: metrics[key] for key in ("train/reward", "budget/fresh_evaluations")})
        bar.update(state.step, _progress_info(metrics))
        every = run.trainer.checkpoint_every
        if every and state.step % every == 0 and state.step < run.trainer.steps:
            self.checkpoint()
        self.evaluate_if_due()
        requested = self.runtime.agreed_stop(self.stop.requested or 0)  # every process stops after the same step
        if requested and state.step < run.trainer.steps:  # keep this step, then go
            raise StopRequested(requested)

    def log_completions(self, picked: dict[int, list]) -> None:
        """The step's sample completions: `tracking.completions_per_step` to MLflow, `print_completions` printed,
        each its own draw (`outcome.completions`), so what is logged does not depend on what is printed."""
        run, task = self.settings, self.parts.task
        logged, shown = run.tracking.completion_counts
        rows = completion_rows(picked.get(logged, []), task, run.policy.max_new_tokens)
        self.tracker.log_completions(rows, self.state.step - 1)
        if shown > logged:
            rows = completion_rows(picked[shown], task, run.policy.max_new_tokens)
        for row in rows[:shown]:
            log.info("%s", completion_line(row))

    def evaluate_if_due(self) -> None:
        """The learning-curve evaluation of this step, unless it is logged already (not twice after a resume)."""
        every, step = self.settings.evaluation.every, self.state.step
        if every and 0 < step < self.settings.trainer.steps and step % every == 0 and not self.tracker.has_metric_at(
                f"{self.settings.evaluation.name}/during/mean_reward", step):
            if self.steps is not None:
                self.steps.before_evaluation()
            self.evaluate("during", step=step)

    def evaluate(self, stage: str, step: int):
        """The configured evaluation protocol on the held-out prompts, logged to this run; a stop cuts it short."""
        run, parts = self.settings, self.parts
        with self.stop.abandonable(), progress.evaluation_progress(
                f"evaluate {stage} ({run.evaluation.name}, step {step})", run.evaluation) as on_repeat:
            result = evaluate_policy(run, parts.policy, parts.tokenizer, parts.engine, self.heldout,
                                     on_repeat=on_repeat, task=parts.task)
        self.tracker.log_evaluation(result, stage, step)
        return result

    def checkpoint(self) -> None:
        if self.saved_at != self.state.step:
            if self.steps is not None:
                self.steps.before_checkpoint()
            self.runtime.save(self.folder, self.parts, self.state.step, self.write_checkpoint)
            self.saved_at = self.state.step

    def write_checkpoint(self, shards: Path | None) -> None:
        """The checkpoint file (rank 0's): the run's state, and the policy and optimizer or their shards."""
        save_checkpoint(self.folder / LATEST_CHECKPOINT, self.parts, self.state, self.tracker.run_id,
                        self.cell.identity, shards, runtime=self.runtime.state_dict())

    def save_policy(self) -> Path:
        """The final policy folder: over ranks every rank takes part in gathering the shards; the lead writes it."""
        whole, folder = self.runtime.whole_policy(self.parts.policy), self.folder / "policy"
        return save_final_policy(self.parts, folder, whole) if self.runtime.lead else folder

    def stop_here(self, request: StopRequested) -> None:
        """Checkpoint (unless the step broke off half done), mark the run KILLED, say how to resume, and pass the
        signal on (or exit 128 + signal)."""
        if not request.mid_step:
            self.checkpoint()
        if not self.runtime.lead:  # the lead process closes the run and says how to resume it
            self.stop.requested = self.stop.requested or request.signum  # the signal may have reached rank 0 only
            self.stop.hand_on()
        problem = close_active_run(self.tracker.run_id, "KILLED")
        if problem is not None:
            leave_run_end(self.tracker.run_id, "KILLED", signal_name(request.signum), problem, self.folder)
        checkpoint = self.folder / LATEST_CHECKPOINT
        kept = (f"checkpoint at step {self.saved_at}: {checkpoint}" if self.saved_at >= 0
                else f"checkpoint {checkpoint}" if checkpoint.exists() else "no checkpoint yet (it starts afresh)")
        where = f"during step {self.state.step + 1}" if request.mid_step else f"after step {self.state.step}"
        log.warning("%s: stopped %s of %d, %s; MLflow run %s marked KILLED; %s", signal_name(request.signum),
                    where, self.settings.trainer.steps, kept, self.tracker.run_id, self.stop.finish_line())
        self.stop.hand_on()


def save_final_policy(parts: Components, folder: Path, whole: dict | None = None) -> Path:
    """The trained policy and tokenizer as a `from_pretrained` folder, with `whole` weights where its shards lie
    over ranks (else its own); a full disk leaves no half of it."""
    try:
        with writing("the final policy", folder, payload_bytes(whole or parts.policy.state_dict())):
            parts.policy.save_pretrained(folder, **({} if whole is None else {"state_dict": whole}))
            parts.tokenizer.save_pretrained(folder)
    except DiskFull:
        shutil.rmtree(folder, ignore_errors=True)
        raise
    return folder


def _progress_info(metrics: dict[str, float]) -> str:
    info = (f"reward {metrics['train/reward']:.3f}  correct {metrics.get('train/correct_fraction', math.nan):.2f}  "
            f"fresh evals {int(metrics['budget/fresh_evaluations']):,}")
    if "offpolicy/mean" in metrics:  # the asynchronous pipeline's (SPEC 11)
        info += f"  off-policiness {metrics['offpolicy/mean']:.2f}  replay {metrics['replay/count_mean']:.2f}"
    return info + (f"  {metrics['time/step']:.1f}s/step" if "time/step" in metrics else "")


def _print_summary(run: RunSettings, name: str, plan, state: TrainState, before, after, run_id: str,
                   folder: Path) -> None:
    table = Table(title=f"{name}  (MLflow run {run_id[:8]})")
    table.add_column("held-out " + run.evaluation.name)
    if before is not None:
        table.add_column("warm start", justify="right")
    table.add_column("after RL", justify="right")
    for metric in [f"pass@{k}" for k in run.evaluation.ks] + ["mean_reward", "correction_rate"]:
        row = [metric] + ([_fmt(before.summary.get(metric))] if before is not None else [])
        table.add_row(*row, _fmt(after.summary.get(metric)))
    _print_result(table)
    # sampling=dynamic generates until its batch is full of effective groups: the plan is its floor.
    planned = ("at least " if budget_is_floor(run.groups) else "") + str(plan.fresh_evaluations)
    _print_result(f"fresh verifier evaluations: {state.fresh_evaluations} (planned {planned}); "
                  f"gradient steps: {state.gradient_steps}")
    opener = ui_command(run.tracking.uri, run.tracking.artifact_location, run.out)
    where = f" (after {opener})" if opener else ""
    _print_result(f"run page{where}: {run_link(run.tracking.uri, run_id)}")
    _print_result(f"run folder: {folder}")


def _print_result(shown) -> None:
    """A result line or table on stdout, and its text in run.log."""
    results.print(shown, soft_wrap=isinstance(shown, str), highlight=False)
    text = Console(width=120, file=io.StringIO(), color_system=None)
    text.print(shown, soft_wrap=isinstance(shown, str), highlight=False)
    run_folder.to_log_file(text.file.getvalue().rstrip("\n"))


def _fmt(value) -> str:
    return "-" if value is None or (isinstance(value, float) and math.isnan(value)) else f"{value:.3f}"


# Mistakes a user fixes by changing the command line: one message, no traceback.
USER_ERRORS = (ConfigError, CheckpointError, StoreUnreachable, PipelineError, TaskDataError)


def nothing_to_train(reason: NothingToTrain) -> Skipped | float:
    """A finished cell, or one another job trains: one line. In a sweep the job is a skip the sweeper counts;
    alone, a finished cell exits 0 and a cell trained elsewhere exits 2 (the command did not train)."""
    if HydraConfig.get().mode == RunMode.MULTIRUN:
        console.print(f"skip: {reason}", soft_wrap=True, highlight=False, markup=False)
        return Skipped(str(reason), "running" if isinstance(reason, RunAlive) else "finished")
    if isinstance(reason, RunAlive):
        exit_with_message(reason)
    console.print(str(reason), soft_wrap=True, highlight=False, markup=False)
    return float("nan")


# submitit pickles the undecorated `main` by value (the module attribute is Hydra's wrapper), with
# the globals it names: it must name only importable things, never the rich console (it holds a lock).
@hydra.main(config_path=str(CONFIG_DIR), config_name="config", version_base="1.3")  # absolute: see __main__
def main(cfg: DictConfig) -> float:
    try:
        job = HydraConfig.get()
        check_settings_take_effect(cfg, list(job.overrides.task), job.runtime.choices)  # this job's command line
        summary = train(cfg)
    except NothingToTrain as reason:
        discard_unused_folder()
        return nothing_to_train(reason)
    except Exception as error:
        fail_unopened_claim(error)  # a run claimed but never opened ends FAILED, not RUNNING
        full = disk_full_error(error, cfg.tracking.uri)  # no space: one line, not a traceback
        if full is None and not isinstance(error, USER_ERRORS):
            raise
        discard_unused_folder()
        if HydraConfig.get().mode == RunMode.MULTIRUN:
            raise (full or error) from None  # the sweeper lists the failed cell with this message
        exit_with_message(full or error, 1 if full else 2)
    # The value a Hydra sweeper would optimise: held-out mean reward.
    return summary.get("mean_reward", float("nan"))


def launch() -> None:
    """Hydra's app on the command line in sys.argv, which `src.command.cli` has checked."""
    # Outside a cell's training (composing the config, planning a sweep, between its cells) a Ctrl-C lets the
    # work in hand end rather than cut it anywhere: the next cell sees it and stops before loading a model.
    with StopOnSignal((signal.SIGINT,), until="before the next cell starts") as outside_cells:
        main()
    if outside_cells.requested:
        sys.exit(128 + signal.SIGINT)
