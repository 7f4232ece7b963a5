"""Variant objectives (SPEC 9: POPO seed 003, truncated IS seed 002) against hand-worked numbers."""

import math

import pytest
import torch

from src.loss.variant_math import clipped_surrogate, group_normalised_advantages, truncated_importance_weights

LN = math.log

# --------------------------------------------------------------------------- GRPO advantages


def test_group_normalised_sample_std_hand_worked():
    rewards = torch.tensor([[1.0, 0.0, 0.0, 0.0], [1.0, 1.0, 0.0, 0.0]])
    # Row 0: mean 0.25; sample var = (0.75^2 + 3 * 0.25^2) / 3 = 0.75 / 3 = 0.25 -> std 0.5;
    #   A = 0.75 / 0.5 = 1.5 and -0.25 / 0.5 = -0.5.
    # Row 1: mean 0.5; sample var = 4 * 0.25 / 3 = 1/3 -> std 0.5773503; A = +-0.5 / 0.5773503 = +-0.8660254.
    expected = torch.tensor([[1.5, -0.5, -0.5, -0.5], [0.8660254, 0.8660254, -0.8660254, -0.8660254]])
    torch.testing.assert_close(group_normalised_advantages(rewards, eps=0.0), expected)


def test_group_normalised_population_std_hand_worked():
    rewards = torch.tensor([[1.0, 0.0, 0.0, 0.0], [1.0, 1.0, 0.0, 0.0]])
    # Row 0: population var = 0.75 / 4 = 0.1875 -> std 0.4330127; A = 0.75 / 0.4330127 = 1.7320508,
    #   -0.25 / 0.4330127 = -0.5773503. Row 1: population std 0.5 -> A = +-1.
    expected = torch.tensor([[1.7320508, -0.5773503, -0.5773503, -0.5773503], [1.0, 1.0, -1.0, -1.0]])
    torch.testing.assert_close(group_normalised_advantages(rewards, eps=0.0, unbiased=False), expected)


def test_group_normalised_partial_credit_and_default_eps():
    # Countdown rewards 1.0 / 0.1 / 0.0: mean 1.1/3 = 0.3666667; deviations 0.6333333, -0.2666667, -0.3666667;
    # squares sum 0.4011111 + 0.0711111 + 0.1344444 = 0.6066667; / 2 -> var 0.3033333, std 0.5507571.
    got = group_normalised_advantages(torch.tensor([[1.0, 0.1, 0.0]]), eps=0.0)
    torch.testing.assert_close(got, torch.tensor([[1.1499323, -0.4841820, -0.6657503]]))
    # Default eps = 1e-6 (verl): 0.75 / (0.5 + 1e-6) = 1.499997.
    got = group_normalised_advantages(torch.tensor([[1.0, 0.0, 0.0, 0.0]], dtype=torch.float64))
    assert got[0, 0].item() == pytest.approx(0.75 / 0.500001, rel=1e-12)


def test_group_normalised_zero_variance_groups_are_exactly_zero():
    rewards = torch.tensor([[0.1] * 8, [1.0] * 8, [0.0] * 8, [1.0, 0.0] * 4])
    # Naively, float32 rounding makes mean([0.1]*8) - 0.1 = 7.45e-9, and dividing by std + eps = 1e-6
    # would give advantages of -0.0074: the zero-variance guard must return exact zeros instead.
    naive = (rewards[0] - rewards[0].mean()) / (rewards[0].std() + 1e-6)
    assert naive.abs().max() > 1e-4  # the hazard is real on this platform's float32
    adv = group_normalised_advantages(rewards)
    assert torch.equal(adv[:3], torch.zeros(3, 8))
    assert adv[3].abs().min() > 0.9  # the mixed group is untouched


def test_group_normalised_validates():
    with pytest.raises(ValueError, match="K=1"):
        group_normalised_advantages(torch.tensor([[1.0]]))
    with pytest.raises(ValueError, match="eps"):
        group_normalised_advantages(torch.zeros(2, 4), eps=-1.0)
    with pytest.raises(ValueError, match="scalar"):
        group_normalised_advantages(torch.tensor(1.0))


# --------------------------------------------------------------------------- clipped surrogate


def _logprobs(ratios, base=-1.0):
    """Token log-probs base + log(ratio); `ratios` nested lists, None for padding (garbage +1000)."""
    return torch.tensor([[base + LN(r) if r is not None else 1000.0 for r in row] for row in ratios])


def _clip_example():
    # Row 0 (A = +1): ratios 1.25, 1.5, 0.75. Row 1 (A = -1): ratios 0.75, 1.25, then padding.
    prox = torch.full((2, 3), -1.0)
    cur = _logprobs([[1.25, 1.5, 0.75], [0.75, 1.25, None]]).requires_grad_(True)
    mask = torch.tensor([[1, 1, 1], [1, 1, 0]])
    adv = torch.tensor([1.0, -1.0])
    return cur, prox, adv, mask


def test_clipped_surrogate_hand_worked_clip_higher():
    cur, prox, adv, mask = _clip_example()
    loss, diag = clipped_surrogate(cur, prox, None, adv, mask)
    # l = min(r A, clip(r, 0.8, 1.28) A):
    #   row 0, A=+1: 1.25 -> 1.25 (1.25 < 1.28, unclipped); 1.5 -> 1.28 (clip high active); 0.75 -> 0.75
    #     (a low ratio is never clipped for A > 0);
    #   row 1, A=-1: 0.75 -> min(-0.75, -0.8) = -0.8 (clip low active); 1.25 -> -1.25 (a high ratio is
    #     never clipped for A < 0).
    # Token mean over the 5 real tokens: -(1.25 + 1.28 + 0.75 - 0.8 - 1.25) / 5 = -1.23 / 5 = -0.246.
    assert loss.item() == pytest.approx(-0.246, abs=1e-6)
    assert diag["clip_frac_high"] == pytest.approx(1 / 5)
    assert diag["clip_frac_low"] == pytest.approx(1 / 5)
    assert diag["behaviour_weight_mean"] == 1.0 and diag["n_tokens"] == 5.0
    assert diag["ratio_max"] == pytest.approx(1.5, rel=1e-6)
    # d loss / d log pi_t = -(w r A) / 5 where unclipped, 0 where the clip is active, 0 on padding:
    # row 0: -1.25/5, 0, -0.75/5; row 1: 0, +1.25/5, 0 (the padding's +1000 log-prob gives no nan).
    loss.backward()
    torch.testing.assert_close(cur.grad, torch.tensor([[-0.25, 0.0, -0.15], [0.0, 0.25, 0.0]]))


def test_clip_higher_is_asymmetric():
    cur, prox, adv, mask = _clip_example()
    higher, _ = clipped_surrogate(cur, prox, None, adv, mask)
    symmetric, diag = clipped_surrogate(cur, prox, None, adv, mask, eps_low=0.2, eps_high=0.2)
    # With eps_high = 0.2, ratio 1.25 at A=+1 is clipped to 1.2 and 1.5 to 1.2:
    # -(1.2 + 1.2 + 0.75 - 0.8 - 1.25) / 5 = -1.1 / 5 = -0.22, versus -0.246 with clip-higher.
    assert symmetric.item() == pytest.approx(-0.22, abs=1e-6)
    assert higher.item() < symmetric.item()
    assert diag["clip_frac_high"] == pytest.approx(2 / 5)


def test_behaviour_weight_per_token_hand_worked():
    prox = torch.tensor([[-2.0, -3.0]])
    cur = (prox + torch.tensor([[LN(1.1), LN(1.0)]])).requires_grad_(True)
    beh = prox - torch.tensor([[LN(1.2), LN(0.5)]])  # pi_prox / mu = 1.2 and 0.5 per token
    mask = torch.ones(1, 2)
    adv = torch.tensor([1.0])
    # Token level: w = (1.2, 0.5), none capped; l = 1.2 * 1.1 + 0.5 * 1.0 = 1.82; loss = -1.82 / 2 = -0.91.
    loss, diag = clipped_surrogate(cur, prox, beh, adv, mask)
    assert loss.item() == pytest.approx(-0.91, abs=1e-6)
    assert diag["behaviour_weight_mean"] == pytest.approx(0.85)


def test_behaviour_weight_cap_hand_worked():
    prox = torch.tensor([[-2.0, -3.0]])
    cur = (prox + torch.tensor([[LN(1.1), LN(1.0)]])).requires_grad_(True)
    beh = prox - torch.tensor([[LN(1.5), LN(3.0)]])  # raw weights 1.5 and 3.0 -> capped 1.5 and 2.0
    loss, diag = clipped_surrogate(cur, prox, beh, torch.tensor([1.0]), torch.ones(1, 2))
    # l = 1.5 * 1.1 + 2.0 * 1.0 = 3.65; loss = -3.65 / 2 = -1.825.
    assert loss.item() == pytest.approx(-1.825, abs=1e-6)
    assert diag["behaviour_weight_mean"] == pytest.approx(1.75)
    assert diag["behaviour_weight_raw_max"] == pytest.approx(3.0, rel=1e-6)
    assert diag["behaviour_cap_frac"] == pytest.approx(0.5)


def test_behaviour_weight_is_a_constant_in_the_gradient():
    prox = torch.tensor([[-2.0, -3.0]], requires_grad=True)
    beh = (prox.detach() - torch.tensor([[LN(1.2), LN(0.5)]])).requires_grad_(True)
    cur = (prox.detach() + torch.tensor([[LN(1.1), LN(1.0)]])).requires_grad_(True)
    loss, _ = clipped_surrogate(cur, prox, beh, torch.tensor([1.0]), torch.ones(1, 2))
    loss.backward()
    # No gradient reaches pi_prox or mu: both are data.
    assert prox.grad is None and beh.grad is None
    # d/d log pi_t of -(1/2) w_t r_t A = -(1/2) w_t r_t: -(1.2 * 1.1)/2 = -0.66 and -(0.5 * 1.0)/2 = -0.25.
    torch.testing.assert_close(cur.grad, torch.tensor([[-0.66, -0.25]]))


def _coupled_loss(cur, beh, adv, mask, eps_low=0.2, eps_high=0.28):
    """Reference coupled objective (seed 003 eq. 9): the clip acts on pi_theta / mu directly."""
    valid = mask.bool()
    rho = torch.exp(torch.where(valid, cur - beh, torch.zeros_like(cur)))  # padding may hold garbage
    a = adv.unsqueeze(-1)
    per_token = torch.minimum(rho * a, rho.clamp(1 - eps_low, 1 + eps_high) * a)
    return -torch.where(valid, per_token, torch.zeros_like(per_token)).sum() / valid.sum()


def test_decoupled_equals_coupled_when_nothing_is_clipped():
    # Lemma 4.2: small ratios (|log r| < 0.05 for both pi_theta/pi_prox and pi_prox/mu, so
    # pi_theta/mu in [0.9, 1.1]) are clipped by neither objective; values and gradients agree.
    gen = torch.Generator().manual_seed(0)
    beh = -3.0 + torch.rand(3, 5, generator=gen, dtype=torch.float64)
    prox = beh + 0.05 * (2 * torch.rand(3, 5, generator=gen, dtype=torch.float64) - 1)
    theta = prox + 0.05 * (2 * torch.rand(3, 5, generator=gen, dtype=torch.float64) - 1)
    adv = torch.tensor([1.0, -0.5, 2.0], dtype=torch.float64)
    mask = torch.tensor([[1, 1, 1, 1, 1], [1, 1, 1, 0, 0], [1, 1, 1, 1, 0]], dtype=torch.float64)
    cur_d = theta.clone().requires_grad_(True)
    cur_c = theta.clone().requires_grad_(True)
    decoupled, diag = clipped_surrogate(cur_d, prox, beh, adv, mask)
    coupled = _coupled_loss(cur_c, beh, adv, mask)
    assert diag["clip_frac_low"] == diag["clip_frac_high"] == diag["behaviour_cap_frac"] == 0.0
    torch.testing.assert_close(decoupled, coupled)
    decoupled.backward()
    coupled.backward()
    torch.testing.assert_close(cur_d.grad, cur_c.grad)


def test_decoupled_equals_coupled_when_prox_is_behaviour_even_if_clipped():
    # pi_prox = mu (fresh data, first mini-batch): w = 1 and both objectives clip the same ratio.
    cur, prox, adv, mask = _clip_example()
    cur_c = cur.detach().clone().requires_grad_(True)
    decoupled, _ = clipped_surrogate(cur, prox, prox, adv, mask)
    coupled = _coupled_loss(cur_c, prox, adv, mask.float())
    torch.testing.assert_close(decoupled, coupled)
    decoupled.backward()
    coupled.backward()
    torch.testing.assert_close(cur.grad, cur_c.grad)


def test_decoupled_differs_from_coupled_where_only_the_coupled_ratio_clips():
    # pi_theta/pi_prox = 1.1 (inside the trust region), pi_prox/mu = 1.5, so pi_theta/mu = 1.65.
    # Coupled (A=+1): min(1.65, 1.28) = 1.28, clipped, zero gradient. Decoupled: 1.5 * 1.1 = 1.65, live gradient.
    prox = torch.tensor([[-2.0]])
    beh = prox - LN(1.5)
    cur = (prox + LN(1.1)).requires_grad_(True)
    decoupled, diag = clipped_surrogate(cur, prox, beh, torch.tensor([1.0]), torch.ones(1, 1))
    coupled = _coupled_loss(cur.detach().requires_grad_(True), beh, torch.tensor([1.0]), torch.ones(1, 1))
    assert decoupled.item() == pytest.approx(-1.65, abs=1e-6)
    assert coupled.item() == pytest.approx(-1.28, abs=1e-6)
    assert diag["clip_frac_high"] == 0.0


def test_clipped_surrogate_accepts_token_advantages():
    cur, prox, adv, mask = _clip_example()
    per_response, _ = clipped_surrogate(cur, prox, None, adv, mask)
    per_token, _ = clipped_surrogate(cur, prox, None, adv.unsqueeze(-1).expand(2, 3), mask)
    torch.testing.assert_close(per_response, per_token)


def test_clipped_surrogate_validates():
    cur, prox, adv, mask = _clip_example()
    with pytest.raises(ValueError, match="eps_low"):
        clipped_surrogate(cur, prox, None, adv, mask, eps_low=1.0)
    with pytest.raises(ValueError, match="behaviour_cap"):
        clipped_surrogate(cur, prox, None, adv, mask, behaviour_cap=0.0)
    with pytest.raises(ValueError, match="prox_logprobs"):
        clipped_surrogate(cur, prox[:, :2], None, adv, mask)
    with pytest.raises(ValueError, match="advantages"):
        clipped_surrogate(cur, prox, None, torch.ones(3), mask)
    with pytest.raises(ValueError, match="no response tokens"):
        clipped_surrogate(cur, prox, None, adv, torch.zeros(2, 3))


# --------------------------------------------------------------------------- truncated IS (seed 002)


def test_truncated_weights_sequence_hand_worked():
    beh = torch.tensor([-3.0, -1.0, -2.0, -4.0])
    cur = beh + torch.tensor([LN(2.0), LN(0.5), LN(5.0), LN(0.05)])
    w, raw = truncated_importance_weights(cur, beh, rho_min=0.1, rho_max=3.0)
    # Eq. 3: clip the log-ratio into [log 0.1, log 3]: 2 -> 2, 0.5 -> 0.5, 5 -> 3, 0.05 -> 0.1.
    torch.testing.assert_close(w, torch.tensor([2.0, 0.5, 3.0, 0.1]))
    torch.testing.assert_close(raw, torch.tensor([2.0, 0.5, 5.0, 0.05]))


def test_truncated_weights_sequence_from_tokens_with_mask():
    beh = torch.tensor([[-1.0, -2.0, 0.0], [-1.0, -1.0, -1.0]])
    diff = torch.tensor([[LN(2.0), LN(3.0), 0.0], [LN(0.5), LN(0.5), LN(2.0)]])
    cur = beh + diff
    cur[0, 2] = 500.0  # garbage in padding must not leak into the sum
    mask = torch.tensor([[1, 1, 0], [1, 1, 1]])
    w, raw = truncated_importance_weights(cur, beh, rho_min=0.0, rho_max=4.0, level="sequence", mask=mask)
    # Row 0: 2 * 3 = 6 -> capped at 4. Row 1: 0.5 * 0.5 * 2 = 0.5 (no lower bound with rho_min = 0).
    torch.testing.assert_close(w, torch.tensor([4.0, 0.5]))
    torch.testing.assert_close(raw, torch.tensor([6.0, 0.5]))


def test_truncated_weights_token_hand_worked():
    beh = torch.tensor([[-1.0, -2.0, 0.0]])
    cur = beh + torch.tensor([[LN(2.0), LN(0.25), 0.0]])
    cur[0, 2] = 1000.0  # padding
    w, raw = truncated_importance_weights(cur, beh, 0.5, 2.0, level="token", mask=torch.tensor([[1, 1, 0]]))
    # Per token: 2 -> 2 (at rho_max, kept), 0.25 -> 0.5 (raised to rho_min), padding -> 0.
    torch.testing.assert_close(w, torch.tensor([[2.0, 0.5, 0.0]]))
    torch.testing.assert_close(raw, torch.tensor([[2.0, 0.25, 0.0]]))


def test_truncated_weights_unbounded_is_raw():
    beh = torch.tensor([-3.0, -1.0])
    cur = beh + torch.tensor([LN(40.0), LN(0.01)])
    w, raw = truncated_importance_weights(cur, beh, rho_min=0.0, rho_max=math.inf)
    torch.testing.assert_close(w, raw)
    torch.testing.assert_close(w, torch.tensor([40.0, 0.01]))


def test_truncated_weights_carry_no_gradient():
    cur = torch.tensor([-1.0, -2.0], requires_grad=True)
    beh = torch.tensor([-1.5, -1.0])
    w, raw = truncated_importance_weights(cur, beh, 0.5, 10.0)
    assert not w.requires_grad and not raw.requires_grad
    # In L = -E[A rho log pi] the gradient flows only through log pi: d/dcur of (w * cur) = w.
    (w * cur).sum().backward()
    torch.testing.assert_close(cur.grad, w)


def test_truncated_weights_validate():
    x = torch.zeros(3)
    with pytest.raises(ValueError, match="rho_min"):
        truncated_importance_weights(x, x, rho_min=2.0, rho_max=1.0)
    with pytest.raises(ValueError, match="rho_min"):
        truncated_importance_weights(x, x, rho_min=-0.1, rho_max=1.0)
    with pytest.raises(ValueError, match="shape"):
        truncated_importance_weights(x, torch.zeros(2), 0.0, 1.0)
    with pytest.raises(ValueError, match="token"):
        truncated_importance_weights(x, x, 0.0, 1.0, level="token")
    with pytest.raises(ValueError, match="mask"):
        truncated_importance_weights(torch.zeros(2, 3), torch.zeros(2, 3), 0.0, 1.0, level="sequence")
    with pytest.raises(ValueError, match="level"):
        truncated_importance_weights(x, x, 0.0, 1.0, level="group")


# --------------------------------------------------------------------------- KL estimators k1, k2, k3
def test_kl_estimators_hand_worked():
    """pi(y) = 1/2, ref(y) = 1/4: d = log ref - log pi = -log 2."""
    from src.loss.kl import kl_k1, kl_k2, kl_k3

    logp, ref = torch.tensor([math.log(0.5)], dtype=torch.float64), torch.tensor([math.log(0.25)], dtype=torch.float64)
    assert kl_k1(logp, ref).item() == pytest.approx(math.log(2))                 # 0.693147
    assert kl_k2(logp, ref).item() == pytest.approx(0.5 * math.log(2) ** 2)      # 0.240227
    assert kl_k3(logp, ref).item() == pytest.approx(0.5 - 1 + math.log(2))       # 0.193147
    same = torch.tensor([-1.3, -0.2])
    for estimator in (kl_k1, kl_k2, kl_k3):
        assert torch.equal(estimator(same, same), torch.zeros(2))


def _exact_expectation(estimator, logits, ref_logprobs):
    """E_{y ~ pi}[estimator(log pi(y), log ref(y))] over a whole vocabulary, the sampling weights pi held fixed.

    This is what a per-token loss on sampled tokens averages to: autograd differentiates the token's
    value through log pi, never the choice of the token, so the expectation weights are constants.
    """
    logprobs = torch.log_softmax(logits, dim=-1)
    return (logprobs.exp().detach() * estimator(logprobs, ref_logprobs)).sum()


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_kl_estimators_exact_values_and_gradients_over_a_five_token_vocabulary(seed):
    """Enumerating the vocabulary (no sampling): which KL each estimator's value and loss-gradient give."""
    from src.loss.kl import kl_k1, kl_k2, kl_k3

    generator = torch.Generator().manual_seed(seed)
    logits = torch.randn(5, generator=generator, dtype=torch.float64, requires_grad=True)
    ref_logprobs = torch.log_softmax(torch.randn(5, generator=generator, dtype=torch.float64), dim=-1)
    pi, ref = torch.softmax(logits, -1), ref_logprobs.exp()

    forward_kl = (ref * (ref_logprobs - torch.log(pi))).sum()      # KL[ref || pi]
    reverse_kl = (pi * (torch.log(pi) - ref_logprobs)).sum()       # KL[pi || ref]
    grad_reverse, = torch.autograd.grad(reverse_kl, logits, retain_graph=True)
    grad_forward, = torch.autograd.grad(forward_kl, logits, retain_graph=True)
    assert not torch.allclose(grad_reverse, grad_forward, atol=1e-3)  # the two KLs pull differently here

    def value_and_gradient(estimator):
        expected = _exact_expectation(estimator, logits, ref_logprobs)
        gradient, = torch.autograd.grad(expected, logits)
        return expected.item(), gradient

    k1_value, k1_gradient = value_and_gradient(kl_k1)
    k2_value, k2_gradient = value_and_gradient(kl_k2)
    k3_value, k3_gradient = value_and_gradient(kl_k3)
    # Values: k1 and k3 are unbiased for KL[pi || ref]; k2 is not.
    assert k1_value == pytest.approx(reverse_kl.item(), rel=1e-12)
    assert k3_value == pytest.approx(reverse_kl.item(), rel=1e-12)
    assert k2_value != pytest.approx(reverse_kl.item(), rel=1e-3)
    # Gradients as a loss: k1 none, k2 that of KL[pi || ref], k3 that of KL[ref || pi].
    assert torch.allclose(k1_gradient, torch.zeros(5, dtype=torch.float64), atol=1e-12)
    assert torch.allclose(k2_gradient, grad_reverse, atol=1e-12)
    assert torch.allclose(k3_gradient, grad_forward, atol=1e-12)
    assert not torch.allclose(k3_gradient, grad_reverse, atol=1e-3)
