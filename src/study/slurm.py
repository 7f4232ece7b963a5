"""A sweep sent to SLURM, from the submitting machine: is SLURM there, what each job asks for, and how many
GPU-hours the sweep will take (from the committed step-time benchmark, `benchmarks/results/gpu_step_*.json`).

Nothing here needs SLURM installed, so the dry run (`hydra.sweeper.dry_run=true`) works on a laptop.
"""

from __future__ import annotations

import json
import math
import shutil
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from omegaconf import DictConfig, OmegaConf

from src.paths import PROJECT_ROOT
from src.variant import described

SLURM_COMMANDS = ("sbatch", "srun")  # submitit submits with sbatch and starts each task with srun
RESULTS_DIR = PROJECT_ROOT / "benchmarks" / "results"
SITE_HINT = "on the command line or in conf/local/<site>.yaml (launch/site-example.yaml)"


def uses_slurm(config: DictConfig) -> bool:
    """True when the sweep's launcher is submitit's SLURM launcher (`hardware=h100`, `hydra/launcher=submitit_slurm`)."""
    return str(OmegaConf.select(config, "hydra.launcher._target_", default="") or "").endswith("SlurmLauncher")


def missing_slurm(config: DictConfig, which=None) -> str | None:
    """The one-line refusal when the launcher is SLURM's but sbatch or srun is not on this machine; else None."""
    which = which or shutil.which  # looked up at the call, so a test's patched shutil.which applies
    missing = [command for command in SLURM_COMMANDS if which(command) is None]
    if not uses_slurm(config) or not missing:
        return None
    choices = OmegaConf.select(config, "hydra.runtime.choices", default=None) or {}
    hardware = choices.get("hardware", "cpu")
    chosen = (f"hardware={hardware} (hydra/launcher={choices.get('hydra/launcher', 'submitit_slurm')})"
              if hardware != "cpu" else f"hydra/launcher={choices.get('hydra/launcher', 'submitit_slurm')}")
    return (f"{chosen} sends each cell to SLURM, but {' and '.join(missing)} "
            f"{'is' if len(missing) == 1 else 'are'} not on this machine's PATH. Submit from a SLURM login node, "
            "or add hydra/launcher=basic to run the cells one after the other on this machine's GPU "
            "(hydra.sweeper.dry_run=true prints the plan without SLURM)")


def gpus_per_job(launcher: DictConfig) -> int:
    per_node = launcher.get("gpus_per_node") or (launcher.get("gpus_per_task") or 0) * launcher.get("tasks_per_node", 1)
    return int(per_node or 0) * nodes_per_job(launcher)


def nodes_per_job(launcher: DictConfig) -> int:
    """The nodes a job asks for (`hydra.launcher.nodes`, which `hardware.nodes` sets)."""
    return int(launcher.get("nodes", 1) or 1)


def job_request(launcher: DictConfig) -> str:
    """What sbatch is asked for per job: nodes, tasks, GPUs, CPUs, memory, time, partition, account, qos."""
    tasks = int(launcher.get("tasks_per_node", 1) or 1)
    cpus = (launcher.get("cpus_per_task") or 0) * tasks
    memory = (f"{launcher.mem_gb} GB" if launcher.get("mem_gb") else f"{launcher.mem_per_gpu} per GPU"
              if launcher.get("mem_per_gpu") else "the partition's default memory")
    where = ", ".join(f"{key} {launcher.get(key) or '(unset)'}" for key in ("partition", "account", "qos", "constraint"))
    hours, minutes = divmod(int(launcher.timeout_min), 60)
    nodes = nodes_per_job(launcher)
    if nodes > 1:  # sbatch's tasks, CPUs and memory are a node's
        return (f"{nodes} nodes x {tasks} task{'s' if tasks > 1 else ''}, {gpus_per_job(launcher)} GPUs in all, "
                f"{cpus or 'default'} CPUs and {memory} a node, {launcher.timeout_min} min ({hours}:{minutes:02d}:00), {where}")
    return (f"1 node x {tasks} task, {gpus_per_job(launcher)} GPU, "
            f"{cpus or 'default'} CPUs, {memory}, {launcher.timeout_min} min ({hours}:{minutes:02d}:00), {where}")


def request_warnings(launcher: DictConfig) -> list[str]:
    """Settings sbatch falls back on the cluster's defaults for, which is rarely what a study wants."""
    warnings = []
    if not launcher.get("partition"):
        warnings.append(f"hydra.launcher.partition is unset: sbatch uses the cluster's default partition; set it "
                        f"{SITE_HINT}")
    if not launcher.get("account"):
        warnings.append(f"hydra.launcher.account is unset: sbatch charges your default account; set it {SITE_HINT}")
    return warnings


@dataclass(frozen=True)
class StepBenchmark:
    """Measured seconds per training step at some replay ratios, for one (B, K, response length, GPU)."""

    path: Path
    device: str
    rhos: tuple[float, ...]
    step_s: tuple[float, ...]

    def seconds(self, rho: float) -> float:
        """Step time at `rho`: interpolated between the measured ratios, the nearest one's outside them."""
        return float(np.interp(rho, self.rhos, self.step_s))


def benchmark_key(cfg: DictConfig) -> tuple[int, int, int, str]:
    return (int(cfg.trainer.groups_per_step), int(cfg.trainer.group_size), int(cfg.policy.max_new_tokens),
            str(cfg.hardware.name))


def find_step_benchmark(cfg: DictConfig, results: Path = RESULTS_DIR) -> StepBenchmark | None:
    """The committed measurement of this cell's step: same B, K and response length, on the hardware's GPU."""
    groups, group_size, tokens, hardware = benchmark_key(cfg)
    for path in sorted(results.glob("gpu_step_*.json")) if results.is_dir() else []:
        try:
            found = json.loads(path.read_text())
            args, rows = found["args"], sorted(found["rows"], key=lambda row: row["rho"])
            same = (int(args["groups"]), int(args["group_size"]), int(args["response_tokens"])) == (
                groups, group_size, tokens)
            if same and hardware.lower() in str(found["device"]).lower() and rows:
                return StepBenchmark(path, str(found["device"]), tuple(float(row["rho"]) for row in rows),
                                     tuple(float(row["step_s"]) for row in rows))
        except (OSError, ValueError, KeyError, TypeError):
            continue  # not a step benchmark of this format
    return None


def gpu_hour_lines(cfgs: list[DictConfig], launcher: DictConfig, results: Path = RESULTS_DIR) -> list[str]:
    """The sweep's GPU-hours from the step benchmark (training steps only), and warnings on the time limit."""
    gpus, nodes = gpus_per_job(launcher), nodes_per_job(launcher)
    on_nodes = f" ({nodes} nodes)" if nodes > 1 else ""
    if not cfgs:
        return ["GPU-hours: 0 (nothing to launch)"]
    if gpus == 0:
        return ["GPU-hours: 0 (the jobs ask for no GPU)"]
    hours, used, missing, longest = 0.0, set(), set(), 0.0
    for cfg in cfgs:
        benchmark = find_step_benchmark(cfg, results)
        if benchmark is None:
            missing.add(benchmark_key(cfg))
            continue
        used.add(benchmark)
        job_s = int(cfg.trainer.steps) * benchmark.seconds(float(OmegaConf.select(cfg, "buffer.ratio", default=0.0)))
        hours, longest = hours + job_s * gpus / 3600, max(longest, job_s)
    lines = []
    if used:
        lines.append(f"GPU-hours: about {hours:,.1f} for {len(cfgs) - sum(_count(cfgs, key) for key in missing)} "
                     f"job(s) x {gpus} GPU{on_nodes}: steps x step time from {'; '.join(map(describe, sorted(used, key=lambda found: found.path)))}; "
                     "training steps only, not evaluations or model loading; resumed cells counted in full")
        limit_s = float(launcher.timeout_min) * 60
        if longest > limit_s:
            lines.append(f"warning: the longest job needs about {longest / 3600:.1f} h of steps, over "
                         f"hydra.launcher.timeout_min={launcher.timeout_min}: it is requeued at the limit and resumes "
                         f"from its checkpoint, at most hydra.launcher.max_num_timeout="
                         f"{launcher.get('max_num_timeout', 0)} times")
    for groups, group_size, tokens, hardware in sorted(missing):
        lines.append(f"GPU-hours: no benchmark committed for B={groups}, K={group_size}, {tokens}-token responses "
                     f"on hardware={hardware} ({_count(cfgs, (groups, group_size, tokens, hardware))} job(s)); "
                     "`make bench-gpu` on a GPU node measures one into benchmarks/results/")
    return lines


def describe(benchmark: StepBenchmark) -> str:
    """Which file gave the step times, and how the cells' ratios were read off it."""
    path = benchmark.path
    name = path.relative_to(PROJECT_ROOT) if path.is_relative_to(PROJECT_ROOT) else path
    measured = ", ".join(f"{rho:g}" for rho in benchmark.rhos)
    how = (f"measured at rho={measured} only, every cell counted at that step time (replay steps are shorter: an "
           "overestimate)" if len(benchmark.rhos) == 1 else f"measured at rho={measured}, interpolated in between")
    return f"{name} ({benchmark.device}; {how})"


def _count(cfgs: list[DictConfig], key: tuple[int, int, int, str]) -> int:
    return sum(benchmark_key(cfg) == key for cfg in cfgs)


# The hardware options with their trainer ranks, the fix a refused job is told about (conf/hardware).
RANKED_HARDWARE = {1: "hardware=h100", 4: "hardware=h100x4", 8: "hardware=h100x8 hardware.ranks=8"}


def engine_share(cfg: DictConfig):
    """The vLLM engine beside each trainer rank on its GPU (`src.distributed.memory.EngineShare`), or None: the
    transformers engine samples with the trainer's own weights, and runtime=async's engines sit on the workers' GPUs."""
    from src.distributed.memory import EngineShare

    beside = described(cfg.runtime).ranks_run_the_loop  # each rank's loop samples with its own engine
    if cfg.policy.engine != "vllm" or not beside or not str(cfg.hardware.device).startswith("cuda"):
        return None
    return EngineShare(float(cfg.policy.vllm.gpu_memory_utilization), bool(cfg.policy.vllm.get("sleep", False)),
                       int(cfg.policy.vllm.get("tensor_parallel_size", 1)), bool(cfg.policy.vllm.get("enforce_eager")))


def gpus_needed(cfg: DictConfig) -> int:
    """The GPUs a cell occupies: one a rank, and under runtime=async its workers' Ray slots beside the trainer's."""
    ranks = int(cfg.hardware.get("ranks", 1) or 1)
    nodes = int(cfg.hardware.get("nodes", 1) or 1)
    return described(cfg.runtime).gpus_needed(cfg.runtime, ranks, str(cfg.hardware.device), nodes)


def memory_refusal(cfg: DictConfig, launcher: DictConfig, hardware: str) -> str | None:
    """One line naming the policy, the hardware and the fix when the job cannot train the cell's policy: more
    GPUs than the job's, or a memory plan (src/distributed/memory.py) that does not fit its ranks' GPUs (training,
    and generation beside it) or the host memory the job asks for (`mem_gb`)."""
    from src.distributed.memory import (ASLEEP_GIB, H100_GIB, SHAPES, Cell, best_fit, cell_fix, describe,  # torch
                                        fewest_gpus, generation_plan, peak_gib, policy_shape)
    from src.runs.ranks import processes

    ranks, gpus, name = int(cfg.hardware.get("ranks", 1) or 1), gpus_per_job(launcher), cfg.policy.name_or_path
    nodes = nodes_per_job(launcher)
    tasks, wanted = int(launcher.get("tasks_per_node", 1) or 1), processes(ranks, cfg.runtime, nodes)
    if tasks * nodes != wanted:
        spread = f" on hydra.launcher.nodes={nodes}" if nodes > 1 else ""
        fix = f"{wanted // nodes}" if wanted % nodes == 0 else f"{wanted} and hydra.launcher.nodes=1"
        return (f"hydra.launcher.tasks_per_node={tasks}{spread} with runtime={cfg.runtime.get('name')} and "
                f"hardware.ranks={ranks}: the cell runs {wanted} process(es) (runtime=async: one driver, its "
                f"trainer ranks are Ray actors, and a task on each further node); set "
                f"hydra.launcher.tasks_per_node={fix}")
    if gpus and ranks > gpus:
        more = (f", or hardware.nodes={math.ceil(ranks / (gpus // nodes))} to span more nodes"
                if described(cfg.runtime).ranks_run_the_loop and ranks % (gpus // nodes) == 0 else "")
        return (f"hardware.ranks={ranks} on hardware={hardware}: the job asks for {gpus} GPU(s), one a rank; "
                f"set hardware.ranks={gpus}{more}, or use a hardware option with more GPUs")
    if gpus and gpus_needed(cfg) > gpus:
        return (f"runtime.workers={cfg.runtime.workers} x runtime.gpus_per_worker={cfg.runtime.gpus_per_worker:g} "
                f"and {ranks} trainer rank(s) beside them on hardware={hardware}: {gpus_needed(cfg)} GPUs, the job "
                f"asks for {gpus}; run fewer workers, or set runtime.gpus_per_worker=0.5 to pack two on a GPU")
    if not (SHAPES / f"{name.replace('/', '__')}.json").is_file():
        return None  # the tiny policy or a local folder: no plan
    engine, shape, cell = engine_share(cfg), policy_shape(name), Cell.of(cfg)
    room = engine.training_gib(H100_GIB) if engine else H100_GIB
    fit = best_fit(shape, ranks, room, cell)
    _, fewest = fewest_gpus(name, H100_GIB - ASLEEP_GIB if engine else H100_GIB)  # the node presets' engines sleep
    on = f"policy.name_or_path={name} on hardware={hardware} (hardware.ranks={ranks})"
    beside = (f", beside vLLM's share (policy.vllm.gpu_memory_utilization={engine.share:g})"
              if engine and not engine.sleep else "")
    if fit.micro_batch_tokens is None:
        fix = next((option for count, option in RANKED_HARDWARE.items() if fewest and count >= fewest), None)
        return (f"{on}: needs {fit.peak_gib:.0f} GiB per GPU at the smallest micro-batch with activation "
                f"checkpointing{beside}, an H100 holds {H100_GIB:g}; "
                + (f"FSDP over {fewest} GPUs fits: use {fix}" if fix else "no plan of up to 8 GPUs fits"))
    if peak_gib(shape, ranks, cell) > room:
        return (f"{on}: the update needs {peak_gib(shape, ranks, cell):.1f} GiB per GPU at {describe(cell)}, "
                f"{room:.1f} GiB is left for it{beside}; set {cell_fix(shape, ranks, cell, room)}")
    if engine is not None:
        problem = generation_plan(shape, ranks, engine, cell).problem(H100_GIB)
        if problem:
            return f"{on}: {problem}"
    return host_refusal(on, name, ranks, launcher, engine, nodes)


def host_refusal(on: str, name: str, ranks: int, launcher: DictConfig, engine=None, nodes: int = 1) -> str | None:
    """The refusal when a node's ranks (`ranks` over `nodes`), each loading the whole fp32 policy at once (and a
    sleeping engine's pinned weights after it), need more than `mem_gb` (sbatch's memory, a node's)."""
    from src.distributed.memory import host_gib, policy_shape

    host, asked = host_gib(policy_shape(name), ranks // nodes, engine), launcher.get("mem_gb")
    where = "in all" if nodes == 1 else f"a node for its {ranks // nodes} ranks"
    if asked and host > float(asked):
        return (f"{on}: each rank loads the whole policy in fp32 on the host before sharding it, {math.ceil(host)} "
                f"GiB {where}, and the job asks for hydra.launcher.mem_gb={asked}; raise hydra.launcher.mem_gb to at "
                f"least {math.ceil(host)}")
    return None


def slurm_plan_lines(config: DictConfig, cfgs: list[DictConfig], results: Path = RESULTS_DIR) -> list[str]:
    """What a SLURM sweep will ask for: each job's request, warnings on unset site settings, the memory plan of
    the large policies (src/distributed/memory.py), the GPU-hours."""
    from src.distributed.memory import Cell, job_plan_lines  # builds models on the meta device: transformers, lazily

    launcher = config.hydra.launcher
    lines = [f"SLURM: {len(cfgs)} job(s) to launch, {launcher.get('array_parallelism', '?')} at a time; each "
             f"asks for {job_request(launcher)}"]
    lines += [f"warning: {warning}" for warning in request_warnings(launcher)]
    plans: dict[tuple, list[str]] = {}  # FSDP shards over the ranks; each rank's vLLM engine takes its share
    for cfg in cfgs:  # each cell's own micro-batch, checkpointing, head, dtype and vLLM context
        key = (int(cfg.hardware.get("ranks", 1) or 1), engine_share(cfg), Cell.of(cfg))
        plans.setdefault(key, []).append(cfg.policy.name_or_path)
    nodes = nodes_per_job(launcher)
    for (ranks, engine, cell), names in sorted(plans.items(), key=lambda item: (item[0][0], str(item[0][1:]))):
        lines += job_plan_lines(names, ranks, engine, cell, nodes)
    return lines + gpu_hour_lines(cfgs, launcher, results)
