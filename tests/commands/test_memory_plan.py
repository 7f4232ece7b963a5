"""The large policy presets: architectures on the meta device, their FSDP sharding on a fake process group,
and the memory plan built from them (no weights, no download)."""

from __future__ import annotations

import math

import pytest
import torch
import torch.distributed as dist

from src.distributed.fsdp import shard_policy
from src.distributed.memory import (GIB, Cell, EngineShare, Shape, best_fit, generation_plan, gpu_bytes, host_gib,
                                    layer_activation_bytes, meta_policy, peak_gib, plan_lines, policy_shape, shape_file)

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
    planned = gpu_bytes(shape, 8, Cell(4096, True))["sharded fp32 weights, gradients, AdamW"]
    assert planned == pytest.approx(16 * local, rel=1e-3)


def test_plans_need_less_per_gpu_on_more_gpus_and_the_7b_needs_sharding():
    seven = Shape.of(meta_policy("Qwen/Qwen2.5-7B"))
    peaks = [peak_gib(seven, gpus, Cell(4096, True)) for gpus in (1, 2, 4, 8)]
    assert peaks == sorted(peaks, reverse=True) and peaks[0] > 80
    small = Shape.of(meta_policy("Qwen/Qwen3-0.6B"))
    fit = best_fit(small, 1)
    assert fit.micro_batch_tokens is not None and fit.peak_gib <= 79
    assert peak_gib(small, 1, Cell(fit.micro_batch_tokens, fit.activation_checkpointing)) == fit.peak_gib
    lines = plan_lines("Qwen/Qwen2.5-7B")
    assert len(lines) == 5 and lines[1].startswith("  1 GPU(s): does not fit")
    assert lines[4] == "  8 GPU(s): FSDP over 8, micro-batch 16384 tokens, activation checkpointing on: 64.1 GiB"


# Qwen2.5-7B by hand (conf/policy/shapes/Qwen__Qwen2.5-7B.json): P parameters, one layer's, L, h, I, V, the
# embedding's (the largest tensor), key/value width (4 heads x 128); R, the root unit's (embedding, head, final
# norm) = P - L x P_layer.
P, P_LAYER, L, H, I, V, EMBEDDING, KV = 7_615_616_512, 233_057_792, 28, 3584, 18944, 152064, 544_997_376, 512
R = P - L * P_LAYER  # 1,089,998,336 = 2 x 152,064 x 3,584 + 3,584


def test_the_7b_shape_is_the_one_the_hand_calculations_use():
    assert policy_shape("Qwen/Qwen2.5-7B") == Shape(P, P_LAYER, L, H, V, EMBEDDING, I, KV, 131072)
    assert R == 2 * V * H + H


def test_a_swiglu_layer_keeps_twice_what_the_gelu_formula_said():
    """Per token, bf16: two RMSNorms 2 x (4h fp32 input + 2h output), attention 12h (projections' input, q, k and v
    repeated to 28 heads, sdpa output, o_proj input), MLP 2h + 4 x 2I. Korthikanti's 34h is about half."""
    by_hand = 2 * (4 * H + 2 * H) + 6 * 2 * H + 2 * H + 4 * 2 * I  # 244,736 bytes
    assert layer_activation_bytes(policy_shape("Qwen/Qwen2.5-7B")) == by_hand == 244_736
    assert by_hand / (34 * H) == pytest.approx(2.01, abs=0.01)


def test_the_7b_update_on_8_gpus_term_by_term():
    """trainer=paper's 12,288-token micro-batches with activation checkpointing and the fused head, 8 ranks on GPUs."""
    n, c = 12288, 4096  # tokens a micro-batch, rows the fused head works at once (token_stats.CHUNK_ROWS)
    parts = gpu_bytes(policy_shape("Qwen/Qwen2.5-7B"), 8, Cell(n, activation_checkpointing=True, fused_head=True))
    by_hand = {"sharded fp32 weights, gradients, AdamW": 16 * P / 8,       # 14.19 GiB
               "gathered bf16 weights": 2 * (R + 2 * P_LAYER),              # 2.90 GiB
               "unsharded fp32 gradients": 4 * R,                            # 4.06 GiB
               "reference policy": 2 * P,                                   # bf16 pi_ref: 14.19 GiB
               "activations": (2 * H * L + 244_736) * n,                    # layer inputs + one layer: 5.10 GiB
               "output head": 8 * n * H + 4 * n * V + 8 * c * V}            # 11.93 GiB
    assert {key: value for key, value in parts.items() if key != "headroom"} == pytest.approx(by_hand)
    assert parts["headroom"] == pytest.approx(2 * GIB + 0.1 * sum(by_hand.values()))
    assert sum(parts.values()) / GIB == pytest.approx(59.59, abs=0.01)
    unfused = gpu_bytes(policy_shape("Qwen/Qwen2.5-7B"), 8, Cell(n, True, fused_head=False))["output head"]
    assert unfused == 8 * n * H + 16 * n * V  # bf16 logits, fp32 log-softmax and softmax, fp32 and bf16 gradients
    whole = gpu_bytes(policy_shape("Qwen/Qwen2.5-7B"), 8, Cell(n, activation_checkpointing=False))["activations"]
    assert whole == 244_736 * L * n  # 78.4 GiB: the paper's micro-batch without checkpointing
    one = gpu_bytes(policy_shape("Qwen/Qwen2.5-7B"), 1, Cell(n, True))
    assert one["reference policy"] == 4 * P and one["gathered bf16 weights"] == 2 * P  # frozen_copy, autocast's cache


def test_the_7b_engine_beside_each_of_8_ranks_term_by_term():
    """vLLM's KV cache is its share less its weights, its profiling peak and its CUDA graphs; it holds sequences of
    the cell's max_model_len (1,024 prompt tokens + 1,024 response tokens), not the model's 131,072."""
    plan = generation_plan(policy_shape("Qwen/Qwen2.5-7B"), 8, EngineShare(0.3, sleep=True), Cell(12288, True))
    share, weights = 0.3 * 79, 2 * P / GIB                      # 23.7, 14.19 GiB
    profile = 16384 * (6 * I + 8 * H) / GIB                      # max_num_batched_tokens forward: 2.17 GiB
    assert 512 * 12 * V / GIB < profile                           # the dummy sampler's fp32 logits: 0.87 GiB
    kv = share - weights - profile - 1.0                          # 1 GiB of CUDA graphs: 6.34 GiB
    sequence = 2048 * 2 * L * KV * 2 / GIB                        # K and V, bf16, every layer: 0.109 GiB
    assert (plan.share, plan.weights, plan.profile, plan.graphs) == pytest.approx((share, weights, profile, 1.0))
    assert (plan.kv_cache, plan.sequence, plan.max_model_len) == pytest.approx((kv, sequence, 2048))
    assert plan.sequences == int(kv // sequence) == 57
    assert plan.startup == pytest.approx(4 * P / 8 / GIB + 2 * P / GIB + 2)   # shards, bf16 pi_ref, context: 19.7
    assert plan.resident == pytest.approx(12 * P / 8 / GIB + 2 * P / GIB + 2)  # + AdamW moments: 26.8
    assert plan.problem(79) is None
    whole = generation_plan(policy_shape("Qwen/Qwen2.5-7B"), 8, EngineShare(0.3, sleep=True),
                            Cell(12288, True, max_model_len=131072))
    assert whole.sequence == pytest.approx(7.0) and whole.kv_cache < whole.sequence  # vLLM's default: no room
    assert whole.problem(79) == ("vLLM's 23.7 GiB share less its bf16 weights (14.2), profiling peak (2.2) and CUDA "
                                 "graphs (1.0) leaves 6.3 GiB of KV cache, and one sequence of max_model_len 131072 "
                                 "needs 7.00; lower policy.vllm.max_model_len, raise "
                                 "policy.vllm.gpu_memory_utilization or split each engine over 2 GPUs "
                                 "(policy.vllm.tensor_parallel_size=2)")
    eager = generation_plan(policy_shape("Qwen/Qwen2.5-7B"), 8, EngineShare(0.3, True, eager=True), Cell(12288, True))
    assert eager.graphs == 0 and eager.kv_cache == pytest.approx(kv + 1.0)


def test_the_hosts_of_8_ranks_hold_each_ones_fp32_load_or_its_engines_pinned_weights():
    """At start each rank loads the policy in fp32 (4P); a sleeping engine later pins its bf16 weights (2P / tp)."""
    seven = policy_shape("Qwen/Qwen2.5-7B")
    assert host_gib(seven, 8, EngineShare(0.3, True)) == pytest.approx(8 * (4 * P / GIB + 3))  # 251 GiB
    assert host_gib(seven, 1, EngineShare(0.3, True)) == pytest.approx(4 * P / GIB + 3)
    tiny_share = EngineShare(0.3, True)
    assert host_gib(Shape(10, 1, 1, 1, 1), 2, tiny_share) == pytest.approx(2 * (40 / GIB + 3))
    # A policy whose pinned bf16 weights outgrow its fp32 load cannot exist; the larger of the two is what counts.
    assert host_gib(seven, 8, None) == host_gib(seven, 8, EngineShare(0.3, False))


def test_the_plan_reads_the_cells_own_settings(compose_config):
    cell = Cell.of(compose_config("hardware=h100x8", "hardware.ranks=8", "policy=qwen2.5-7b"))
    assert cell == Cell(micro_batch_tokens=12288, activation_checkpointing=True, fused_head=True, max_model_len=None,
                        max_new_tokens=1024, master_bytes=4, on_gpu=True)
    assert cell.context(policy_shape("Qwen/Qwen2.5-7B")) == 2048
    off = Cell.of(compose_config("hardware=h100x8", "hardware.ranks=8", "policy=qwen2.5-7b",
                                 "hardware.activation_checkpointing=false", "trainer.fused_logprobs=false",
                                 "policy.vllm.max_model_len=4096"))
    assert (off.activation_checkpointing, off.fused_head, off.context(None)) == (False, False, 4096)
    # one process: hardware.activation_checkpointing is a ranks' setting; trainer.gradient_checkpointing is its own
    alone = Cell.of(compose_config("hardware=h100x8", "policy=qwen2.5-7b"))
    assert not alone.activation_checkpointing and alone.checkpointing_key == "trainer.gradient_checkpointing"
    rows = Cell.of(compose_config("hardware=h100", "policy=qwen2.5-7b", "trainer.micro_batch_tokens=null"))
    assert rows.micro_batch_tokens == 128 * 2048  # micro_batch_size rows of max_model_len


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
    # the cell's own update (trainer=paper, hardware=h100x8's checkpointing) in the whole GPU less the sleeping engine
    assert ("training 59.6 GiB per GPU of 77.0 at micro-batch 12288 tokens, activation checkpointing on, fused head; "
            "host: 251 GiB") in planned[0]
    generation = [line for line in lines if line.startswith("generation plan: Qwen/Qwen2.5-7B")]
    assert len(generation) == 1 and "a vLLM engine on each of the 8 GPU(s), each sampling 1/8" in generation[0]
    assert ("23.7 GiB per GPU (bf16 weights 14.2, profiling peak 2.2, CUDA graphs 1.0, KV cache 6.3: 57 sequences of "
            "max_model_len 2048), started beside the trainer's 19.7 GiB") in generation[0]  # hand-checked above
    assert "weight sync per step: 28.4 GiB gathered on each rank" in generation[0] and "does not fit" not in generation[0]
    unchecked = compose_config("hardware=h100x8", "policy=qwen2.5-7b", *EIGHT_RANKS,
                               "hardware.activation_checkpointing=false", hydra=True)
    assert ("does not fit, training needs 140.2 GiB per GPU of 77.0 at micro-batch 12288 tokens, activation "
            "checkpointing off, fused head; fits with hardware.activation_checkpointing=true (59.6 GiB)"
            ) in " ".join(slurm_plan_lines(unchecked, [unchecked]))
    hf = compose_config("hardware=h100x8", "policy=qwen2.5-7b", *EIGHT_RANKS, "policy.engine=hf", hydra=True)
    assert not any(line.startswith("generation plan") for line in slurm_plan_lines(hf, [hf]))
    alone = compose_config("hardware=h100", "policy=qwen2.5-7b", hydra=True)
    assert any(line.startswith("memory plan: Qwen/Qwen2.5-7B trained data-parallel (FSDP) over the job's 1 GPU(s): "
                               "does not fit") for line in slurm_plan_lines(alone, [alone]))
    tiny = compose_config("hardware=h100", hydra=True)
    assert not any(line.startswith("memory plan") for line in slurm_plan_lines(tiny, [tiny]))


def job_refusal(compose_config):
    """`refusal(*overrides)`: the one-line refusal of their SLURM job (`memory_refusal`), after the checks."""
    from src.command.config import validate
    from src.study.slurm import memory_refusal

    def refusal(*overrides):
        cfg = compose_config(*overrides, hydra=True)
        job = compose_config(*overrides)
        validate(job, check_device=False)
        return memory_refusal(job, cfg.hydra.launcher, cfg.hydra.runtime.choices.hardware)

    return refusal


def test_a_job_whose_gpus_cannot_hold_the_policy_is_refused_with_the_hardware_that_fits(compose_config):
    refusal = job_refusal(compose_config)
    assert refusal("hardware=h100x4", "policy=qwen2.5-7b") is None
    assert refusal("hardware=h100x8", "policy=qwen2.5-7b", *EIGHT_RANKS) is None
    assert refusal("hardware=h100", "policy=qwen2.5-0.5b") is None
    # the cell's own micro-batch (trainer=paper's 12,288 tokens) and checkpointing, not the plan's best guess
    assert refusal("hardware=h100", "policy=qwen2.5-1.5b") == (
        "policy.name_or_path=Qwen/Qwen2.5-1.5B on hardware=h100 (hardware.ranks=1): the update needs 89.0 GiB per GPU "
        "at micro-batch 12288 tokens, activation checkpointing off, fused head, 55.3 GiB is left for it, beside "
        "vLLM's share (policy.vllm.gpu_memory_utilization=0.3); set trainer.gradient_checkpointing=true (52.2 GiB)")
    assert refusal("hardware=h100", "policy=qwen2.5-1.5b", "trainer.gradient_checkpointing=true") is None
    unchecked = refusal("hardware=h100x8", "policy=qwen2.5-7b", *EIGHT_RANKS, "hardware.activation_checkpointing=false")
    assert unchecked.endswith("at micro-batch 12288 tokens, activation checkpointing off, fused head, 77.0 GiB is left "
                              "for it; set hardware.activation_checkpointing=true (59.6 GiB)")
    whole_context = refusal("hardware=h100x8", "policy=qwen2.5-7b", *EIGHT_RANKS, "policy.vllm.max_model_len=131072")
    assert "leaves 6.3 GiB of KV cache, and one sequence of max_model_len 131072 needs 7.00" in whole_context
    assert refusal("hardware=h100") is None  # the tiny policy: nothing to plan
    one = refusal("hardware=h100", "policy=qwen2.5-7b")
    assert one.startswith("policy.name_or_path=Qwen/Qwen2.5-7B on hardware=h100 (hardware.ranks=1): needs 176 GiB")
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
                      "policy.vllm.gpu_memory_utilization=0.55")
    # 12 P / 4 (fp32 shards, AdamW moments) + 2 P (bf16 pi_ref) + 2 GiB of context, beside 0.55 x 79
    assert "generating, the trainer keeps 37.5 GiB beside the engine's 43.5 GiB" in crowded
    # runtime=async on the 8-GPU node: W workers' GPUs, then the trainer's
    assert refusal("hardware=h100x8", "runtime=async", "runtime.workers=7", "runtime.gpus_per_worker=1",
                   "buffer=none") is None
    assert refusal("hardware=h100x8", "runtime=async", "runtime.workers=8", "runtime.gpus_per_worker=1",
                   "buffer=none").startswith("runtime.workers=8 x runtime.gpus_per_worker=1 and 1 trainer rank(s) "
                                             "beside them on hardware=h100x8: 9 GPUs, the job asks for 8")
    # Over two nodes the driver's copy holds a GPU of its own beside the workers' and the rank's.
    assert refusal("hardware=h100x8", "runtime=async", "hardware.nodes=2", "runtime.workers=14",
                   "runtime.gpus_per_worker=1", "buffer=none") is None
    assert refusal("hardware=h100x8", "runtime=async", "hardware.nodes=2", "runtime.workers=15",
                   "runtime.gpus_per_worker=1", "buffer=none").startswith(
        "runtime.workers=15 x runtime.gpus_per_worker=1 and 1 trainer rank(s) beside them on hardware=h100x8: "
        "17 GPUs, the job asks for 16")
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
    assert refusal(*actors) is None  # the launcher asks for the runtime's processes a node (`tasks_a_node`): 1
    assert refusal(*actors, "hydra.launcher.tasks_per_node=2") == (
        "hydra.launcher.tasks_per_node=2 with runtime=async and hardware.ranks=2: the cell runs 1 process(es) "
        "(runtime=async: one driver, its trainer ranks are Ray actors, and a task on each further node); set "
        "hydra.launcher.tasks_per_node=1")
    # over two nodes: one task a node (the driver, and the further node's Ray cluster member), whatever T is
    spread = ("hardware=h100x8", "runtime=async", "hardware.nodes=2", "hardware.ranks=4", "runtime.trainers=4",
              "runtime.gpus_per_worker=1", "buffer=none")
    assert refusal(*spread) is None
    cfg = compose_config(*spread, hydra=True)
    assert (cfg.hydra.launcher.nodes, cfg.hydra.launcher.tasks_per_node, cfg.hydra.launcher.cpus_per_task) == (2, 1, 64)


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
    # the cell's own micro-batch (trainer=paper), checkpointing (hardware=h100x8) and head; the terms by hand above
    assert ("over the job's 8 GPU(s): training 59.6 GiB per GPU of 77.0 at micro-batch 12288 tokens, activation "
            "checkpointing on, fused head; host: 251 GiB") in said
    assert ("a vLLM engine on each of the 8 GPU(s), each sampling 1/8 of every step's groups: 23.7 GiB per GPU (bf16 "
            "weights 14.2, profiling peak 2.2, CUDA graphs 1.0, KV cache 6.3: 57 sequences of max_model_len 2048), "
            "started beside the trainer's 19.7 GiB") in said
    assert "awake beside the trainer's 26.8 GiB" in said
    assert "weight sync per step: 28.4 GiB gathered on each rank" in said and "nothing launched" in said


@pytest.mark.slow  # a Hydra sweep composes in a subprocess: ~10 s
def test_the_dry_run_of_a_cell_over_two_nodes_plans_each_node(tmp_path):
    """docs/distributed.md's two-node command, as typed there: SLURM is asked for 2 nodes of 8 tasks, the plan
    shards over the 16 GPUs and counts each node's host memory."""
    import subprocess
    import sys

    from src.paths import PROJECT_ROOT

    command = [sys.executable, "-m", "src.run", "-m", "hardware=h100x8", "hardware.nodes=2", "hardware.ranks=16",
               "policy=qwen2.5-7b", "hydra.sweeper.dry_run=true", f"tracking.uri=sqlite:///{tmp_path}/mlruns.db",
               f"hydra.sweep.dir={tmp_path}/sweep"]
    done = subprocess.run(command, cwd=PROJECT_ROOT, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    said = " ".join((done.stdout + done.stderr).split())
    assert "each asks for 2 nodes x 8 tasks, 16 GPUs in all, 64 CPUs and 512 GB a node" in said
    # 16 shards of the fp32 weights and AdamW's moments instead of 8; each node's 8 ranks load it on its host
    assert ("over the job's 16 GPU(s) on 2 nodes: training 51.8 GiB per GPU of 77.0 at micro-batch 12288 tokens, "
            "activation checkpointing on, fused head; host: 251 GiB a node") in said
    assert "a vLLM engine on each of the 16 GPU(s), each sampling 1/16 of every step's groups" in said
    assert "nothing launched" in said and "hardware.nodes=2" in said


def test_a_cell_over_more_ranks_than_a_node_is_told_to_span_nodes(compose_config):
    refusal = job_refusal(compose_config)
    assert refusal("hardware=h100x8", "hardware.ranks=16") == (
        "hardware.ranks=16 on hardware=h100x8: the job asks for 8 GPU(s), one a rank; set hardware.ranks=8, or "
        "hardware.nodes=2 to span more nodes, or use a hardware option with more GPUs")
    assert refusal("hardware=h100x8", "hardware.ranks=16", "hardware.nodes=2", "policy=qwen2.5-7b") is None
    # 8 ranks a node each load the 7B's 28 GiB of fp32 weights beside 3 GiB of their own: 251 GiB a node
    host = refusal("hardware=h100x8", "hardware.ranks=16", "hardware.nodes=2", "policy=qwen2.5-7b",
                   "hydra.launcher.mem_gb=200")
    assert "251 GiB a node for its 8 ranks, and the job asks for hydra.launcher.mem_gb=200" in host
    tasks = refusal("hardware=h100x8", "hardware.ranks=16", "hardware.nodes=2", "hydra.launcher.tasks_per_node=16")
    assert tasks.startswith("hydra.launcher.tasks_per_node=16 on hydra.launcher.nodes=2 with runtime=sync and "
                            "hardware.ranks=16: the cell runs 16 process(es)")
    assert tasks.endswith("set hydra.launcher.tasks_per_node=8")
