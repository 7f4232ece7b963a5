"""What a rank holds when its engine wakes: `src.build.build_components` under ranks loads the policy on the host,
makes pi_ref in the sharded policy's compute dtype and shards the policy (FSDP2) before it builds the engine, so a
7B policy never sits whole in fp32 on the GPU beside the awake engine and a second whole fp32 copy (pi_ref)."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

import src.build
from src.distributed.fsdp import compute_dtype, is_sharded
from src.distributed.memory import GIB, meta_policy
from src.settings import RunSettings
from src.task import countdown


class Built(Exception):
    """Raised by the stand-in engine: the build is read up to the engine, then stopped."""


@pytest.fixture
def eight_fake_ranks():
    from torch.testing._internal.distributed.fake_pg import FakeStore  # registers the "fake" backend

    dist.init_process_group("fake", rank=3, world_size=8, store=FakeStore())
    yield
    dist.destroy_process_group()


def test_under_ranks_the_policy_is_sharded_and_pi_ref_made_before_the_engine_is_built(compose_config, monkeypatch,
                                                                                      eight_fake_ranks):
    """hardware=h100x8's 8 ranks, on this CPU (a fake process group of 8): at the engine's build the policy was
    loaded on the host, is sharded, and pi_ref is a frozen copy of its own (no parameter shared with it)."""
    cfg = compose_config("hardware=h100x8", "hardware.ranks=8", "hardware.device=cpu", "policy.engine=hf",
                         "hardware.activation_checkpointing=true")
    seen = {}
    load = src.build.load_policy

    def loading(name, device, dtype):
        seen["loaded on"] = device
        return load(name, device, dtype)

    def engine(kind, policy, *args, **kwargs):
        seen["sharded"] = is_sharded(policy)
        seen["checkpointed layers"] = sum("checkpoint" in str(layer.__dict__.get("forward", ""))
                                          for layer in policy.model.layers)
        raise Built

    monkeypatch.setattr(src.build, "load_policy", loading)
    monkeypatch.setattr(src.build, "build_engine", engine)
    with pytest.raises(Built):
        src.build.build_components(RunSettings(cfg), countdown.generate_instances(8, seed=1))
    assert seen == {"loaded on": "cpu", "sharded": True, "checkpointed layers": 4}


def test_pi_ref_under_ranks_is_a_bf16_copy_on_a_gpu_not_a_whole_fp32_one():
    """Qwen2.5-7B on the meta device: pi_ref made as a rank makes it for a GPU is 2 bytes a parameter (14.2 GiB),
    where the whole fp32 copy it used to be (`frozen_copy`) took 4 (28.4 GiB); the policy itself stays fp32."""
    policy = meta_policy("Qwen/Qwen2.5-7B").float()  # as hardware=h100x8 loads it (hardware.dtype=float32)
    assert compute_dtype("cuda") == torch.bfloat16 and compute_dtype("cpu") is None
    reference = src.build.reference_policy(policy, "meta", compute_dtype("cuda"))
    parameters = sum(p.numel() for p in policy.parameters())
    assert sum(p.numel() * p.element_size() for p in reference.parameters()) == 2 * parameters  # 7.62 B x 2
    assert round(2 * parameters / GIB, 1) == 14.2
    assert all(p.dtype == torch.float32 for p in policy.parameters())
    assert not any(p.requires_grad for p in reference.parameters()) and not reference.training


def test_pi_ref_on_the_cpu_keeps_the_policys_dtype_and_ties():
    """On the CPU (the multi-rank tests) pi_ref is the policy's exact copy: same values, fp32, tied head, own storage."""
    from src.policy.model import build_tiny_model
    from src.policy.tokenizer import build_countdown_tokenizer, template_pieces

    template = countdown.DEFAULT_PROMPT_TEMPLATE
    tokenizer = build_countdown_tokenizer([template], template_pieces(template))
    policy = build_tiny_model(tokenizer, hidden_size=32, layers=1, heads=2, kv_heads=1)
    reference = src.build.reference_policy(policy, "cpu", compute_dtype("cpu"))
    assert reference.lm_head.weight is reference.model.embed_tokens.weight  # tied, as the policy's
    for (name, mine), theirs in zip(policy.named_parameters(), reference.parameters()):
        assert torch.equal(mine, theirs) and theirs.dtype == mine.dtype, name
        assert theirs.data_ptr() != mine.data_ptr(), name


def test_activation_checkpointing_recomputes_each_layer_in_backward_and_keeps_the_parameter_names():
    """`hardware.activation_checkpointing`: each decoder layer's forward runs again in backward (its activations
    were not kept), the gradients are those of the plain model, and the parameter names (the weight sync's and the
    checkpoints') are the policy's own."""
    from src.distributed.fsdp import checkpoint_layers
    from src.policy.model import build_tiny_model
    from src.policy.tokenizer import build_countdown_tokenizer, template_pieces

    template = countdown.DEFAULT_PROMPT_TEMPLATE
    tokenizer = build_countdown_tokenizer([template], template_pieces(template))
    plain = build_tiny_model(tokenizer, hidden_size=32, layers=2, heads=2, kv_heads=1)
    checkpointed = build_tiny_model(tokenizer, hidden_size=32, layers=2, heads=2, kv_heads=1)
    names = [name for name, _ in plain.named_parameters()]
    checkpoint_layers(checkpointed.model.layers)
    assert [name for name, _ in checkpointed.named_parameters()] == names
    calls = []
    for layer in checkpointed.model.layers:
        # a pre-hook: the recompute stops once the last tensor backward needs is made again (torch's early stop),
        # inside the MLP's down projection, before a hook after the MLP would run
        layer.mlp.register_forward_pre_hook(lambda module, args: calls.append(torch.is_grad_enabled()))
    ids = torch.tensor([[3, 4, 5, 6, 7, 8]])
    for model in (plain, checkpointed):
        model.train()
        model(input_ids=ids).logits.float().square().mean().backward()
    assert calls == [True] * 4  # 2 layers, each run in the forward and again in the backward
    for (name, mine), theirs in zip(plain.named_parameters(), checkpointed.parameters()):
        torch.testing.assert_close(theirs.grad, mine.grad, msg=name)
