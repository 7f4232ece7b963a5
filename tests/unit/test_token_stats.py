"""The memory-lean log-prob/entropy path equals the plain autograd expressions (values and gradients)."""

import pytest
import torch
from omegaconf import OmegaConf

from src.policy.token_stats import token_entropy, token_logprobs_and_entropy
from src.policy.model import load_policy
from src.policy.forward import response_token_stats
from src.build import build_optimizer


def plain(logits, targets, temperature):
    z = logits / temperature
    return torch.log_softmax(z, -1).gather(-1, targets[:, None]).squeeze(-1), token_entropy(z)


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_values_and_gradients_equal_autograd_in_float64(temperature):
    generator = torch.Generator().manual_seed(0)
    logits = (3 * torch.randn(11, 37, generator=generator, dtype=torch.float64)).requires_grad_()
    targets = torch.randint(0, 37, (11,), generator=generator)
    up_chosen, up_entropy = torch.randn(11, generator=generator, dtype=torch.float64), torch.randn(
        11, generator=generator, dtype=torch.float64)

    chosen, entropy = token_logprobs_and_entropy(logits, targets, temperature, chunk_rows=4)  # 3 chunks
    (chosen * up_chosen + entropy * up_entropy).sum().backward()
    fused_grad = logits.grad.clone()
    logits.grad = None
    ref_chosen, ref_entropy = plain(logits, targets, temperature)
    (ref_chosen * up_chosen + ref_entropy * up_entropy).sum().backward()

    assert torch.allclose(chosen, ref_chosen, atol=1e-12)
    assert torch.allclose(entropy, ref_entropy, atol=1e-12)
    assert torch.allclose(fused_grad, logits.grad, atol=1e-12)
    assert fused_grad.abs().max() > 1e-3  # a real gradient, not zeros


def test_masked_logits_give_finite_values_and_zero_gradient_there():
    logits = torch.tensor([[0.0, 1.0, float("-inf")], [2.0, float("-inf"), 0.5]], requires_grad=True)
    targets = torch.tensor([1, 0])
    chosen, entropy = token_logprobs_and_entropy(logits, targets)
    (chosen.sum() + entropy.sum()).backward()
    assert torch.isfinite(chosen).all() and torch.isfinite(entropy).all()
    assert logits.grad[0, 2] == 0 and logits.grad[1, 1] == 0
    ref_chosen, ref_entropy = plain(logits.detach(), targets, 1.0)
    assert torch.allclose(chosen, ref_chosen) and torch.allclose(entropy, ref_entropy)


def test_bf16_logits_are_worked_in_fp32_and_the_gradient_comes_back_in_bf16():
    logits = torch.randn(6, 50).to(torch.bfloat16).requires_grad_()
    targets = torch.randint(0, 50, (6,))
    chosen, entropy = token_logprobs_and_entropy(logits, targets)
    assert chosen.dtype == torch.float32 and entropy.dtype == torch.float32
    ref_chosen, ref_entropy = plain(logits.detach().float(), targets, 1.0)
    assert torch.allclose(chosen, ref_chosen, atol=1e-6) and torch.allclose(entropy, ref_entropy, atol=1e-5)
    chosen.sum().backward()
    assert logits.grad.dtype == torch.bfloat16


def test_shapes_are_checked():
    with pytest.raises(ValueError, match=r"logits must be \[N, V\]"):
        token_logprobs_and_entropy(torch.zeros(2, 3, 4), torch.zeros(2, dtype=torch.long))


@pytest.fixture
def tiny_policy(random_policy_dir):
    return load_policy(str(random_policy_dir), "cpu", "float32")


def test_fused_response_stats_equal_the_plain_path_on_the_tiny_policy(tiny_policy):
    """Same per-token log-probs, entropies, mask and parameter gradients, prompts of different lengths."""
    model, tokenizer = tiny_policy
    pad = tokenizer.pad_token_id
    sequences = [([5, 6, 7, 8], [9, 10, 11]), ([5, 6], [12, 13, 14, 15, 16]), ([7, 8, 9], [17])]
    results = []
    for fused in (False, True):
        model.zero_grad(set_to_none=True)
        logprobs, entropy, mask = response_token_stats(model, sequences, pad, with_entropy=True, fused=fused)
        ((logprobs * mask).sum() + 0.3 * (entropy * mask).sum()).backward()
        results.append((logprobs.detach(), entropy.detach(), mask,
                        [p.grad.clone() for p in model.parameters() if p.grad is not None]))
    (lp0, h0, m0, g0), (lp1, h1, m1, g1) = results
    assert torch.equal(m0, m1)
    assert torch.allclose(lp0 * m0, lp1, atol=1e-5) and torch.allclose(h0 * m0, h1, atol=1e-5)
    assert len(g0) == len(g1) and all(torch.allclose(a, b, atol=1e-5, rtol=1e-4) for a, b in zip(g0, g1))


def test_the_optimizer_is_adamw_with_the_trainer_settings(tiny_policy):
    model, _ = tiny_policy
    trainer = OmegaConf.create({"learning_rate": 3e-5, "weight_decay": 1e-4, "betas": [0.9, 0.95]})
    optimizer = build_optimizer(model, trainer)
    group = optimizer.param_groups[0]
    assert isinstance(optimizer, torch.optim.AdamW)
    assert (group["lr"], group["weight_decay"], group["betas"]) == (3e-5, 1e-4, (0.9, 0.95))
    assert not group["fused"]  # fused AdamW is CUDA-only; the CPU keeps the default implementation
