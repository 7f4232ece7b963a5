"""Stale and diversified behaviour with truncated importance sampling (SPEC 9; seed 002 sec. 3.2, eq. 3)."""

from __future__ import annotations

import math

import pytest
import torch

from src.settings import RunSettings
from src.command.config import ConfigError, validate
from src.rollout.behaviour import BehaviourPolicy
from src.study.sweep import cell_identity, cell_name, variant_label
from src.batch import TrainState
from src.train import train_step
from tests.unit.test_train import (assert_resumed_like_straight, group, make_parts, policy_update, small_config,
                              straight_and_resumed)


# --------------------------------------------------------------------------- which weights sample
def test_stale_behaviour_samples_with_the_weights_from_lag_steps_back():
    policy = torch.nn.Linear(1, 1, bias=False)
    behaviour = BehaviourPolicy(policy, lag=2, temperature=1.0)
    seen = []
    for step in range(5):
        with torch.no_grad():
            policy.weight.fill_(float(step))  # theta_t = t
        model, lag = behaviour.model_for_step(policy)
        seen.append((lag, model.weight.item(), model is policy))
    # Until two updates exist, the current weights (seed 002); then theta_{t-2}.
    assert seen == [(0, 0.0, True), (0, 1.0, True), (2, 0.0, False), (2, 1.0, False), (2, 2.0, False)]
    assert len(behaviour.history) == 3  # lag + 1 snapshots, no more


def test_behaviour_history_survives_a_checkpoint():
    policy = torch.nn.Linear(1, 1, bias=False)
    first = BehaviourPolicy(policy, lag=1, temperature=1.0)
    with torch.no_grad():
        policy.weight.fill_(7.0)
    first.model_for_step(policy)
    restored = BehaviourPolicy(policy, lag=1, temperature=1.0)
    restored.load_state_dict(first.state_dict())
    with torch.no_grad():
        policy.weight.fill_(8.0)
    model, lag = restored.model_for_step(policy)
    assert (lag, model.weight.item()) == (1, 7.0)
    with pytest.raises(ValueError, match="lag"):
        BehaviourPolicy(policy, lag=3, temperature=1.0).load_state_dict(first.state_dict())


# --------------------------------------------------------------------------- the update
RESPONSES = [" 1 + 2 = 3 </think>\n<answer> 1 + 2 + 3 </answer>", " 7 8", " 6 * 1"]


def off_policy_update(policy_dir, compose_config, level, offset=None):
    """One rloo update on a group sampled 'off-policy' whose log mu = log pi - offset (per token); returns result, grads."""
    cfg = small_config(compose_config, "behaviour=stale", f"behaviour.is_level={level}", "behaviour.is_max=2.0",
                       "behaviour.is_max_token=2.0", "behaviour.is_min=0.5")
    parts = make_parts(policy_dir, cfg)
    parts.optimizer = torch.optim.SGD(parts.policy.parameters(), lr=0.0)  # keep the weights, read the gradients
    fresh = group(parts.tokenizer, RESPONSES, [1.0, 0.0, 0.1])
    sequences = [(fresh.prompt_ids, ids) for ids in fresh.response_ids]
    tokens = parts.forward.sampled_token_logprobs(parts.policy, sequences, temperature=1.0)
    if offset is not None:
        tokens = [tuple(t - offset(i, n) for n, t in enumerate(row)) for i, row in enumerate(tokens)]
    fresh = fresh.with_behaviour_logprobs([sum(row) for row in tokens], None, tokens)
    result = policy_update(parts.policy, parts.reference, parts.optimizer, [fresh], cfg.trainer, clip_ceiling=1.0,
                           pad_id=parts.tokenizer.pad_token_id, off_policy_groups=1, truncation=cfg.behaviour)
    return result, [p.grad.clone() for p in parts.policy.parameters()], tokens


def plain_fresh_update(policy_dir, compose_config):
    cfg = small_config(compose_config)
    parts = make_parts(policy_dir, cfg)
    parts.optimizer = torch.optim.SGD(parts.policy.parameters(), lr=0.0)
    fresh = group(parts.tokenizer, RESPONSES, [1.0, 0.0, 0.1])
    policy_update(parts.policy, parts.reference, parts.optimizer, [fresh], cfg.trainer, clip_ceiling=1.0,
                  pad_id=parts.tokenizer.pad_token_id)
    return [p.grad.clone() for p in parts.policy.parameters()]


@pytest.mark.parametrize("level", ["sequence", "token"])
def test_a_behaviour_equal_to_the_policy_gives_weight_one_and_the_on_policy_gradient(random_policy_dir,
                                                                                      compose_config, level):
    result, grads, _ = off_policy_update(random_policy_dir, compose_config, level)
    torch.testing.assert_close(result.weights, torch.ones(3), rtol=0, atol=1e-5)
    for a, b in zip(grads, plain_fresh_update(random_policy_dir, compose_config)):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-6)


def test_sequence_level_weight_is_the_truncated_sequence_ratio(random_policy_dir, compose_config):
    # Response 0: every token 3x likelier now than under mu -> raw 3^T, truncated to 2; response 1:
    # each token half as likely -> raw 0.5^T, truncated below at 0.5; response 2: unchanged -> 1.
    def offset(response, token):
        return {0: math.log(3.0), 1: math.log(0.5), 2: 0.0}[response]
    result, _, tokens = off_policy_update(random_policy_dir, compose_config, "sequence", offset)
    lengths = [len(row) for row in tokens]
    torch.testing.assert_close(result.raw_weights, torch.tensor([3.0 ** lengths[0], 0.5 ** lengths[1], 1.0]),
                               rtol=1e-3, atol=0)
    torch.testing.assert_close(result.weights, torch.tensor([2.0, 0.5, 1.0]), rtol=1e-4, atol=1e-5)


def test_token_level_weights_truncate_each_token(random_policy_dir, compose_config):
    # Alternate tokens 3x likelier / as likely: token weights 2 (truncated), 1, 2, 1, ...
    def offset(response, token):
        return math.log(3.0) if token % 2 == 0 else 0.0
    result, _, tokens = off_policy_update(random_policy_dir, compose_config, "token", offset)
    expected = [sum(2.0 if n % 2 == 0 else 1.0 for n in range(len(row))) / len(row) for row in tokens]
    torch.testing.assert_close(result.weights, torch.tensor(expected), rtol=1e-4, atol=1e-5)  # mean token weight


def test_truncated_fraction_counts_tokens_at_token_level(random_policy_dir, compose_config):
    """Only the first token of each response is 3x likelier now than under mu: at is_level=token one token
    per response is truncated, although every sequence ratio (3) is above is_max = 2."""
    from types import SimpleNamespace

    from src.batch import Batch, BatchGroup

    def offset(response, token):
        return math.log(3.0) if token == 0 else 0.0
    result, _, tokens = off_policy_update(random_policy_dir, compose_config, "token", offset)
    behaviour = BehaviourPolicy(None, lag=0, temperature=1.2, is_min=0.5, is_max=2.0, is_level="token")
    rows = torch.ones(3, dtype=torch.bool)
    raw, _ = result.weights_of(rows)
    assert raw.numel() == sum(len(row) for row in tokens)  # one weight per response token
    entries = Batch([BatchGroup(SimpleNamespace(size=3), "fresh", 0, None, True)])
    metrics = behaviour.metrics(SimpleNamespace(off_policy=True, lag=0, temperature=1.2), entries, result)
    assert metrics["behaviour/truncated_fraction"] == pytest.approx(3 / raw.numel(), rel=1e-6)
    assert (result.raw_weights > 2.0).all()  # per response, all three would count as truncated


# --------------------------------------------------------------------------- the loop
def test_stale_behaviour_runs_the_step_with_off_policy_fresh_weights(random_policy_dir, compose_config):
    cfg = small_config(compose_config, "behaviour=stale", "behaviour.lag=1", "buffer=age1", "clip=tight",
                       "trainer.steps=3")
    validate(cfg)
    parts, state = make_parts(random_policy_dir, cfg, learning_rate=1e-2), TrainState()
    metrics = [train_step(parts, state) for _ in range(cfg.trainer.steps)]
    assert [m["behaviour/lag"] for m in metrics] == [0.0, 1.0, 1.0]
    assert metrics[0]["weights/raw_mean/fresh"] == 1.0  # step 0: no older weights yet, sampled on-policy
    assert metrics[1]["weights/raw_mean/fresh"] != pytest.approx(1.0, abs=1e-6)  # sampled by theta_0, trained at theta_1
    assert all(m["weights/clipped_max/fresh"] <= cfg.behaviour.is_max + 1e-6 for m in metrics[1:])
    assert "behaviour/truncated_fraction" in metrics[1] and "time/behaviour_logprobs" in metrics[1]
    # Stored groups keep the stale sampler's log mu, not the log pi the update saw.
    stored = [g for g in parts.buffer.groups if g.step == 2]
    assert stored and all(g.behaviour_token_logprobs is not None for g in stored)
    assert state.fresh_evaluations == 4 * 2 + 2 * 2 * 2  # B=4 at step 0, then B_fresh=2, K=2


def test_diverse_behaviour_samples_at_its_temperature_and_corrects_to_the_training_one(random_policy_dir,
                                                                                       compose_config):
    cfg = small_config(compose_config, "behaviour=diverse", "behaviour.temperature=1.5", "trainer.steps=1")
    parts, state = make_parts(random_policy_dir, cfg), TrainState()
    metrics = train_step(parts, state)
    assert metrics["behaviour/temperature"] == 1.5 and metrics["behaviour/lag"] == 0.0
    assert metrics["weights/raw_mean/fresh"] != pytest.approx(1.0, abs=1e-6)


@pytest.mark.parametrize("overrides", [["behaviour=stale", "behaviour.lag=1", "buffer=age1"],
                                       ["behaviour=diverse", "behaviour.is_level=token"]])
def test_resuming_an_off_policy_behaviour_run_continues_exactly(random_policy_dir, compose_config, tmp_path,
                                                                overrides):
    cfg = small_config(compose_config, *overrides, "trainer.steps=4")
    straight, resumed, _ = straight_and_resumed(make_parts, random_policy_dir, cfg, tmp_path)
    assert_resumed_like_straight(straight, resumed,
                                 ("train/reward", "train/loss", "weights/raw_mean/fresh", "budget/fresh_evaluations"))


# --------------------------------------------------------------------------- config
@pytest.mark.parametrize("overrides,words", [
    (["behaviour=stale", "behaviour.lag=-1"], ["lag=-1", "0 <= value"]),
    (["behaviour=stale", "behaviour.lag=0"], ["lag=0", "behaviour=current"]),
    (["behaviour=diverse", "behaviour.temperature=1.0"], ["temperature 1.0", "behaviour=current"]),
    (["behaviour=diverse", "behaviour.temperature=0"], ["temperature=0", "0 < value"]),
    (["behaviour=stale", "behaviour.is_level=group"], ["is_level='group'", "token"]),
    (["behaviour=stale", "behaviour.is_max=0.5"], ["is_max=0.5", "1 <= value"]),
    (["behaviour=stale", "behaviour.is_level=token", "behaviour.is_max_token=0.5"],
     ["behaviour.is_max_token=0.5", "1 <= value"]),
    (["behaviour=stale", "behaviour.is_min=1.5", "behaviour.is_max=3"], ["is_min=1.5"]),
])
def test_invalid_behaviour_settings_are_refused_with_the_fix(compose_config, overrides, words):
    with pytest.raises(ConfigError) as error:
        validate(compose_config(*overrides))
    assert all(word in str(error.value) for word in words), str(error.value)


@pytest.mark.parametrize("overrides, cap", [
    (["behaviour=stale"], 10.0), (["behaviour=diverse"], 10.0),
    (["behaviour=stale", "behaviour.is_level=token"], 2.0), (["behaviour=diverse", "behaviour.is_level=token"], 2.0),
    (["loss=rloo-tis", "buffer=fifo", "buffer.ratio=0", "buffer.extra_updates=1"], 10.0),
    (["loss=rloo-tis", "behaviour=stale", "behaviour.is_level=token"], 2.0),
])
def test_seed_002_truncates_at_10_per_sequence_and_2_per_token(compose_config, overrides, cap):
    """Seed 002 l.121: "rho_max = 10 ... for all experiments", "rho_max = 2 ... with token importance sampling"."""
    from src.build import build_rollout_and_trainer

    cfg = compose_config(*overrides)
    validate(cfg, check_device=False)
    behaviour, _, trainer = build_rollout_and_trainer(RunSettings(cfg), torch.nn.Module(), None, None, None, None, None)
    for truncation in (behaviour.truncation, getattr(trainer.objective, "truncation", None)):
        if truncation is not None:
            assert (truncation.is_min, truncation.is_max) == (0.0, cap)


def test_behaviour_cells_are_named_and_distinct(compose_config):
    stale, diverse = compose_config("behaviour=stale"), compose_config("behaviour=diverse", "behaviour.is_level=token")
    assert cell_name(stale) == "rho0-stale4" and cell_name(diverse) == "rho0-T1.2-tokenIS"
    assert variant_label(stale) == "Fresh-only + stale behaviour n=4 (sequence IS)"
    assert len({cell_identity(c) for c in (compose_config(), stale, diverse)}) == 3
