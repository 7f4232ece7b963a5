"""The loop's one way to the processes that run it: its runtime (src/runtime/base.py). In one process each call does
its one-process part, checked here; over torchrun's ranks tests/e2e/test_run_ranks.py runs `src.run` through the
same calls."""

from __future__ import annotations

import ast

import pytest
import torch

from src.batch import TrainState
from src.build import build_components, build_runtime
from src.paths import PROJECT_ROOT
from src.runs.checkpoint import read_checkpoint, save_checkpoint
from src.settings import RunSettings
from src.task import countdown

SMALL = ("trainer=smoke", "hardware.threads=1")


def test_src_run_reaches_the_ranks_only_through_its_runtime():
    tree = ast.parse((PROJECT_ROOT / "src" / "run.py").read_text())
    named = {node.id for node in ast.walk(tree) if isinstance(node, ast.Name)}
    attributes = {node.attr for node in ast.walk(tree) if isinstance(node, ast.Attribute)}
    imported = {alias.name for node in ast.walk(tree) if isinstance(node, ast.ImportFrom) for alias in node.names}
    assert "ranks" not in named and "ranks" not in attributes  # no `ranks.x`, no `self.ranks`
    assert not {"Ranks", "joined", "join"} & imported


def built(compose_config, *overrides):
    run = RunSettings(compose_config(*SMALL, *overrides))
    train_set, _ = countdown.train_and_heldout(run.groups["task"])
    return run, build_components(run, train_set)


def test_one_process_places_saves_restores_and_agrees_on_a_stop(compose_config, tmp_path):
    run, parts = built(compose_config)
    runtime = build_runtime(run)
    with runtime.joined(run) as joined:
        assert joined is runtime and runtime.lead
        placed, state = runtime.place(parts, None)
        assert placed is parts and state == TrainState()  # one process: nothing sharded, a fresh start
        assert runtime.lead_only(lambda a, b=0: a + b, 2, b=3) == 5
        with pytest.raises(KeyError, match="raised by the lead"):
            runtime.lead_only(lambda: (_ for _ in ()).throw(KeyError("raised by the lead")))
        assert runtime.agreed_stop(15) == 15 and runtime.agreed_stop(0) == 0
        assert runtime.whole_policy(parts.policy) is None  # one process holds the whole policy
        state.step = 2
        written = []

        def write(shards, pipeline=None):
            written.append(shards)  # None: one process's checkpoint file holds the weights whole
            save_checkpoint(tmp_path / f"{len(written)}.pt", parts, state, "run", "cell", shards, runtime=pipeline)

        runtime.save(tmp_path, parts, 2, write)
        runtime.save(tmp_path, parts, 2, lambda shards: write(shards, {"signature": "async pipeline v2"}))
        assert written == [None, None] and not (tmp_path / "shards").exists()
    _, again = built(compose_config)
    with torch.no_grad():  # other weights until the checkpoint restores them
        for parameter in again.policy.parameters():
            parameter.add_(1.0)
    placed, restored = runtime.place(again, read_checkpoint(tmp_path / "1.pt"))
    assert restored.step == 2
    assert all(torch.equal(a, b) for a, b in zip(parts.policy.state_dict().values(),
                                                 placed.policy.state_dict().values()))
    with pytest.raises(ValueError, match="resume it with runtime=async"):  # the runtime's own state is restored too
        runtime.place(again, read_checkpoint(tmp_path / "2.pt"))


def test_ranks_the_runtime_cannot_join_are_refused_in_one_line(compose_config, monkeypatch):
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    run = RunSettings(compose_config(*SMALL, "hardware.ranks=2"))
    with pytest.raises(ValueError, match="not started by torchrun"):
        with build_runtime(run).joined(run):
            pass
