"""Cells of a study: their identity, which are finished in MLflow, and the launch plan.

A cell is identified by its resolved config minus the keys that only say how or where it
runs (`LAUNCH_ONLY`). A fresh-only cell (rho = 0) has no buffer and every weight is 1, so
its buffer and clip settings are dropped too: the ratio study's rho = 0 baseline and the
baseline study's `buffer=none` run are the same cell, and run once. A local policy folder adds
the hash of its weights, so rebuilding the warm start (`make sft-tiny`) never reuses results
trained from the old one. The identity is stored on
every run as the tag `cell_id`, and the newest run of a cell decides what happens to it
(`src.runs.cells.cell_runs`): the sweeper (`hydra_plugins/replay_rloo_sweeper`) skips a cell whose newest run
FINISHED and launches each remaining identity once; a job whose cell's newest run FAILED or was
KILLED (or a requeued SLURM job) resumes from that run's checkpoint into the same MLflow run
(`src.runs.resume`, `trainer.auto_resume`); a cell with a live run elsewhere is left to it (`src.runs.claim`).
"""

from __future__ import annotations

import functools
import hashlib
import json
from dataclasses import dataclass
from pathlib import Path

from mlflow.tracking import MlflowClient
from omegaconf import DictConfig, OmegaConf

from src.study.budget import budget_is_floor, plan_for_config
from src.buffer.store import ReplayStore
from src.task.base import task_class
from src.runs.cells import CellRuns
from src.paths import resolve_policy_path
from src.validate.schema import knobs_for
from src.variant import described

# Keys that change how a cell is launched or logged, never what it computes.
LAUNCH_ONLY = (
    "hydra",
    "out",  # where the store and run folders are: the same numbers anywhere
    "tracking",
    "hardware.threads",
    "hardware.name",
    "hardware.ranks",  # data-parallel ranks: the same numbers as one process (src/runs/ranks.py)
    "hardware.nodes",  # the nodes those ranks span: the same numbers (tests/e2e/test_run_ranks.py)
    "hardware.activation_checkpointing",  # each layer's forward again in backward: the same numbers, less memory
    "hardware.ranked",  # one process on the ranked path: the one-process numbers (tests/e2e/test_run_ranks.py)
    "policy.vllm.sleep",  # frees the engine's GPU memory between generations: the same engine when awake
    "policy.vllm.tensor_parallel_size",  # one engine over several GPUs: one engine's samples (tests/e2e/test_vllm_ranks.py)
    "trainer.resume_from",
    "trainer.auto_resume",
    "trainer.rerun",  # train a finished cell again: a new run of the same cell
    "trainer.extend",  # continue the cell's shorter finished run: the steps it trains are the same steps
    "trainer.checkpoint_every",
    "trainer.fused_logprobs",  # the same log-probs to fp32 rounding, computed with less memory
    "trainer.pack_rows",  # the same log-probs to float rounding, without padding
    "trainer.compile",  # the same log-probs to float rounding, from compiled kernels
    "trainer.heartbeat_every_s",
    "trainer.heartbeat_timeout_s",
    "buffer.mechanism_only",  # lifts a config check only: the same computation
    "sampling.mechanism_only",
    "runtime.num_cpus", "runtime.worker_threads", "runtime.max_restarts", "runtime.gpus_per_worker",  # where the async pipeline runs
    "runtime.address",  # a Ray cluster over several nodes instead of this node's own session: the same pipeline
)


# Variant groups that suffix a cell's name, in this order; at a plain setting each leaves the identity (rule 3).
SUFFIX_GROUPS = ("sampling", "behaviour", "curriculum", "runtime")



def cell_name(cfg: DictConfig) -> str:
    """The grid cell as text, e.g. 'rho1-L2-c1' (fresh-only runs: 'rho0'), with the variant groups as suffixes.

    Each component names its own part (`src.variant.Variant.cell_label`): the store, then the loss, or
    the clip ceiling where the loss reads it and something is replayed, then '-dapo', '-stale4', ...
    """
    store, objective = described(cfg.buffer, ReplayStore), described(cfg.loss)
    loss = objective.cell_label(cfg.loss, cfg)
    given = described(cfg.runtime).store_label(cfg.runtime, cfg)  # the runtime's, where it names the store
    named = given is None and not store.fresh_only(cfg.buffer)
    clip = f"-c{cfg.clip.ceiling:g}" if _reads_clip(objective) and named else ""
    suffixes = "".join(described(cfg.get(group)).cell_label(cfg.get(group), cfg) for group in SUFFIX_GROUPS)
    label = store.cell_label(cfg.buffer, cfg) if given is None else given
    return label + (loss or clip) + suffixes + task_class(cfg.get("task")).cell_suffix


def variant_label(cfg: DictConfig) -> str:
    """A reader's name for what the cell runs, e.g. 'Replay-RLOO', 'POPO (GRPO loss)', 'Fresh-only + DAPO dynamic sampling'."""
    store, given = described(cfg.buffer, ReplayStore), described(cfg.runtime).store_label(cfg.runtime, cfg, reader=True)
    parts = [(store.reader_label(cfg.buffer, cfg) if given is None else given)
             + described(cfg.loss).reader_label(cfg.loss, cfg)]
    for group in SUFFIX_GROUPS:
        parts.append(described(cfg.get(group)).reader_label(cfg.get(group), cfg))
    parts.append(task_class(cfg.get("task")).reader_name)
    return " + ".join(part for part in parts if part)


def _reads_clip(objective: type) -> bool:
    return getattr(objective, "reads_clip", False)  # a loss class that is not an `Objective` reads no clip


# The identity rules below are version 1. A change to them that would give an existing cell another id
# must raise the version, which then enters the hash: every cell of version 1 keeps its id, and
# tests/unit/test_cell_identity.py lists the ids that must survive.
CELL_ID_VERSION = 1


def cell_identity(cfg: DictConfig) -> str:
    """A short stable hash of the config that decides the cell's results (rules of `CELL_ID_VERSION`).

    1. The resolved config, without `_target_` keys (which class implements a group is code, not the
       cell) and without the launch-only keys (`LAUNCH_ONLY`). The training seed is part of it: each
       (cell, seed) is its own job.
    2. Fresh-only (a store whose settings replay nothing, `ReplayStore.fresh_only`: rho = 0 with the age
       buffer, or buffer=none): no buffer and no clip, since nothing is replayed (under runtime=async, where
       every rollout is stale, the runtime's `identity` decides the clip).
    3. The variant groups at a plain setting (`Variant.plain`: sampling=standard, behaviour=current,
       curriculum=none, runtime=sync) and the plain loss (rloo) are left out: they compute plain
       Replay-RLOO. Another loss enters with its settings, and clip leaves (only rloo reads clip.ceiling).
    4. A local policy folder adds the hash of its weights.
    5. A knob added after version 1 is left out at the value that computes what version-1 cells
       computed, which its declaration names (`Knob.id_omitted_at`), so adding a knob keeps every id.
    """
    return _config_hash(cfg, LAUNCH_ONLY)


# What training seeds of one cell may differ in: the runs of a cell across seeds share every other key.
SEED_KEYS = ("trainer.seed",)


def cell_key(cfg: DictConfig) -> str:
    """The cell across training seeds: `cell_identity` without `trainer.seed` (the report groups repeats by it)."""
    return _config_hash(cfg, LAUNCH_ONLY + SEED_KEYS)


def cell_family(cfg: DictConfig) -> str:
    """The cell at any number of steps: `cell_identity` without `trainer.steps`. A FINISHED run of the family at
    fewer steps is what `trainer.extend=true` continues (src/runs/resume.py), the documented exception to
    "a cell is trained by its own runs": the steps it adds are the steps a longer run of the cell takes."""
    return _config_hash(cfg, LAUNCH_ONLY + ("trainer.steps",))


def _config_hash(cfg: DictConfig, dropped: tuple[str, ...]) -> str:
    resolved = _without_targets(OmegaConf.to_container(cfg, resolve=True))
    for key in dropped:
        _drop(resolved, key)
    for key, knob in knobs_for(cfg).items():
        if knob.id_omitted_at and OmegaConf.select(cfg, key) in knob.id_omitted_at:
            _drop(resolved, key)
    runtime, store = described(cfg.runtime), described(cfg.buffer, ReplayStore)
    if "buffer" in resolved:
        resolved["buffer"] = store.identity(cfg.buffer, resolved["buffer"], cfg)
    resolved = runtime.identity(resolved, cfg)
    if described(cfg.buffer, ReplayStore).fresh_only(cfg.buffer):
        resolved.pop("buffer", None)
        if runtime.step_replays:  # under the pipeline every rollout is stale: its runtime decides the clip
            resolved.pop("clip", None)
    for group in SUFFIX_GROUPS:
        if described(cfg[group]).plain(cfg[group]):
            resolved.pop(group, None)
    loss = resolved.pop("loss", None)
    if loss is not None and not described(cfg.loss).plain(cfg.loss):
        resolved["loss"] = loss
        resolved.pop("clip", None)
    weights = policy_fingerprint(cfg.policy.name_or_path)
    if weights is not None:  # a rebuilt warm start under the same folder name is a new cell
        resolved["policy_weights"] = weights
    if CELL_ID_VERSION > 1:
        resolved["cell_id_version"] = CELL_ID_VERSION
    text = json.dumps(_numbers_as_floats(resolved), sort_keys=True, default=str)
    return hashlib.sha256(text.encode()).hexdigest()[:16]


WEIGHT_FILES = ("*.safetensors", "*.bin")


def policy_fingerprint(name_or_path: str) -> str | None:
    """A content hash of a local policy folder's weight files; None for a hub name (its name is the identity)."""
    folder = Path(resolve_policy_path(name_or_path))
    if not folder.is_dir():
        return None
    files = sorted(path for pattern in WEIGHT_FILES for path in folder.glob(pattern))
    return _content_digest(tuple((str(path), path.stat().st_size, path.stat().st_mtime_ns) for path in files))


@functools.lru_cache(maxsize=64)
def _content_digest(files: tuple[tuple[str, int, int], ...]) -> str:
    """sha256 over the files' bytes, cached per (path, size, mtime): a sweep hashes each folder once."""
    digest = hashlib.sha256()
    for path, _, _ in files:
        with open(path, "rb") as handle:
            for block in iter(lambda: handle.read(1 << 20), b""):
                digest.update(block)
    return digest.hexdigest()[:16]


def _numbers_as_floats(node):
    """`buffer.ratio=1` on the command line and `ratio: 1.0` in a YAML file are the same cell."""
    if isinstance(node, dict):
        return {key: _numbers_as_floats(value) for key, value in node.items()}
    if isinstance(node, list):
        return [_numbers_as_floats(value) for value in node]
    if isinstance(node, (int, float)) and not isinstance(node, bool):
        return float(node)
    return node


def _without_targets(tree):
    """The config without `_target_` keys: which class implements a group is code, not the cell."""
    if isinstance(tree, dict):
        return {key: _without_targets(value) for key, value in tree.items() if key != "_target_"}
    return tree


def _drop(tree: dict, dotted: str) -> None:
    *parents, leaf = dotted.split(".")
    for part in parents:
        tree = tree.get(part, {})
    if isinstance(tree, dict):
        tree.pop(leaf, None)


@dataclass(frozen=True)
class Skipped:
    """What a sweep job returns when it trained nothing: its cell finished, or another job trains it."""

    reason: str
    kind: str  # "finished" or "running"


@dataclass
class PlannedCell:
    """One job of a sweep as the sweeper sees it before launching."""

    overrides: list[str]
    cell: str
    cell_id: str
    fresh_evaluations: int
    status: str  # "launch", "resume", "finished" (skipped), "running" (alive elsewhere, skipped) or "duplicate"
    previous: str | None = None  # the finished run id, the checkpoint a resumed cell continues from, or why it runs
    budget_is_floor: bool = False  # sampling=dynamic generates until its batch is full: the plan is a minimum
    budget_is_ceiling: bool = False  # a positive-bias FIFO with distinct draws: fewer if kept rollouts are correct
    seed: int = 0  # trainer.seed: each (cell, seed) is its own job
    same_as: int | None = None  # a duplicate: the index of the job in this sweep that trains its cell
    rerun: bool = False  # launched although the cell has a FINISHED run (trainer.rerun or skip_finished=false)


def plan_cells(jobs: list[tuple[list[str], DictConfig]], known: CellRuns, rerun: bool = False) -> list[PlannedCell]:
    """Mark each (overrides, composed config) job as launch / resume / finished / running / duplicate.

    The same cell twice in one sweep runs once (the later job is a "duplicate" of the earlier one);
    then a live run elsewhere, the newest run's checkpoint, and a FINISHED run decide, in that order.
    `rerun` (or the job's `trainer.rerun`) launches a finished cell again.
    """
    first: dict[str, int] = {}
    planned = []
    for index, (overrides, cfg) in enumerate(jobs):
        identity, trainer = cell_identity(cfg), cfg.trainer
        plan = plan_for_config(cfg)
        cell = PlannedCell(list(overrides), cell_name(cfg), identity, plan.fresh_evaluations, "launch",
                           budget_is_floor=budget_is_floor(cfg), seed=int(trainer.seed),
                           budget_is_ceiling=plan.reward_dependent)
        looks_up = trainer.auto_resume and not trainer.resume_from  # else the job starts a separate run (src.run)
        if identity in first:
            cell.status, cell.same_as = "duplicate", first[identity]
        elif looks_up and known.busy(identity):
            cell.status, cell.previous = "running", known.alive[identity]  # its job would refuse to start (src.run)
        elif looks_up and identity in known.resumable:
            cell.status, cell.previous = "resume", known.resumable[identity]  # the job finds it itself (src.run)
        elif identity in known.finished:
            cell.previous = known.finished[identity]
            cell.rerun = rerun or bool(trainer.rerun)
            cell.status = "launch" if cell.rerun else "finished"
        first.setdefault(identity, index)
        planned.append(cell)
    return planned


def record_membership(uri: str, planned: list[PlannedCell], sweep: str) -> None:
    """Add this study to the `sweeps` tag of the finished runs it reuses, so its report finds them."""
    client = MlflowClient(uri)
    for cell in planned:
        if cell.status == "finished":
            members = client.get_run(cell.previous).data.tags.get("sweeps", ",")
            if f",{sweep}," not in members:
                client.set_tag(cell.previous, "sweeps", f"{members}{sweep},")
