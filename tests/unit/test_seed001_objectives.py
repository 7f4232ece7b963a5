"""Seed 001's objectives (D.2): loss=grpo-coupled clips pi_theta / mu itself; loss=asymre shifts the baseline, no ratio."""

from __future__ import annotations

import math

import pytest

from src.settings import RunSettings
from src.batch import Batch, BatchGroup
from src.build import build_components
from src.task import countdown
from src.train import collect

SMALL = ("trainer.groups_per_step=2", "trainer.group_size=4", "policy.max_new_tokens=12", "task.train_size=50",
         "trainer.kl_coef=0", "trainer.entropy_coef=0")


@pytest.mark.parametrize("loss, ratio", [("grpo-coupled", math.exp(-0.5)), ("grpo", 1.0)])
def test_ratio_is_taken_against_mu_only_in_the_coupled_form(compose_config, loss, ratio):
    cfg = compose_config(f"loss={loss}", "loss.updates_per_step=1", *SMALL)
    train_set, _ = countdown.train_and_heldout(cfg.task)
    parts = build_components(RunSettings(cfg), train_set)
    fresh = collect(parts, 0).batch.groups
    measured = parts.forward.with_sampled_logprobs(fresh, parts.policy, 1.0)
    # mu 0.5 nats above the current policy on every token: pi_theta / mu = exp(-0.5) per token
    shifted = [g.with_behaviour_logprobs([v + 0.5 * len(ids) for v, ids in zip(g.behaviour_logprobs, g.response_ids)],
                                         None, [[t + 0.5 for t in tokens] for tokens in g.behaviour_token_logprobs])
               for g in measured]
    update = parts.trainer.update(parts.policy, parts.reference, parts.optimizer,
                                    Batch([BatchGroup(g, "replay", 1) for g in shifted]))
    assert update.extras["grpo/ratio_mean"] == pytest.approx(ratio, rel=1e-4)


def test_asymre_shifts_the_group_mean_baseline_and_ignores_importance_ratios(compose_config):
    import torch

    cfg = compose_config("loss=asymre", *SMALL)
    train_set, _ = countdown.train_and_heldout(cfg.task)
    parts = build_components(RunSettings(cfg), train_set)
    rewards = torch.tensor([[1.0, 0.0, 0.1, 0.1]])
    assert parts.loss.advantages(rewards)[0].tolist() == pytest.approx([0.8, -0.2, -0.1, -0.1])
    fresh = collect(parts, 0).batch.groups
    stale = [g.with_behaviour_logprobs([v + 3.0 for v in g.behaviour_logprobs], None, g.behaviour_token_logprobs)
             for g in parts.forward.with_sampled_logprobs(fresh, parts.policy, 1.0)]
    update = parts.trainer.update(parts.policy, parts.reference, parts.optimizer,
                                    Batch([BatchGroup(g, "replay", 2) for g in stale]))
    assert torch.all(update.weights == 1.0) and torch.all(update.raw_weights == 1.0)
