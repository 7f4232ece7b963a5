"""How long a sweep's cells take on this machine: the wall-time estimate of a dry run's plan.

A cell's time is what it does once (load the model; for a past run also its evaluations), its steps, and its
held-out evaluations:

    seconds = once_s + trainer.steps * step_s + evaluations * evaluation_s

Two sources give the three figures, and the plan names which:
- the store's FINISHED runs of the same shape (`SHAPE`: the keys that set a step's and an evaluation's cost,
  read from the params every run logs): the median of their logged `time/step`, and their wall time outside
  the steps counted once;
- else, when the sweep asks (`hydra.sweeper.probe=true`, which the reproductions set), a probe here: the first
  cell of that shape built in this process and one training step timed; an evaluation costs its sequences at
  the probe's generate-and-score time a sequence.

The probe's first step has nothing to replay and generates every group; a replay cell's step generates its
B_fresh of B groups, and the plan takes off the rest of the probe's generating-and-scoring time. A past run's
steps are taken whole, whatever its ratio. A probe needs a one-process
synchronous cell on a device this machine has; other cells get no estimate, and a SLURM job's plan gives GPU-hours
from committed step benchmarks instead (src/study/slurm.py).
"""

from __future__ import annotations

import statistics
import sys
import time
from dataclasses import dataclass, field

from omegaconf import DictConfig, OmegaConf

from src.variant import described

# The keys that set what a step and an evaluation cost; seed, buffer, clip, loss and curriculum do not change
# the shape of the work (a replay cell generates less: see the module's docstring).
SHAPE = ("policy.name_or_path", "policy.engine", "policy.max_new_tokens", "policy.generation_batch_size",
         "trainer.groups_per_step", "trainer.group_size", "trainer.micro_batch_size", "trainer.micro_batch_tokens",
         "hardware.device", "hardware.dtype", "hardware.threads", "hardware.ranks", "runtime.name",
         "evaluation.prompts", "evaluation.samples_per_prompt", "evaluation.repeats")
PAST_RUNS = 5  # the newest finished runs of a shape that are read


@dataclass(frozen=True)
class Timing:
    """Where a cell's wall time goes, and what measured it."""

    once_s: float
    step_s: float  # a step that generates every group
    evaluation_s: float
    source: str
    generate_s: float = 0.0  # the part of step_s that generates and scores: a replay step does B_fresh/B of it

    def cell_seconds(self, cfg: DictConfig) -> float:
        return self.once_s + int(cfg.trainer.steps) * self.cell_step_s(cfg) + evaluations(cfg) * self.evaluation_s

    def cell_step_s(self, cfg: DictConfig) -> float:
        """A step of this cell: SPEC 3's B_fresh = round(B / (1 + rho)) of its B groups are generated."""
        from src.batch import plan_batch

        groups = int(cfg.trainer.groups_per_step)
        fresh, _ = plan_batch(groups, float(OmegaConf.select(cfg, "buffer.ratio", default=0.0) or 0.0))
        return self.step_s - self.generate_s * (1 - fresh / groups)


@dataclass
class PlanTimes:
    """Each launched job's estimate (its index in the plan), and the lines that say where they come from."""

    seconds: dict[int, float] = field(default_factory=dict)
    lines: list[str] = field(default_factory=list)


def evaluations(cfg: DictConfig) -> int:
    """Held-out evaluations a run makes: at the start if asked, every `evaluation.every` steps, and at the end."""
    steps, every = int(cfg.trainer.steps), int(cfg.evaluation.every)
    return int(bool(cfg.evaluation.at_start)) + (len(range(every, steps, every)) if every > 0 else 0) + 1


def shape(cfg: DictConfig) -> tuple[tuple[str, str], ...]:
    """The cell's shape as (key, value) pairs, values as MLflow params hold them."""
    from src.runs.naming import flat_params

    params = flat_params(cfg)
    return tuple((key, params[key]) for key in SHAPE if key in params)


def plan_times(planned: list, cfgs: list[DictConfig], uri: str, experiment: str, probe: bool) -> PlanTimes:
    """Estimates for the jobs the plan launches or resumes: one timing per shape, past runs first, else a probe
    if asked (`hydra.sweeper.probe=true`).

    A resumed job is counted in full (its remaining steps are known only once its checkpoint is read)."""
    times, timings, missing = PlanTimes(), {}, {}
    for index, cell in enumerate(planned):
        if cell.status not in ("launch", "resume"):
            continue
        key = shape(cfgs[index])
        if key not in timings:
            timings[key] = stored_timing(uri, experiment, key)
            if timings[key] is None:
                timings[key] = probe_timing(cfgs[index], cell.cell) if probe else NOT_PROBED
        timing = timings[key]
        if isinstance(timing, Timing):
            times.seconds[index] = timing.cell_seconds(cfgs[index])
        else:
            missing[timing] = missing.get(timing, 0) + 1
    used = [timing for timing in timings.values() if isinstance(timing, Timing)]
    replays = any(float(OmegaConf.select(cfgs[index], "buffer.ratio", default=0.0) or 0) > 0 for index in times.seconds)
    times.lines = summary_lines(times.seconds, used, missing, replays and any(not t.generate_s for t in used))
    return times


NOT_PROBED = ("no finished run of this shape in the store; hydra.sweeper.probe=true times one training step here "
              "(make ARGS=hydra.sweeper.probe=true)")


def summary_lines(seconds: dict[int, float], used: list[Timing], missing: dict[str, int], replays: bool) -> list[str]:
    lines = []
    if seconds:
        lines.append(f"estimated time on this machine: about {duration(sum(seconds.values()))} for "
                     f"{len(seconds)} job(s) one after another, as the local launcher runs them")
        lines += [f"  from {timing.source}" for timing in used]
        if replays:  # a past run's steps are not split into generation and the rest
            lines.append("  a replay cell is timed by past runs' steps, whatever their ratio: high if they "
                         "replayed less")
    lines += [f"no time estimate for {count} job(s): {why}" for why, count in missing.items()]
    return lines


def duration(seconds: float) -> str:
    """A plan's time as people say it: 45 s, 12 min, 2 h 05 min."""
    if seconds < 60:
        return f"{seconds:.0f} s"
    minutes = round(seconds / 60)
    return f"{minutes} min" if minutes < 60 else f"{minutes // 60} h {minutes % 60:02d} min"


# --------------------------------------------------------------------------- the store's past runs
def stored_timing(uri: str, experiment: str, key: tuple[tuple[str, str], ...]) -> Timing | None:
    """`past_timing`, or None when the store cannot be read: the plan is printed all the same."""
    try:
        return past_timing(uri, experiment, key)
    except Exception:  # noqa: BLE001  (an unreachable server must not hide the plan; known_runs says so)
        return None


def past_timing(uri: str, experiment: str, key: tuple[tuple[str, str], ...]) -> Timing | None:
    """The timing of the newest FINISHED runs of this shape in the store, or None (no such run, or no store)."""
    from mlflow.tracking import MlflowClient

    from src.runs import store  # noqa: F401  (MLflow's store logger quieted before the client opens a store)

    if any("'" in value for _, value in key):
        return None  # a value MLflow's filter cannot quote: no match rather than a wrong one
    client = MlflowClient(uri)
    found = client.get_experiment_by_name(experiment)
    if found is None:
        return None
    query = " and ".join(["attributes.status = 'FINISHED'", *(f"params.`{name}` = '{value}'" for name, value in key)])
    runs = client.search_runs([found.experiment_id], filter_string=query, max_results=PAST_RUNS,
                              order_by=["attributes.start_time DESC"])
    measured = [figures for figures in (_run_figures(client, run) for run in runs) if figures is not None]
    if not measured:
        return None
    step_s = statistics.median(step for step, _ in measured)
    once_s = statistics.median(once for _, once in measured)
    return Timing(once_s, step_s, 0.0, f"the store's {len(measured)} finished run(s) of this shape: median "
                  f"{step_s:.1f} s a step, {duration(once_s)} of loading and evaluations a run")


def _run_figures(client, run) -> tuple[float, float] | None:
    """(mean seconds a step, wall time outside the steps) of one finished run, or None if it logged no steps."""
    steps = [point.value for point in client.get_metric_history(run.info.run_id, "time/step")]
    if not steps or not run.info.end_time:
        return None
    wall = (run.info.end_time - run.info.start_time) / 1000
    return statistics.fmean(steps), max(0.0, wall - sum(steps))


# --------------------------------------------------------------------------- a probe here
def probe_refusal(cfg: DictConfig) -> str | None:
    """Why a probe in this process cannot time the cell, or None."""
    device = str(cfg.hardware.device)
    if int(cfg.hardware.ranks) != 1:
        return "a probe times one-process cells only (hardware.ranks > 1)"
    if not described(cfg.runtime).ranks_run_the_loop:  # its steps run in this process, which the probe times
        return f"a probe times the synchronous runtime only (runtime={cfg.runtime.name})"
    if cfg.policy.engine != "hf":
        return f"a probe times the transformers engine only (policy.engine={cfg.policy.engine})"
    if device.startswith("cuda"):
        import torch

        if not torch.cuda.is_available():
            return f"hardware.device={device} and this machine has no CUDA GPU"
    return None


def probe_timing(cfg: DictConfig, cell: str) -> Timing | str:
    """One training step of the cell, timed here; or why it cannot be (the plan's line for such cells)."""
    refusal = probe_refusal(cfg)
    if refusal:
        return refusal
    from src.build import build_components
    from src.runs.progress import silence_library_bars
    from src.settings import RunSettings
    from src.batch import TrainState
    from src.task.base import build_task
    from src.train import train_step

    print(f"timing one training step of {cell} here for the plan's time estimate (no finished run of its shape "
          "in the store)", file=sys.stderr, flush=True)
    silence_library_bars()
    started = time.perf_counter()
    run = RunSettings(cfg)
    task = build_task(run.groups["task"])
    parts = build_components(run, task.splits()[0], task=task)
    loaded_s = time.perf_counter() - started
    metrics = train_step(parts, TrainState())
    generated = metrics.get("time/generate", 0.0) + metrics.get("time/score", 0.0)
    per_sequence = generated / max(1.0, metrics["budget/fresh_evaluations"])
    sequences = int(cfg.evaluation.prompts) * int(cfg.evaluation.samples_per_prompt) * int(cfg.evaluation.repeats)
    return Timing(loaded_s, metrics["time/step"], per_sequence * sequences,
                  f"a probe here: {cell}'s model built in {duration(loaded_s)} and one step timed at "
                  f"{metrics['time/step']:.1f} s ({generated:.1f} s generating and scoring, which a replay step "
                  f"does for its fresh groups only); an evaluation's {sequences:,} sequences at "
                  f"{per_sequence * 1000:.0f} ms a sequence", generated)
