"""vLLM's host overhead, probed: where a decode step's time goes besides the GPU's work (docs/benchmarks.md).

    python -m benchmarks.vllm_probe --json probe.json        # on a GPU: the 0.5B shape, 512 and 1024 sequences
    python -m benchmarks.vllm_probe --tiny --device cpu --waves 8,16 --response-tokens 8 --prompt-tokens 16 \
        --json probe.json                                     # the CPU rehearsal, in .venv-vllm

One engine start (the project's `VLLMEngine`, in this process, on random weights of `--preset`'s shape and a
word-level tokenizer over its vocabulary: benchmarks/vllm_phase.py), then per wave of sequences (prompts x 8
samples) one `LLM.generate` call per variant, each differing from what training asks in one respect:

- `project`: what training asks (per-request seeds, the stop string `</answer>`, the stop token ids);
- `unseeded`: no per-request seed (vLLM's per-request generators off);
- `token_stop`: no stop string and `detokenize=False`, so vLLM neither detokenizes nor scans text each step;
- `gc_frozen`: `project` after `gc.freeze()`, the objects alive so far out of the collector's sweeps.

Every sequence runs to `--response-tokens` (`ignore_eos`), so the variants generate the same number of tokens.
After the first wave, one cProfile of its `project` call: its 25 functions with the most cumulative time. The
figures are written after every wave, so a probe stopped at its limit keeps the waves it measured.
"""

from __future__ import annotations

import argparse
import cProfile
import gc
import json
import pstats
import sys
import time
from pathlib import Path

VARIANTS = ("project", "unseeded", "token_stop", "gc_frozen")
GROUP_SIZE = 8  # samples per prompt, as the papers' K


def parse(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--preset", default="Qwen/Qwen2.5-0.5B", help="the architecture (conf/policy/shapes)")
    parser.add_argument("--tiny", action="store_true", help="2 narrow layers of it (the CPU rehearsal)")
    parser.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    parser.add_argument("--waves", default="512,1024", help="sequences a call, comma-separated (multiples of 8)")
    parser.add_argument("--response-tokens", type=int, default=256)
    parser.add_argument("--prompt-tokens", type=int, default=128)
    parser.add_argument("--folder", type=Path, default=Path("/tmp/vllm-probe"), help="where the policy is written")
    parser.add_argument("--json", type=Path, default=None, help="write every figure to this file")
    args = parser.parse_args(argv)
    try:
        args.wave_list = [int(word) for word in args.waves.split(",")]
    except ValueError:
        parser.error(f"--waves={args.waves}: give whole numbers of sequences, e.g. --waves 512,1024")
    if any(wave < GROUP_SIZE or wave % GROUP_SIZE for wave in args.wave_list):
        parser.error(f"--waves={args.waves}: each wave is prompts x {GROUP_SIZE} samples, e.g. --waves 512,1024")
    if args.response_tokens < 1 or args.prompt_tokens < 1:
        parser.error("--response-tokens and --prompt-tokens: at least 1 token each")
    return args


def start_engine(args):
    """The project's engine on a random policy of the preset's shape; its seconds to start (compile, graphs)."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    from benchmarks.vllm_phase import policy_folder, word_tokenizer
    from launch.gpu_lease import TINY_SHAPE
    from src.distributed.memory import shape_file
    from src.rollout.vllm_engine import VLLMEngine

    shape = json.loads(shape_file(args.preset).read_text())
    if args.tiny:
        shape.update(TINY_SHAPE)
    torch.manual_seed(0)
    policy = AutoModelForCausalLM.from_config(AutoConfig.for_model(**shape))
    tokenizer = word_tokenizer(policy.config.vocab_size)
    folder = policy_folder(policy, tokenizer, args.folder)
    cpu = args.device == "cpu"
    start = time.perf_counter()
    engine = VLLMEngine(policy, tokenizer, enforce_eager=cpu, dtype="float32" if cpu else "bfloat16",
                        max_model_len=args.prompt_tokens + args.response_tokens + 16, max_num_seqs=max(args.wave_list),
                        model_path=str(folder), kv_cache_gib=0.25 if cpu else None)
    return engine, time.perf_counter() - start


def sampling(engine, variant: str, response_tokens: int, seed: int | None):
    """vLLM's SamplingParams of one prompt's request: training's (`VLLMEngine.sampling_params`) but for `variant`."""
    from src.rollout.vllm_engine import STOP_STRING

    options = dict(n=GROUP_SIZE, temperature=1.0, top_p=1.0, top_k=0, max_tokens=response_tokens, ignore_eos=True,
                   stop_token_ids=engine.stop_token_ids, seed=None if variant == "unseeded" else seed)
    if variant == "token_stop":
        options["detokenize"] = False
    else:
        options.update(stop=[STOP_STRING], include_stop_str_in_output=True)
    return engine._vllm.SamplingParams(**options)


def one_call(engine, variant: str, wave: int, args, profile: cProfile.Profile | None = None) -> dict:
    """One `LLM.generate` call of `wave` sequences; its seconds, tokens and rate."""
    import torch

    from benchmarks.vllm_phase import prompts

    texts = prompts(wave // GROUP_SIZE, args.prompt_tokens, engine.tokenizer.vocab_size - 1,
                    torch.Generator().manual_seed(wave))
    requests = [{"prompt_token_ids": engine.tokenizer(text, add_special_tokens=False)["input_ids"]} for text in texts]
    params = [sampling(engine, variant, args.response_tokens, seed) for seed in range(len(texts))]
    if variant == "gc_frozen":
        gc.collect()
        gc.freeze()
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    start = time.perf_counter()
    if profile is not None:
        profile.enable()
    outputs = engine.llm.generate(requests, params, use_tqdm=False)
    if profile is not None:
        profile.disable()
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    seconds = time.perf_counter() - start
    if variant == "gc_frozen":
        gc.unfreeze()
    tokens = sum(len(sample.token_ids) for output in outputs for sample in output.outputs)
    return {"seconds": round(seconds, 4), "sequences": wave, "tokens": tokens, "tokens_per_s": round(tokens / seconds, 1)}


def top_functions(profile: cProfile.Profile, count: int = 25) -> list[dict]:
    stats = pstats.Stats(profile)
    rows = [{"function": f"{Path(file).name}:{line}({name})", "calls": calls, "own_s": round(own, 4),
             "cumulative_s": round(cumulative, 4)}
            for (file, line, name), (_, calls, own, cumulative, _) in stats.stats.items()]
    return sorted(rows, key=lambda row: -row["cumulative_s"])[:count]


def main(argv=None) -> int:
    args = parse(argv)
    engine, started = start_engine(args)
    one_call(engine, "project", GROUP_SIZE, args)  # warm-up: the first call's one-time costs out of the figures
    figures = {"preset": args.preset, "tiny": args.tiny, "device": args.device, "engine_start_s": round(started, 2),
               "response_tokens": args.response_tokens, "prompt_tokens": args.prompt_tokens, "waves": {}}
    for number, wave in enumerate(args.wave_list):
        figures["waves"][wave] = {variant: one_call(engine, variant, wave, args) for variant in VARIANTS}
        rates = ", ".join(f"{variant} {row['tokens_per_s']:,.0f}" for variant, row in figures["waves"][wave].items())
        print(f"{wave} sequences x {args.response_tokens} tokens: tokens/s {rates}", flush=True)
        if number == 0:  # the profile right after the first wave: a probe cut short by its limit still has one
            profile = cProfile.Profile()
            one_call(engine, "project", wave, args, profile)
            figures["profile"] = {"sequences": wave, "functions": top_functions(profile)}
            print(f"the profiled call ({wave} sequences): top function {figures['profile']['functions'][0]['function']}",
                  flush=True)
        save(figures, args.json)  # after every wave: what a limit cuts short is the rest, not what was measured
    print(f"engine start {started:.1f} s")
    return 0


def save(figures: dict, path: Path | None) -> None:
    if path:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(figures, indent=1))


if __name__ == "__main__":
    sys.exit(main())
