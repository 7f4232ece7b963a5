"""A run's MLflow labels from its config: tags, name (`<study>/<cell>[/seed<k>]`) and description."""

from __future__ import annotations

from pathlib import Path

from hydra.core.hydra_config import HydraConfig
from omegaconf import DictConfig, OmegaConf

from src.runs.naming import RunLabels, run_description, run_name, run_params, run_tags
from src.runs.cells import Cell
from src.study.sweep import cell_family, cell_identity, cell_key, cell_name, variant_label


def cell_of(cfg: DictConfig, identity: str) -> Cell:
    """The cell a run of `cfg` trains for, as the runs wing needs it (its id, name and the run's labels)."""
    return Cell(identity, cell_name(cfg), run_labels(cfg))


def run_labels(cfg: DictConfig) -> RunLabels:
    """The run's tags, name (`<study>/<cell>[/seed<k>]`) and description, from the cell's identity."""
    cell, variant = cell_name(cfg), variant_label(cfg)
    tags = run_tags(cfg, cell=cell, cell_id=cell_identity(cfg), cell_key=cell_key(cfg), variant=variant)
    tags["cell_family"] = cell_family(cfg)  # the cell at any number of steps (trainer.extend)
    return RunLabels(tags=tags, name=run_name(cfg.tracking.sweep, cell, cfg.trainer.seed),
                     description=run_description(cell, variant, cfg, launch_command()),
                     params=run_params(cfg), config=OmegaConf.to_yaml(cfg, resolve=True))


def launch_command() -> str:
    """The command that runs this job alone: `python -m src.run` and the job's overrides (the cell's, in a sweep)."""
    _, overrides = hydra_job()
    return " ".join(["python -m src.run", *(overrides or [])])


def hydra_job() -> tuple[Path | None, list[str] | None]:
    """This Hydra job's output folder (holding `.hydra/`) and its overrides; (None, None) outside Hydra."""
    if not HydraConfig.initialized():
        return None, None
    hydra_cfg = HydraConfig.get()
    return Path(hydra_cfg.runtime.output_dir), list(hydra_cfg.overrides.task)
