"""One run over torchrun's ranks (`hardware.ranks` > 1, `runtime=sync`): what each rank does beside the step.

    torchrun --standalone --nproc_per_node 2 -m src.run hardware.ranks=2 ...
    python -m src.run -m hardware=h100x4 ...     # SLURM: one task a rank (submitit's tasks_per_node)
    python -m src.run -m hardware=h100x8 hardware.nodes=2 hardware.ranks=16 ...   # SLURM: 2 nodes of 8 tasks

Every rank runs the whole step: it samples the same prompts and holds the same rollouts (the generation
seed comes from (seed, step)): a vLLM engine on each rank samples its share of them and the shares are
gathered (`src.distributed.generation`), transformers `generate` samples them all on every rank with the
sharded policy, in lockstep. Each rank then trains its share of the batch (`src.distributed.data_parallel`),
so every rank holds the step's numbers.
Rank 0 alone talks to MLflow, claims the cell, writes the heartbeat, the run's small state and the final
policy; what the others must know of its answers (which run, which checkpoint, whether a metric is
logged already, whether a stop came) it broadcasts. The policy and optimizer are checkpointed by every
rank as DCP shards (`src.distributed.checkpoint`), which any number of ranks, one included, reads back.
One process (`hardware.ranks=1`, no torchrun) goes through the same calls, which then do only their
one-process part. `src.run` reaches the ranks only through its runtime (`src.runtime.base.Runtime`: `joined`,
`lead_only`, `place`, `save`, ...), which holds this process's `Ranks`.
"""

from __future__ import annotations

import contextlib
import os
import shutil
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist

from src.distributed.group import group_options
from src.variant import described

SHARDS = "shards"  # a run folder's DCP checkpoints, one folder a step: shards/step-000010


@dataclass(frozen=True)
class Ranks:
    """This process's place among the run's ranks (torchrun's WORLD_SIZE, RANK, LOCAL_RANK)."""

    world: int = 1
    rank: int = 0
    local: int = 0
    ranked: bool = False  # `hardware.ranked`: one process on the ranked path, in a process group of one

    @property
    def lead(self) -> bool:
        return self.rank == 0

    @property
    def many(self) -> bool:
        """Whether the ranked path runs: several ranks, or one by `hardware.ranked` (a group and a mesh of one)."""
        return self.world > 1 or self.ranked

    def share(self, value=None):
        """Rank 0's `value` on every rank (pickled between the ranks of one job: trusted peers)."""
        if not self.many:
            return value
        box = [value if self.lead else None]
        dist.broadcast_object_list(box, src=0)
        return box[0]

    def most(self, value: int) -> int:
        """The largest of the ranks' `value`s (e.g. a stop signal that reached only some ranks yet)."""
        if not self.many:
            return value
        reduced = torch.tensor(int(value), dtype=torch.int64)
        dist.all_reduce(reduced, op=dist.ReduceOp.MAX)
        return int(reduced.item())

    def barrier(self) -> None:
        if self.many:
            dist.barrier()

    def lead_only(self, work, *args, **kwargs):
        """`work(*args, **kwargs)` on rank 0, its result (or the exception it raised) on every rank."""
        result, error = None, None
        if self.lead:
            try:
                result = work(*args, **kwargs)
            except Exception as raised:  # noqa: BLE001  (every rank raises it below)
                error = raised
        result, error = self.share((result, error))
        if error is not None:
            raise error
        return result

    # ---- what src.run asks of the ranks, whatever their number (in one process each call does its plain part)
    def leave(self, finished: bool) -> None:
        """Leave torchrun's process group (`finished`: the run ended normally)."""
        if self.many and dist.is_initialized():
            from src.distributed.data_parallel import leave_group

            leave_group(finished)

    def shard(self, parts):
        """`parts` trained data-parallel over the ranks (FSDP2), or as they are in one process."""
        if not self.many:
            return parts
        from src.build import data_parallel

        return data_parallel(parts)

    def restore(self, payload: dict, parts):
        """`restore_checkpoint` into `parts`, whose policy is sharded over several ranks (a one-process
        checkpoint's whole weights included: each rank keeps its slices); returns the run's TrainState."""
        from src.runs.checkpoint import restore_checkpoint

        return restore_checkpoint(payload, parts, sharded=self.many)

    def lead_context(self, context, elsewhere=None):
        """`context` entered on rank 0 only (the MLflow run, the heartbeat); `elsewhere` on the other ranks."""
        return context if self.lead else contextlib.nullcontext(elsewhere)

    @contextlib.contextmanager
    def tracking(self, opened):
        """Rank 0's MLflow run (`opened`, a context giving its Tracker) as every rank's tracker."""
        with self.lead_context(opened) as tracker:
            yield RankTracker(tracker, self) if self.many else tracker

    def save(self, folder: Path, parts, step: int, write) -> None:
        """A checkpoint at `step`: over several ranks each writes its DCP shards first; rank 0 then writes the
        checkpoint file (`write(shards)`, shards None in one process, whose file holds them whole) and drops
        older shards; no rank goes on before the file is written."""
        shards = None
        if self.many:
            from src.distributed.checkpoint import save_sharded

            shards = folder / SHARDS / f"step-{step:06d}"
            save_sharded(shards, parts.policy, parts.optimizer)
            self.barrier()  # every rank's shards are on disk before rank 0's checkpoint file points at them
        if self.lead:
            write(shards)
            prune_shards(folder, step)
        self.barrier()

    def gathered_state(self, policy) -> dict | None:
        """The whole policy's weights (every rank calls it under FSDP); None in one process, which holds them."""
        if not self.many:
            return None
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

        return get_model_state_dict(policy, options=StateDictOptions(full_state_dict=True, cpu_offload=True))


def processes(ranks: int | None, runtime, nodes: int = 1) -> int:
    """How many processes run the cell: `hardware.ranks` under runtime=sync (torchrun's, or SLURM's tasks); under
    runtime=async (the runtime group's node) one driver, whose trainer ranks are Ray actors
    (src/runtime/ray_work.py), and one task for each further node of its Ray cluster."""
    return described(runtime).processes(runtime, ranks, nodes)  # src.runtime.base.Runtime.processes


def mismatch(want: int, world: int) -> str | None:
    """The one-line refusal when the run's `want` processes are not the ones torchrun started; else None."""
    if want == world:
        return None
    if world == 1:
        return (f"hardware.ranks={want} but this process was not started by torchrun (WORLD_SIZE unset): launch "
                f"`torchrun --standalone --nproc_per_node {want} -m src.run ...`, or set hardware.ranks=1")
    return (f"hardware.ranks={want} but torchrun started {world} processes (WORLD_SIZE={world}): set "
            f"hardware.ranks={world}, or start torchrun with --nproc_per_node {want}")


def node_mismatch(nodes: int, world: int, local: int | None) -> str | None:
    """The one-line refusal when the ranks span other than `nodes` nodes (`hardware.nodes`): each node runs
    LOCAL_WORLD_SIZE of the WORLD_SIZE ranks (torchrun and submitit's export set both); None when they agree or
    the launcher did not say."""
    if local is None or local < 1 or world // local == nodes:
        return None
    return (f"hardware.nodes={nodes} but the {world} ranks run {local} a node, on {world // local} node(s) "
            f"(WORLD_SIZE={world}, LOCAL_WORLD_SIZE={local}): set hardware.nodes={world // local}, or start "
            f"{nodes} node(s) of {world // nodes} rank(s) (SLURM: hydra.launcher.nodes; torchrun --nnodes {nodes} "
            f"--nproc_per_node {world // nodes})")


def join(want: int, device: str, error=ValueError, ranked: bool = False, nodes: int = 1) -> Ranks:
    """Join torchrun's process group (gloo on the CPU; on GPUs NCCL for CUDA tensors and gloo for CPU ones, each
    rank on GPU LOCAL_RANK: `src.distributed.group`); `error`
    with one line when the run's `want` processes (`processes`) over `nodes` nodes are not the ones torchrun or
    SLURM started. One process makes no group unless `ranked` (`hardware.ranked`) asks for the ranked path in a
    group of one."""
    export_slurm_tasks()
    world = int(os.environ.get("WORLD_SIZE", "1"))
    local = os.environ.get("LOCAL_WORLD_SIZE")
    problem = mismatch(want, world) or node_mismatch(nodes, world, int(local) if local else None)
    if problem:
        raise error(problem)
    if ranked and "RANK" not in os.environ:
        raise error("hardware.ranked=true but this process was not started by torchrun (RANK unset): launch "
                    "`torchrun --standalone --nproc_per_node 1 -m src.run ... hardware.ranked=true`")
    if world == 1 and not ranked:
        own_store()
        return Ranks()
    ranks = Ranks(world, int(os.environ["RANK"]), int(os.environ.get("LOCAL_RANK", "0")), ranked=ranked)
    if not dist.is_initialized():
        if str(device).startswith("cuda"):
            torch.cuda.set_device(ranks.local)
        dist.init_process_group(**group_options(device, ranks.local))
    return ranks


def own_store() -> None:
    """One process under torchrun (`--nproc_per_node 1`) makes no group of ours, but a colocated vLLM 0.26 makes its
    own over `tcp://<host ip>:<free port>` (vllm/v1/executor/uniproc_executor.py:73). torchrun sets
    TORCHELASTIC_USE_AGENT_STORE=True, and with it every rank of any tcp:// group is a client of a store the agent
    is assumed to host at that address (torch/distributed/rendezvous.py, `_create_c10d_store`): nobody hosts
    vLLM's, so the engine would wait out the store's ten-minute timeout (benchmarks/results/README.md, 2026-11-30).
    The agent's store serves only the groups torchrun's own address names, none here: the process hosts its own."""
    os.environ.pop("TORCHELASTIC_USE_AGENT_STORE", None)


@contextlib.contextmanager
def joined(want: int, device: str, error=ValueError, ranked: bool = False, nodes: int = 1):
    """`join` for the length of a run: the ranks leave the group when it ends, as it ended."""
    ranks = join(want, device, error, ranked, nodes)
    try:
        yield ranks
    except BaseException:
        ranks.leave(finished=False)
        raise
    ranks.leave(finished=True)


def export_slurm_tasks() -> None:
    """In a SLURM job submitit started with several tasks (hydra.launcher.tasks_per_node = hardware.ranks), the
    variables torchrun would set (MASTER_ADDR, MASTER_PORT, RANK, WORLD_SIZE, LOCAL_RANK), from SLURM's."""
    if "WORLD_SIZE" in os.environ or os.environ.get("SUBMITIT_EXECUTOR") != "slurm":
        return
    from submitit import JobEnvironment
    from submitit.helpers import TorchDistributedEnvironment

    if JobEnvironment().num_tasks > 1:
        # A site's job script often fixes MASTER_PORT (submitit takes its port from it: `_get_master_port` in
        # submitit/helpers.py), and `export` refuses to set any variable already there unless told to overwrite;
        # WORLD_SIZE unset (above) means no launcher set the others, so they are rewritten with the same meaning.
        TorchDistributedEnvironment().export(set_cuda_visible_devices=False, overwrite=True)  # GPU LOCAL_RANK


class RankTracker:
    """Rank 0's MLflow tracker on every rank: rank 0 writes, the others skip the writes and get rank 0's reads."""

    def __init__(self, tracker, ranks: Ranks) -> None:
        self.tracker, self.ranks = tracker, ranks
        self.run_id = ranks.share(tracker.run_id if ranks.lead else None)

    @property
    def redone_mismatches(self) -> list[str]:
        return self.tracker.redone_mismatches if self.ranks.lead else []

    def has_metric_at(self, key: str, step: int) -> bool:
        return self.ranks.share(self.tracker.has_metric_at(key, step) if self.ranks.lead else None)

    def __getattr__(self, name):  # log_step, log_evaluation, log_completions, log_summary, set_tags
        return getattr(self.tracker, name) if self.ranks.lead else (lambda *args, **kwargs: None)


class NoHeartbeat:
    """The heartbeat of a rank other than 0: rank 0 beats for the run."""

    def beat_for(self, run_id: str) -> None:
        return None


def prune_shards(folder: Path, step: int) -> None:
    """Keep the shards of the two newest checkpoints up to `step` (the file's two generations point at them);
    remove older ones (rank 0, after a checkpoint). Newer ones, left by a run that died before its checkpoint
    file pointed at them, are rewritten when the run gets there again."""
    done = sorted(path for path in (folder / SHARDS).glob("step-*") if int(path.name.split("-")[1]) <= step)
    for path in done[:-2]:
        shutil.rmtree(path, ignore_errors=True)
