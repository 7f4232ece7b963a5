"""One Replay-RLOO step at the paper's scale, per phase, on a GPU (`make bench-gpu`).

    python -m benchmarks.gpu_step                      # Qwen2.5-0.5B architecture, 128 x 8, 256-token responses
    python -m benchmarks.gpu_step --response-tokens 1024
    python -m benchmarks.gpu_step --tiny --device cpu  # a smoke run of the same code on a tiny model

No weights or data are downloaded: the model is Qwen2.5-0.5B's exact architecture from a config
in code (random weights), the batch is synthetic token ids at the paper's shape (B=128 groups x
K=8, 128-token prompts, fixed-length responses that ignore EOS). Phases:

- generation: transformers `generate` (the HF engine; vLLM is measured on nodes that have it)
  on a sample of prompts, tokens/s extrapolated to the fresh part of the batch;
- the update, through the trainer's own `policy_update` (bf16 autocast on fp32 weights,
  token-budget micro-batches, reference log-probs cached for replayed groups), split into
  reference forward, policy forward+backward and optimizer step;
- the same update at rho = 1 and rho = 2, where replayed groups carry stored reference
  log-probs and need no generation.

MFU = model FLOPs (2 N per token forward, 6 N forward+backward, N = non-embedding parameters,
plus attention) / time / the measured bf16 matmul rate of the same device. The paper: about
126 s per step on one H100; the target here: <= 12 s per step.
"""

from __future__ import annotations

import argparse
import datetime
import json
import time
from pathlib import Path

import torch
from omegaconf import OmegaConf
from transformers import Qwen2Config, Qwen2ForCausalLM

from src.objective import plan_batch
from src.replay.buffer import Group
from src.train import policy_update, response_token_stats

RESULTS = Path(__file__).resolve().parent / "results"

QWEN25_05B = dict(vocab_size=151936, hidden_size=896, intermediate_size=4864, num_hidden_layers=24,
                  num_attention_heads=14, num_key_value_heads=2, max_position_embeddings=32768,
                  rope_theta=1_000_000.0, rms_norm_eps=1e-6, tie_word_embeddings=True)
TINY = dict(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, max_position_embeddings=2048, tie_word_embeddings=True)


def synchronize(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def timed(device: str, function):
    """(result, seconds) of function(), with the device drained before and after."""
    synchronize(device)
    start = time.perf_counter()
    result = function()
    synchronize(device)
    return result, time.perf_counter() - start


def matmul_rate(device: str, dtype: torch.dtype, size: int) -> float:
    """Measured dense matmul FLOP/s of this device at this dtype (the MFU denominator)."""
    a = torch.randn(size, size, device=device, dtype=dtype)
    b = torch.randn(size, size, device=device, dtype=dtype)
    for _ in range(3):
        a @ b
    repeats = 20
    _, seconds = timed(device, lambda: [a @ b for _ in range(repeats)])
    return 2 * size**3 * repeats / seconds


def flops_per_token(config: Qwen2Config, context: int) -> float:
    """Forward FLOPs per token: 2 x non-embedding parameters + attention scores and values."""
    hidden, layers = config.hidden_size, config.num_hidden_layers
    head_dim = hidden // config.num_attention_heads
    kv = config.num_key_value_heads * head_dim
    per_layer = 2 * (hidden * hidden + 2 * hidden * kv + hidden * hidden + 3 * hidden * config.intermediate_size)
    attention = 2 * 2 * layers * context * hidden  # QK^T and AV, causal average ~ context/2 each way x2
    return layers * per_layer + 2 * hidden * config.vocab_size + attention / 2


def synthetic_groups(groups: int, group_size: int, prompt_tokens: int, response_tokens: int, vocab: int,
                     step: int, replayed: bool, generator: torch.Generator) -> list[Group]:
    """Groups of random token ids; replayed ones carry behaviour and per-token reference log-probs."""
    out = []
    for _ in range(groups):
        prompt = torch.randint(10, vocab, (prompt_tokens,), generator=generator).tolist()
        responses = [torch.randint(10, vocab, (response_tokens,), generator=generator).tolist()
                     for _ in range(group_size)]
        rewards = (torch.rand(group_size, generator=generator) > 0.5).float().tolist()
        group = Group(prompt="", prompt_ids=prompt, numbers=(1, 2, 3), target=6, responses=[""] * group_size,
                      response_ids=responses, rewards=rewards, step=step - 1 if replayed else step)
        if replayed:
            group = group.with_behaviour_logprobs([-float(response_tokens)] * group_size,
                                                  [[-1.0] * response_tokens for _ in range(group_size)])
        out.append(group)
    return out


def measure_update(policy, reference, trainer_cfg, groups, device, autocast) -> dict[str, float]:
    """Seconds of the whole update and of its reference-forward and optimizer parts."""
    optimizer = torch.optim.AdamW(policy.parameters(), lr=1e-5, weight_decay=1e-4)
    policy_update(policy, reference, optimizer, groups[:2], trainer_cfg, 1.0, 0, autocast)  # warm-up, state init
    if device.startswith("cuda"):
        torch.cuda.reset_peak_memory_stats()
    _, total = timed(device, lambda: policy_update(policy, reference, optimizer, groups, trainer_cfg, 1.0, 0,
                                                   autocast))
    fresh_rows = [(g.prompt_ids, r) for g in groups if g.reference_logprobs is None for r in g.response_ids]

    def reference_forward():
        from src.train import autocast_context, micro_batches

        with torch.no_grad(), autocast_context(reference, autocast):
            for index in micro_batches(fresh_rows, trainer_cfg.micro_batch_size, trainer_cfg.micro_batch_tokens):
                response_token_stats(reference, [fresh_rows[i] for i in index], 0, with_entropy=False)

    _, reference_seconds = timed(device, reference_forward) if fresh_rows else (None, 0.0)
    _, optimizer_seconds = timed(device, optimizer.step)
    peak = torch.cuda.max_memory_allocated() / 2**30 if device.startswith("cuda") else float("nan")
    return {"update_s": total, "reference_forward_s": reference_seconds, "optimizer_s": optimizer_seconds,
            "policy_forward_backward_s": total - reference_seconds - optimizer_seconds, "peak_memory_gib": peak}


def measure_generation(policy, prompts: int, prompt_tokens: int, response_tokens: int, vocab: int, device: str,
                       autocast) -> float:
    """Generated tokens per second with transformers generate, fixed length (EOS ignored)."""
    from src.train import autocast_context

    input_ids = torch.randint(10, vocab, (prompts, prompt_tokens), device=device)
    policy.eval()
    with torch.no_grad(), autocast_context(policy, autocast):
        _, seconds = timed(device, lambda: policy.generate(
            input_ids=input_ids, attention_mask=torch.ones_like(input_ids), do_sample=True, temperature=1.0,
            top_p=1.0, top_k=0, max_new_tokens=response_tokens, min_new_tokens=response_tokens,
            pad_token_id=0, eos_token_id=None))
    policy.train()
    return prompts * response_tokens / seconds


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--tiny", action="store_true", help="a tiny model and batch (smoke run on any device)")
    parser.add_argument("--groups", type=int, default=128)
    parser.add_argument("--group-size", type=int, default=8)
    parser.add_argument("--prompt-tokens", type=int, default=128)
    parser.add_argument("--response-tokens", type=int, default=256)
    parser.add_argument("--generation-prompts", type=int, default=64, help="prompts sampled to time generate")
    parser.add_argument("--micro-batch-tokens", type=int, default=65536)
    parser.add_argument("--micro-batch-size", type=int, default=64)
    parser.add_argument("--ratios", default="0,1,2")
    parser.add_argument("--gradient-checkpointing", action="store_true")
    parser.add_argument("--save", action="store_true", help="write the figures to benchmarks/results/")
    args = parser.parse_args()
    if args.tiny:
        args.groups, args.group_size, args.prompt_tokens, args.response_tokens = 4, 2, 8, 8
        args.generation_prompts = 2
    device = args.device
    autocast = "bfloat16" if device.startswith("cuda") else None

    config = Qwen2Config(**(TINY if args.tiny else QWEN25_05B))
    torch.manual_seed(0)
    policy = Qwen2ForCausalLM(config).to(device)  # fp32 weights and AdamW state; bf16 autocast for the math
    if args.gradient_checkpointing:
        policy.gradient_checkpointing_enable()
    reference = Qwen2ForCausalLM(config).to(device).eval()
    reference.load_state_dict(policy.state_dict())
    for parameter in reference.parameters():
        parameter.requires_grad_(False)
    trainer_cfg = OmegaConf.create({"micro_batch_size": args.micro_batch_size,
                                    "micro_batch_tokens": args.micro_batch_tokens, "kl_coef": 1e-3,
                                    "entropy_coef": 1e-3, "max_grad_norm": None})
    peak_rate = matmul_rate(device, torch.bfloat16 if device.startswith("cuda") else torch.float32,
                            256 if args.tiny else 8192)
    tokens_per_sequence = args.prompt_tokens + args.response_tokens
    per_token = flops_per_token(config, tokens_per_sequence)
    generation_rate = measure_generation(policy, args.generation_prompts, args.prompt_tokens, args.response_tokens,
                                         config.vocab_size, device, autocast)

    rows = []
    generator = torch.Generator().manual_seed(0)
    for ratio in (float(r) for r in args.ratios.split(",")):
        fresh_groups, replay_groups = plan_batch(args.groups, ratio)
        groups = (synthetic_groups(fresh_groups, args.group_size, args.prompt_tokens, args.response_tokens,
                                   config.vocab_size, 5, False, generator)
                  + synthetic_groups(replay_groups, args.group_size, args.prompt_tokens, args.response_tokens,
                                     config.vocab_size, 5, True, generator))
        update = measure_update(policy, reference, trainer_cfg, groups, device, autocast)
        fresh_tokens = fresh_groups * args.group_size * args.response_tokens
        generation_s = fresh_tokens / generation_rate
        all_tokens = len(groups) * args.group_size * tokens_per_sequence
        fresh_sequence_tokens = fresh_groups * args.group_size * tokens_per_sequence
        update_flops = 3 * per_token * all_tokens + per_token * fresh_sequence_tokens  # fwd+bwd, reference fwd
        rows.append({"rho": ratio, "fresh_groups": fresh_groups, "replay_groups": replay_groups,
                     "generation_s": generation_s, **update, "step_s": generation_s + update["update_s"],
                     "update_mfu": update_flops / update["update_s"] / peak_rate})

    device_name = torch.cuda.get_device_name() if device.startswith("cuda") else "cpu"
    lines = [f"# One step at B={args.groups} x K={args.group_size}, prompt {args.prompt_tokens} + response "
             f"{args.response_tokens} tokens; {'tiny smoke model' if args.tiny else 'Qwen2.5-0.5B architecture'}",
             f"device {device_name}, measured matmul rate {peak_rate / 1e12:.1f} TFLOP/s, "
             f"HF generate {generation_rate:,.0f} tokens/s ({args.generation_prompts} prompts), "
             f"{datetime.date.today()}", "",
             "| rho | fresh/replay groups | generate s | reference fwd s | policy fwd+bwd s | optimizer s | "
             "step s | update MFU | peak GiB |", "|---|---|---|---|---|---|---|---|---|"]
    for row in rows:
        lines.append(f"| {row['rho']:g} | {row['fresh_groups']}/{row['replay_groups']} | {row['generation_s']:.1f} | "
                     f"{row['reference_forward_s']:.2f} | {row['policy_forward_backward_s']:.2f} | "
                     f"{row['optimizer_s']:.3f} | {row['step_s']:.1f} | {row['update_mfu']:.1%} | "
                     f"{row['peak_memory_gib']:.1f} |")
    lines.append("")
    lines.append("Paper: ~126 s per step (210 min per 100 steps, one H100). Target: <= 12 s per step.")
    text = "\n".join(lines)
    print(text)
    if args.save:
        RESULTS.mkdir(exist_ok=True)
        stem = f"gpu_step_{device_name.replace(' ', '_')}_{datetime.date.today()}_{args.response_tokens}"
        (RESULTS / f"{stem}.md").write_text(text + "\n")
        (RESULTS / f"{stem}.json").write_text(json.dumps({"args": vars(args), "rows": rows}, indent=2))
        print(f"written to {RESULTS / stem}.md")


if __name__ == "__main__":
    main()
