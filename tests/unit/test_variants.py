"""Variants as options of the one runner (SPEC 9): loss=grpo, buffer=fifo and buffer=popo through `train_step`."""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch
from omegaconf import OmegaConf

from src.eval.standalone import with_components_named
from src.study.budget import plan_fresh_evaluations, planning_max_age
from src.command.config import ConfigError, validate
from src.batch import is_effective
from src.study.sweep import cell_identity, cell_name
from src.task import countdown
from src.batch import TrainState
from src.train import train_step
from tests.unit.test_train import (assert_resumed_like_straight, group, make_parts, policy_update, sample_groups, small_config,
                              straight_and_resumed)


# --------------------------------------------------------------------------- config
@pytest.mark.parametrize("overrides", [
    ["loss=rloo"], ["loss=grpo"], ["buffer=fifo"], ["loss=grpo", "buffer=age1"], ["loss=grpo", "buffer=fifo"],
    ["buffer=fifo", "buffer.positive_bias=0.5"], ["buffer=fifo", "buffer.extra_updates=1"],
    ["buffer=fifo", "buffer.ratio=0", "buffer.extra_updates=1"],
    ["buffer=fifo", "buffer.ratio=0", "buffer.extra_updates=1", "loss=rloo-tis"],
    ["buffer=fifo", "buffer.ratio=0", "buffer.extra_updates=3", "loss=rloo-tis", "behaviour=stale",
     "behaviour.is_level=token"],
    ["buffer=fifo", "buffer.mode=without_replacement"], ["buffer=fifo", "buffer.mode=at_least_once"],
])

def test_every_variant_option_composes_and_validates(compose_config, overrides):
    validate(compose_config(*overrides, hydra=True))


def test_the_default_loss_is_rloo_and_leaves_cell_ids_and_names_unchanged(compose_config):
    """Finished cells in the tracking store keep their ids, so the sweeper still skips them."""
    for overrides in ([], ["buffer=age2", "clip=tight"], ["buffer=age1", "buffer.ratio=0.5"]):
        cfg = compose_config(*overrides)
        assert cfg.loss.name == "rloo"
        as_before = OmegaConf.create(OmegaConf.to_container(cfg))  # the config before the loss group existed
        del as_before["loss"]
        assert cell_identity(with_components_named(as_before, compose_config())) == cell_identity(cfg)
    assert cell_name(compose_config("buffer=age2", "clip=tight")) == "rho1-L2-c1" and cell_name(compose_config()) == "rho0"


def test_variant_cells_are_distinct(compose_config):
    cells = [compose_config(*o) for o in (
        [], ["loss=grpo"], ["buffer=age1", "clip=tight"], ["buffer=age1", "loss=grpo"], ["buffer=fifo"],
        ["buffer=fifo", "buffer.positive_bias=0.5"], ["buffer=fifo", "buffer.extra_updates=1"])]
    assert len({cell_identity(c) for c in cells}) == len(cells)
    assert len({cell_name(c) for c in cells}) == len(cells)
    # grpo does not read clip.ceiling: changing it does not make a new cell
    assert cell_identity(compose_config("loss=grpo", "clip=tight")) == cell_identity(compose_config("loss=grpo"))


@pytest.mark.parametrize("overrides,words", [
    (["loss=grpo", "loss.eps_low=1.0"], ["eps_low=1.0", "value < 1", "clipped below"]),
    (["loss=grpo", "loss.eps_low=-0.1"], ["eps_low=-0.1"]),
    (["loss=grpo", "loss.eps_high=-0.5"], ["eps_high=-0.5", "0 <= value"]),
    (["loss=grpo", "loss.behaviour_cap=0"], ["behaviour_cap=0", "0 < value"]),
    (["loss=grpo", "loss.updates_per_step=0"], ["updates_per_step=0", "1 <= value"]),
    (["loss=grpo", "loss.updates_per_step=1.5"], ["updates_per_step=1.5", "integer"]),
    (["buffer=fifo", "buffer.mode=lifo"], ["lifo", "with_replacement"]),
    (["buffer=fifo", "buffer.positive_bias=1.0"], ["positive_bias=1.0", "value < 1", "delta = 1"]),
    (["buffer=fifo", "buffer.positive_bias=-0.1"], ["positive_bias=-0.1", "0 <= value"]),
    (["buffer=fifo", "buffer.capacity=0"], ["capacity=0", "1 <= value"]),
    (["buffer=fifo", "buffer.extra_updates=-1"], ["extra_updates=-1", "0 <= value"]),
    (["buffer=fifo", "buffer.max_age=2"], ["max_age=2", "no age window"]),
    (["buffer=fifo", "buffer.ratio=0"], ["rho=0", "extra_updates"]),
    (["buffer=fifo", "buffer.mode=without_replacement", "buffer.capacity=64"], ["N=64 rollouts", "4 groups", "B_replay=16"]),
    (["buffer=fifo", "buffer.capacity=8"], ["N=8 rollouts < K=16", "would keep none"]),
])
def test_invalid_variant_configs_are_refused_with_the_value_and_the_fix(compose_config, overrides, words):
    with pytest.raises(ConfigError) as error:
        validate(compose_config(*overrides))
    for word in words:
        assert word in str(error.value)


# --------------------------------------------------------------------------- loss=grpo
def test_grpo_update_raises_the_log_prob_of_the_rewarded_response(random_policy_dir, compose_config):
    cfg = small_config(compose_config, "loss=grpo", "loss.updates_per_step=1", "trainer.kl_coef=0",
                       "trainer.entropy_coef=0")
    parts = make_parts(random_policy_dir, cfg)
    parts.optimizer = torch.optim.SGD(parts.policy.parameters(), lr=0.01)
    groups = [group(parts.tokenizer, [" 1 + 2 + 3", " 9 9 9"], [1.0, 0.0])]
    update = lambda: policy_update(parts.policy, parts.reference, parts.optimizer, groups, cfg.trainer, 1.0, 0,
                                   loss_cfg=cfg.loss)
    before, after = update().logprobs, update().logprobs
    assert after[0] > before[0] and after[1] < before[1]


def test_grpo_single_update_on_fresh_groups_has_ratio_one_and_clips_nothing(random_policy_dir, compose_config):
    cfg = small_config(compose_config, "loss=grpo", "loss.updates_per_step=1")
    parts = make_parts(random_policy_dir, cfg)
    groups = [dataclasses.replace(g, behaviour_logprobs=None) for g in sample_groups(parts.tokenizer)]  # all fresh
    result = policy_update(parts.policy, parts.reference, parts.optimizer, groups, cfg.trainer, 1.0, 0,
                           loss_cfg=cfg.loss)
    assert result.extras["grpo/ratio_mean"] == 1.0 and result.extras["grpo/ratio_max"] == 1.0
    assert result.extras["grpo/clip_frac_low"] == 0.0 and result.extras["grpo/clip_frac_high"] == 0.0
    assert result.extras["grpo/behaviour_weight_mean"] == 1.0 and result.weights.tolist() == [1.0] * 6
    assert result.optimizer_steps == 1
    assert [len(t) for t in result.behaviour_tokens] == [len(r) for g in groups for r in g.response_ids]
    torch.testing.assert_close(result.logprobs, torch.tensor([sum(t) for t in result.behaviour_tokens]))


def test_grpo_micro_batching_gives_the_same_gradients(random_policy_dir, compose_config):
    grads = []
    for micro in (100, 2):
        cfg = small_config(compose_config, "loss=grpo", "loss.updates_per_step=1", f"trainer.micro_batch_size={micro}")
        parts = make_parts(random_policy_dir, cfg)
        parts.optimizer = torch.optim.SGD(parts.policy.parameters(), lr=0.0)
        groups = [dataclasses.replace(g, behaviour_logprobs=None) for g in sample_groups(parts.tokenizer)]
        result = policy_update(parts.policy, parts.reference, parts.optimizer, groups, cfg.trainer, 1.0, 0,
                               loss_cfg=cfg.loss)
        grads.append(([p.grad.clone() for p in parts.policy.parameters()], result.loss))
    assert grads[0][1] == pytest.approx(grads[1][1], rel=1e-5, abs=1e-7)
    for a, b in zip(grads[0][0], grads[1][0]):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-6)


def test_grpo_takes_updates_per_step_optimizer_steps_and_caps_the_behaviour_weight(random_policy_dir,
                                                                                     compose_config):
    cfg = small_config(compose_config, "loss=grpo", "loss.updates_per_step=3")
    parts = make_parts(random_policy_dir, cfg)
    groups = sample_groups(parts.tokenizer)
    # the replayed group's mu per token: very unlikely tokens, so pi_prox/mu is far above the cap
    tokens = [tuple([-20.0] * len(ids)) for ids in groups[1].response_ids]
    groups[1] = dataclasses.replace(groups[1], behaviour_token_logprobs=tokens)
    result = policy_update(parts.policy, parts.reference, parts.optimizer, groups, cfg.trainer, 1.0, 0,
                           loss_cfg=cfg.loss)
    assert result.optimizer_steps == 3 and result.extras["grpo/updates"] == 3.0
    assert result.weights[:3].tolist() == [1.0] * 3
    assert result.weights[3:].tolist() == pytest.approx([2.0] * 3)  # capped at behaviour_cap
    assert result.extras["grpo/behaviour_cap_frac"] > 0


def test_grpo_weight_diagnostics_are_per_token_where_the_cap_acts(random_policy_dir, compose_config):
    """Seed 003 caps pi_prox/mu per token: 20-odd tokens at ratio 1.05 each cap nothing, although their
    sequence ratio 1.05^n is above the cap 2 (the per-response rule logged a clip fraction of 1.0)."""
    from src.batch import Batch, BatchGroup
    from src.policy.forward import row_values
    from src.train import step_metrics

    cfg = small_config(compose_config, "loss=grpo", "loss.updates_per_step=1")
    parts = make_parts(random_policy_dir, cfg)
    parts.optimizer = torch.optim.SGD(parts.policy.parameters(), lr=0.0)  # pi_prox stays put across updates
    long_responses = [" 1 + 2 = 3 </think>\n<answer> 1 + 2 + 3 </answer> 1 + 2 + 3 = 6 6 6"] * 2
    fresh = group(parts.tokenizer, long_responses, [1.0, 0.0])
    replay = group(parts.tokenizer, long_responses, [0.0, 1.0])
    assert min(len(ids) for ids in replay.response_ids) >= 15  # 1.05^15 > 2
    parts.policy.train()
    with torch.no_grad():
        tokens, _, mask = parts.forward.token_stats(parts.policy, [(replay.prompt_ids, ids)
                                                                   for ids in replay.response_ids], with_entropy=False)
    prox = row_values(tokens, mask)
    for ratio, capped in ((1.05, 0.0), (2.5, 1.0)):
        mu = [tuple(t - math.log(ratio) for t in row) for row in prox]
        stored = replay.with_behaviour_logprobs([sum(row) for row in mu], tokens=mu)
        batch = Batch([BatchGroup(fresh), BatchGroup(stored, "replay", 1)])
        update = parts.trainer.update(parts.policy, parts.reference, parts.optimizer, batch)
        metrics = step_metrics(batch, update, parts.loss.weight_ceiling, [], parts.task.correct_reward)
        assert metrics["weights/clip_fraction"] == capped
        assert metrics["weights/raw_mean/replay"] == pytest.approx(ratio, rel=1e-4)
        assert metrics["weights/clipped_max/replay"] == pytest.approx(min(ratio, 2.0), rel=1e-4)
        assert (update.raw_weights[2:] > 2.0).all()  # per response, every replayed sequence is above the cap
        assert metrics["weights/raw_mean/fresh"] == pytest.approx(1.0, rel=1e-5)


# --------------------------------------------------------------------------- the loop
@pytest.mark.parametrize("loss,buffer,ratio", [("grpo", "none", 0), ("grpo", "age1", 1), ("grpo", "fifo", 1),
                                               ("rloo", "fifo", 1)])
def test_variants_run_the_step_and_count_fresh_evaluations_as_planned(random_policy_dir, compose_config, loss,
                                                                      buffer, ratio):
    cfg = small_config(compose_config, f"loss={loss}", f"buffer={buffer}", f"buffer.ratio={ratio}",
                       "trainer.steps=3", "trainer.groups_per_step=6", "loss.updates_per_step=2" if loss == "grpo"
                       else "trainer.seed=0")
    validate(cfg)
    parts, state = make_parts(random_policy_dir, cfg), TrainState()
    metrics = [train_step(parts, state) for _ in range(cfg.trainer.steps)]
    plan = plan_fresh_evaluations(6, 2, 3, ratio, planning_max_age(cfg.buffer, cfg.trainer.steps))
    assert state.fresh_evaluations == plan.fresh_evaluations
    assert tuple(m["batch/replay_groups"] for m in metrics) == plan.replay_groups_per_step
    per_update = 2 if loss == "grpo" else 1
    assert [m["budget/gradient_steps"] for m in metrics] == [per_update, 2 * per_update, 3 * per_update]
    if loss == "grpo":
        assert all("grpo/ratio_mean" in m for m in metrics)
        if parts.buffer is not None:
            assert all(g.behaviour_token_logprobs is not None for g in parts.buffer.groups)
    if buffer == "fifo":
        assert metrics[-1]["fifo/age_at_use_mean"] >= 1 and metrics[-1]["fifo/replay_count_max"] >= 1
        assert metrics[-1]["fifo/draws"] == plan.replay_groups_per_step[-1]


@pytest.mark.parametrize("loss", ["rloo", "grpo"])
def test_a_partial_group_trains_only_its_kept_responses_with_advantages_from_all_k(random_policy_dir,
                                                                                   compose_config, loss):
    cfg = small_config(compose_config, f"loss={loss}", "loss.updates_per_step=1" if loss == "grpo" else "clip=loose")
    parts = make_parts(random_policy_dir, cfg)
    parts.optimizer = torch.optim.SGD(parts.policy.parameters(), lr=0.0)
    groups = sample_groups(parts.tokenizer)
    if loss == "grpo":  # a replayed group needs mu per token; make it equal pi (weight 1) for a clean check
        groups = [dataclasses.replace(g, behaviour_logprobs=None) for g in groups]
    full = policy_update(parts.policy, parts.reference, parts.optimizer, groups, cfg.trainer, 3.0, 0,
                         loss_cfg=cfg.loss)
    part = policy_update(parts.policy, parts.reference, parts.optimizer, groups, cfg.trainer, 3.0, 0,
                         loss_cfg=cfg.loss, responses=[None, (0, 2)])
    kept = [0, 1, 2, 3, 5]
    torch.testing.assert_close(part.logprobs, full.logprobs[kept])
    torch.testing.assert_close(part.weights, full.weights[kept])
    rewards = torch.tensor([g.rewards for g in groups])
    if loss == "rloo":  # eq. 3 over the kept responses, A from all K rewards of each group
        from src.loss.rloo_math import leave_one_out_advantages
        advantages = leave_one_out_advantages(rewards).flatten()[kept]
        expected = -(full.weights[kept] * advantages * full.logprobs[kept]).sum().item() / len(kept)
    else:  # ratio 1, weight 1: -(token-mean of A), A group-normalised from all K rewards
        from src.loss.variant_math import group_normalised_advantages
        advantages = group_normalised_advantages(rewards).flatten()[kept]
        counts = full.token_counts[kept]
        expected = -(advantages * counts).sum().item() / counts.sum().item()
    assert part.policy_loss == pytest.approx(expected, rel=1e-5, abs=1e-7)


def test_train_step_trains_the_rollouts_a_positive_bias_fifo_draws(random_policy_dir, compose_config, monkeypatch):
    """B_replay = 2 groups' worth is 2K = 4 rollouts, drawn singly: the batch trains exactly those, each with
    its leave-one-out advantage from all K rewards of its group."""
    cfg = small_config(compose_config, "buffer=fifo", "buffer.positive_bias=0.5", "trainer.steps=2")
    parts, state = make_parts(random_policy_dir, cfg), TrainState()
    train_step(parts, state)
    seen = []
    real = parts.trainer.update
    monkeypatch.setattr(parts.trainer, "update", lambda policy, reference, optimizer, batch: seen.append(batch)
                        or real(policy, reference, optimizer, batch))
    metrics = train_step(parts, state)
    batch, = seen
    assert [entry.responses for entry in batch.fresh] == [None, None]  # 2 fresh groups whole
    assert sum(len(entry.trained) for entry in batch.replayed) == 2 * cfg.trainer.group_size
    assert all(entry.group.step == 0 for entry in batch.replayed)
    assert metrics["batch/replay_groups"] == 2 and metrics["batch/gap_fill_groups"] == 0
    replayed_rewards = [entry.group.rewards[j] for entry in batch.replayed for j in entry.trained]
    assert metrics["train/reward/replay"] == pytest.approx(sum(replayed_rewards) / len(replayed_rewards))


def test_fifo_extra_updates_add_gradient_steps(random_policy_dir, compose_config):
    cfg = small_config(compose_config, "buffer=fifo", "buffer.extra_updates=1", "trainer.steps=3")
    parts, state = make_parts(random_policy_dir, cfg), TrainState()
    metrics = [train_step(parts, state) for _ in range(3)]
    # step 0: empty buffer, no extra update; then 1 main + 1 extra per step
    assert [m["budget/gradient_steps"] for m in metrics] == [1, 3, 5]
    assert [m["fifo/extra_draws"] for m in metrics] == [0, 4, 4]  # extra batches of B = 4 groups
    cfg0 = small_config(compose_config, "buffer=fifo", "buffer.ratio=0", "buffer.extra_updates=2", "trainer.steps=2")
    parts0, state0 = make_parts(random_policy_dir, cfg0), TrainState()
    metrics0 = [train_step(parts0, state0) for _ in range(2)]
    assert [m["budget/gradient_steps"] for m in metrics0] == [1, 4]  # seed 002: all-fresh batch, then R-1 = 2 more
    assert [m["batch/replay_groups"] for m in metrics0] == [0, 0]


def updates_of(parts):
    """Wrap the trainer so every update's batch and result are kept, in order."""
    seen, update = [], parts.trainer.update

    def keep(policy, reference, optimizer, batch):
        seen.append((batch, update(policy, reference, optimizer, batch)))
        return seen[-1][1]

    parts.trainer.update = keep
    return seen


def test_seed_002_replay_cell_is_one_fresh_update_then_r_minus_1_buffer_updates_with_truncated_is(
        random_policy_dir, compose_config):
    """Seed 002 Algorithm 1 at the on-policy rollout budget: a full fresh batch of B groups, then R - 1 = 1
    update on B groups from the FIFO, replayed rows weighted exp(clip(log pi - log mu, log 0, log 10))."""
    cfg = small_config(compose_config, "buffer=fifo", "buffer.ratio=0", "buffer.extra_updates=1", "loss=rloo-tis",
                       "trainer.steps=3", "trainer.learning_rate=1e-3")
    assert cell_name(cfg) == "fifo-rho0-N512-with_replacement-R2-rloo-tis"  # 256 groups of K = 2
    parts, state = make_parts(random_policy_dir, cfg), TrainState()
    seen = updates_of(parts)
    metrics = [train_step(parts, state) for _ in range(3)]
    b, k = cfg.trainer.groups_per_step, cfg.trainer.group_size
    assert [m["budget/fresh_evaluations"] for m in metrics] == [b * k, 2 * b * k, 3 * b * k]  # on-policy budget
    assert [m["budget/gradient_steps"] for m in metrics] == [1, 3, 5]  # step 0: nothing stored to replay yet
    assert [(len(batch.fresh), len(batch.replayed)) for batch, _ in seen] == [(b, 0), (b, 0), (0, b), (b, 0), (0, b)]
    replayed = torch.cat([result.raw_weights for batch, result in seen if batch.replayed])
    used = torch.cat([result.weights for batch, result in seen if batch.replayed])
    torch.testing.assert_close(used, replayed.clamp(max=10.0))  # truncated at rho_max = 10, not eq. 2's c
    assert (replayed != 1.0).any()


def test_seed_002_aggressive_cell_truncates_replayed_tokens_at_rho_max_2(random_policy_dir, compose_config):
    """Stale n = 1 + replay R = 4 + token IS (rho_max = 2, the stale behaviour's): replayed rows are weighted
    per token, from the per-token log mu stored with each fresh group."""
    cfg = small_config(compose_config, "buffer=fifo", "buffer.ratio=0", "buffer.extra_updates=3", "loss=rloo-tis",
                       "behaviour=stale", "behaviour.lag=1", "behaviour.is_level=token", "trainer.steps=3",
                       "trainer.learning_rate=1e-3")
    assert (cfg.loss.is_max_token, cfg.loss.is_level) == (2.0, "token")  # the behaviour group's truncation
    parts, state = make_parts(random_policy_dir, cfg), TrainState()
    seen = updates_of(parts)
    metrics = [train_step(parts, state) for _ in range(3)]
    assert [m["budget/gradient_steps"] for m in metrics] == [1, 5, 9]
    replay_results = [result for batch, result in seen if batch.replayed]
    assert len(replay_results) == 6 and all(result.token_weights is not None for result in replay_results)
    tokens = torch.cat([torch.cat(result.token_weights) for result in replay_results])
    raw = torch.cat([torch.cat(result.token_raw_weights) for result in replay_results])
    torch.testing.assert_close(tokens, raw.clamp(max=2.0))
    assert all(group.behaviour_token_logprobs is not None for group in parts.buffer.groups)


def test_seed_002_replay_cell_plans_table_1s_rollouts(compose_config):
    """Seed 002 Table 1 at its sizes (B = 32 prompts, K = 8, 60 steps): 15,360 rollouts for R = 2, as on-policy."""
    from src.study.budget import plan_for_config

    cfg = compose_config("buffer=fifo", "buffer.ratio=0", "buffer.extra_updates=1", "loss=rloo-tis",
                  "trainer.groups_per_step=32", "trainer.group_size=8", "trainer.steps=60")
    assert plan_for_config(cfg).fresh_evaluations == 15_360


@pytest.mark.parametrize("overrides", [["buffer=fifo", "buffer.extra_updates=1"],
                                       ["buffer=fifo", "loss=grpo", "loss.updates_per_step=2",
                                        "buffer.positive_bias=0.5"]])
def test_resuming_a_fifo_run_from_a_checkpoint_continues_exactly(random_policy_dir, compose_config, tmp_path,
                                                                 overrides):
    cfg = small_config(compose_config, *overrides, "trainer.steps=4")
    keys = ("train/reward", "train/loss", "batch/replay_groups", "weights/raw_mean", "budget/fresh_evaluations",
            "budget/gradient_steps", "fifo/age_at_use_mean", "fifo/replay_count_mean", "fifo/stored_rollouts")

    straight, resumed, run = straight_and_resumed(make_parts, random_policy_dir, cfg, tmp_path)
    assert (run["run_id"], run["step"]) == ("run-1", 2)
    assert run["buffer_sizes"][0] == run["buffer_sizes"][1]  # the restored buffer holds what the first one did
    assert_resumed_like_straight(straight, resumed, keys)


def test_the_variants_study_runs_every_variant_once_sharing_the_baseline_cells():
    from src.runs.cells import CellRuns
    from src.study.sweep import plan_cells
    from tests.e2e.test_sweep import study_jobs

    planned = plan_cells(study_jobs("variants"), CellRuns({}, {}))
    assert len(planned) == 19 and len({cell.cell_id for cell in planned}) == 19
    assert {"popo-grpo", "popo-ineff-grpo", "popo-stale2-grpo", "popo-c1", "rho0-grpo-dapo", "rho0-stale4",
            "rho0-T1.2", "rho0-frontier", "rho0-failure", "rho0-goldilocks", "rho0-ipo",
            "fifo-rho0-N4096-with_replacement-R2-rloo-tis",
            "fifo-rho0-N4096-with_replacement-R4-rloo-tis-stale4-tokenIS"} <= {cell.cell for cell in planned}
    shared = {cell.cell_id for cell in plan_cells(study_jobs("baseline") + study_jobs("age"), CellRuns({}, {}))}
    assert {cell.cell for cell in planned if cell.cell_id in shared} == {"rho0", "rho1-L1-c1"}


# --------------------------------------------------------------------------- one way to ask for POPO and DAPO
@pytest.mark.parametrize("overrides", [["buffer=popo"], ["buffer=popo", "loss=grpo"], ["loss=grpo", "buffer=popo"],
                                       ["buffer=popo", "buffer.variant=popo-ineff"], ["sampling=dynamic"],
                                       ["buffer=popo", "policy=qwen2.5-0.5b"]])
def test_popo_and_dapo_options_alone_give_seed_003s_configuration(compose_config, overrides):
    """Seed 003 D.2: the GRPO clipped surrogate with clip-higher 0.2/0.28, POPO's behaviour weight capped at 2,
    and no KL penalty, whichever way the option is asked for."""
    cfg = compose_config(*overrides)
    validate(cfg, check_device=False)
    loss = cfg.loss
    assert (loss.name, loss.eps_low, loss.eps_high, loss.behaviour_cap) == ("grpo", 0.2, 0.28, 2.0)
    assert cfg.trainer.kl_coef == 0


def test_asking_for_popo_with_or_without_loss_grpo_is_one_cell(compose_config):
    assert cell_identity(compose_config("buffer=popo")) == cell_identity(compose_config("buffer=popo", "loss=grpo"))
    assert cell_identity(compose_config("sampling=dynamic")) == cell_identity(
        compose_config("sampling=dynamic", "loss=grpo", "trainer.kl_coef=0"))


@pytest.mark.parametrize("overrides, words", [
    (["buffer=popo", "loss=rloo"], ["buffer=popo with loss=rloo", "drop loss=rloo", "buffer.mechanism_only=true"]),
    (["buffer=popo", "loss=ipo"], ["loss=ipo", "GRPO clipped surrogate"]),
    (["buffer=popo", "loss=grpo", "trainer.kl_coef=0.05"], ["trainer.kl_coef=0.05", "without a KL penalty",
                                                            "buffer.mechanism_only=true"]),
    (["buffer=popo", "buffer.variant=popo-stale", "buffer.stale_factor=2", "trainer.kl_coef=1e-3"],
     ["kl_coef=0.001"]),
    (["sampling=dynamic", "loss=rloo-tis"], ["sampling=dynamic with loss=rloo-tis", "sampling.mechanism_only=true"]),
    (["sampling=dynamic", "trainer.kl_coef=1e-3"], ["DAPO trains without a KL penalty", "drop the override"]),
])
def test_choices_that_cannot_be_popo_or_dapo_are_refused_in_one_line(compose_config, overrides, words):
    with pytest.raises(ConfigError) as error:
        validate(compose_config(*overrides), check_device=False)
    message = str(error.value)
    assert "\n" not in message and all(word in message for word in words), message


@pytest.mark.parametrize("overrides", [
    ["buffer=popo", "buffer.mechanism_only=true", "loss=rloo", "trainer.kl_coef=1e-3", "clip=tight"],  # popo-c1
    ["buffer=popo", "buffer.mechanism_only=true", "loss=grpo", "trainer.kl_coef=0.05"],
    ["sampling=dynamic", "sampling.mechanism_only=true", "loss=rloo"],
])
def test_mechanism_only_runs_the_mechanism_on_the_loss_and_kl_named(compose_config, overrides):
    cfg = compose_config(*overrides)
    validate(cfg, check_device=False)
    named = dict(override.split("=", 1) for override in overrides)
    assert cfg.loss.name == named["loss"] and cfg.trainer.kl_coef == float(named.get("trainer.kl_coef", 0))


# --------------------------------------------------------------------------- POPO (seed 003)
@pytest.mark.parametrize("overrides, words", [
    (["buffer=popo", "buffer.variant=popo-fancy"], ["popo-fancy", "popo-ineff"]),
    (["buffer=popo", "buffer.stale_factor=2"], ["stale_factor=2", "popo-stale"]),
    (["buffer=popo", "buffer.ratio=1"], ["ratio=1", "ratio=0"]),
])
def test_popo_settings_are_refused_with_the_fix(compose_config, overrides, words):
    with pytest.raises(ConfigError) as error:
        validate(compose_config(*overrides))
    assert all(word in str(error.value) for word in words)


def test_popo_drops_ineffective_groups_and_refills_from_memory(random_policy_dir, compose_config, monkeypatch):
    """Online groups with equal rewards leave the batch; the most recent effective groups of earlier steps refill it."""
    # A deterministic stand-in verifier: about half the responses "correct", so some groups are effective.
    patch_reward(monkeypatch, lambda text, numbers, target: float(len(text) % 2))
    cfg = small_config(compose_config, "loss=grpo", "loss.updates_per_step=1", "buffer=popo", "trainer.steps=4",
                       "trainer.groups_per_step=6")
    validate(cfg)
    parts, state = make_parts(random_policy_dir, cfg), TrainState()
    metrics = []
    for _ in range(cfg.trainer.steps):
        metrics.append(train_step(parts, state))
        # The memory holds only effective groups, each with the log-probs a later replay needs.
        assert all(is_effective(g) and g.behaviour_token_logprobs is not None for g in parts.buffer.groups)
    assert state.fresh_evaluations == 4 * 6 * 2  # every step samples all B groups online, each counted
    for m in metrics:
        online, replayed, dropped = m["popo/online_groups"], m["popo/replayed_groups"], m["popo/dropped_groups"]
        assert online + dropped == 6 and online + replayed + m["popo/shortfall"] == 6
        assert m["popo/effective_sample_ratio"] == 1.0 and m["popo/on_policy_share"] == pytest.approx(
            online / (online + replayed))
    assert metrics[0]["popo/replayed_groups"] == 0  # nothing to refill from at step 0
    assert any(m["popo/replayed_groups"] > 0 for m in metrics[1:])


def test_popo_step_with_nothing_effective_takes_no_update(random_policy_dir, compose_config, monkeypatch):
    patch_reward(monkeypatch, lambda text, numbers, target: 0.0)  # every group ineffective
    cfg = small_config(compose_config, "loss=grpo", "buffer=popo", "trainer.steps=1")
    parts, state = make_parts(random_policy_dir, cfg), TrainState()
    before = [p.detach().clone() for p in parts.policy.parameters()]
    metrics = train_step(parts, state)
    assert metrics["popo/shortfall"] == cfg.trainer.groups_per_step and metrics["budget/gradient_steps"] == 0
    assert metrics["train/reward"] == 0.0 and state.fresh_evaluations == 4 * 2
    assert all(torch.equal(a, b) for a, b in zip(before, parts.policy.parameters()))


def test_popo_ineff_memory_keeps_every_online_group_with_its_log_mu(random_policy_dir, compose_config, monkeypatch):
    """POPO-ineff (seed 003 sec. 5.3): ineffective groups still leave the batch, but the memory keeps them too."""
    patch_reward(monkeypatch, lambda text, numbers, target: float(len(text) % 2))
    cfg = small_config(compose_config, "loss=grpo", "loss.updates_per_step=1", "buffer=popo",
                       "buffer.variant=popo-ineff", "trainer.steps=3", "trainer.groups_per_step=6")
    validate(cfg)
    parts, state = make_parts(random_policy_dir, cfg), TrainState()
    metrics = [train_step(parts, state) for _ in range(cfg.trainer.steps)]
    stored = parts.buffer.groups
    assert len(stored) == 6  # capacity B: the last step's six online groups, effective or not
    assert any(not is_effective(g) for g in stored)
    assert all(g.behaviour_logprobs is not None and g.behaviour_token_logprobs is not None for g in stored)
    # mu of an ineffective group is its sequence log-prob under the policy that sampled it
    assert all(math.isclose(sum(tokens), total, rel_tol=1e-5, abs_tol=1e-4)
               for g in stored for tokens, total in zip(g.behaviour_token_logprobs, g.behaviour_logprobs))
    refilled = [m for m in metrics[1:] if m["popo/replayed_groups"] > 0]
    assert refilled and any(m["popo/effective_sample_ratio"] < 1.0 for m in refilled)


# --------------------------------------------------------------------------- DAPO dynamic sampling
def parity_verifier(text, numbers, target):
    return float(len(text) % 2)  # deterministic stand-in: a group of K=2 is effective iff its lengths' parities differ


def test_dynamic_sampling_fills_the_batch_with_effective_groups_and_counts_every_rollout(random_policy_dir,
                                                                                      compose_config, monkeypatch):
    patch_reward(monkeypatch, parity_verifier)
    cfg = small_config(compose_config, "sampling=dynamic", "sampling.oversample=1.5", "sampling.max_rounds=20",
                       "trainer.steps=3")
    validate(cfg)
    parts, state = make_parts(random_policy_dir, cfg), TrainState()
    metrics = [train_step(parts, state) for _ in range(cfg.trainer.steps)]
    for m in metrics:
        assert m["dynamic/kept_groups"] == 4 and m["dynamic/shortfall"] == 0
        assert m["batch/effective_fraction"] == 1.0  # only effective groups trained
        assert m["dynamic/generated_groups"] >= 6  # round 1 alone samples ceil(4 x 1.5) prompts
    # Every generated rollout is a fresh verifier evaluation, kept or not.
    assert state.fresh_evaluations == sum(m["dynamic/generated_groups"] for m in metrics) * 2
    assert metrics[-1]["budget/fresh_evaluations"] == state.fresh_evaluations
    assert any(m["batch/effective_fraction_fresh"] < 1.0 for m in metrics)  # something was discarded


def test_dynamic_sampling_gives_up_after_max_rounds(random_policy_dir, compose_config, monkeypatch):
    patch_reward(monkeypatch, lambda text, numbers, target: 0.0)  # nothing is ever effective
    cfg = small_config(compose_config, "sampling=dynamic", "sampling.oversample=1.5", "sampling.max_rounds=3",
                       "trainer.steps=1")
    parts, state = make_parts(random_policy_dir, cfg), TrainState()
    before = [p.detach().clone() for p in parts.policy.parameters()]
    metrics = train_step(parts, state)
    # Three rounds of ceil(4 x 1.5) = 6 prompts, K = 2 each: 36 evaluations, nothing kept, no update.
    assert (metrics["dynamic/rounds"], metrics["dynamic/generated_groups"], metrics["dynamic/shortfall"]) == (3, 18, 4)
    assert state.fresh_evaluations == 36 and metrics["budget/gradient_steps"] == 0
    assert all(torch.equal(a, b) for a, b in zip(before, parts.policy.parameters()))


def test_standard_sampling_logs_the_effective_fractions(random_policy_dir, compose_config, monkeypatch):
    patch_reward(monkeypatch, parity_verifier)
    cfg = small_config(compose_config, "trainer.steps=2")
    parts, state = make_parts(random_policy_dir, cfg), TrainState()
    metrics = [train_step(parts, state) for _ in range(2)]
    groups_effective = [m["batch/effective_fraction"] * 4 for m in metrics]
    assert metrics[-1]["batch/effective_fraction_cumulative"] == pytest.approx(sum(groups_effective) / 8)
    assert all(m["batch/effective_fraction"] == m["batch/effective_fraction_fresh"] for m in metrics)


# --------------------------------------------------------------------------- frontier curriculum in the loop
def test_frontier_curriculum_runs_in_the_loop_and_resumes_exactly(random_policy_dir, compose_config, tmp_path,
                                                                  monkeypatch):
    patch_reward(monkeypatch, parity_verifier)
    cfg = small_config(compose_config, "curriculum=frontier", "curriculum.fraction=0.5", "curriculum.min_memory=1",
                       "trainer.steps=4")
    validate(cfg)
    straight, resumed, _ = straight_and_resumed(make_parts, random_policy_dir, cfg, tmp_path)
    assert straight[0]["curriculum/requested"] == 2  # round(0.5 x 4) slots per batch
    assert any(m["curriculum/retrieved"] > 0 for m in straight[1:])  # once memory holds a frontier prompt
    assert max(m["curriculum/memory_size"] for m in straight) >= 1
    assert_resumed_like_straight(straight, resumed,
                                 ("train/reward", "train/loss", "curriculum/memory_size", "curriculum/retrieved"))


@pytest.mark.parametrize("overrides,words", [
    (["sampling=dynamic", "sampling.oversample=0.5"], ["oversample=0.5", "1 <= value"]),
    (["sampling=dynamic", "sampling.max_rounds=0"], ["max_rounds=0", "1 <= value"]),
    (["curriculum=frontier", "curriculum.fraction=0.001"], ["fraction=0.001"]),
])
def test_invalid_sampling_and_curriculum_settings_are_refused(compose_config, overrides, words):
    with pytest.raises(ConfigError) as error:
        validate(compose_config(*overrides))
    assert all(word in str(error.value) for word in words), str(error.value)


def test_new_groups_at_their_defaults_leave_cell_ids_unchanged_and_variants_are_distinct(compose_config):
    for overrides in ([], ["buffer=age2", "clip=tight"], ["loss=grpo", "buffer=fifo"]):
        cfg = compose_config(*overrides)
        before = OmegaConf.create(OmegaConf.to_container(cfg))
        for new_group in ("sampling", "behaviour", "curriculum"):
            del before[new_group]  # the config before these groups existed
        for group in ("buffer", "loss", "task"):
            del before[group]["_target_"]  # ... and before components were named
        read_back = with_components_named(before, compose_config())
        assert cell_identity(read_back) == cell_identity(cfg)
        assert read_back.buffer._target_ == cfg.buffer._target_ and read_back.loss._target_ == cfg.loss._target_
    cells = [compose_config(*o) for o in ([], ["sampling=dynamic"], ["curriculum=frontier"], ["curriculum=failure"],
                                          ["buffer=popo", "loss=grpo", "buffer.variant=popo-ineff"],
                                          ["buffer=popo", "loss=grpo"])]
    assert len({cell_identity(c) for c in cells}) == len({cell_name(c) for c in cells}) == len(cells)
    assert cell_name(cells[1]) == "rho0-grpo-dapo" and cell_name(cells[4]) == "popo-ineff-grpo"


def test_resuming_a_dynamic_sampling_run_continues_exactly(random_policy_dir, compose_config, tmp_path, monkeypatch):
    patch_reward(monkeypatch, parity_verifier)
    cfg = small_config(compose_config, "sampling=dynamic", "sampling.max_rounds=20", "buffer=age1", "trainer.steps=4")
    straight, resumed, _ = straight_and_resumed(make_parts, random_policy_dir, cfg, tmp_path)
    assert_resumed_like_straight(straight, resumed,
                                 ("train/reward", "train/loss", "dynamic/generated_groups", "budget/fresh_evaluations"))


def patch_reward(monkeypatch, reward) -> None:
    """Countdown's verifier with `reward(text, numbers, target)` as its reward: the task scores through
    `countdown.verify`, looked up at each call, so the collection and the evaluation both see it."""
    real = countdown.verify
    monkeypatch.setattr(countdown, "verify", lambda text, numbers, target: dataclasses.replace(
        real(text, numbers, target), reward=float(reward(text, numbers, target))))


def test_a_curriculum_setting_its_sampler_does_not_take_is_refused_before_anything_runs(compose_config):
    # A study of `curriculum: frontier,none` whose preset sets curriculum.fraction gives the none cell a setting
    # uniform sampling does not take: the sweep's plan (validate) must refuse it, not the cell's job.
    cfg = compose_config("curriculum=none")
    OmegaConf.set_struct(cfg, False)
    cfg.curriculum.fraction = 0.1
    with pytest.raises(ConfigError, match="fraction"):
        validate(cfg)
