"""runtime=async (W = 1, T = 1) against runtime=sync on the same work: updates/s and rollouts/s (SPEC 11).

    python -m benchmarks.async_vs_sync                      # B = 8 groups of K = 8, 6 timed steps
    python -m benchmarks.async_vs_sync --groups 16 --steps 10
    python -m benchmarks.async_vs_sync --groups 16 --steps 10 --repeats 5   # runtimes in turn, the median
    python -m benchmarks.async_vs_sync --groups 16 --steps 10 --repeats 3 --lifo-batches 2   # a shallower LIFO

Every update trains on B x K rollouts of the tiny policy. `sync` runs SPEC 3's fresh-only step
(generate, then train) in this process with one torch thread and with two; `async lifo` runs seed
001's streaming baseline in the free schedule with one worker actor and one trainer actor (one thread
each, this process driving them), the worker generating a whole batch per call as the synchronous step
does: each rollout is used once, as in the fresh-only step, so both do the same work per update,
and overlapped the pipeline should approach the slower phase alone rather than the sum of both. The
workers take log mu from the engine's own logits (`runtime.behaviour_logprobs=engine`, checked against
the trainer's forward pass on each worker's first request), as the synchronous step makes no pass for
it either; `--log-mu forward` gives them the forward pass of their own. `async buffer` is the same
pipeline with seed 001's FIFO buffer (N = 4 B): the trainer does not wait for generation, so updates/s
is the trainer's own speed. The LIFO queue holds `--lifo-batches` batches (4 B by default), queued and
being generated: newest first, it trains the newest batch and keeps the older ones it never trains, and
its worker generates without a pause while it fills.

The first step of each runtime is left out of the timing (model load, actor start, warm-up). A round runs
sync with one thread first and again last, and takes their mean as the baseline, so that a drift in the
machine's speed over the round moves the baseline as it moves the others. LIFO also gets a measure
from its own run alone, immune to such drift: the share of the shorter role's seconds (the trainer's
update, or the worker's generating, scoring and log mu of a batch) hidden behind the longer's. Over
few steps it can pass 100 %: a worker's seconds count when its batch arrives.
"""

from __future__ import annotations

import argparse
import math
import statistics
import time

from rich.console import Console
from rich.table import Table

# torch, Hydra and the project's builders are imported where they are used, so that a bad argument gets its one
# line before they load.


def config(groups: int, group_size: int, steps: int, *overrides: str):
    from hydra import compose, initialize_config_dir

    import src.command.config  # noqa: F401  (the ${root:} resolver)
    from src.paths import CONFIG_DIR

    with initialize_config_dir(str(CONFIG_DIR), version_base="1.3"):
        return compose("config", overrides=[f"trainer.groups_per_step={groups}", f"trainer.group_size={group_size}",
                                            f"trainer.steps={steps + 1}", "task.train_size=2000", *overrides])


PHASES = {"generate": ("time/generate", "time/score"), "train": ("time/train",)}


def time_sync(cfg, threads: int, phases: dict[str, float] | None = None) -> tuple[float, int, int]:
    """Seconds for steps 1.. of the synchronous loop, updates and rollouts in them; adds up its phases."""
    import torch

    from src.batch import TrainState
    from src.build import build_components
    from src.settings import RunSettings
    from src.task import countdown
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
    import torch

    from src.batch import TrainState
    from src.build import build_components, build_runtime
    from src.runtime.base import RunContext
    from src.settings import RunSettings
    from src.task import countdown

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
    if phases is not None:  # the trainer actor's own update seconds and the workers' busy seconds in the timed steps
        phases["train"] = sum(metrics["time/train"] for _, metrics in times[1:])
        phases["generate"] = workers_busy(m1, cfg.runtime.workers) - workers_busy(m0, cfg.runtime.workers)
    return last - first, len(times) - 1, int(rollouts)


def workers_busy(metrics: dict[str, float], workers: int) -> float:
    """The workers' busy seconds so far (generating, scoring, log mu), from the pipeline's running measures."""
    wall = metrics["runtime/generated_rollouts"] / metrics["time/rollouts_per_s"]
    return (1 - metrics["time/idle_workers"]) * wall * workers


def overlap(seconds: float, updates: int, phases: dict[str, float]) -> float:
    """The share of the shorter role's seconds an update hidden behind the longer's, from one run's own measures:
    1 when a step takes the slower role's time alone, 0 when it takes the sum of both."""
    train, generate, step = phases["train"] / updates, phases["generate"] / updates, seconds / updates
    return (train + generate - step) / min(train, generate) if min(train, generate) > 0 else math.nan


def one_round(args, base) -> tuple[dict[str, tuple[float, int, int]], dict[str, float], dict[str, float]]:
    """Every runtime once: its (seconds, updates, rollouts), sync's phases with one thread (the mean of a run before
    the others and one after), and LIFO's share of its shorter role hidden (`overlap`)."""
    import tempfile
    from pathlib import Path

    batch, rows, phases, hidden = args.groups * args.group_size, {}, {}, {}
    before = time_sync(base, 1, phases)
    rows["sync, 2 threads"] = time_sync(base, 2)
    for queue, buffer, capacity in (("lifo", "none", args.lifo_batches * batch), ("buffer", "fifo", 4 * batch)):
        cfg = config(args.groups, args.group_size, args.steps, "runtime=async", "runtime.workers=1",
                     "runtime.schedule=free", f"buffer={buffer}", f"buffer.capacity={capacity}",
                     "buffer.mode=without_replacement" if buffer == "fifo" else "buffer.ratio=0",
                     f"runtime.groups_per_request={args.groups}", "runtime.depth=2", "hardware.threads=1",
                     f"runtime.behaviour_logprobs={args.log_mu}")
        with tempfile.TemporaryDirectory() as tmp:
            name = f"async {queue}, W=1 T=1 free"
            rows[name] = seconds, updates, _ = time_async(cfg, Path(tmp), roles := {})
        if queue == "lifo":  # each rollout used once: both roles do the synchronous step's work, one batch an update
            hidden[name] = overlap(seconds, updates, roles)
            print(f"  lifo: the trainer's update {roles['train'] / updates:.2f} s and the worker's batch "
                  f"{roles['generate'] / updates:.2f} s an update, the step {seconds / updates:.2f} s: "
                  f"{hidden[name]:.0%} of the shorter hidden", flush=True)
    # The baseline before and after the others: a drift in the machine's speed over the round then moves it as
    # it moves them, rather than only the runtimes measured later.
    after = time_sync(base, 1, phases)
    rows = {"sync, 1 thread": tuple(x + y for x, y in zip(before, after)), **rows}
    return rows, {phase: seconds / 2 for phase, seconds in phases.items()}, hidden


def gains(rows: dict[str, tuple[float, int, int]], phases: dict[str, float], steps: int) -> dict[str, float]:
    """Each runtime's updates/s over sync's with one thread, and `ideal`: the slower synchronous phase alone."""
    rate = {name: updates / seconds for name, (seconds, updates, _) in rows.items()}
    reference = rate["sync, 1 thread"]
    return {**{name: r / reference for name, r in rate.items()}, "ideal": steps / max(phases.values()) / reference}


def share(ratio: float, ideal: float) -> str:
    return f"{(ratio - 1) / (ideal - 1):.0%}" if ideal > 1 else "n/a"


def at_least_one(text: str) -> int:
    """An argparse type: a whole number of 1 or more (argparse names the option in its one-line error)."""
    if not text.strip().isdigit() or int(text) < 1:
        raise argparse.ArgumentTypeError(f"{text!r} is not a whole number of 1 or more (e.g. 5)")
    return int(text)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--groups", type=at_least_one, default=8, help="B, groups per update")
    parser.add_argument("--group-size", type=at_least_one, default=8, help="K")
    parser.add_argument("--steps", type=at_least_one, default=6, help="timed updates (after one warm-up step)")
    parser.add_argument("--log-mu", choices=("engine", "forward"), default="engine",
                        help="the workers' log mu: from the engine's logits (the synchronous step's work) or from a "
                             "forward pass of their own (runtime.behaviour_logprobs)")
    parser.add_argument("--lifo-batches", type=at_least_one, default=4,
                        help="the LIFO queue's bound (buffer.capacity) in batches of B x K rollouts, queued and being "
                             "generated; 2: one batch ready and one being generated")
    parser.add_argument("--repeats", type=at_least_one, default=1,
                        help="rounds of every runtime in turn, so that drifts in the machine's speed hit them alike")
    args = parser.parse_args(argv)
    # A wide table whatever the terminal: a log or a pipe would wrap it at 80 columns.
    base, console, rounds = config(args.groups, args.group_size, args.steps), Console(width=140), []
    from src.runtime.ray_session import ray_session

    # One Ray session for every round: each pipeline uses the running session as a run inside a test or a
    # connected cluster does (src/runtime/ray_session.py), so Ray's daemons start once, outside every timed span.
    with ray_session(config(1, 1, 1, "runtime=async").runtime.num_cpus):
        for index in range(args.repeats):
            console.print(f"round {index + 1}:")
            rows, phases, hidden = one_round(args, base)
            rounds.append((rows, gains(rows, phases, args.steps), hidden))
            report_round(console, args, rows, phases, rounds[-1][1])
    console.print(summary(args, rounds))


def report_round(console: Console, args, rows: dict, phases: dict, ratio: dict) -> None:
    """One round's line: sync's rate and phases, the ideal ratio, and each async runtime's ratio and share."""
    seconds, updates, _ = rows["sync, 1 thread"]
    console.print(f"  sync (1 thread, before and after) {updates / seconds:.3f} updates/s, generate + score "
                  f"{phases['generate'] / args.steps:.2f} s and train {phases['train'] / args.steps:.2f} s a "
                  f"step; the slower phase alone allows {ratio['ideal']:.2f}x; "
                  + "; ".join(f"{name} {ratio[name]:.2f}x ({share(ratio[name], ratio['ideal'])})"
                              for name in rows if name.startswith("async")), soft_wrap=True)


def summary(args, rounds: list) -> Table:
    """The median over rounds of each runtime's rates, its ratio to sync, its share of the possible gain, and how
    much of the shorter role the pipeline hid in its own run."""
    table = Table(title=f"updates of B x K = {args.groups} x {args.group_size} rollouts, tiny policy, {args.steps} "
                        f"timed steps, LIFO of {args.lifo_batches} B, median of {len(rounds)} "
                        f"round{'s' if len(rounds) > 1 else ''}")
    for column in ("runtime", "updates/s", "rollouts/s", "vs sync (1 thread)", "min-max", "of the possible gain",
                   "shorter role hidden"):
        table.add_column(column, justify="right" if column != "runtime" else "left")
    for name in rounds[0][0]:
        rates = [(updates / seconds, rollouts / seconds) for (seconds, updates, rollouts) in
                 (rows[name] for rows, _, _ in rounds)]
        ratios = [ratio[name] for _, ratio, _ in rounds]
        shares = [(r - 1) / (ratio["ideal"] - 1) for r, (_, ratio, _) in zip(ratios, rounds)]
        hidden = [round_hidden[name] for _, _, round_hidden in rounds
                  if not math.isnan(round_hidden.get(name, math.nan))]
        table.add_row(name, f"{statistics.median(u for u, _ in rates):.3f}",
                      f"{statistics.median(r for _, r in rates):.1f}", f"{statistics.median(ratios):.2f}x",
                      f"{min(ratios):.2f}-{max(ratios):.2f}x",
                      "" if name.startswith("sync, 1") else f"{statistics.median(shares):.0%}",
                      f"{statistics.median(hidden):.0%} ({min(hidden):.0%}-{max(hidden):.0%})" if hidden else "")
    ideals = [ratio["ideal"] for _, ratio, _ in rounds]
    table.caption = (f"fully overlapped, the slower synchronous phase alone allows {statistics.median(ideals):.2f}x "
                     f"({min(ideals):.2f}-{max(ideals):.2f}x); the possible gain is that less 1. Shorter role "
                     "hidden: from the async run's own seconds, (update + worker's batch - step) / the shorter of the two")
    return table


if __name__ == "__main__":
    main()
