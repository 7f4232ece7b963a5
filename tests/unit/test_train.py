"""The training step: loss/gradient properties, budget counting, and exact resume from a checkpoint."""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch

from hydra.utils import instantiate
from omegaconf import OmegaConf

from src.settings import RunSettings
from src.batch import Batch, BatchGroup, Group
from src.study.budget import plan_fresh_evaluations
from src.loss.base import Truncation
from src.loss.inputs import Needs
from src.loss.rloo import RlooObjective
from src.loss.trainer import Trainer
from src.policy.forward import Forward, micro_batches
from src.build import build_components
from src.task import countdown
from src.runs.checkpoint import read_checkpoint, restore_checkpoint, save_checkpoint
from src.components import Components
from src.batch import TrainState
from src.train import train_step


def make_parts(policy_dir, cfg, learning_rate=None) -> Components:
    """The step's components as src.build builds them for `cfg`, on a local policy folder."""
    cfg = OmegaConf.merge(cfg, {"policy": {"name_or_path": str(policy_dir)},
                                "trainer": {"learning_rate": learning_rate or cfg.trainer.learning_rate}})
    return build_components(RunSettings(cfg), countdown.generate_instances(64, seed=1))


def policy_update(policy, reference, optimizer, groups, trainer_cfg, clip_ceiling=1.0, pad_id=0, autocast=None,
                  loss_cfg=None, responses=None, off_policy_groups=0, truncation=None):
    """One update of the objective `loss_cfg` names (RLOO with `clip_ceiling` by default) on `groups`.

    `responses[g]`: the responses of group g to train on (None: all); the first `off_policy_groups`
    groups were sampled by a stale or tempered behaviour, corrected with `truncation`'s weights.
    """
    forward = Forward(pad_id, trainer_cfg.micro_batch_size, trainer_cfg.micro_batch_tokens, autocast,
                      trainer_cfg.fused_logprobs)
    settings = dict(truncation=None if truncation is None else Truncation.checked(
        "behaviour", truncation.is_min, truncation.is_max, truncation.is_level, truncation.get("is_max_token")))
    if loss_cfg is None or loss_cfg.name == "rloo":
        objective = RlooObjective(clip_ceiling, **settings)
    else:
        objective = instantiate(loss_cfg, **settings)
    trainer = Trainer(objective, forward, kl_coef=trainer_cfg.kl_coef, entropy_coef=trainer_cfg.entropy_coef,
                      max_grad_norm=trainer_cfg.max_grad_norm)
    entries = [BatchGroup(g, "fresh", 0, None if responses is None else responses[i], i < off_policy_groups)
               for i, g in enumerate(groups)]
    return trainer.update(policy, reference, optimizer, Batch(entries))


def small_config(compose_config, *overrides):
    return compose_config("trainer.groups_per_step=4", "trainer.group_size=2", "policy.max_new_tokens=12",
                          "trainer.micro_batch_size=3", *overrides)


def group(tokenizer, responses, rewards, step=0, behaviour=None) -> Group:
    prompt = countdown.format_prompt(countdown.Instance((1, 2, 3), 6), countdown.DEFAULT_PROMPT_TEMPLATE)
    return Group(prompt=prompt, prompt_ids=tuple(tokenizer(prompt)["input_ids"]),
                 truth={"numbers": [1, 2, 3], "target": 6}, responses=responses,
                 response_ids=[tuple(tokenizer(r)["input_ids"]) for r in responses],
                 rewards=rewards, step=step, behaviour_logprobs=behaviour)


def gradients_after_update(policy_dir, compose_config, groups_of, micro_batch_size):
    cfg = small_config(compose_config, f"trainer.micro_batch_size={micro_batch_size}")
    parts = make_parts(policy_dir, cfg)
    parts.optimizer = torch.optim.SGD(parts.policy.parameters(), lr=0.0)  # keep weights, inspect grads
    result = policy_update(parts.policy, parts.reference, parts.optimizer, groups_of(parts.tokenizer),
                           cfg.trainer, clip_ceiling=3.0, pad_id=parts.tokenizer.pad_token_id)
    return result, [p.grad.clone() for p in parts.policy.parameters()]


def sample_groups(tokenizer):
    return [
        group(tokenizer, [" 1 + 2 = 3 </think>\n<answer> 1 + 2 + 3 </answer>", " 7", " 8 8"], [1.0, 0.0, 0.1]),
        group(tokenizer, [" 3 * 2 = 6", " 1 - 1 = 0 </think>\n<answer> 1 </answer>", " 6"], [0.1, 0.0, 1.0],
              step=0, behaviour=[-3.0, -80.0, -2.0]),
    ]


def test_micro_batching_gives_the_same_loss_and_gradients(random_policy_dir, compose_config):
    whole, whole_grads = gradients_after_update(random_policy_dir, compose_config, sample_groups, 100)
    parts, parts_grads = gradients_after_update(random_policy_dir, compose_config, sample_groups, 2)
    assert math.isclose(whole.loss, parts.loss, rel_tol=1e-5, abs_tol=1e-7)
    for a, b in zip(whole_grads, parts_grads):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-6)


def test_token_budget_micro_batches_give_the_same_loss_and_gradients(random_policy_dir, compose_config):
    whole, whole_grads = gradients_after_update(random_policy_dir, compose_config, sample_groups, 100)
    cfg_tokens = "trainer.micro_batch_tokens=60"  # a few rows per micro-batch at these lengths
    cfg = small_config(compose_config, "trainer.micro_batch_size=100", cfg_tokens)
    parts = make_parts(random_policy_dir, cfg)
    parts.optimizer = torch.optim.SGD(parts.policy.parameters(), lr=0.0)
    groups = sample_groups(parts.tokenizer)
    sequences = [(g.prompt_ids, r) for g in groups for r in g.response_ids]
    batches = micro_batches(sequences, 100, 60)
    assert len(batches) > 1 and sorted(i for b in batches for i in b) == list(range(len(sequences)))
    result = policy_update(parts.policy, parts.reference, parts.optimizer, groups, cfg.trainer, 3.0,
                           parts.tokenizer.pad_token_id)
    assert math.isclose(whole.loss, result.loss, rel_tol=1e-5, abs_tol=1e-7)
    for a, b in zip(whole_grads, [p.grad for p in parts.policy.parameters()]):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-6)


def test_micro_batches_respect_rows_and_padded_tokens():
    sequences = [((1,) * 5, (2,) * n) for n in (1, 9, 3, 5, 20)]  # lengths 6, 14, 8, 10, 25
    assert micro_batches(sequences, 2, None) == [[0, 2], [3, 1], [4]]
    assert micro_batches(sequences, 10, 30) == [[0, 2, 3], [1, 4][:1], [4]]  # 3 x 10 = 30; 25 alone


class NoForward(torch.nn.Module):
    """A reference model that must not be called: every log-prob it could give is cached."""

    def forward(self, *args, **kwargs):
        raise AssertionError("reference forward pass on a group whose reference log-probs are stored")


def test_stored_reference_logprobs_replace_the_reference_forward(random_policy_dir, compose_config):
    cfg = small_config(compose_config)
    parts = make_parts(random_policy_dir, cfg)
    parts.optimizer = torch.optim.SGD(parts.policy.parameters(), lr=0.5)  # move pi away from pi_ref
    groups = sample_groups(parts.tokenizer)
    first = policy_update(parts.policy, parts.reference, parts.optimizer, groups, cfg.trainer, 3.0, 0)
    assert [len(t) for t in first.reference_tokens] == [len(r) for g in groups for r in g.response_ids]
    stored, start = [], 0
    for g in groups:  # as the trainer stores a fresh group after its first update
        stored.append(g.with_behaviour_logprobs(first.logprobs[start : start + g.size].tolist(),
                                                first.reference_tokens[start : start + g.size]))
        start += g.size
    plain = [dataclasses.replace(g, reference_logprobs=None) for g in stored]
    frozen = torch.optim.SGD(parts.policy.parameters(), lr=0.0)
    computed = policy_update(parts.policy, parts.reference, frozen, plain, cfg.trainer, 3.0, 0)
    cached = policy_update(parts.policy, NoForward(), frozen, stored, cfg.trainer, 3.0, 0)  # no reference forward
    assert computed.kl > 0
    assert cached.kl == pytest.approx(computed.kl, rel=1e-6) and cached.loss == pytest.approx(computed.loss, rel=1e-6)
    torch.testing.assert_close(cached.kl_sums, computed.kl_sums)


class CountingReference(torch.nn.Module):
    """The reference policy, counting its forward passes."""

    def __init__(self, model) -> None:
        super().__init__()
        self.model, self.calls = model, 0

    def forward(self, *args, **kwargs):
        self.calls += 1
        return self.model(*args, **kwargs)


@pytest.mark.parametrize("loss", ["rloo", "grpo", "ipo"])
def test_the_reference_forward_runs_only_where_the_update_reads_it(random_policy_dir, compose_config, loss):
    """At kl_coef = 0 RLOO and GRPO read no pi_ref: no reference forward, the KL logged as nan, the group stored
    without reference log-probs, and the same loss and gradients as with the reference read. IPO's loss reads it."""
    cfg = small_config(compose_config, f"loss={loss}", "trainer.kl_coef=0")
    parts = make_parts(random_policy_dir, cfg)
    groups = sample_groups(parts.tokenizer)[:1]
    outcomes = []
    for forced in (False, True):
        objective = RlooObjective(3.0) if loss == "rloo" else instantiate(cfg.loss)
        if forced and objective.needs.penalised:  # pi_ref read in the training pass, as at kl_coef != 0
            objective.needs = dataclasses.replace(objective.needs, reads=(False, True))
        trainer = Trainer(objective, Forward(0, 3), kl_coef=0.0, entropy_coef=cfg.trainer.entropy_coef)
        reference = CountingReference(parts.reference)
        parts.policy.zero_grad(set_to_none=True)
        result = trainer.update(parts.policy, reference, torch.optim.SGD(parts.policy.parameters(), lr=0.0),
                                Batch([BatchGroup(groups[0], "fresh")]))
        outcomes.append((reference.calls, result, [p.grad.clone() for p in parts.policy.parameters()]))
    (calls, skipped, skipped_grads), (forced_calls, read, read_grads) = outcomes
    assert forced_calls > 0 and not math.isnan(read.kl)
    if loss == "ipo":
        assert calls == forced_calls
        return
    assert calls == 0 and math.isnan(skipped.kl) and torch.isnan(skipped.kl_sums).all()
    assert skipped.stored(groups[0], 0).reference_logprobs is None  # a later update that reads it computes it
    assert skipped.loss == read.loss and skipped.policy_loss == read.policy_loss
    assert all(torch.equal(a, b) for a, b in zip(skipped_grads, read_grads))


def test_fresh_weights_are_one_and_replayed_weights_are_clipped(random_policy_dir, compose_config):
    result, _ = gradients_after_update(random_policy_dir, compose_config, sample_groups, 100)
    assert result.weights[:3].tolist() == [1.0, 1.0, 1.0]  # fresh group: mu = pi_theta
    expected_raw = torch.exp(result.logprobs[3:] - torch.tensor([-3.0, -80.0, -2.0]))
    torch.testing.assert_close(result.raw_weights[3:], expected_raw)
    torch.testing.assert_close(result.weights[3:], expected_raw.clamp(max=3.0))
    assert result.weights[4].item() == 3.0  # log mu = -80: far below pi, clipped at c


def test_the_update_raises_the_log_prob_of_the_rewarded_response(random_policy_dir, compose_config):
    cfg = small_config(compose_config, "trainer.kl_coef=0", "trainer.entropy_coef=0")
    parts = make_parts(random_policy_dir, cfg)
    parts.optimizer = torch.optim.SGD(parts.policy.parameters(), lr=0.01)
    groups = [group(parts.tokenizer, [" 1 + 2 + 3", " 9 9 9"], [1.0, 0.0])]
    before = policy_update(parts.policy, parts.reference, parts.optimizer, groups, cfg.trainer, 10.0, 0).logprobs
    after = policy_update(parts.policy, parts.reference, parts.optimizer, groups, cfg.trainer, 10.0, 0).logprobs
    assert after[0] > before[0] and after[1] < before[1]


@pytest.mark.parametrize("buffer_option,ratio", [("none", 0), ("age1", 1), ("age2", 2)])
def test_counted_fresh_evaluations_equal_the_planned_budget(random_policy_dir, compose_config, buffer_option, ratio):
    cfg = small_config(compose_config, f"buffer={buffer_option}", f"buffer.ratio={ratio}", "trainer.steps=4",
                       "trainer.groups_per_step=6")
    parts, state = make_parts(random_policy_dir, cfg), TrainState()
    replayed = []
    for _ in range(cfg.trainer.steps):
        metrics = train_step(parts, state)
        replayed.append(metrics["batch/replay_groups"])
    plan = plan_fresh_evaluations(6, 2, 4, ratio, max(cfg.buffer.max_age, 1))
    assert state.fresh_evaluations == plan.fresh_evaluations
    assert tuple(replayed) == plan.replay_groups_per_step
    if parts.buffer is not None:  # every stored group carries mu's log-probs from the trainer's forward
        assert all(g.behaviour_logprobs is not None for g in parts.buffer.groups)


def assert_resumed_like_straight(straight, resumed, keys, stop_at=2):
    """Every step after the restored checkpoint logs what the uninterrupted run logged, key by key."""
    for expected, actual in zip(straight[stop_at:], resumed):
        for key in keys:
            assert key in expected, key
            assert expected[key] == pytest.approx(actual[key], rel=1e-5), key


def straight_and_resumed(make_parts, policy_dir, cfg, tmp_path, steps=4, stop_at=2):
    """Metrics of `steps` uninterrupted steps, and of the steps after a checkpoint at `stop_at` restored into new parts."""
    straight_parts, straight_state = make_parts(policy_dir, cfg, learning_rate=1e-2), TrainState()
    straight = [train_step(straight_parts, straight_state) for _ in range(steps)]
    first_parts, first_state = make_parts(policy_dir, cfg, learning_rate=1e-2), TrainState()
    for _ in range(stop_at):
        train_step(first_parts, first_state)
    save_checkpoint(tmp_path / "checkpoint.pt", first_parts, first_state, run_id="run-1", cell_id="cell-1")
    resumed_parts = make_parts(policy_dir, cfg, learning_rate=1e-2)
    payload = read_checkpoint(tmp_path / "checkpoint.pt")  # weights_only=True: every part is plain data
    resumed_state, run_id = restore_checkpoint(payload, resumed_parts), payload["run_id"]
    restored = {"run_id": run_id, "step": resumed_state.step,
                "buffer_sizes": (len(resumed_parts.buffer or ()), len(first_parts.buffer or ()))}
    resumed = [train_step(resumed_parts, resumed_state) for _ in range(steps - stop_at)]
    return straight, resumed, restored


def test_resuming_from_a_checkpoint_continues_exactly(random_policy_dir, compose_config, tmp_path):
    cfg = small_config(compose_config, "buffer=age2", "trainer.steps=4")
    keys = ("train/reward", "train/loss", "batch/replay_groups", "weights/raw_mean", "budget/fresh_evaluations")

    straight, resumed, run = straight_and_resumed(make_parts, random_policy_dir, cfg, tmp_path)
    assert (run["run_id"], run["step"]) == ("run-1", 2)
    for expected, actual in zip(straight[2:], resumed):
        for key in keys:
            assert expected.get(key) == pytest.approx(actual.get(key), rel=1e-5), key



def test_token_budget_counts_every_generated_and_every_trained_token(random_policy_dir, compose_config):
    """budget/generated_tokens and budget/trained_tokens (cumulative) against counts taken around the components."""
    cfg = small_config(compose_config, "buffer=fifo", "buffer.extra_updates=1", "trainer.steps=3")
    parts, state = make_parts(random_policy_dir, cfg), TrainState()
    collected, trained = [], []
    collect, update = parts.sampling.fresh_groups, parts.trainer.update

    def counting_collect(*args, **kwargs):
        collected.append(collect(*args, **kwargs))
        return collected[-1]

    def counting_update(policy, reference, optimizer, batch):
        trained.append(sum(len(batch.groups[g].response_ids[j]) for g, j in batch.rows))
        return update(policy, reference, optimizer, batch)

    parts.sampling.fresh_groups, parts.trainer.update = counting_collect, counting_update
    for _ in range(3):
        metrics = train_step(parts, state)
    assert len(trained) > 3  # the extra replay updates (R = 2) train tokens too
    assert metrics["budget/trained_tokens"] == sum(trained)
    assert metrics["budget/generated_tokens"] == sum(len(ids) for step in collected for group in step.generated
                                                     for ids in group.response_ids)
    assert metrics["budget/generated_tokens"] > 0


class PolicyTermOnly(RlooObjective):
    """A loss that returns its term and nothing else: no per-row log-probs, no weights."""

    def __call__(self, lp, totals):
        full = super().__call__(lp, totals)
        return dataclasses.replace(full, logprobs=None, weights=None)


def test_a_loss_that_returns_no_logprobs_still_stores_the_behaviour_logprobs(random_policy_dir, compose_config):
    """The trainer records log mu of every fresh row itself: a group stored after the update carries the
    log-probs its responses were sampled with, whatever the loss returns (else every later replay weight is
    exp(log pi - 0))."""
    cfg = small_config(compose_config)
    parts = make_parts(random_policy_dir, cfg)
    group = sample_groups(parts.tokenizer)[0]
    frozen = torch.optim.SGD(parts.policy.parameters(), lr=0.0)
    stored = []
    for objective in (RlooObjective(3.0), PolicyTermOnly(3.0)):
        result = Trainer(objective, Forward(0, 3)).update(parts.policy, parts.reference, frozen,
                                                          Batch([BatchGroup(group, "fresh")]))
        stored.append(result.stored(group, 0).behaviour_logprobs)
    assert all(value < 0 for value in stored[0])  # log-probs of sampled responses under the policy
    assert stored[1] == pytest.approx(stored[0], abs=1e-6)


class ProximalProbe(RlooObjective):
    """A loss that asks for pi_prox (`Needs.proximal`) and no more: it reads the trainer's pi_prox and mu per token,
    returns eq. 3's RLOO term and two diagnostics, and keeps what it saw."""

    def __init__(self) -> None:
        super().__init__(clip_ceiling=2.0)
        self.needs = Needs(truncates="none", proximal=True, updates=2)
        self.seen: list[tuple[float, float]] = []

    def __call__(self, lp, totals):
        response = lp.mask.bool()
        moved = float((lp.policy.detach() - lp.proximal)[response].abs().max())
        fresh = [i for i, row in enumerate(lp.index) if row < 3]  # group 0 (rows 0..2) is fresh: mu = pi_prox
        self.seen.append((moved, float((lp.behaviour_tokens - lp.proximal)[fresh][response[fresh]].abs().max())))
        out = super().__call__(lp, totals)
        return dataclasses.replace(out, diagnostics={"probe/moved_max": moved, "probe/one": 1.0})


def test_the_trainer_owns_pi_prox_and_mu_per_token_for_a_loss_that_asks(random_policy_dir, compose_config):
    """Needs.proximal: the trainer's first pass fixes pi_prox, so the first mini-batch's ratio is exactly 1 and the
    second's is not; mu per token is pi_prox on fresh rows; the update stores pi_prox as their log mu (per token
    too) and averages the loss's diagnostics, with the optimizer steps as probe/updates."""
    cfg = small_config(compose_config)
    parts = make_parts(random_policy_dir, cfg)
    groups = sample_groups(parts.tokenizer)
    groups[1] = dataclasses.replace(groups[1], behaviour_token_logprobs=[tuple([-2.0] * len(ids))
                                                                         for ids in groups[1].response_ids])
    probe = ProximalProbe()
    trainer = Trainer(probe, Forward(parts.tokenizer.pad_token_id, micro_batch_size=100))
    batch = Batch([BatchGroup(groups[0], "fresh", 0), BatchGroup(groups[1], "replay", 1)])
    result = trainer.update(parts.policy, parts.reference, parts.optimizer, batch)
    (first_moved, first_fresh), (second_moved, _) = probe.seen
    assert first_moved <= 1e-6 and first_fresh == 0.0 and second_moved > 1e-4
    assert [len(tokens) for tokens in result.behaviour_tokens] == [len(r) for g in groups for r in g.response_ids]
    assert result.logprobs[:3].tolist() == pytest.approx([sum(t) for t in result.behaviour_tokens[:3]], abs=1e-4)
    stored = result.stored(groups[0], 0)
    assert stored.behaviour_token_logprobs == tuple(result.behaviour_tokens[:3])
    assert result.extras == {"probe/moved_max": second_moved, "probe/one": pytest.approx(1.0), "probe/updates": 2.0}
