"""One Replay-RLOO step at the paper's scale, per phase, on a GPU (`make bench-gpu`).

    python -m benchmarks.gpu_step                      # Qwen2.5-0.5B architecture, 128 x 8, 256-token responses
    python -m benchmarks.gpu_step --response-tokens 1024 --ratios 0
    python -m benchmarks.gpu_step --plain-logprobs --no-fused-adamw   # the trainer before the GPU optimisations
    python -m benchmarks.gpu_step --profile DIR        # torch profiler tables of one update and one generate call
    python -m benchmarks.gpu_step --tiny --device cpu  # a smoke run of the same code on a tiny model (B=4, K=2)
    python -m benchmarks.gpu_step --lengths uniform:0.25:1 --pack   # mixed response lengths, packed micro-batches
    python -m benchmarks.gpu_step --engine vllm --response-tokens 256,1024 --save   # vLLM colocated (make bench-gpu)

No weights or data are downloaded: the model is Qwen2.5-0.5B's exact architecture from a config
in code (random weights), the batch is synthetic token ids at the paper's shape (B=128 groups x
K=8, 128-token prompts, responses that ignore EOS: all `--response-tokens` long, or with
`--lengths uniform:LO:HI` each drawn (seeded) uniformly between LO and HI x that, so the padding a
padded micro-batch pays shows, and `--pack` (`trainer.pack_rows`) removes it; each update reports its
real tokens beside the tokens its micro-batches compute). Phases:

- generation, `--engine hf`: transformers `generate` (the HF engine) at each `--generation-rows`
  batch size, with the dynamic KV cache and, with `--static-cache`, the static cache that
  transformers compiles (`torch.compile`) on CUDA; the step's generate time uses the fastest
  rate measured, for the fresh part of the batch;
- generation, `--engine vllm`: the trainer's own vLLM engine colocated on the same GPU
  (benchmarks/vllm_phase.py), one `generate` call per replay ratio for exactly its fresh groups,
  plus the engine's start and its weight sync (counted in the step);
- the update, through the trainer's own `policy_update` and `build_optimizer` (bf16 autocast
  on fp32 weights, token-budget micro-batches, reference log-probs cached for replayed groups,
  `trainer.fused_logprobs`, fused AdamW on CUDA), split into reference forward, policy
  forward+backward and optimizer step;
- the same update at rho = 1 and rho = 2, where replayed groups carry stored reference
  log-probs and need no generation.

MFU = model FLOPs / time / the measured bf16 matmul rate of the same device. Model FLOPs per
token: 2 x non-embedding parameters + attention (forward), the output head (2 x hidden x vocab)
only where it is needed (every position on the plain path, response positions with
`fused_logprobs`); forward+backward = 3 x forward. The paper: about 126 s per step on one H100;
the target here: <= 12 s per step.
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import datetime
import json
import time
from pathlib import Path

import torch
from omegaconf import OmegaConf
from transformers import Qwen2Config, Qwen2ForCausalLM

from src.batch import plan_batch, Batch, BatchGroup, Group
from src.build import build_optimizer
from src.loss.rloo import RlooObjective
from src.loss.trainer import Trainer
from src.policy.forward import Forward, autocast_context
from src.policy.model import compile_layers
from src.policy.packing import lanes
from src.rollout.vllm_engine import CUDA_MAX_NUM_SEQS, vllm_problem

RESULTS = Path(__file__).resolve().parent / "results"

QWEN25_05B = dict(vocab_size=151936, hidden_size=896, intermediate_size=4864, num_hidden_layers=24,
                  num_attention_heads=14, num_key_value_heads=2, max_position_embeddings=32768,
                  rope_theta=1_000_000.0, rms_norm_eps=1e-6, tie_word_embeddings=True)
TINY = dict(vocab_size=512, hidden_size=128, intermediate_size=256, num_hidden_layers=2, num_attention_heads=4,
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


def body_flops_per_token(config: Qwen2Config, context: int) -> float:
    """Forward FLOPs per token of the decoder without the output head: 2 x matmul parameters + attention."""
    hidden, layers = config.hidden_size, config.num_hidden_layers
    head_dim = hidden // config.num_attention_heads
    kv = config.num_key_value_heads * head_dim
    per_layer = 2 * (hidden * hidden + 2 * hidden * kv + hidden * hidden + 3 * hidden * config.intermediate_size)
    attention = 2 * 2 * layers * context * hidden / 2  # QK^T and AV over on average half the (causal) context
    return layers * per_layer + attention


def head_flops_per_token(config: Qwen2Config) -> float:
    return 2 * config.hidden_size * config.vocab_size


def parse_lengths(text: str) -> tuple[float, float] | None:
    """`--lengths`: None for "fixed", (LO, HI) for "uniform:LO:HI" with 0 < LO <= HI <= 1; ValueError otherwise."""
    if text == "fixed":
        return None
    kind, *bounds = text.split(":")
    try:
        low, high = (float(bound) for bound in bounds)
    except ValueError:
        low = high = float("nan")
    if kind != "uniform" or not 0 < low <= high <= 1:
        raise ValueError(f"--lengths {text}: expected fixed or uniform:LO:HI with 0 < LO <= HI <= 1 "
                         "(fractions of --response-tokens), e.g. uniform:0.25:1")
    return low, high


def response_lengths(count: int, response_tokens: int, spread: tuple[float, float] | None,
                     generator: torch.Generator) -> list[int]:
    """`count` response lengths: all `response_tokens`, or uniform in [LO, HI] x `response_tokens` (at least 1)."""
    if spread is None:
        return [response_tokens] * count
    low, high = spread
    fractions = low + (high - low) * torch.rand(count, generator=generator, dtype=torch.float64)
    return [max(1, round(float(f) * response_tokens)) for f in fractions]


def synthetic_groups(groups: int, group_size: int, prompt_tokens: int, response_tokens: int, vocab: int,
                     step: int, replayed: bool, generator: torch.Generator,
                     spread: tuple[float, float] | None = None) -> list[Group]:
    """Groups of random token ids; replayed ones carry behaviour and per-token reference log-probs."""
    out = []
    for _ in range(groups):
        prompt = torch.randint(10, vocab, (prompt_tokens,), generator=generator).tolist()
        lengths = response_lengths(group_size, response_tokens, spread, generator)
        responses = [torch.randint(10, vocab, (length,), generator=generator).tolist() for length in lengths]
        rewards = (torch.rand(group_size, generator=generator) > 0.5).float().tolist()
        group = Group(prompt="", prompt_ids=prompt, truth={"numbers": [1, 2, 3], "target": 6},
                      responses=[""] * group_size,
                      response_ids=responses, rewards=rewards, step=step - 1 if replayed else step)
        if replayed:
            group = group.with_behaviour_logprobs([-float(length) for length in lengths],
                                                  [[-1.0] * length for length in lengths])
        out.append(group)
    return out


def forward_of(trainer_cfg, autocast) -> Forward:
    return Forward(0, trainer_cfg.micro_batch_size, trainer_cfg.micro_batch_tokens, autocast,
                   trainer_cfg.fused_logprobs, trainer_cfg.pack_rows)


def token_counts(sequences, forward: Forward) -> dict[str, int]:
    """Real tokens of `sequences` and the tokens their micro-batches compute: rows (packed: lanes) x longest row."""
    lengths = [len(prompt) + len(response) for prompt, response in sequences]
    batches = forward.batches(sequences)
    computed = sum((len(lanes([lengths[i] for i in b])) if forward.pack else len(b)) * max(lengths[i] for i in b)
                   for b in batches)
    return {"real_tokens": sum(lengths), "computed_tokens": computed, "micro_batches": len(batches)}


def make_optimizer(policy, fused: bool):
    settings = OmegaConf.create({"learning_rate": 1e-5, "weight_decay": 1e-4, "betas": [0.9, 0.999]})
    if fused:
        return build_optimizer(policy, settings)
    return torch.optim.AdamW(policy.parameters(), lr=1e-5, weight_decay=1e-4)  # the default (foreach) kernels


def policy_update(policy, reference, optimizer, groups, trainer_cfg, autocast):
    """The trainer's own RLOO objective (c = 1) on `groups`; replayed ones carry mu and log pi_ref."""
    forward = forward_of(trainer_cfg, autocast)
    trainer = Trainer(RlooObjective(1.0), forward, kl_coef=trainer_cfg.kl_coef, entropy_coef=trainer_cfg.entropy_coef,
                      max_grad_norm=trainer_cfg.max_grad_norm)
    entries = [BatchGroup(g, "fresh") if g.behaviour_logprobs is None else BatchGroup(g, "replay", 1) for g in groups]
    return trainer.update(policy, reference, optimizer, Batch(entries))


def measure_update(policy, reference, trainer_cfg, groups, device, autocast, fused_adamw: bool,
                   compiled: bool = False) -> dict[str, float]:
    """Seconds of the whole update and of its reference-forward and optimizer parts. Compiled layers warm up on
    the whole batch, so every micro-batch shape is compiled before the timed update."""
    optimizer = make_optimizer(policy, fused_adamw)
    policy_update(policy, reference, optimizer, groups if compiled else groups[:2], trainer_cfg, autocast)
    if device.startswith("cuda"):
        torch.cuda.reset_peak_memory_stats()
    _, total = timed(device, lambda: policy_update(policy, reference, optimizer, groups, trainer_cfg,
                                                   autocast))
    peak = torch.cuda.max_memory_allocated() / 2**30 if device.startswith("cuda") else float("nan")
    fresh_rows = [(g.prompt_ids, r) for g in groups if g.reference_logprobs is None for r in g.response_ids]
    forward = forward_of(trainer_cfg, autocast)

    def reference_forward():
        with torch.no_grad():
            for index in forward.batches(fresh_rows):
                forward.token_stats(reference, [fresh_rows[i] for i in index], with_entropy=False)

    # At kl_coef = 0 the update reads no pi_ref and runs no reference forward.
    reads_reference = fresh_rows and trainer_cfg.kl_coef != 0
    if reads_reference and compiled:
        reference_forward()  # its head (no entropy) is a region of its own: compiled before it is timed
    _, reference_seconds = timed(device, reference_forward) if reads_reference else (None, 0.0)
    _, optimizer_seconds = timed(device, optimizer.step)
    return {"update_s": total, "reference_forward_s": reference_seconds, "optimizer_s": optimizer_seconds,
            "policy_forward_backward_s": total - reference_seconds - optimizer_seconds, "peak_memory_gib": peak}


def generate_once(model, rows: int, prompt_tokens: int, response_tokens: int, vocab: int, device: str, autocast,
                  static_cache: bool) -> float:
    input_ids = torch.randint(10, vocab, (rows, prompt_tokens), device=device)
    options = {"cache_implementation": "static"} if static_cache else {}
    # As the HF engine samples (src/rollout/engine.py): the update's compiled layers eager, transformers' own
    # compile of a static cache left alone.
    stance = contextlib.nullcontext() if static_cache else torch.compiler.set_stance("force_eager")
    with torch.no_grad(), autocast_context(model, autocast), stance:
        return timed(device, lambda: model.generate(
            input_ids=input_ids, attention_mask=torch.ones_like(input_ids), do_sample=True, temperature=1.0,
            top_p=1.0, top_k=0, max_new_tokens=response_tokens, min_new_tokens=response_tokens,
            pad_token_id=0, eos_token_id=None, **options))[1]


def measure_generation(policy, rows: int, prompt_tokens: int, response_tokens: int, vocab: int, device: str,
                       autocast, weights: str, static_cache: bool) -> dict:
    """Generated tokens per second with transformers generate, fixed length (EOS ignored).

    `weights="fp32+autocast"` samples from the trainer's own module (what the HF engine does);
    `"bf16 copy"` from a bf16 copy of it without autocast (a static KV cache needs one dtype:
    under autocast the rotary embedding turns bf16 keys into fp32 while values stay bf16). The
    static cache is compiled on its first call, so that call is timed apart (`first_call_s`)
    and the rate comes from a second call.
    """
    model = copy.deepcopy(policy).to(torch.bfloat16) if weights == "bf16 copy" else policy
    model.eval()
    run_autocast = autocast if weights != "bf16 copy" else None
    result = {"rows": rows, "weights": weights, "cache": "static" if static_cache else "dynamic"}
    try:
        first = generate_once(model, rows, prompt_tokens, response_tokens, vocab, device, run_autocast, static_cache)
        seconds = generate_once(model, rows, prompt_tokens, response_tokens, vocab, device, run_autocast,
                                static_cache)
        result.update(first_call_s=first, seconds=seconds, tokens_per_s=rows * response_tokens / seconds)
    except Exception as error:  # a variant this torch/transformers cannot run is reported, not fatal
        result.update(first_call_s=float("nan"), seconds=float("nan"), tokens_per_s=float("nan"),
                      error=f"{type(error).__name__}: {str(error)[:200]}")
    policy.train()
    del model
    if device.startswith("cuda"):
        torch._dynamo.reset()  # each static-cache shape compiles anew; do not let them pile up
        torch.cuda.empty_cache()
    return result


def profile(policy, reference, trainer_cfg, groups, device, autocast, args, config, folder: Path) -> None:
    """Profiler tables (top kernels by device time) of one update and one short generate call."""
    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as torch_profile

    folder.mkdir(parents=True, exist_ok=True)
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.startswith("cuda") else [])
    sort = "cuda_time_total" if device.startswith("cuda") else "cpu_time_total"
    optimizer = make_optimizer(policy, not args.no_fused_adamw)
    policy_update(policy, reference, optimizer, groups[:2], trainer_cfg, autocast)
    with torch_profile(activities=activities) as update_profile:
        policy_update(policy, reference, optimizer, groups, trainer_cfg, autocast)
        synchronize(device)
    (folder / "update_profile.txt").write_text(update_profile.key_averages().table(sort_by=sort, row_limit=30))
    policy.eval()
    tokens = min(64, args.response_tokens)
    generate_once(policy, 256, args.prompt_tokens, tokens, config.vocab_size, device, autocast, False)
    with torch_profile(activities=activities) as generate_profile:
        generate_once(policy, 256, args.prompt_tokens, tokens, config.vocab_size, device, autocast, False)
    policy.train()
    (folder / "generate_profile.txt").write_text(generate_profile.key_averages().table(sort_by=sort, row_limit=30))
    print(f"profiles written to {folder}")


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--tiny", action="store_true", help="a tiny model and batch (smoke run on any device)")
    parser.add_argument("--groups", type=int, default=None, help="B (default 128; --tiny: 4)")
    parser.add_argument("--group-size", type=int, default=None, help="K (default 8; --tiny: 2)")
    parser.add_argument("--prompt-tokens", type=int, default=None, help="default 128; --tiny: 8")
    parser.add_argument("--response-tokens", default=None, help="response lengths, comma-separated (e.g. 256,1024)")
    parser.add_argument("--engine", choices=("hf", "vllm"), default="hf", help="the generation phase's engine")
    parser.add_argument("--vllm-memory", type=float, default=0.3, help="vLLM's share of the GPU (policy.vllm)")
    parser.add_argument("--vllm-kv-gib", type=float, default=None,
                        help="vLLM's KV cache in GiB instead of --vllm-memory (needed on CPU, where that is RAM)")
    parser.add_argument("--vllm-max-num-seqs", type=int, default=CUDA_MAX_NUM_SEQS,
                        help="vLLM's concurrent sequences (default: the engine's on a GPU, CUDA_MAX_NUM_SEQS)")
    parser.add_argument("--enforce-eager", action="store_true", help="vLLM without CUDA graphs")
    parser.add_argument("--unseeded", action="store_true", help="vLLM: policy.vllm.per_request_seeds=false")
    parser.add_argument("--hf-baseline-tokens", type=int, default=0,
                        help="with --engine vllm, also time HF generate at response lengths up to this")
    parser.add_argument("--generation-rows", default="1024", help="generate batch sizes to time (comma-separated)")
    parser.add_argument("--static-cache", action="store_true",
                        help="also time generate from a bf16 copy, with the dynamic and the static (compiled) KV cache")
    parser.add_argument("--micro-batch-tokens", type=int, default=12288, help="as trainer=paper")
    parser.add_argument("--micro-batch-size", type=int, default=128, help="as trainer=paper")
    parser.add_argument("--ratios", default="0,1,2")
    parser.add_argument("--lengths", default="fixed",
                        help="the update's response lengths: fixed (all --response-tokens) or uniform:LO:HI (seeded, "
                             "x that); generation stays at --response-tokens")
    parser.add_argument("--pack", action="store_true",
                        help="trainer.pack_rows=true: packed micro-batches of real tokens, no padding")
    parser.add_argument("--kl-coef", type=float, default=1e-3, help="trainer.kl_coef (0: no reference forward)")
    parser.add_argument("--gradient-checkpointing", action="store_true")
    parser.add_argument("--compile", action="store_true",
                        help="trainer.compile: torch.compile the decoder layers and the fused head of both models")
    parser.add_argument("--plain-logprobs", action="store_true",
                        help="trainer.fused_logprobs=false: full-vocabulary fp32 log_softmax on every position")
    parser.add_argument("--no-fused-adamw", action="store_true", help="AdamW's default kernels instead of fused")
    parser.add_argument("--profile", type=Path, default=None, help="write profiler tables to this folder")
    parser.add_argument("--save", action="store_true", help="write the figures to benchmarks/results/")
    parser.add_argument("--results", type=Path, default=RESULTS, help="folder for --save")
    parser.add_argument("--label", default="", help="a word for the results file name (e.g. before)")
    args = parser.parse_args()
    sizes = (4, 2, 8) if args.tiny else (128, 8, 128)  # B, K and prompt tokens, where not given
    args.groups, args.group_size, args.prompt_tokens = (given if given is not None else size for given, size in
                                                        zip((args.groups, args.group_size, args.prompt_tokens), sizes))
    if args.tiny:
        args.response_tokens, args.generation_rows = args.response_tokens or "8", "2"
    args.response_tokens = args.response_tokens or "256"
    try:
        args.response_token_list = [int(tokens) for tokens in str(args.response_tokens).split(",")]
    except ValueError:
        parser.error(f"--response-tokens {args.response_tokens}: expected whole numbers, e.g. 256,1024")
    if min(args.response_token_list) < 1:
        parser.error(f"--response-tokens {args.response_tokens}: each length must be >= 1")
    try:
        args.spread = parse_lengths(args.lengths)
    except ValueError as error:
        parser.error(str(error))
    if args.engine == "vllm" and vllm_problem() is not None:
        parser.error(f"--engine vllm: {vllm_problem()}")
    return args


def build_models(args, device: str):
    """The policy (fp32 weights and AdamW state; bf16 autocast for the math) and a frozen copy as reference."""
    config = Qwen2Config(**(TINY if args.tiny else QWEN25_05B))
    torch.manual_seed(0)
    policy = Qwen2ForCausalLM(config).to(device)
    if args.gradient_checkpointing:
        policy.gradient_checkpointing_enable()
    reference = Qwen2ForCausalLM(config).to(device).eval()
    reference.load_state_dict(policy.state_dict())
    for parameter in reference.parameters():
        parameter.requires_grad_(False)
    if args.compile:  # after the copy, as the trainer compiles (src/policy/model.py, compile_layers)
        compile_layers(policy)
        compile_layers(reference)
    return config, policy, reference


def update_flops(config, groups: list[Group], fused: bool, reference_forward: bool) -> float:
    """Model FLOPs of one update on `groups`: forward+backward (3 x forward) of every row, and a reference
    forward of each fresh row where it runs. Per row: the decoder on its real tokens, the head where
    log-probs are taken (every position on the plain path, response positions with `fused_logprobs`)."""
    total = 0.0
    for group in groups:
        for response in group.response_ids:
            tokens = len(group.prompt_ids) + len(response)
            forward = (body_flops_per_token(config, tokens) * tokens
                       + head_flops_per_token(config) * (len(response) if fused else tokens))
            fresh = group.reference_logprobs is None
            total += forward * (3 + (1 if fresh and reference_forward else 0))
    return total


def measure_updates(args, config, policy, reference, device: str, autocast, peak_rate: float) -> list[dict]:
    """One update per replay ratio, on synthetic groups, with its model FLOP utilisation and token counts."""
    trainer_cfg = OmegaConf.create({"micro_batch_size": args.micro_batch_size,
                                    "micro_batch_tokens": args.micro_batch_tokens, "kl_coef": args.kl_coef,
                                    "entropy_coef": 1e-3, "max_grad_norm": None,
                                    "fused_logprobs": not args.plain_logprobs, "pack_rows": args.pack})
    rows = []
    generator = torch.Generator().manual_seed(0)
    for ratio in (float(r) for r in args.ratios.split(",")):
        fresh_groups, replay_groups = plan_batch(args.groups, ratio)
        groups = (synthetic_groups(fresh_groups, args.group_size, args.prompt_tokens, args.response_tokens,
                                   config.vocab_size, 5, False, generator, args.spread)
                  + synthetic_groups(replay_groups, args.group_size, args.prompt_tokens, args.response_tokens,
                                     config.vocab_size, 5, True, generator, args.spread))
        if args.profile and ratio == 0:
            profile(policy, reference, trainer_cfg, groups, device, autocast, args, config, args.profile)
        update = measure_update(policy, reference, trainer_cfg, groups, device, autocast, not args.no_fused_adamw,
                                args.compile)
        flops = update_flops(config, groups, not args.plain_logprobs, args.kl_coef != 0)
        counts = token_counts([(g.prompt_ids, r) for g in groups for r in g.response_ids],
                              forward_of(trainer_cfg, autocast))
        rows.append({"rho": ratio, "fresh_groups": fresh_groups, "replay_groups": replay_groups,
                     "fresh_tokens": sum(len(r) for g in groups[:fresh_groups] for r in g.response_ids), **update,
                     **counts, "update_mfu": flops / update["update_s"] / peak_rate})
        print(f"update {rows[-1]}", flush=True)
        print(f"tokens: {counts['real_tokens']:,} real, {counts['computed_tokens']:,} computed in "
              f"{counts['micro_batches']} micro-batches ({padding_share(counts):.1%} padding)", flush=True)
    return rows


def padding_share(row: dict) -> float:
    return 1 - row["real_tokens"] / row["computed_tokens"]


def measure_generations(args, config, policy, device: str, autocast) -> list[dict]:
    """Generation rate at each batch size, from the trainer's module (and bf16 copies with --static-cache)."""
    variants = [("fp32+autocast", False)] + ([("bf16 copy", False), ("bf16 copy", True)] if args.static_cache else [])
    generation = []
    for generate_rows in (int(r) for r in args.generation_rows.split(",")):
        for weights, static in variants:
            generation.append(measure_generation(policy, generate_rows, args.prompt_tokens, args.response_tokens,
                                                 config.vocab_size, device, autocast, weights, static))
            print(f"generate {generation[-1]}", flush=True)
    return generation


def generation_line(g: dict) -> str:
    if g.get("engine") == "vllm":
        setting = "per-request seeds" if g["seeded"] else "unseeded"
        return f"| vLLM | {g['rows']} | {setting} | {g['seconds']:.1f} | {g['tokens_per_s']:,.0f} |"
    setting = f"{g['weights']}, {g['cache']} KV cache, first call {g['first_call_s']:.1f} s"
    return (f"| HF generate | {g['rows']} | {setting} | {g['seconds']:.1f} | {g['tokens_per_s']:,.0f} |"
            + (f" {g['error']}" if "error" in g else ""))


def results_text(args, device_name: str, peak_rate: float, generation: list[dict], rows: list[dict],
                 engine_info: dict) -> str:
    """The results as markdown: settings, the generation table and the per-ratio step table."""
    budget = "real tokens, packed" if args.pack else "padded tokens"
    settings = (f"micro-batches of <= {args.micro_batch_size} rows and {args.micro_batch_tokens} {budget}, "
                f"response lengths {args.lengths}, kl_coef {args.kl_coef:g}, "
                f"fused_logprobs={not args.plain_logprobs}, fused AdamW={not args.no_fused_adamw}, "
                f"gradient checkpointing={args.gradient_checkpointing}, trainer.compile={args.compile}, "
                f"generation engine {args.engine}")
    lines = [f"# One step at B={args.groups} x K={args.group_size}, prompt {args.prompt_tokens} + response "
             f"{args.response_tokens} tokens; {'tiny smoke model' if args.tiny else 'Qwen2.5-0.5B architecture'}",
             f"device {device_name}, torch {torch.__version__}, measured bf16 matmul rate "
             f"{peak_rate / 1e12:.1f} TFLOP/s, {datetime.date.today()}", "", settings, ""]
    if engine_info:
        lines += [f"vLLM {engine_info['vllm']} colocated (gpu_memory_utilization {args.vllm_memory}, "
                  f"max_num_seqs {args.vllm_max_num_seqs}, CUDA graphs {not args.enforce_eager}): start "
                  f"{engine_info['start_s']:.1f} s, weight sync {engine_info['sync_s']:.3f} s (median), "
                  f"GPU memory in use {engine_info.get('device_used_gib', float('nan')):.1f} GiB at the end", ""]
    lines += ["| engine | rows | setting | seconds | tokens/s |", "|---|---|---|---|---|"]
    lines += [generation_line(g) for g in generation]
    lines += ["", "| rho | fresh/replay groups | generate s | sync s | reference fwd s | policy fwd+bwd s | "
              "optimizer s | update s | step s | update MFU | peak GiB | real / computed tokens |",
              "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for row in rows:
        lines.append(f"| {row['rho']:g} | {row['fresh_groups']}/{row['replay_groups']} | {row['generation_s']:.1f} | "
                     f"{row['sync_s']:.2f} | {row['reference_forward_s']:.2f} | {row['policy_forward_backward_s']:.2f} | "
                     f"{row['optimizer_s']:.3f} | {row['update_s']:.2f} | {row['step_s']:.1f} | "
                     f"{row['update_mfu']:.1%} | {row['peak_memory_gib']:.1f} | {row['real_tokens']:,} / "
                     f"{row['computed_tokens']:,} ({padding_share(row):.0%} padding) |")
    lines += ["", "Paper: ~126 s per step (210 min per 100 steps, one H100). Target: <= 12 s per step."]
    return "\n".join(lines)


def save_results(args, device_name: str, text: str, generation: list[dict], rows: list[dict],
                 engine_info: dict) -> None:
    """benchmarks/results/gpu_step_<device>_<tokens>[_label].md and .json, with the command that made them."""
    args.results.mkdir(parents=True, exist_ok=True)
    label = f"_{args.label}" if args.label else ""
    stem = f"gpu_step_{device_name.replace(' ', '_')}_{args.response_tokens}{label}"
    (args.results / f"{stem}.md").write_text(text + "\n")
    command = "python -m benchmarks.gpu_step " + " ".join(
        f"--{k.replace('_', '-')}" + ("" if v is True else f" {v}") for k, v in vars(args).items()
        if v not in (False, None, "") and k not in ("save", "results", "response_token_list", "spread"))
    (args.results / f"{stem}.json").write_text(json.dumps(
        {"device": device_name, "torch": torch.__version__, "date": str(datetime.date.today()),
         "command": command, "args": {k: str(v) for k, v in vars(args).items()}, "engine": engine_info,
         "generation": generation, "rows": rows}, indent=2))
    print(f"written to {args.results / stem}.md")


def hf_step_times(args, config, policy, rows: list[dict], device: str, autocast) -> list[dict]:
    """HF generate's rates; each ratio's generate time is its fresh tokens at the fastest of them."""
    generation = measure_generations(args, config, policy, device, autocast)
    rate = max(g["tokens_per_s"] for g in generation if g["weights"] == "fp32+autocast")
    for row in rows:
        row["generation_s"], row["sync_s"] = row["fresh_tokens"] / rate, 0.0
    return generation


def vllm_step_times(args, config, engine, rows: list[dict], sync_s: float) -> list[dict]:
    """One vLLM `generate` call per ratio for exactly its fresh groups (a warm-up call first)."""
    from benchmarks.vllm_phase import WARM_UP_TOKENS, generate_rate

    generate_rate(engine, 8, args.group_size, args.prompt_tokens, WARM_UP_TOKENS, config.vocab_size, seed=1)
    generation = []
    for row in rows:
        generation.append(generate_rate(engine, row["fresh_groups"], args.group_size, args.prompt_tokens,
                                        args.response_tokens, config.vocab_size, seed=2 + len(generation)))
        row["generation_s"], row["sync_s"] = generation[-1]["seconds"], sync_s
        print(f"generate {generation[-1]}", flush=True)
    # The lever policy.vllm.per_request_seeds: the rho = 0 call again with the other setting (not in the step).
    engine.per_request_seeds = not engine.per_request_seeds
    generation.append(generate_rate(engine, rows[0]["fresh_groups"], args.group_size, args.prompt_tokens,
                                    args.response_tokens, config.vocab_size, seed=99))
    engine.per_request_seeds = not engine.per_request_seeds
    print(f"generate {generation[-1]}", flush=True)
    return generation


def measure_length(args, config, policy, reference, device, autocast, peak_rate, engine, engine_info) -> None:
    """Updates and generation at one response length; the step is generate + weight sync + update."""
    rows = measure_updates(args, config, policy, reference, device, autocast, peak_rate)
    if engine is None:
        generation = hf_step_times(args, config, policy, rows, device, autocast)
    else:
        from benchmarks.vllm_phase import sync_seconds

        engine_info["sync_s"] = sync_seconds(engine, policy)  # the updated weights into vLLM
        generation = vllm_step_times(args, config, engine, rows, engine_info["sync_s"])
        if args.response_tokens <= args.hf_baseline_tokens:
            generation += measure_generations(args, config, policy, device, autocast)
        if device.startswith("cuda"):
            free, total = torch.cuda.mem_get_info()
            engine_info["device_used_gib"] = (total - free) / 2**30
    for row in rows:
        row["step_s"] = row["generation_s"] + row["sync_s"] + row["update_s"]
    device_name = torch.cuda.get_device_name() if device.startswith("cuda") else "cpu"
    text = results_text(args, device_name, peak_rate, generation, rows, engine_info)
    print(text, flush=True)
    if args.save:
        save_results(args, device_name, text, generation, rows, engine_info)


def main() -> None:
    args = parse_args()
    device = args.device
    autocast = "bfloat16" if device.startswith("cuda") else None
    config, policy, reference = build_models(args, device)
    peak_rate = matmul_rate(device, torch.bfloat16 if device.startswith("cuda") else torch.float32,
                            256 if args.tiny else 8192)
    engine, engine_info = None, {}
    if args.engine == "vllm":
        import tempfile

        import vllm

        from benchmarks.vllm_phase import start_engine

        engine, start_s = start_engine(policy, Path(tempfile.mkdtemp(prefix="gpu-step-policy-")), args)
        engine_info = {"vllm": vllm.__version__, "start_s": start_s}
        print(f"vLLM {vllm.__version__} started in {start_s:.1f} s", flush=True)
    for tokens in args.response_token_list:
        one = argparse.Namespace(**{**vars(args), "response_tokens": tokens})
        measure_length(one, config, policy, reference, device, autocast, peak_rate, engine, dict(engine_info))


if __name__ == "__main__":
    main()
