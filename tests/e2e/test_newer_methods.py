"""The newer reuse methods (docs/papers.md#newer-reuse-methods) train on the tiny policy under the sync runtime,
through the same step as every other variant."""

from __future__ import annotations

import math

from src.task import countdown
from tests.e2e.test_golden import golden_config, run_steps


def test_m2po_trains_on_replayed_groups_and_logs_its_mask(compose_config):
    """loss=m2po with an age-1 store: the second step replays the first step's groups (mu one update old), the
    mask's diagnostics are logged every step, and the loss is finite."""
    cfg = golden_config(compose_config, ("loss=m2po", "buffer=age1", "trainer.kl_coef=0", "trainer.entropy_coef=0"))
    steps = run_steps(cfg, countdown.generate_instances(64, seed=1), steps=3)
    assert [step["batch/replay_groups"] > 0 for step in steps] == [False, True, True]
    for step in steps:
        assert math.isfinite(step["train/loss"]) and step["m2po/updates"] == 4.0
        assert 0.0 <= step["m2po/masked_frac"] < 1.0 and step["m2po/m2_after"] <= 0.04
    assert steps[0]["m2po/m2_before"] == 0.0  # fresh groups only: log r = 0 on every token
    assert steps[1]["m2po/m2_before"] > 0.0   # replayed rows, sampled one update earlier


def test_rlep_appends_earlier_successes_to_fresh_groups_on_the_tiny_math_policy(compose_config):
    """buffer=rlep on two prompts the tiny math policy often solves: from the second step the groups get M = 2
    of their prompt's earlier successes, which train (more response tokens than were generated) and cost no
    verifier call (the fresh evaluations stay B x G a step)."""
    from src.task.base import build_task

    cfg = compose_config("task=math", "policy=tiny-math", "policy.max_new_tokens=80", "buffer=rlep", "loss=grpo",
                         "trainer.kl_coef=0", "trainer.entropy_coef=0", "trainer.groups_per_step=2",
                         "trainer.group_size=4", "hardware.threads=1")
    train_set, _ = build_task(cfg.task).splits(train_size=2)
    steps = run_steps(cfg, train_set, steps=3)
    merged = [step["rlep/merged_groups"] for step in steps]
    assert merged[0] == 0.0 and max(merged[1:]) > 0.0, merged
    for step in steps:
        assert step["rlep/replayed_rollouts"] == 2 * step["rlep/merged_groups"] and math.isfinite(step["train/loss"])
        if step["rlep/merged_groups"]:  # the appended rows are the replay split: verified successes only
            assert step["train/correct_fraction/replay"] == 1.0 and step["train/reward/replay"] == 1.0
    assert [step["budget/fresh_evaluations"] for step in steps] == [8.0, 16.0, 24.0]
    tokens = [(step["budget/generated_tokens"], step["budget/trained_tokens"]) for step in steps]
    assert tokens[0][0] == tokens[0][1] and tokens[-1][1] > tokens[-1][0], tokens
