"""The large policy presets: architectures on the meta device, their FSDP sharding on a fake process group,
and the memory plan built from them (no weights, no download)."""

from __future__ import annotations

import math

import pytest
import torch
import torch.distributed as dist

from src.distributed.fsdp import shard_policy
from src.distributed.memory import GIB, Shape, best_fit, gpu_bytes, meta_policy, plan_lines, shape_file

# Parameter counts the model cards publish (billions), which the local config.json files must reproduce.
PUBLISHED = {"Qwen/Qwen2.5-0.5B": 0.49, "Qwen/Qwen3-0.6B": 0.60, "Qwen/Qwen2.5-1.5B": 1.54,
             "Qwen/Qwen2.5-7B": 7.61, "deepseek-ai/DeepSeek-R1-Distill-Qwen-1.5B": 1.78}
PRESETS = {"qwen2.5-0.5b": "Qwen/Qwen2.5-0.5B", "qwen3-0.6b": "Qwen/Qwen3-0.6B", "qwen2.5-1.5b": "Qwen/Qwen2.5-1.5B",
           "qwen2.5-7b": "Qwen/Qwen2.5-7B", "r1-distill-qwen-1.5b": "deepseek-ai/DeepSeek-R1-Distill-Qwen-1.5B"}


@pytest.mark.parametrize("preset, hub", PRESETS.items())
def test_each_preset_names_a_policy_whose_architecture_is_written_down(compose_config, preset, hub):
    assert compose_config(f"policy={preset}").policy.name_or_path == hub
    model = meta_policy(hub)
    assert next(model.parameters()).device.type == "meta"
    assert sum(p.numel() for p in model.parameters()) / 1e9 == pytest.approx(PUBLISHED[hub], abs=0.01)


def test_the_plan_counts_what_fsdp_puts_on_each_of_8_ranks():
    """Qwen2.5-7B sharded by `shard_policy` over a fake 8-rank group: each rank's shards are 1/8 of the
    parameters (up to FSDP's padding of each tensor's first dimension), as the plan assumes."""
    model = meta_policy("Qwen/Qwen2.5-7B")
    shape = Shape.of(model)
    from torch.testing._internal.distributed.fake_pg import FakeStore  # registers the "fake" backend

    dist.init_process_group("fake", rank=3, world_size=8, store=FakeStore())
    try:
        shard_policy(model)
        local = sum(p.to_local().numel() for p in model.parameters())
    finally:
        dist.destroy_process_group()
    padded = sum(math.ceil(p.shape[0] / 8) * math.prod(p.shape[1:]) for p in model.parameters())
    assert local == padded
    planned = gpu_bytes(shape, 8, 4096, True)["sharded fp32 weights, gradients, AdamW"]
    assert planned == pytest.approx(16 * local, rel=1e-3)


def test_plans_need_less_per_gpu_on_more_gpus_and_the_7b_needs_sharding():
    seven = Shape.of(meta_policy("Qwen/Qwen2.5-7B"))
    peaks = [sum(gpu_bytes(seven, gpus, 4096, True).values()) / GIB for gpus in (1, 2, 4, 8)]
    assert peaks == sorted(peaks, reverse=True) and peaks[0] > 80
    small = Shape.of(meta_policy("Qwen/Qwen3-0.6B"))
    fit = best_fit(small, 1)
    assert fit.micro_batch_tokens is not None and fit.peak_gib <= 79
    assert sum(gpu_bytes(small, 1, fit.micro_batch_tokens, fit.activation_checkpointing).values()) / GIB == fit.peak_gib
    lines = plan_lines("Qwen/Qwen2.5-7B")
    assert len(lines) == 5 and lines[1].startswith("  1 GPU(s): does not fit")
    assert lines[4].startswith("  8 GPU(s): FSDP over 8, micro-batch 8192 tokens, activation checkpointing on")


def test_a_policy_without_a_written_architecture_is_named_with_the_fix():
    with pytest.raises(FileNotFoundError, match="policy.name_or_path=org/unknown: no architecture in .*known: "):
        shape_file("org/unknown")


def test_the_slurm_dry_run_prints_the_memory_plan_of_the_job(compose_config):
    from src.study.slurm import slurm_plan_lines

    seven = compose_config("hardware=h100x8", "policy=qwen2.5-7b", hydra=True)
    lines = slurm_plan_lines(seven, [seven])
    planned = [line for line in lines if line.startswith("memory plan: Qwen/Qwen2.5-7B")]
    assert len(planned) == 1 and "over the job's 8 GPU(s): " in planned[0]
    assert "at micro-batch 8192 tokens, activation checkpointing on" in planned[0]
    alone = compose_config("hardware=h100", "policy=qwen2.5-7b", hydra=True)
    assert any(line.startswith("memory plan: Qwen/Qwen2.5-7B trained data-parallel (FSDP) over the job's 1 GPU(s): "
                               "does not fit") for line in slurm_plan_lines(alone, [alone]))
    tiny = compose_config("hardware=h100", hydra=True)
    assert not any(line.startswith("memory plan") for line in slurm_plan_lines(tiny, [tiny]))
