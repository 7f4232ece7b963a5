"""Standalone evaluation (`python -m src.eval`): choosing runs, merging configs, seed namespaces."""

from __future__ import annotations

import itertools

import pytest
from omegaconf import OmegaConf

from src.eval.standalone import main, merged_config, stage_of
from src.task import countdown
from src.sampling.collection import generation_seed


def test_stage_is_final_only_at_the_last_step():
    assert stage_of(60, 60) == "final"
    assert stage_of(30, 60) == "during"


def test_merged_config_keeps_the_runs_task_and_policy(compose_config):
    trained = compose_config("task.heldout_seed=7", "policy.max_new_tokens=12", "evaluation=quick")
    now = compose_config("evaluation=probe", "evaluation.repeats=2")
    cfg = merged_config(OmegaConf.create(OmegaConf.to_yaml(trained, resolve=True)), now)
    assert cfg.task.heldout_seed == 7 and cfg.policy.max_new_tokens == 12
    assert cfg.evaluation.name == "probe" and cfg.evaluation.repeats == 2


def test_heldout_instances_equal_the_training_split_heldout(compose_config):
    task = compose_config("task.train_size=300").task
    assert countdown.heldout_instances(task) == countdown.train_and_heldout(task)[1]


def test_protocol_seed_namespaces_are_disjoint(compose_config):
    """Canonical, probe and quick never share a sampling seed, nor with training rollouts (seeds 0-9, 10k steps)."""
    ranges = {}
    for name in ("quick", "canonical", "probe"):
        evaluation = compose_config(f"evaluation={name}").evaluation
        ranges[name] = set(range(evaluation.seed, evaluation.seed + evaluation.repeats))
    for first, second in itertools.combinations(ranges, 2):
        assert not ranges[first] & ranges[second], (first, second)
    training = {generation_seed(seed, step) for seed in range(10) for step in range(10_000)}
    assert all(not seeds & training for seeds in ranges.values())


def test_canonical_reports_every_k_up_to_16(compose_config):
    assert list(compose_config("evaluation=canonical").evaluation.ks) == list(range(1, 17))


def test_cli_needs_a_target_and_refuses_bad_settings(capsys):
    with pytest.raises(SystemExit):
        main([])
    assert "--run" in capsys.readouterr().err
    assert main(["--policy", "unused", "evaluation=probe", "evaluation.ks=[128]"]) == 2  # before loading anything


def test_cli_names_a_missing_checkpoint_or_run(tmp_path, capsys):
    store = [f"tracking.uri=sqlite:///{tmp_path}/mlruns.db", f"tracking.artifact_location={tmp_path}/a"]
    assert main(["--checkpoint", str(tmp_path / "nope.pt"), *store]) == 2
    assert "no checkpoint at" in capsys.readouterr().err
    with pytest.raises(SystemExit, match="no MLflow run 'deadbeef'"):
        main(["--run", "deadbeef", *store])
