"""The one entry point: compose config groups, train one cell, evaluate it, log it all to MLflow.

    python -m src.run                                  # tiny CPU policy, fresh-only RLOO
    python -m src.run buffer=age2 clip=tight           # one Replay-RLOO cell
    python -m src.run -m buffer=age1,age2 clip=tight   # a sweep through the configured launcher
    python -m src.run buffer.ratio=2 trainer.steps=50  # any knob from the command line
"""

from __future__ import annotations

import logging
import math
import sys
from pathlib import Path

import hydra
from hydra.core.hydra_config import HydraConfig
from hydra.types import RunMode
from omegaconf import DictConfig
from rich.console import Console
from rich.table import Table

from src import progress, tracking
from src.budget import plan_for_config, replay_demand_met
from src.config import ConfigError, validate
from src.lifecycle import LATEST_CHECKPOINT, Heartbeat
from src.eval.standalone import evaluate_policy
from src.sweep import cell_identity, cell_name, slurm_job_key
from src.interrupt import StopOnSignal
from src.paths import CONFIG_DIR
from src.task.base import TaskDataError, build_task
from src.build import build_components
from src.labels import hydra_job, run_labels
from src.checkpoint import CheckpointError, check_resume_from, restore_checkpoint, save_checkpoint
from src.components import Components
from src.resume import RunAlive, choose_start
from src.state import TrainState
from src.train import train_step

log = logging.getLogger(__name__)
console = Console(stderr=True)


def run_evaluation(cfg: DictConfig, parts: Components, heldout, stage: str, tracker, step: int):
    """The configured evaluation protocol on the held-out prompts, logged to this run."""
    with progress.evaluation_progress(f"evaluate {stage} ({cfg.evaluation.name}, step {step})",
                                      cfg.evaluation) as on_repeat:
        result = evaluate_policy(cfg, parts.policy, parts.tokenizer, parts.engine, heldout, on_repeat=on_repeat,
                                 task=parts.task)
    tracker.log_evaluation(result, stage, step)
    return result


def train(cfg: DictConfig) -> dict[str, float]:
    """Train and evaluate one cell; returns the final evaluation summary."""
    validate(cfg)  # config mistakes fail here, before any model is loaded
    progress.silence_library_bars()
    tracking.check_store(cfg.tracking.uri, cfg.tracking.experiment, cfg.tracking.artifact_location)
    check_resume_from(cfg.trainer.resume_from)
    fifo = cfg.buffer.name == "fifo"  # no age window: its pool is every stored group of age >= 1
    if not fifo and cfg.buffer.ratio > 0 and not replay_demand_met(cfg.trainer.groups_per_step, cfg.buffer.ratio, cfg.buffer.max_age):
        log.warning("B=%d, rho=%g, L=%d: rounding leaves the replay pool short of demand; gap fill will be "
                    "logged (batch/gap_fill_groups)", cfg.trainer.groups_per_step, cfg.buffer.ratio, cfg.buffer.max_age)
    identity = cell_identity(cfg)
    start = choose_start(cfg, identity, Path(HydraConfig.get().runtime.output_dir))
    output_dir = start.folder
    checkpoint_path = output_dir / LATEST_CHECKPOINT
    plan = plan_for_config(cfg)
    # A resumed run was claimed by its heartbeat: keep it alive through model loading (a new run gets its
    # id, and the heartbeat with it, once MLflow opens it).
    with Heartbeat(output_dir, start.run_id, cfg.trainer.heartbeat_every_s) as heartbeat:
        task = build_task(cfg.task)
        train_set, heldout = task.splits()
        parts = build_components(cfg, train_set, task=task)
        state = restore_checkpoint(start.checkpoint, parts) if start.checkpoint else TrainState()
        start.checkpoint = None  # the policy holds it now; free the copy

        with tracking.start_run(cfg, run_labels(cfg), start.run_id, *hydra_job()) as tracker, \
                StopOnSignal() as stop:
            heartbeat.beat_for(tracker.run_id)
            tracker.set_tags({"output_dir": str(output_dir), "planned_fresh_evaluations": str(plan.fresh_evaluations),
                              "slurm_job": slurm_job_key() or "-"})
            before = None
            if cfg.evaluation.at_start and state.step == 0 and not tracker.has_metric_at(
                    f"{cfg.evaluation.name}/start/mean_reward", 0):
                before = run_evaluation(cfg, parts, heldout, "start", tracker, step=0)
            with training_bar(cfg, state.step) as bar:
                while state.step < cfg.trainer.steps:
                    metrics = train_step(parts, state)
                    step = state.step - 1
                    tracker.log_step(metrics, step)
                    state.history.append({key: metrics[key] for key in ("train/reward", "budget/fresh_evaluations")})
                    bar.update(state.step, _progress_info(metrics))
                    every = cfg.trainer.checkpoint_every
                    if every and state.step % every == 0 and state.step < cfg.trainer.steps:
                        save_checkpoint(checkpoint_path, parts, state, tracker.run_id, identity)
                    evaluate_now = cfg.evaluation.every and state.step % cfg.evaluation.every == 0
                    if evaluate_now and state.step < cfg.trainer.steps and not tracker.has_metric_at(
                            f"{cfg.evaluation.name}/during/mean_reward", state.step):  # not twice after a resume
                        run_evaluation(cfg, parts, heldout, "during", tracker, step=state.step)
                    if stop.requested and state.step < cfg.trainer.steps:  # pre-empted: keep this step, then go
                        save_checkpoint(checkpoint_path, parts, state, tracker.run_id, identity)
                        log.warning("checkpoint at step %d written to %s; run %s marked KILLED (it resumes)",
                                    state.step, checkpoint_path, tracker.run_id)
                        tracking.end_run("KILLED")
                        stop.hand_on()
            save_checkpoint(checkpoint_path, parts, state, tracker.run_id, identity)
            final_dir = output_dir / "policy"
            parts.policy.save_pretrained(final_dir)
            parts.tokenizer.save_pretrained(final_dir)
            after = run_evaluation(cfg, parts, heldout, "final", tracker, step=state.step)
            tracker.set_tags({"fresh_evaluations": str(state.fresh_evaluations)})
            tracking.log_final_policy(tracker.run_id, final_dir, cfg.tracking.policy_artifact_max_mb)
            if tracker.redone_mismatches:
                tracker.set_tags({"resume_mismatches": str(len(tracker.redone_mismatches))})
                log.error("%d metric values of redone steps differ from the values logged before the restart "
                          "(first: %s)", len(tracker.redone_mismatches), tracker.redone_mismatches[0])
            _print_summary(cfg, plan, state, before, after, tracker.run_id)
        return after.summary


def training_bar(cfg: DictConfig, done: int) -> progress.Bar:
    """Steps done of the run, ETA from this session's step times; a plain line per step off a terminal."""
    return progress.Bar(f"train {cell_name(cfg)}", cfg.trainer.steps, "steps", done=done)


def _progress_info(metrics: dict[str, float]) -> str:
    return (f"reward {metrics['train/reward']:.3f}  correct {metrics['train/correct_fraction']:.2f}  "
            f"fresh evals {int(metrics['budget/fresh_evaluations']):,}  {metrics['time/step']:.1f}s/step")


def _print_summary(cfg, plan, state: TrainState, before, after, run_id: str) -> None:
    table = Table(title=f"{cell_name(cfg)}  (MLflow run {run_id[:8]})")
    table.add_column("held-out " + cfg.evaluation.name)
    if before is not None:
        table.add_column("warm start", justify="right")
    table.add_column("after RL", justify="right")
    for metric in [f"pass@{k}" for k in cfg.evaluation.ks] + ["mean_reward", "correction_rate"]:
        row = [metric] + ([_fmt(before.summary.get(metric))] if before is not None else [])
        table.add_row(*row, _fmt(after.summary.get(metric)))
    console.print(table)
    # sampling=dynamic generates until its batch is full of effective groups: the plan is its floor.
    planned = ("at least " if cfg.sampling.name == "dynamic" else "") + str(plan.fresh_evaluations)
    console.print(f"fresh verifier evaluations: {state.fresh_evaluations} (planned {planned}); "
                  f"gradient steps: {state.gradient_steps}")


def _fmt(value) -> str:
    return "-" if value is None or (isinstance(value, float) and math.isnan(value)) else f"{value:.3f}"


# Mistakes a user fixes by changing the command line: one message, no traceback.
USER_ERRORS = (ConfigError, CheckpointError, RunAlive, tracking.StoreUnreachable, TaskDataError)


def exit_with_message(error: Exception) -> None:
    """One line naming the problem and its fix, exit status 2, no traceback."""
    console.print(f"[bold red]error:[/bold red] {error}", soft_wrap=True, highlight=False)
    sys.exit(2)


# submitit pickles the undecorated `main` by value (the module attribute is Hydra's wrapper), with
# the globals it names: it must name only importable things, never the rich console (it holds a lock).
@hydra.main(config_path=str(CONFIG_DIR), config_name="config", version_base="1.3")  # absolute: see __main__
def main(cfg: DictConfig) -> float:
    try:
        summary = train(cfg)
    except USER_ERRORS as error:
        if HydraConfig.get().mode == RunMode.MULTIRUN:
            raise  # the sweeper lists the failed cell with this message; the other cells go on
        exit_with_message(error)
    # The value a Hydra sweeper would optimise: held-out mean reward.
    return summary.get("mean_reward", float("nan"))


def cli() -> None:
    """The command line (`python -m src.run`, console script `replay-rloo`): help, key check, then Hydra."""
    from src.help import help_text, wants_help
    from src.schema import SchemaError, check_override_keys

    if wants_help(sys.argv[1:]):
        sys.stdout.write(help_text())
        return
    try:
        check_override_keys(sys.argv[1:])
    except SchemaError as error:
        exit_with_message(error)
    main()


if __name__ == "__main__":
    # Call the task through the importable module, not __main__: submitit pickles it for SLURM
    # jobs, and a __main__ function would be pickled by value with this module's globals.
    from src import run

    run.cli()
