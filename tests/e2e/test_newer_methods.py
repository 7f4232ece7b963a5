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
