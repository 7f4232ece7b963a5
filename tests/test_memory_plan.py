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


EIGHT_RANKS = ("hardware.ranks=8",)  # hardware=h100x8's runtime=sync over the node, as docs/distributed.md types it


def test_the_slurm_dry_run_prints_the_memory_plan_of_the_job(compose_config):
    from src.study.slurm import slurm_plan_lines

    seven = compose_config("hardware=h100x8", "policy=qwen2.5-7b", *EIGHT_RANKS, hydra=True)
    lines = slurm_plan_lines(seven, [seven])
    assert "1 node x 8 task, 8 GPU" in lines[0]  # one SLURM task a rank
    planned = [line for line in lines if line.startswith("memory plan: Qwen/Qwen2.5-7B")]
    assert len(planned) == 1 and "over the job's 8 GPU(s): " in planned[0]
    assert "training 66.8 GiB per GPU at micro-batch 4096 tokens, activation checkpointing on; host: 251 GiB" \
        in planned[0]  # the update's share: the whole GPU less the sleeping vLLM engine's context (2 GiB)
    generation = [line for line in lines if line.startswith("generation plan: Qwen/Qwen2.5-7B")]
    assert len(generation) == 1 and "a vLLM engine on each of the 8 GPU(s), each sampling 1/8" in generation[0]
    assert "23.7 GiB per GPU (bf16 weights 14.2, KV cache 9.5)" in generation[0]  # 0.3 x 79; 2 x 7.6 B bytes
    assert "weight sync per step: 28.4 GiB gathered on each rank" in generation[0] and "does not fit" not in generation[0]
    hf = compose_config("hardware=h100x8", "policy=qwen2.5-7b", *EIGHT_RANKS, "policy.engine=hf", hydra=True)
    assert not any(line.startswith("generation plan") for line in slurm_plan_lines(hf, [hf]))
    alone = compose_config("hardware=h100", "policy=qwen2.5-7b", hydra=True)
    assert any(line.startswith("memory plan: Qwen/Qwen2.5-7B trained data-parallel (FSDP) over the job's 1 GPU(s): "
                               "does not fit") for line in slurm_plan_lines(alone, [alone]))
    tiny = compose_config("hardware=h100", hydra=True)
    assert not any(line.startswith("memory plan") for line in slurm_plan_lines(tiny, [tiny]))


def test_a_job_whose_gpus_cannot_hold_the_policy_is_refused_with_the_hardware_that_fits(compose_config):
    from src.config import validate
    from src.study.slurm import memory_refusal

    def refusal(*overrides):
        cfg = compose_config(*overrides, hydra=True)
        job = compose_config(*overrides)
        validate(job, check_device=False)
        return memory_refusal(job, cfg.hydra.launcher, cfg.hydra.runtime.choices.hardware)

    assert refusal("hardware=h100x4", "policy=qwen2.5-7b") is None
    assert refusal("hardware=h100x8", "policy=qwen2.5-7b", *EIGHT_RANKS) is None
    assert refusal("hardware=h100", "policy=qwen2.5-1.5b") is None
    assert refusal("hardware=h100") is None  # the tiny policy: nothing to plan
    one = refusal("hardware=h100", "policy=qwen2.5-7b")
    assert one.startswith("policy.name_or_path=Qwen/Qwen2.5-7B on hardware=h100 (hardware.ranks=1): needs 168 GiB")
    assert one.endswith("FSDP over 4 GPUs fits: use hardware=h100x4")
    # hardware=h100x8 trains on one GPU unless told its ranks (runtime=async's trainer)
    assert refusal("hardware=h100x8", "policy=qwen2.5-7b").endswith("use hardware=h100x4")
    # an engine awake beside the update leaves it 70 % of each GPU; its share must hold the bf16 weights
    awake = refusal("hardware=h100x4", "policy=qwen2.5-7b", "policy.vllm.sleep=false")
    assert "beside vLLM's share (policy.vllm.gpu_memory_utilization=0.3)" in awake
    small = refusal("hardware=h100x8", "policy=qwen2.5-7b", *EIGHT_RANKS, "policy.vllm.gpu_memory_utilization=0.15")
    assert small == ("policy.name_or_path=Qwen/Qwen2.5-7B on hardware=h100x8 (hardware.ranks=8): vLLM's bf16 weights "
                     "take 14.2 GiB of its 11.8 GiB share: no room for a KV cache; raise "
                     "policy.vllm.gpu_memory_utilization or split each engine over 2 GPUs "
                     "(policy.vllm.tensor_parallel_size=2)")
    assert refusal("hardware=h100x8", "policy=qwen2.5-7b", *EIGHT_RANKS, "policy.vllm.gpu_memory_utilization=0.15",
                   "policy.vllm.tensor_parallel_size=2") is None  # 7.1 GiB of weights a GPU
    crowded = refusal("hardware=h100x8", "policy=qwen2.5-7b", "hardware.ranks=4", "hydra.launcher.tasks_per_node=4",
                      "policy.vllm.gpu_memory_utilization=0.5")
    assert "generating, the trainer keeps 51.6 GiB beside the engine's 39.5 GiB" in crowded
    # runtime=async on the 8-GPU node: W workers' GPUs, then the trainer's
    assert refusal("hardware=h100x8", "runtime=async", "runtime.workers=7", "runtime.gpus_per_worker=1",
                   "buffer=none") is None
    assert refusal("hardware=h100x8", "runtime=async", "runtime.workers=8", "runtime.gpus_per_worker=1",
                   "buffer=none").startswith("runtime.workers=8 x runtime.gpus_per_worker=1 and 1 trainer rank(s) "
                                             "after them on hardware=h100x8: 9 GPUs, the job asks for 8")
    many = refusal("hardware=h100x4", "hardware.ranks=8")
    assert many.startswith("hardware.ranks=8 on hardware=h100x4: the job asks for 4 GPU(s)")
    # 4 ranks each load 7.6 B fp32 parameters (28 GiB) on the host beside 3 GiB of their own: 126 GiB
    host = refusal("hardware=h100x4", "policy=qwen2.5-7b", "hydra.launcher.mem_gb=100")
    assert host.startswith("policy.name_or_path=Qwen/Qwen2.5-7B on hardware=h100x4 (hardware.ranks=4): each rank "
                           "loads the whole policy in fp32 on the host before sharding it, 126 GiB in all")
    assert host.endswith("hydra.launcher.mem_gb=100; raise hydra.launcher.mem_gb to at least 126")
    assert refusal("hardware=h100x4", "policy=qwen2.5-7b", "hydra.launcher.mem_gb=128") is None
    # runtime=async: one driver process; its 2 trainer ranks are Ray actors (on cuda:2 and 3), not SLURM tasks
    actors = ("hardware=h100x4", "runtime=async", "runtime.workers=2", "runtime.gpus_per_worker=1",
              "hardware.device=cuda:2", "hardware.ranks=2", "runtime.trainers=2", "buffer=none")
    assert refusal(*actors) == ("hydra.launcher.tasks_per_node=2 with runtime=async and hardware.ranks=2: the cell "
                                "runs 1 process(es) (runtime=async: one driver, its trainer ranks are Ray actors); "
                                "set hydra.launcher.tasks_per_node=1")
    assert refusal(*actors, "hydra.launcher.tasks_per_node=1") is None


@pytest.mark.slow  # a Hydra sweep composes in a subprocess: ~10 s
def test_the_dry_run_refuses_a_policy_the_job_cannot_hold_in_one_line(tmp_path):
    import subprocess
    import sys

    from src.paths import PROJECT_ROOT

    command = [sys.executable, "-m", "src.run", "-m", "hardware=h100", "policy=qwen2.5-7b", "hydra.sweeper.dry_run=true",
               f"tracking.uri=sqlite:///{tmp_path}/mlruns.db", f"hydra.sweep.dir={tmp_path}/sweep"]
    done = subprocess.run(command, cwd=PROJECT_ROOT, capture_output=True, text=True, timeout=300)
    assert done.returncode == 2
    said = [line for line in (done.stdout + done.stderr).splitlines() if "Qwen2.5-7B on hardware=h100" in line]
    assert len(said) == 1 and said[0].endswith("use hardware=h100x4") and "Traceback" not in done.stderr
    assert "SLURM: " not in done.stdout  # refused before the job's request is planned


@pytest.mark.slow  # a Hydra sweep composes in a subprocess: ~10 s
def test_the_dry_run_of_8_ranks_plans_each_ranks_vllm_share_and_the_weight_sync(tmp_path):
    """docs/distributed.md's command, as typed there: 8 ranks, each with its vLLM engine, no further overrides."""
    import subprocess
    import sys

    from src.paths import PROJECT_ROOT

    command = [sys.executable, "-m", "src.run", "-m", "hardware=h100x8", "hardware.ranks=8", "policy=qwen2.5-7b",
               "hydra.sweeper.dry_run=true", f"tracking.uri=sqlite:///{tmp_path}/mlruns.db",
               f"hydra.sweep.dir={tmp_path}/sweep"]
    done = subprocess.run(command, cwd=PROJECT_ROOT, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    said = " ".join((done.stdout + done.stderr).split())  # the plan goes to the log, the table to stdout
    assert "each asks for 1 node x 8 task, 8 GPU, 64 CPUs, 512 GB" in said  # 8 CPUs a rank
    assert "over the job's 8 GPU(s): training 66.8 GiB per GPU" in said
    assert "a vLLM engine on each of the 8 GPU(s), each sampling 1/8 of every step's groups: 23.7 GiB per GPU" in said
    assert "weight sync per step: 28.4 GiB gathered on each rank" in said and "nothing launched" in said
