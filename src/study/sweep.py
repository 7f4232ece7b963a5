"""Cells of a study: their identity, which are finished in MLflow, and the launch plan.

A cell is identified by its resolved config minus the keys that only say how or where it
runs (`LAUNCH_ONLY`). A fresh-only cell (rho = 0) has no buffer and every weight is 1, so
its buffer and clip settings are dropped too: the ratio study's rho = 0 baseline and the
baseline study's `buffer=none` run are the same cell, and run once. A local policy folder adds
the hash of its weights, so rebuilding the warm start (`make sft-tiny`) never reuses results
trained from the old one. The identity is stored on
every run as the tag `cell_id`, and the newest run of a cell decides what happens to it
(`cell_runs`): the sweeper (`hydra_plugins/replay_rloo_sweeper`) skips a cell whose newest run
FINISHED and launches each remaining identity once; a job whose cell's newest run FAILED or was
KILLED (or a requeued SLURM job) resumes from that run's checkpoint into the same MLflow run
(`src.runs.resume`, `trainer.auto_resume`); a cell with a live run elsewhere is left to it (`src.runs.claim`).
"""

from __future__ import annotations

import functools
import hashlib
import json
import os
from dataclasses import dataclass, field
from pathlib import Path

from mlflow.tracking import MlflowClient
from omegaconf import DictConfig, OmegaConf

from src.study.budget import budget_is_floor, plan_for_config
from src.buffer.store import store_class
from src.task.base import task_class
from src.runs.lifecycle import Liveness, checkpoint_files, run_liveness
from src.paths import resolve_policy_path
from src.schema import knobs_for
from src.variant import described

# Keys that change how a cell is launched or logged, never what it computes.
LAUNCH_ONLY = (
    "hydra",
    "tracking",
    "hardware.threads",
    "hardware.name",
    "hardware.ranks",  # data-parallel ranks: the same numbers as one process (src/runs/ranks.py)
    "trainer.resume_from",
    "trainer.auto_resume",
    "trainer.rerun",  # train a finished cell again: a new run of the same cell
    "trainer.checkpoint_every",
    "trainer.fused_logprobs",  # the same log-probs to fp32 rounding, computed with less memory
    "trainer.heartbeat_every_s",
    "trainer.heartbeat_timeout_s",
    "buffer.mechanism_only",  # lifts a config check only: the same computation
    "sampling.mechanism_only",
    "runtime.num_cpus", "runtime.worker_threads", "runtime.max_restarts", "runtime.gpus_per_worker",  # where the async pipeline runs
)


# Variant groups that suffix a cell's name, in this order; at a plain setting each leaves the identity (rule 3).
SUFFIX_GROUPS = ("sampling", "behaviour", "curriculum", "runtime")



def cell_name(cfg: DictConfig) -> str:
    """The grid cell as text, e.g. 'rho1-L2-c1' (fresh-only runs: 'rho0'), with the variant groups as suffixes.

    Each component names its own part (`src.variant.Variant.cell_label`): the store, then the loss, or
    the clip ceiling where the loss reads it and something is replayed, then '-dapo', '-stale4', ...
    """
    store, objective = store_class(cfg.buffer), described(cfg.loss)
    loss = objective.cell_label(cfg.loss, cfg)
    clip = f"-c{cfg.clip.ceiling:g}" if _reads_clip(objective) and not store.fresh_only(cfg.buffer) else ""
    suffixes = "".join(described(cfg.get(group)).cell_label(cfg.get(group), cfg) for group in SUFFIX_GROUPS)
    return store.cell_label(cfg.buffer, cfg) + (loss or clip) + suffixes + task_class(cfg.get("task")).cell_suffix


def variant_label(cfg: DictConfig) -> str:
    """A reader's name for what the cell runs, e.g. 'Replay-RLOO', 'POPO (GRPO loss)', 'Fresh-only + DAPO dynamic sampling'."""
    parts = [store_class(cfg.buffer).reader_label(cfg.buffer, cfg) + described(cfg.loss).reader_label(cfg.loss, cfg)]
    for group in SUFFIX_GROUPS:
        parts.append(described(cfg.get(group)).reader_label(cfg.get(group), cfg))
    parts.append(task_class(cfg.get("task")).reader_name)
    return " + ".join(part for part in parts if part)


def _reads_clip(objective: type) -> bool:
    return getattr(objective, "reads_clip", False)  # a loss class that is not an `Objective` reads no clip


# The identity rules below are version 1. A change to them that would give an existing cell another id
# must raise the version, which then enters the hash: every cell of version 1 keeps its id, and
# tests/test_cell_identity.py lists the ids that must survive.
CELL_ID_VERSION = 1


def cell_identity(cfg: DictConfig) -> str:
    """A short stable hash of the config that decides the cell's results (rules of `CELL_ID_VERSION`).

    1. The resolved config, without `_target_` keys (which class implements a group is code, not the
       cell) and without the launch-only keys (`LAUNCH_ONLY`). The training seed is part of it: each
       (cell, seed) is its own job.
    2. Fresh-only (a store whose settings replay nothing, `ReplayStore.fresh_only`: rho = 0 with the age
       buffer, or buffer=none): no buffer and no clip, since nothing is replayed.
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


def _config_hash(cfg: DictConfig, dropped: tuple[str, ...]) -> str:
    resolved = _without_targets(OmegaConf.to_container(cfg, resolve=True))
    for key in dropped:
        _drop(resolved, key)
    for key, knob in knobs_for(cfg).items():
        if knob.id_omitted_at and OmegaConf.select(cfg, key) in knob.id_omitted_at:
            _drop(resolved, key)
    if store_class(cfg.buffer).fresh_only(cfg.buffer):
        resolved.pop("buffer")
        resolved.pop("clip")
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


@dataclass
class CellRuns:
    """What the tracking store knows about the cells of one experiment: the newest run of a cell decides.

    A cell whose newest run is FINISHED is finished; one whose newest run is dead (FAILED, KILLED, or
    RUNNING with a dead heartbeat) and left a checkpoint resumes from it, even when an older run of
    the cell finished (a killed rerun resumes like any other run). Any live RUNNING run makes the cell
    busy: nobody else trains it.
    """

    finished: dict[str, str]  # cell_id -> run id of its newest FINISHED run
    resumable: dict[str, str]  # cell_id -> checkpoint of its newest run, when that run is dead and left one
    resumable_runs: dict[str, str] = field(default_factory=dict)  # cell_id -> that run's id
    alive: dict[str, str] = field(default_factory=dict)  # cell_id -> which live run trains it, for the message
    alive_runs: dict[str, list[tuple[int, str]]] = field(default_factory=dict)  # cell_id -> (start ms, run id) live
    dead_running: dict[str, list[tuple[str, str, bool]]] = field(default_factory=dict)  # (run id, why dead, has ckpt)

    def busy(self, identity: str) -> bool:
        return identity in self.alive

    def unresumed_dead(self, identity: str) -> list[tuple[str, str]]:
        """The cell's dead RUNNING runs nobody will resume, each with why: to be marked FAILED."""
        resumed = self.resumable_runs.get(identity)
        return [(run_id, f"dead ({why}), not resumable: " + ("a newer run of the cell replaced it" if checkpoint
                                                              else "no checkpoint in its folder"))
                for run_id, why, checkpoint in self.dead_running.get(identity, []) if run_id != resumed]


@dataclass(frozen=True)
class Skipped:
    """What a sweep job returns when it trained nothing: its cell finished, or another job trains it."""

    reason: str
    kind: str  # "finished" or "running"


def slurm_job_key() -> str | None:
    """This process's SLURM job (array job and task), the same across a requeue; None outside SLURM."""
    if "SLURM_ARRAY_JOB_ID" in os.environ:
        return f"{os.environ['SLURM_ARRAY_JOB_ID']}_{os.environ.get('SLURM_ARRAY_TASK_ID', '')}"
    return os.environ.get("SLURM_JOB_ID")


def cell_runs(uri: str, experiment: str, cell_id: str | None = None, heartbeat_timeout_s: float = 300.0) -> CellRuns:
    """Finished, resumable, alive and silently dead cells of the experiment (or of one cell), with one paged search.

    A RUNNING run is dead when its heartbeat timed out, its process is gone from this host, its
    SLURM job no longer runs, or it is this same SLURM job's earlier attempt (a requeued job whose
    first attempt was killed outright). A dead run resumes from the newest checkpoint in its folder.
    """
    client = MlflowClient(uri)
    found = client.get_experiment_by_name(experiment)
    known = CellRuns({}, {})
    if found is None:
        return known
    query = f"tags.cell_id = '{cell_id}'" if cell_id else ""
    page_token = None
    while True:  # oldest first, so the newest run of a cell decides
        page = client.search_runs([found.experiment_id], filter_string=query, max_results=1000,
                                  order_by=["attributes.start_time ASC"], page_token=page_token)
        for run in page:
            if run.data.tags.get("cell_id") is not None:
                _judge_run(known, run, heartbeat_timeout_s)
        page_token = page.token
        if not page_token:
            return known


def _judge_run(known: CellRuns, run, heartbeat_timeout_s: float) -> None:
    """Fold one run (runs come oldest first) into what is known about its cell."""
    identity, status, tags, run_id = run.data.tags["cell_id"], run.info.status, run.data.tags, run.info.run_id
    if status == "FINISHED":
        known.finished[identity] = run_id
        known.resumable.pop(identity, None)
        known.resumable_runs.pop(identity, None)
        return
    folder = Path(tags["output_dir"]) if tags.get("output_dir") else None
    if status == "RUNNING":
        why_dead = running_run_death(run, folder, heartbeat_timeout_s)
        if isinstance(why_dead, Liveness):  # alive
            known.alive[identity] = (f"run {run_id} ({running_job(tags, why_dead)}) is training it: wait "
                                     f"{why_dead.wait_s:.0f} s for its heartbeat to time out if it died")
            known.alive_runs.setdefault(identity, []).append((run.info.start_time, run_id))
            return
    elif status not in ("FAILED", "KILLED"):
        return
    checkpoints = checkpoint_files(folder) if folder is not None else []
    if status == "RUNNING":
        known.dead_running.setdefault(identity, []).append((run_id, why_dead, bool(checkpoints)))
    known.resumable.pop(identity, None)
    known.resumable_runs.pop(identity, None)
    if checkpoints:
        known.resumable[identity] = str(checkpoints[0])
        known.resumable_runs[identity] = run_id


def running_run_death(run, folder: Path | None, heartbeat_timeout_s: float) -> "str | Liveness":
    """Why a RUNNING run is dead, or its `Liveness` when it is alive."""
    tags, this_job = run.data.tags, slurm_job_key()
    if this_job is not None and tags.get("slurm_job") == this_job:
        return f"an earlier attempt of this SLURM job {this_job}"
    liveness = run_liveness(run.info.run_id, folder, run.info.start_time / 1000, tags.get("slurm_job"),
                            heartbeat_timeout_s)
    return liveness if liveness.alive else liveness.reason


def running_job(tags: dict, liveness: Liveness) -> str:
    """Where a live run runs, for a message: its process and host from the heartbeat, and its SLURM job."""
    slurm = tags.get("slurm_job")
    return liveness.reason + (f", SLURM job {slurm}" if slurm and slurm != "-" else "")


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
