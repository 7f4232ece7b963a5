"""What a run is called and what it carries into MLflow, from its config: tags, name, description and params.

Runs are named `<study>/<cell>[/seed<k>]` and carry a description (the cell in words and the launch command);
tags name the study (`sweep`) and the grid cell (rho, L, c), so runs can be filtered without parsing params; the
params are the resolved config. The cell's name and identity come from the caller (`src.study.labels`, with
`src.study.sweep`); these only turn a config into MLflow's strings, and need no MLflow to do it.
"""

from __future__ import annotations

from dataclasses import dataclass

from omegaconf import DictConfig, OmegaConf

from src.task.base import task_class


def run_tags(cfg: DictConfig, *, cell: str, cell_id: str, cell_key: str, variant: str) -> dict[str, str]:
    """Tags that name the study and the cell, so runs can be filtered without parsing params.

    The cell's name, identity and variant label come from the caller (`src.run` computes them with
    `src.study.sweep`): this only records what it is given.
    """
    task = task_class(cfg.get("task"))
    return {
        "sweep": str(cfg.tracking.sweep),
        "sweeps": f",{cfg.tracking.sweep},",  # every study this cell belongs to; the sweeper appends shared ones
        "cell": cell,
        "cell_id": cell_id,
        "cell_key": cell_key,  # the same for every training seed of the cell (analysis/seeds.py groups by it)
        "seed": str(cfg.trainer.seed),
        **paper_knobs(cfg),
        "buffer": str(cfg.buffer.name),
        "clip": str(cfg.clip.name),
        "loss": str(cfg.loss.name),
        "sampling": str(cfg.sampling.name),
        "behaviour": str(cfg.behaviour.name),
        "curriculum": str(cfg.curriculum.name),
        "variant": variant,
        "policy": str(cfg.policy.name_or_path),
        "hardware": str(cfg.hardware.name),
        "evaluation": str(cfg.evaluation.name),
        "runtime": str(cfg.runtime.name),
        "task": task.name,
        "task_suffix": task.cell_suffix,  # what the task adds to a grid cell's name ("-math"; Countdown: "")
    }


def paper_knobs(cfg: DictConfig) -> dict[str, str]:
    """The cell's knobs by the paper's names (rho, L, c), as tags and as params: the runs table's columns by
    those names, beside the config's own `buffer.ratio`, `buffer.max_age`, `clip.ceiling`."""
    return {"rho": f"{cfg.buffer.ratio:g}", "L": str(cfg.buffer.max_age), "c": f"{cfg.clip.ceiling:g}"}


# MLflow shows this tag as the run's description (the "Description" box of a run page).
DESCRIPTION_TAG = "mlflow.note.content"
DEFAULT_SEED = 0  # every trainer preset's seed: a run name carries /seed<k> only for another one


def run_name(study: str, cell: str, seed: int) -> str:
    """`<study>/<cell>` (e.g. `ratio/rho1-L2-c1`), with `/seed<k>` when the training seed is not the default 0."""
    return f"{study}/{cell}" + (f"/seed{seed}" if seed != DEFAULT_SEED else "")


def run_description(cell: str, variant: str, cfg: DictConfig, command: str) -> str:
    """The run page's description: the cell in words and the command that launched (and relaunches) it."""
    trainer = cfg.trainer
    replay = (f"rho = {cfg.buffer.ratio:g} reused groups per fresh group, max age L = {cfg.buffer.max_age}, "
              f"clip c = {cfg.clip.ceiling:g}" if cfg.buffer.ratio > 0 else "fresh-only (rho = 0)")
    return (f"**{variant}**, cell `{cell}` of study `{cfg.tracking.sweep}`: {replay}; loss {cfg.loss.name}, "
            f"{trainer.groups_per_step} groups x {trainer.group_size} responses, {trainer.steps} steps, "
            f"seed {trainer.seed}, policy `{cfg.policy.name_or_path}`, evaluation `{cfg.evaluation.name}`.\n\n"
            f"Launched with:\n\n```\n{command}\n```\n\n(the same command resumes it; `overrides.yaml` "
            "among the artifacts lists the overrides, `hydra/` the composed config)")


def flat_params(cfg: DictConfig) -> dict[str, str]:
    """The resolved config flattened to dotted keys (MLflow params are strings), without the `_target_`
    class paths: the runs table shows what a researcher set; `config.yaml` keeps the whole config."""
    flat: dict[str, str] = {}

    def walk(node, prefix: str) -> None:
        if isinstance(node, dict):
            for key, value in node.items():
                if key != "_target_":
                    walk(value, f"{prefix}{key}.")
        else:
            flat[prefix[:-1]] = str(node)

    walk(OmegaConf.to_container(cfg, resolve=True), "")
    return flat


def run_params(cfg: DictConfig) -> dict[str, str]:
    """A new run's params: the flat config without the launch-only `tracking.*` settings (config.yaml has
    them), and the paper's knobs by their short names."""
    params = {key: value for key, value in flat_params(cfg).items() if not key.startswith("tracking.")}
    return {**params, **paper_knobs(cfg)}


@dataclass
class RunLabels:
    """What names a run in MLflow, computed by the caller: tags, the run name and the description, and what a new
    run logs once: its params and its resolved config (config.yaml)."""

    tags: dict[str, str]
    name: str
    description: str
    params: dict[str, str]
    config: str
