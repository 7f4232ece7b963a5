"""Objective pieces (SPEC 4) against hand-worked numbers."""

import math

import pytest
import torch

from src.loss.rloo_math import clip_fraction, effective_sample_size, importance_weights, leave_one_out_advantages
from src.batch import plan_batch
from src.policy.token_stats import token_entropy
from src.loss.kl import kl_k3


@pytest.mark.parametrize(
    "ratio, expected",
    [(0, (128, 0)), (0.5, (85, 43)), (1, (64, 64)), (1.5, (51, 77)), (2, (43, 85))],
)
def test_plan_batch_paper_table(ratio, expected):
    assert plan_batch(128, ratio) == expected


@pytest.mark.parametrize("b, ratio, match", [(0, 1.0, "groups_per_step"), (128, -0.5, "ratio"), (1, 1.0, "B_fresh")])
def test_plan_batch_validates(b, ratio, match):
    with pytest.raises(ValueError, match=match):
        plan_batch(b, ratio)


def test_leave_one_out_hand_worked():
    rewards = torch.tensor([[1.0, 0.0, 0.1, 1.0], [1.0, 1.0, 1.0, 1.0]])
    # Row 0, sum 2.1: A_0 = 1 - (0 + 0.1 + 1)/3 = 0.633333..., A_1 = 0 - 2.1/3 = -0.7,
    # A_2 = 0.1 - 2.0/3 = -0.566666..., A_3 = A_0. Row 1: identical rewards -> all zero.
    expected = torch.tensor(
        [[0.6333333, -0.7, -0.5666667, 0.6333333], [0.0, 0.0, 0.0, 0.0]]
    )
    torch.testing.assert_close(leave_one_out_advantages(rewards), expected)


def test_leave_one_out_k2():
    torch.testing.assert_close(leave_one_out_advantages(torch.tensor([[1.0, 0.1]])), torch.tensor([[0.9, -0.9]]))


def test_leave_one_out_needs_k_at_least_two():
    with pytest.raises(ValueError, match="K=1"):
        leave_one_out_advantages(torch.tensor([[1.0]]))


def test_importance_weights_hand_worked():
    beh = torch.tensor([-3.0, -1.0, -2.0])
    cur = beh + torch.tensor([math.log(2.0), math.log(0.5), math.log(5.0)])
    clipped, raw = importance_weights(cur, beh, clip_ceiling=3.0)
    torch.testing.assert_close(raw, torch.tensor([2.0, 0.5, 5.0]))
    torch.testing.assert_close(clipped, torch.tensor([2.0, 0.5, 3.0]))
    assert clip_fraction(raw, 3.0) == pytest.approx(1 / 3)


def test_importance_weights_carry_no_gradient():
    cur = torch.tensor([-1.0, -2.0], requires_grad=True)
    beh = torch.tensor([-1.5, -1.0])
    clipped, raw = importance_weights(cur, beh, clip_ceiling=3.0)
    assert not clipped.requires_grad and not raw.requires_grad
    # In the eq. 3 surrogate the gradient flows only through log pi: d/dcur of (w * cur) = w.
    (clipped * cur).sum().backward()
    torch.testing.assert_close(cur.grad, clipped)


def test_importance_weights_validate():
    x = torch.zeros(3)
    with pytest.raises(ValueError, match="clip_ceiling"):
        importance_weights(x, x, clip_ceiling=0.0)
    with pytest.raises(ValueError, match="shape"):
        importance_weights(x, torch.zeros(2), clip_ceiling=1.0)


def test_clip_fraction_strict_and_empty():
    assert clip_fraction(torch.tensor([1.0, 3.0, 3.0001]), 3.0) == pytest.approx(1 / 3)
    assert math.isnan(clip_fraction(torch.tensor([]), 3.0))


def test_effective_sample_size_hand_worked():
    assert effective_sample_size(torch.tensor([1.0, 1.0, 1.0, 1.0])) == pytest.approx(1.0)
    assert effective_sample_size(torch.tensor([1.0, 0.0, 0.0, 0.0])) == pytest.approx(0.25)
    # (2 + 0.5 + 3)^2 / (3 * (4 + 0.25 + 9)) = 30.25 / 39.75
    assert effective_sample_size(torch.tensor([2.0, 0.5, 3.0])) == pytest.approx(5.5**2 / (3 * 13.25))
    assert math.isnan(effective_sample_size(torch.tensor([])))


def test_kl_k3_zero_when_equal_and_hand_value():
    lp = torch.tensor([-0.3, -2.0, -7.0])
    torch.testing.assert_close(kl_k3(lp, lp), torch.zeros(3))
    # logp = ln 0.5, ref = ln 0.25: d = ln 0.5; exp(d) - d - 1 = 0.5 + 0.693147 - 1 = 0.193147
    val = kl_k3(torch.tensor([math.log(0.5)]), torch.tensor([math.log(0.25)]))
    torch.testing.assert_close(val, torch.tensor([0.5 + math.log(2.0) - 1.0]))
    assert (kl_k3(torch.randn(100), torch.randn(100)) >= 0).all()


def test_kl_k3_is_differentiable_in_logprobs():
    lp = torch.tensor([math.log(0.5)], requires_grad=True)
    ref = torch.tensor([math.log(0.25)])
    kl_k3(lp, ref).sum().backward()
    # d/dlogp [exp(ref - logp) - (ref - logp) - 1] = -exp(ref - logp) + 1 = 1 - 0.5
    torch.testing.assert_close(lp.grad, torch.tensor([0.5]))


def test_token_entropy_uniform_is_log_v():
    logits = torch.zeros(2, 5, 7)
    torch.testing.assert_close(token_entropy(logits), torch.full((2, 5), math.log(7)))


def test_token_entropy_hand_value_and_gradient():
    # softmax([ln 1, ln 3]) = [0.25, 0.75]; H = -(0.25 ln 0.25 + 0.75 ln 0.75) = 0.562335
    logits = torch.tensor([[0.0, math.log(3.0)]], requires_grad=True)
    h = token_entropy(logits)
    torch.testing.assert_close(h, torch.tensor([-(0.25 * math.log(0.25) + 0.75 * math.log(0.75))]))
    h.sum().backward()
    assert logits.grad is not None and logits.grad.abs().sum() > 0


def test_token_entropy_masked_logits_are_finite():
    logits = torch.tensor([[0.0, 0.0, float("-inf")]], requires_grad=True)
    h = token_entropy(logits)
    torch.testing.assert_close(h, torch.tensor([math.log(2.0)]))
    h.sum().backward()
    assert torch.isfinite(logits.grad).all()


def test_eq3_on_a_hand_worked_two_group_batch():
    """Two groups of K = 2: rewards (1, 0) and (1, 0.5), four responses of 2, 1, 2 and 1 tokens.

    Leave-one-out advantages (eq. 1): (1, -1) and (0.5, -0.5). Sequence log-probs -1.5, -2, -0.5, -1;
    weights 1, 1, 2, 0.5. Policy term -(1/4)(1(-1.5) - 1(-2) + 2(0.5)(-0.5) + 0.5(-0.5)(-1)) = -0.0625.
    k3 with d = log ref - log pi per token (0, .5 | -.5 | 0, 0 | 1): e^d - d - 1 sums to
    (e^.5 - 1.5) + (e^-.5 - .5) + (e - 2) = 0.9735339, over 6 tokens 0.1622557. Entropy 8/6.
    Loss = -0.0625 + 0.1 * 0.1622557 - 0.01 * 8/6 = -0.0596078.
    """
    from src.loss.rloo_math import leave_one_out_advantages

    advantages = leave_one_out_advantages(torch.tensor([[1.0, 0.0], [1.0, 0.5]])).flatten()
    assert advantages.tolist() == [1.0, -1.0, 0.5, -0.5]
    logprobs = torch.tensor([[-1.0, -0.5], [-2.0, 0.0], [-0.2, -0.3], [-1.0, 0.0]])
    mask = torch.tensor([[1.0, 1.0], [1.0, 0.0], [1.0, 1.0], [1.0, 0.0]])
    reference = logprobs + torch.tensor([[0.0, 0.5], [-0.5, 0.0], [0.0, 0.0], [1.0, 0.0]])
    entropy = torch.tensor([[1.0, 2.0], [3.0, 9.0], [0.5, 0.5], [1.0, 9.0]])  # 9: padding, masked out
    weights = torch.tensor([1.0, 1.0, 2.0, 0.5])[:, None].expand(4, 2)
    terms = eq3(logprobs, reference, entropy, mask, advantages, weights, rows=range(4))
    assert terms.policy_loss.item() == pytest.approx(-0.0625, abs=1e-7)
    assert terms.kl.item() == pytest.approx(0.9735339 / 6, abs=1e-7)
    assert terms.entropy.item() == pytest.approx(8 / 6, abs=1e-7)
    assert terms.loss.item() == pytest.approx(-0.0625 + 0.1 * 0.9735339 / 6 - 0.01 * 8 / 6, abs=1e-7)
    # A micro-batch of the last two rows, normalised by the whole batch, is exactly its share.
    half = eq3(logprobs, reference, entropy, mask, advantages, weights, rows=[2, 3])
    first = eq3(logprobs, reference, entropy, mask, advantages, weights, rows=[0, 1])
    assert (half.loss + first.loss).item() == pytest.approx(terms.loss.item(), abs=1e-7)
    # Without pi_ref (kl_coef = 0) the KL is not measured, and the loss holds the entropy term alone.
    unread = eq3(logprobs, None, entropy, mask, advantages, weights, rows=range(4))
    assert math.isnan(unread.kl.item())
    assert unread.loss.item() == pytest.approx(-0.0625 - 0.01 * 8 / 6, abs=1e-7)


def eq3(logprobs, reference, entropy, mask, advantages, weights, rows, kl_coef=0.1, entropy_coef=0.01,
        estimator=None):
    """Eq. 3 on the chosen rows of a batch of 4 responses and 6 tokens: RLOO's policy term
    (`rloo_policy_loss`) plus the KL and entropy terms the trainer adds to every loss (`penalised`)."""
    from src.loss.kl import kl_k3
    from src.loss.rloo_math import rloo_policy_loss
    from src.loss.trainer import Loss, MicroBatch, Totals, penalised

    rows = list(rows)
    lp = MicroBatch(rows, [], logprobs[rows], entropy[rows], None if reference is None else reference[rows],
                    mask[rows])
    policy = rloo_policy_loss(lp.policy, lp.mask, advantages[rows], weights[rows], batch_size=4)
    return penalised(Loss(policy, policy), lp, Totals(rows=4, tokens=6), kl_coef, entropy_coef, estimator or kl_k3)


def test_eq3_kl_term_uses_the_estimator_it_is_given():
    """The batch of the eq. 3 test with d = log ref - log pi per token (0, .5 | -.5 | 0, 0 | 1):
    k2 = d^2/2 sums to 0.125 + 0.125 + 0.5 = 0.75 and k1 = -d to -1, over 6 tokens."""
    from src.loss.kl import kl_k1, kl_k2

    logprobs = torch.tensor([[-1.0, -0.5], [-2.0, 0.0], [-0.2, -0.3], [-1.0, 0.0]])
    mask = torch.tensor([[1.0, 1.0], [1.0, 0.0], [1.0, 1.0], [1.0, 0.0]])
    reference = logprobs + torch.tensor([[0.0, 0.5], [-0.5, 0.0], [0.0, 0.0], [1.0, 0.0]])
    ones = torch.ones(4, 2)
    for estimator, expected in ((kl_k2, 0.75 / 6), (kl_k1, -1 / 6)):
        terms = eq3(logprobs, reference, ones, mask, torch.zeros(4), ones, rows=range(4), kl_coef=1.0,
                    entropy_coef=0.0, estimator=estimator)
        assert terms.kl.item() == pytest.approx(expected, abs=1e-7)
        assert terms.loss.item() == pytest.approx(expected, abs=1e-7)  # zero advantages: the KL term alone


@pytest.mark.parametrize("loss", ["rloo", "grpo", "ipo"])
def test_trainer_kl_estimator_reaches_every_objective(compose_config, loss):
    from src.batch import Batch, Group, fresh_entries
    from src.build import build
    from src.loss.kl import kl_k2
    from src.loss.trainer import FirstPass, MicroBatch, Trainer

    cfg = compose_config(f"loss={loss}", "trainer.kl_estimator=k2")
    objective = build(cfg.loss)
    trainer = Trainer(objective, forward=None, kl_estimator=cfg.trainer.kl_estimator)
    assert trainer.kl_tokens is kl_k2
    if loss == "ipo":  # IPO logs the KL its first pass measures, with the trainer's estimate
        policy, reference = torch.tensor([[-1.0, -0.5], [-0.5, -0.5]]), torch.tensor([[-0.5, -0.5], [-0.5, -1.5]])
        lp = MicroBatch([0, 1], [((1,), (2, 3))] * 2, policy, torch.zeros(2, 2), reference, torch.ones(2, 2))
        two = Group("p", (1,), None, ("r", "r"), ((2, 3), (2, 3)), (1.0, 0.0), step=0)
        first = FirstPass.of(Batch(fresh_entries([two])), objective.needs)
        first.observe(lp, trainer.kl_tokens)
        assert first.kl_sums.tolist() == [0.125, 0.5]  # k2: (log pi - log pi_ref)^2 / 2 per token
    with pytest.raises(ValueError, match="trainer.kl_estimator='k4': choose one of k1, k2, k3"):
        Trainer(build(cfg.loss), forward=None, kl_estimator="k4")
