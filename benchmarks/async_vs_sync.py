"""runtime=async (W = 1, T = 1) against runtime=sync on the same work: updates/s and rollouts/s (SPEC 11).

    python -m benchmarks.async_vs_sync                      # B = 8 groups of K = 8, 6 timed steps
    python -m benchmarks.async_vs_sync --groups 16 --steps 10

Every update trains on B x K rollouts of the tiny policy. `sync` runs SPEC 3's fresh-only step
(generate, then train) in this process with one torch thread and with two; `async lifo` runs seed
001's streaming baseline in the free schedule with one worker actor and one trainer actor (one thread
each, this process driving them), the worker generating a whole batch per call as the synchronous step
does: each rollout is used once, as in the fresh-only step, so both do the same work per update,
and overlapped the pipeline should approach the slower phase alone rather than the sum of both. `async buffer` is the same pipeline with seed 001's FIFO buffer (N = 4 B):
the trainer no longer waits for generation, so updates/s is the trainer's own speed.

The first step of each runtime is left out of the timing (model load, actor start, warm-up).
"""

from __future__ import annotations

import argparse
import time

import torch
from hydra import compose, initialize_config_dir
from rich.console import Console
from rich.table import Table

import src.command.config  # noqa: F401  (the ${root:} resolver)
from src.build import build_components, build_runtime
from src.paths import CONFIG_DIR
from src.batch import TrainState
from src.task import countdown
from src.settings import RunSettings


def config(groups: int, group_size: int, steps: int, *overrides: str):
    with initialize_config_dir(str(CONFIG_DIR), version_base="1.3"):
        return compose("config", overrides=[f"trainer.groups_per_step={groups}", f"trainer.group_size={group_size}",
                                            f"trainer.steps={steps + 1}", "task.train_size=2000", *overrides])


PHASES = {"generate": ("time/generate", "time/score"), "train": ("time/train",)}


def time_sync(cfg, threads: int, phases: dict[str, float] | None = None) -> tuple[float, int, int]:
    """Seconds for steps 1.. of the synchronous loop, updates and rollouts in them; adds up its phases."""
    from src.train import train_step

    torch.set_num_threads(threads)
    train_set, _ = countdown.train_and_heldout(cfg.task)
    parts, state = build_components(RunSettings(cfg), train_set), TrainState()
    train_step(parts, state)  # warm-up
    started, evaluations = time.perf_counter(), state.fresh_evaluations
    while state.step < cfg.trainer.steps:
        metrics = train_step(parts, state)
        for phase, keys in PHASES.items():
            if phases is not None:
                phases[phase] = phases.get(phase, 0.0) + sum(metrics.get(key, 0.0) for key in keys)
    return time.perf_counter() - started, state.step - 1, state.fresh_evaluations - evaluations


def time_async(cfg, tmp, phases: dict[str, float] | None = None) -> tuple[float, int, int]:
    """Seconds for steps 1.. of the pipeline, updates and rollouts generated in them; the trainer's update seconds
    in them into `phases`."""
    from src.runtime.base import RunContext

    torch.set_num_threads(1)
    train_set, _ = countdown.train_and_heldout(cfg.task)
    state, times = TrainState(), []
    run = RunSettings(cfg)
    context = RunContext(run, build_components(run, train_set), state, tmp, log_artifact=lambda path: None)
    with build_runtime(run).session(context) as steps:
        while state.step < cfg.trainer.steps:
            outcome = steps.next()
            state.advance(outcome.counts)  # the loop's part: a session's step counts nothing itself
            times.append((time.perf_counter(), outcome.metrics))
    (first, m0), (last, m1) = times[0], times[-1]
    rollouts = m1["runtime/generated_rollouts"] - m0["runtime/generated_rollouts"]
    if phases is not None:  # the trainer actor's own update seconds in the timed steps
        phases["train"] = sum(metrics["time/train"] for _, metrics in times[1:])
    return last - first, len(times) - 1, int(rollouts)


def main(argv: list[str] | None = None) -> None:
    import tempfile
    from pathlib import Path

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--groups", type=int, default=8, help="B, groups per update")
    parser.add_argument("--group-size", type=int, default=8, help="K")
    parser.add_argument("--steps", type=int, default=6, help="timed updates (after one warm-up step)")
    args = parser.parse_args(argv)
    batch = args.groups * args.group_size
    table = Table(title=f"updates of B x K = {args.groups} x {args.group_size} rollouts, tiny policy, "
                        f"{args.steps} timed steps")
    for column in ("runtime", "updates/s", "rollouts/s", "vs sync (1 thread)"):
        table.add_column(column, justify="right" if column != "runtime" else "left")
    rows = []
    base = config(args.groups, args.group_size, args.steps)
    phases: dict[str, float] = {}
    busy: list[str] = []
    for threads in (1, 2):
        rows.append((f"sync, {threads} thread{'s' if threads > 1 else ''}",
                     *time_sync(base, threads, phases if threads == 1 else None)))
    for queue, buffer in (("lifo", "none"), ("buffer", "fifo")):
        cfg = config(args.groups, args.group_size, args.steps, "runtime=async", "runtime.workers=1",
                     "runtime.schedule=free", f"buffer={buffer}", f"buffer.capacity={4 * batch}",
                     "buffer.mode=without_replacement" if buffer == "fifo" else "buffer.ratio=0",
                     f"runtime.groups_per_request={args.groups}", "runtime.depth=2", "hardware.threads=1")
        with tempfile.TemporaryDirectory() as tmp:
            rows.append((f"async {queue}, W=1 T=1 free", *time_async(cfg, Path(tmp), trainer := {})))
        busy.append(f"{queue} {trainer['train'] / rows[-1][2]:.2f} s of {rows[-1][1] / rows[-1][2]:.2f} s")
    reference = rows[0][2] / rows[0][1]
    for name, seconds, updates, rollouts in rows:
        rate = updates / seconds
        table.add_row(name, f"{rate:.3f}", f"{rollouts / seconds:.1f}", f"{rate / reference:.2f}x")
    console = Console()
    console.print(table)
    slower = max(phases.values()) / args.steps
    console.print(f"sync (1 thread) per step: generate + score {phases['generate'] / args.steps:.2f} s, train "
                  f"{phases['train'] / args.steps:.2f} s; fully overlapped, the slower phase alone allows "
                  f"{1 / slower:.3f} updates/s ({rows[0][1] / args.steps * (1 / slower):.2f}x sync)")
    console.print(f"async, the trainer actor's update per step, of the step's wall time: {'; '.join(busy)}",
                  soft_wrap=True)


if __name__ == "__main__":
    main()
