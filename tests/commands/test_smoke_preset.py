"""`trainer=smoke` (conf/trainer/smoke.yaml): the install check in seconds, with any other choice, filed apart
from real cells. The README's command itself runs in tests/commands/test_commands.py."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from src.command.config import validate
from src.study.sweep import cell_identity, cell_name

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize("overrides", [[], ["buffer=age1", "clip=tight"], ["task=math"], ["policy=qwen2.5-0.5b"]])
def test_smoke_shrinks_every_run_it_is_combined_with(compose_config, overrides):
    cfg = compose_config("trainer=smoke", *overrides)
    assert (cfg.trainer.steps, cfg.trainer.groups_per_step, cfg.trainer.group_size) == (2, 4, 2)
    assert (cfg.evaluation.name, cfg.evaluation.prompts, cfg.evaluation.samples_per_prompt) == ("smoke", 2, 2)
    assert (cfg.tracking.sweep, cfg.trainer.rerun) == ("smoke", True)  # apart from the studies; trains every time
    assert cfg.trainer.learning_rate == compose_config().trainer.learning_rate  # the tiny preset otherwise
    if overrides != ["policy=qwen2.5-0.5b"]:  # its weights are not here; the composition is what counts
        validate(cfg)


def test_the_command_line_still_wins(compose_config):
    cfg = compose_config("trainer=smoke", "evaluation=canonical", "tracking.sweep=mine", "trainer.steps=3")
    assert (cfg.evaluation.name, cfg.tracking.sweep, cfg.trainer.steps) == ("canonical", "mine", 3)
    assert compose_config().evaluation.name == "quick"  # the default evaluation is untouched


def test_a_smoke_cell_is_never_the_full_cell(compose_config):
    for overrides in ([], ["buffer=age1", "clip=tight"]):
        smoke, full = compose_config("trainer=smoke", *overrides), compose_config(*overrides)
        assert cell_name(smoke) == cell_name(full) and cell_identity(smoke) != cell_identity(full)


@pytest.mark.slow
def test_a_smoke_sweep_plans_each_cell(tmp_path):
    """`python -m src.run -m trainer=smoke buffer=none,age1`, planned (dry run) into its own store."""
    done = subprocess.run([sys.executable, "-m", "src.run", "-m", "trainer=smoke", "buffer=none,age1",
                           "hydra.sweeper.dry_run=true", f"out={tmp_path}"], cwd=ROOT, capture_output=True, text=True,
                          timeout=300, env={**os.environ, "PYTHONPATH": str(ROOT), "COLUMNS": "200"})
    printed = done.stdout + done.stderr
    assert done.returncode == 0, printed[-3000:]
    assert "2 jobs, 2 to launch" in printed and "rho0" in printed and "rho1-L1-c10" in printed
    assert f"against sqlite:///{tmp_path}/mlruns.db" in printed
    # The sweep folder is under out too, and a dry run leaves none (nor the folders above it).
    assert f"sweep folder, made at launch: {tmp_path}/outputs/multirun/" in printed
    assert not (tmp_path / "outputs").exists()
