"""IPO baseline (seed 004 Table 1, Azar et al. eq. 17): pairing, loss and gradient against hand-worked numbers."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from src.study.budget import plan_fresh_evaluations
from src.command.config import ConfigError, validate
from src.loss.ipo import batch_pairs, ipo_loss, ipo_pairs, ipo_response_gradients
from src.study.sweep import cell_name, variant_label
from src.policy.forward import response_token_stats
from src.batch import Batch, BatchGroup, Group, TrainState, fresh_entries
from src.train import train_step
from tests.unit.test_train import make_parts, policy_update, sample_groups, small_config


def test_pairs_are_every_ordered_pair_with_a_higher_reward_chosen():
    assert ipo_pairs([1.0, 0.1, 0.1, 0.0]) == [(0, 1), (0, 2), (0, 3), (1, 3), (2, 3)]
    assert ipo_pairs([0.1, 1.0]) == [(1, 0)]
    assert ipo_pairs([0.1, 0.1, 0.1]) == []  # no preference, no pair


def group(rewards: tuple[float, ...]) -> Group:
    k = len(rewards)
    return Group("p", (1,), None, ("r",) * k, ((2,),) * k, rewards, step=0)


def test_batch_pairs_index_the_batchs_rows_within_each_group():
    whole = Batch(fresh_entries([group((1.0, 0.0, 0.1)), group((0.0, 0.0)), group((0.1, 1.0))]))
    assert batch_pairs(whole) == [(0, 1), (0, 2), (2, 1), (6, 5)]
    # A draw of some of a group's responses (a positive-bias FIFO, the async pipeline) pairs those it trains:
    # responses 0 and 2 of the first group (rows 0, 1), responses 1 and 0 of the third (rows 2, 3).
    drawn = Batch([BatchGroup(group((1.0, 0.0, 0.1)), "replay", 1, (0, 2)),
                   BatchGroup(group((0.1, 1.0)), "replay", 1, (1, 0))])
    assert batch_pairs(drawn) == [(0, 1), (2, 3)]


def test_ipo_loss_hand_worked():
    # tau = 0.5: target margin 1/(2 tau) = 1. Margins 1.0 - 0.0 = 1 and 0.5 - 1.5 = -1: ((0)^2 + (-2)^2) / 2 = 2.
    loss = ipo_loss(torch.tensor([1.0, 0.5]), torch.tensor([0.0, 1.5]), tau=0.5)
    assert loss.item() == pytest.approx(2.0)
    # tau = 0.1: target 5; one pair with margin 3: (3 - 5)^2 = 4.
    assert ipo_loss(torch.tensor([2.0]), torch.tensor([-1.0]), tau=0.1).item() == pytest.approx(4.0)
    with pytest.raises(ValueError, match="tau must be > 0"):
        ipo_loss(torch.tensor([0.0]), torch.tensor([0.0]), tau=0.0)


def test_response_gradients_hand_worked():
    # Pairs (0,1), (0,2), tau = 0.5 (target 1), log-ratios [2, 0, 1]: d1 = 2 - 0 - 1 = 1, d2 = 2 - 1 - 1 = 0.
    # L = (d1^2 + d2^2) / 2 = 0.5; dL/dx0 = d1 + d2 = 1, dL/dx1 = -d1 = -1, dL/dx2 = -d2 = 0.
    gradient, loss = ipo_response_gradients(torch.tensor([2.0, 0.0, 1.0]), [(0, 1), (0, 2)], tau=0.5)
    assert loss == pytest.approx(0.5)
    assert gradient.tolist() == pytest.approx([1.0, -1.0, 0.0])
    gradient, loss = ipo_response_gradients(torch.tensor([2.0, 0.0]), [], tau=0.5)
    assert loss == 0.0 and gradient.tolist() == [0.0, 0.0]


def ipo_gradients(policy_dir, compose_config, micro_batch_size):
    cfg = small_config(compose_config, "loss=ipo", "loss.tau=0.5", f"trainer.micro_batch_size={micro_batch_size}")
    parts = make_parts(policy_dir, cfg)
    parts.optimizer = torch.optim.SGD(parts.policy.parameters(), lr=0.0)  # keep weights, inspect grads
    groups = [dataclasses.replace(g, behaviour_logprobs=None) for g in sample_groups(parts.tokenizer)]
    result = policy_update(parts.policy, parts.reference, parts.optimizer, groups, cfg.trainer, 1.0, 0,
                           loss_cfg=cfg.loss)
    return parts, groups, result, [p.grad.clone() for p in parts.policy.parameters()]


def test_ipo_update_gradient_equals_autograd_of_the_loss_and_ignores_micro_batching(random_policy_dir,
                                                                                     compose_config):
    parts, groups, whole, whole_grads = ipo_gradients(random_policy_dir, compose_config, 100)
    _, _, split, split_grads = ipo_gradients(random_policy_dir, compose_config, 2)
    assert whole.loss == pytest.approx(split.loss, rel=1e-5)
    for a, b in zip(whole_grads, split_grads):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-6)
    # The same gradient straight from autograd on one batch: L = mean (h - 1/(2 tau))^2 over the pairs.
    sequences = [(g.prompt_ids, r) for g in groups for r in g.response_ids]
    parts.policy.zero_grad()
    token_logprobs, _, mask = response_token_stats(parts.policy, sequences, 0, with_entropy=False)
    with torch.no_grad():
        ref_tokens, _, _ = response_token_stats(parts.reference, sequences, 0, with_entropy=False)
    ratios = ((token_logprobs - ref_tokens) * mask).sum(-1)
    pairs = batch_pairs(Batch(fresh_entries(groups)))
    assert len(pairs) == 6  # rewards [1, 0, 0.1] and [0.1, 0, 1]: 3 pairs each
    loss = ipo_loss(ratios[[w for w, _ in pairs]], ratios[[l for _, l in pairs]], tau=0.5)
    loss.backward()
    assert whole.loss == pytest.approx(loss.item(), rel=1e-5)
    for a, p in zip(whole_grads, parts.policy.parameters()):
        torch.testing.assert_close(a, p.grad, rtol=1e-4, atol=1e-6)
    assert whole.extras["ipo/pairs"] == 6 and whole.extras["ipo/target_margin"] == 1.0
    assert whole.optimizer_steps == 1


def test_ipo_update_widens_the_margin_of_the_chosen_response(random_policy_dir, compose_config):
    cfg = small_config(compose_config, "loss=ipo", "loss.tau=0.5")  # target margin 1, from 0 at the start
    parts = make_parts(random_policy_dir, cfg)
    parts.optimizer = torch.optim.SGD(parts.policy.parameters(), lr=1e-3)
    groups = [dataclasses.replace(sample_groups(parts.tokenizer)[0], behaviour_logprobs=None)]
    update = lambda: policy_update(parts.policy, parts.reference, parts.optimizer, groups, cfg.trainer, 1.0, 0,
                                   loss_cfg=cfg.loss)
    before, after = update(), update()
    assert before.extras["ipo/margin_mean"] == 0.0  # pi = pi_ref before the first step
    assert 0.0 < after.extras["ipo/margin_mean"] < 2.0  # moved towards the target margin 1, not past it wildly
    assert after.logprobs[0] > before.logprobs[0]  # the correct response (reward 1.0) is chosen in both its pairs


def test_a_batch_without_preferences_takes_no_optimizer_step(random_policy_dir, compose_config):
    cfg = small_config(compose_config, "loss=ipo")
    parts = make_parts(random_policy_dir, cfg)
    weights = [p.detach().clone() for p in parts.policy.parameters()]
    groups = [dataclasses.replace(g, rewards=(0.1,) * g.size, behaviour_logprobs=None)
              for g in sample_groups(parts.tokenizer)]
    result = policy_update(parts.policy, parts.reference, parts.optimizer, groups, cfg.trainer, 1.0, 0,
                           loss_cfg=cfg.loss)
    assert result.optimizer_steps == 0 and result.extras["ipo/pairs"] == 0
    assert all(torch.equal(a, b) for a, b in zip(weights, parts.policy.parameters()))


def test_ipo_runs_in_the_loop_counting_fresh_evaluations_like_every_method(random_policy_dir, compose_config):
    cfg = small_config(compose_config, "loss=ipo", "trainer.steps=2", "trainer.groups_per_step=6")
    validate(cfg)
    parts, state = make_parts(random_policy_dir, cfg), TrainState()
    metrics = [train_step(parts, state) for _ in range(cfg.trainer.steps)]
    assert state.fresh_evaluations == plan_fresh_evaluations(6, 2, 2, 0, 1).fresh_evaluations == 24
    assert all("ipo/pairs" in m for m in metrics)
    assert cell_name(cfg) == "rho0-ipo" and variant_label(cfg) == "Fresh-only (IPO loss)"


@pytest.mark.parametrize("tau, fix", [("0", "IPO.*> 0"), ("-1", "IPO.*> 0"),
                                      ("true", r"must be a number \(e\.g\. loss\.tau=")])
def test_a_bad_tau_is_refused_with_the_fix(compose_config, tau, fix):
    # A non-number is refused by the typed schema (src/validate/schema.py) before the IPO range check.
    with pytest.raises(ConfigError, match=rf"loss\.tau=.*{fix}"):
        validate(compose_config("loss=ipo", f"loss.tau={tau}"))
