"""Where a training step's time goes, per phase, on the configured policy (`make bench`).

    python -m benchmarks.step_phases                       # tiny policy, rho=1, L=1, c=1, 20 steps
    python -m benchmarks.step_phases --steps 40 buffer=age2 trainer.groups_per_step=32

The model phases are generate (rollouts) and train (forward, reference forward, backward,
optimizer step). Everything else (replay draw, verifier scoring, buffer update, metric
bookkeeping, MLflow logging) is overhead that should stay under 5 % of the step.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time

import torch
from hydra import compose, initialize_config_dir
from rich.console import Console
from rich.table import Table

import src.command.config  # noqa: F401  (the ${root:} resolver)
from src.runs import tracking
from src.paths import CONFIG_DIR
from src.build import build_components
from src.study.labels import run_labels
from src.study.sweep import cell_name
from src.task.base import build_task
from src.batch import TrainState
from src.train import train_step
from src.settings import RunSettings

MODEL_PHASES = ("generate", "train")
OVERHEAD_PHASES = ("replay_draw", "score", "buffer_update", "bookkeeping", "logging")


def measure(overrides: list[str], steps: int, warmup: int) -> dict[str, list[float]]:
    """Run `warmup + steps` training steps, logging to a throwaway MLflow store; per-phase seconds."""
    with tempfile.TemporaryDirectory() as folder, initialize_config_dir(str(CONFIG_DIR), version_base="1.3"):
        cfg = compose("config", overrides=[f"tracking.uri=sqlite:///{folder}/mlruns.db",
                                           f"tracking.artifact_location={folder}/artifacts",
                                           f"trainer.steps={steps + warmup}", "tracking.sweep=benchmark", *overrides])
        src.command.config.validate(cfg)
        task = build_task(cfg.task)
        train_set, _ = task.splits()
        run = RunSettings(cfg)
        parts = build_components(run, train_set, task=task)
        state, phases = TrainState(), {name: [] for name in (*MODEL_PHASES, *OVERHEAD_PHASES, "step")}
        with tracking.start_run(run.tracking, run_labels(cfg)) as tracker:
            for _ in range(warmup + steps):
                metrics = train_step(parts, state)
                logged = time.perf_counter()
                tracker.log_step(metrics, state.step - 1)
                log_seconds = time.perf_counter() - logged
                if state.step > warmup:
                    for name in phases:
                        if name != "logging":
                            phases[name].append(metrics[f"time/{name}"])
                    phases["logging"].append(log_seconds)
                    phases["step"][-1] += log_seconds
        return cfg, phases


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=20, help="measured steps")
    parser.add_argument("--warmup", type=int, default=2, help="unmeasured first steps (step 0 has no replay)")
    parser.add_argument("overrides", nargs="*", default=["buffer=age1", "clip=tight"], help="Hydra overrides")
    args = parser.parse_args()
    cfg, phases = measure(args.overrides, args.steps, args.warmup)
    step_mean = statistics.mean(phases["step"])
    table = Table(title=f"Step phases: {cell_name(cfg)}, policy {cfg.policy.name_or_path}, "
                        f"B={cfg.trainer.groups_per_step}, K={cfg.trainer.group_size}, {args.steps} steps, "
                        f"{torch.get_num_threads()} threads")
    for column in ("phase", "kind", "mean s", "share"):
        table.add_column(column, justify="right" if column != "phase" else "left")
    for name in (*MODEL_PHASES, *OVERHEAD_PHASES):
        mean = statistics.mean(phases[name])
        table.add_row(name, "model" if name in MODEL_PHASES else "overhead", f"{mean:.4f}", f"{mean / step_mean:.1%}")
    overhead = sum(statistics.mean(phases[name]) for name in OVERHEAD_PHASES)
    table.add_row("step (total)", "", f"{step_mean:.4f}", "100%")
    console = Console()
    console.print(table)
    console.print(f"work outside model generate/forward/backward: {overhead:.4f} s = {overhead / step_mean:.1%} "
                  f"of the step (target <= 5%)")


if __name__ == "__main__":
    main()
