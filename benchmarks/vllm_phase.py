"""The generation phase of `benchmarks.gpu_step` through the project's vLLM engine, colocated with the trainer.

The trainer's own `VLLMEngine` (src/rollout/vllm_engine.py) runs exactly as `policy.engine=vllm`
does in training: in this process, on the trainer's GPU with a share of its memory, bf16,
prefix caching on, prompts handed over as the trainer tokenizer's ids and each response's ids
decoded back by that tokenizer, per-prompt seeds (`policy.vllm.per_request_seeds`). No weights
or data are downloaded: vLLM starts from a folder holding the random-weight policy (bf16) and a
word-level tokenizer over the policy's whole vocabulary (`t0 ... t151935`), so every sampled id
decodes. Responses run to `max_new_tokens` unless the policy samples EOS (`t1`), which random
weights rarely do and updated ones more often (up to 15 % of the tokens measured), so the rate
counts the tokens actually returned.

Measured: the engine's start (load, torch.compile, CUDA graphs), `sync_weights` (the trainer's
fp32 parameters copied into vLLM's bf16 model in place, prefix cache reset), and the seconds
and tokens/s of one `generate` call per batch size.
"""

from __future__ import annotations

import statistics
import time
from pathlib import Path

import torch
from tokenizers import Tokenizer, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast

from src.rollout.interface import SamplingParams


def drain() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def word_tokenizer(vocab_size: int) -> PreTrainedTokenizerFast:
    """A tokenizer with one word per id (`t<id>`): prompts are written as words and every sampled id decodes.

    A special token is matched anywhere in the text, before words are split, so each one is a word that is no
    other word's start: `t0` (no id starts with 0) and the last id (a longer number would be past the vocabulary).
    EOS as `t1` would cut `t126172` into `t1` and an unknown word, and a 128-word prompt into up to 194 ids."""
    backend = Tokenizer(models.WordLevel(vocab={f"t{i}": i for i in range(vocab_size)}, unk_token="t0"))
    backend.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return PreTrainedTokenizerFast(tokenizer_object=backend, unk_token="t0", pad_token="t0",
                                   eos_token=f"t{vocab_size - 1}")


def policy_folder(policy, tokenizer, folder: Path) -> Path:
    """The policy's weights (bf16, as vLLM loads them) and the tokenizer, where vLLM starts from."""
    folder.mkdir(parents=True, exist_ok=True)
    policy.save_pretrained(folder, state_dict={k: v.to(torch.bfloat16) for k, v in policy.state_dict().items()})
    tokenizer.save_pretrained(folder)
    return folder


WARM_UP_TOKENS = 32  # the response length of the call that warms the engine up before anything is timed


def start_engine(policy, folder: Path, args) -> tuple[object, float]:
    """The trainer's vLLM engine on the policy folder, and the seconds it took to start (compile and graphs included)."""
    from src.rollout.vllm_engine import VLLMEngine

    tokenizer = word_tokenizer(policy.config.vocab_size)
    policy_folder(policy, tokenizer, folder)
    start = time.perf_counter()
    engine = VLLMEngine(policy, tokenizer, gpu_memory_utilization=args.vllm_memory, enforce_eager=args.enforce_eager,
                        max_model_len=args.prompt_tokens + max(*args.response_token_list, WARM_UP_TOKENS) + 16,
                        max_num_seqs=args.vllm_max_num_seqs, seed=0, per_request_seeds=not args.unseeded,
                        model_path=str(folder), kv_cache_gib=args.vllm_kv_gib)
    return engine, time.perf_counter() - start


def sync_seconds(engine, policy, repeats: int = 3) -> float:
    """Median seconds of one weight sync (the trainer's parameters into vLLM, in place)."""
    seconds = []
    for _ in range(repeats):
        drain()
        start = time.perf_counter()
        engine.sync_weights(policy)
        drain()
        seconds.append(time.perf_counter() - start)
    return statistics.median(seconds)


def prompts(count: int, prompt_tokens: int, vocab: int, generator: torch.Generator) -> list[str]:
    ids = torch.randint(10, vocab, (count, prompt_tokens), generator=generator).tolist()
    return [" ".join(f"t{i}" for i in row) for row in ids]


def generate_rate(engine, groups: int, group_size: int, prompt_tokens: int, response_tokens: int, vocab: int,
                  seed: int) -> dict:
    """One `engine.generate` call: `groups` prompts x `group_size` samples, at temperature 1."""
    texts = prompts(groups, prompt_tokens, vocab, torch.Generator().manual_seed(seed))
    sampling = SamplingParams(temperature=1.0, top_p=1.0, top_k=None, max_new_tokens=response_tokens)
    drain()
    start = time.perf_counter()
    generation = engine.generate(texts, group_size, sampling, seed)
    drain()
    seconds = time.perf_counter() - start
    tokens = sum(len(c.token_ids) for completions in generation.completions for c in completions)
    return {"engine": "vllm", "rows": groups * group_size, "tokens": tokens, "seconds": seconds,
            "tokens_per_s": tokens / seconds, "seeded": engine.per_request_seeds}
