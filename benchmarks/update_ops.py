"""Operator counts of one policy update, the trainer's against a plain reference loop.

    python -m benchmarks.update_ops                                # CPU, float32, a tiny Qwen2-shaped model
    python -m benchmarks.update_ops --dtype bfloat16               # fp32 weights + bf16 compute, as hardware=h100
    python -m benchmarks.update_ops --device cuda --json $OUT/update_ops.json

Both loops do the same work on the same random Qwen2 model: forward+backward of the response tokens'
log-probs (the output head on response positions only) in micro-batches of `--micro` rows, then one
AdamW step. Ours is `src.loss.trainer.Trainer` with the RLOO objective (fused head, kl_coef 0 by
default, so no reference forward: the plain loop has none); the plain loop is
`update_reference.py`'s, imported from the shared bench folder beside the repository (shared/bench). Each
update is profiled (torch.profiler) after a warm-up update, and the table counts:

- syncs: `aten::_local_scalar_dense` (`.item()`, `bool(tensor)`, `.tolist()` of one element) outside the
  optimizer step. The optimizer's own are counted apart ("optimizer syncs"): off CUDA, or on CUDA
  without the fused kernel, AdamW reads each parameter's step counter, a CPU scalar, with `.item()`,
  alike in both loops and no device sync;
- nonzero: `aten::nonzero` (boolean-mask indexing), a host sync on a GPU that is no `_local_scalar_dense`;
- device syncs (CUDA only): the synchronizing operations `torch.cuda.set_sync_debug_mode` reports;
- casts: `aten::_to_copy` + `aten::copy_` + `aten::_foreach_copy_` (one call each);
- ops: every `aten::` operator call.

Targets (against the plain loop): syncs <= optimizer steps + 2; casts and ops each within 1.5x.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import sys
import warnings
from pathlib import Path

import torch

from src.paths import PROJECT_ROOT

REFERENCE_PATH = PROJECT_ROOT.parent / "shared" / "bench" / "update_reference.py"
QWEN_TINY = dict(vocab_size=512, hidden_size=128, intermediate_size=256, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=2, max_position_embeddings=2048, tie_word_embeddings=True)
CASTS = ("aten::_to_copy", "aten::copy_", "aten::_foreach_copy_")
TARGET_RATIO = 1.5  # casts and ops of ours over the plain loop's
EXTRA_SYNCS = 2  # syncs allowed beyond one per optimizer step: reading the update's tallies


def reference_module(path: Path | None = None):
    """The plain loop as a module: `path` (`--reference`; a GPU lease gives the copy its bundle carried), else
    shared/bench/update_reference.py beside the repository; SystemExit with one line saying where it looked."""
    path = REFERENCE_PATH if path is None else path
    if not path.is_file():
        raise SystemExit(f"update_ops: the plain reference loop is missing: expected {path} "
                         "(shared/bench in the folder beside the repository, or --reference PATH)")
    spec = importlib.util.spec_from_file_location("update_reference", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def qwen_model(device: str, dtype: torch.dtype, layers: int):
    """A Qwen2 model with random weights of `QWEN_TINY`'s shape (`layers` decoder layers), in train mode."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(0)
    config = Qwen2Config(**{**QWEN_TINY, "num_hidden_layers": layers}, attn_implementation="sdpa")
    return Qwen2ForCausalLM(config).to(device=device, dtype=dtype).train()


class Counter:
    """Counts of one profiled region (`counts`), with CUDA's synchronizing operations where it runs on CUDA."""

    def __init__(self, device: str) -> None:
        self.device, self.device_syncs = device, None

    def __call__(self, function) -> dict[str, int]:
        from torch.profiler import ProfilerActivity, profile

        caught = warnings.catch_warnings(record=True)
        with caught as seen:
            warnings.simplefilter("always")
            if self.device == "cuda":
                torch.cuda.synchronize()
                torch.cuda.set_sync_debug_mode("warn")
            try:
                with profile(activities=[ProfilerActivity.CPU]) as profiled:
                    function()
            finally:
                if self.device == "cuda":
                    torch.cuda.set_sync_debug_mode("default")
        counts = counts_of(profiled.events())
        if self.device == "cuda":
            counts["device_syncs"] = sum("synchronizing" in str(w.message) for w in seen)
        return counts


def counts_of(events) -> dict[str, int]:
    """Syncs (outside and inside the optimizer step), nonzero calls, casts and all aten ops of profiler `events`."""
    in_optimizer = {}

    def under_optimizer(event) -> bool:
        if event.id not in in_optimizer:
            parent = event.cpu_parent
            in_optimizer[event.id] = event.name.startswith("Optimizer.step") or (
                parent is not None and under_optimizer(parent))
        return in_optimizer[event.id]

    counts = dict(syncs=0, optimizer_syncs=0, nonzero=0, casts=0, ops=0)
    for event in events:
        name = event.name
        if not name.startswith("aten::"):
            continue
        counts["ops"] += 1
        counts["casts"] += name in CASTS
        counts["nonzero"] += name == "aten::nonzero"
        if name == "aten::_local_scalar_dense":
            counts["optimizer_syncs" if under_optimizer(event) else "syncs"] += 1
    return counts


def reference_update(ref, model, optimizer, ids, advantages, size: dict, autocast: torch.dtype | None):
    """One update of the plain loop (update_reference.py's `run_variant.update`, its `response_logprobs`)."""
    rows, micro, prompt, response = size["rows"], size["micro"], size["prompt"], size["response"]
    device = ids.device.type
    for start in range(0, rows, micro):
        context = (torch.autocast(device, dtype=autocast) if autocast else torch.autocast(device, enabled=False))
        with context:
            logprobs = ref.response_logprobs(model, ids[start:start + micro], prompt, size["chunk"])
        loss = -(advantages[start:start + micro] * logprobs).sum() / (rows * response)
        loss.backward()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)


def measure_reference(args, size: dict) -> dict[str, int]:
    """The plain loop's counts: bf16 weights where `--dtype bfloat16` (its fastest variant), else fp32."""
    ref = reference_module(args.reference)
    device = args.device
    model = qwen_model(device, getattr(torch, args.dtype), args.layers)
    if args.compile:
        model.model = torch.compile(model.model)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-6, fused=(device == "cuda"))
    generator = torch.Generator().manual_seed(1)
    ids = torch.randint(10, QWEN_TINY["vocab_size"], (size["rows"], size["prompt"] + size["response"]),
                        generator=generator).to(device)
    advantages = torch.randn(size["rows"], 1, generator=generator).to(device)
    reference_update(ref, model, optimizer, ids, advantages, size, None)  # warm-up: optimizer state, compile
    return Counter(device)(lambda: reference_update(ref, model, optimizer, ids, advantages, size, None))


def synthetic_batch(size: dict):
    """Fresh groups of random token ids at `size`: prompts and responses of fixed lengths, 0/1 rewards."""
    from src.batch import Batch, BatchGroup, Group

    generator = torch.Generator().manual_seed(1)
    groups = []
    for _ in range(size["groups"]):
        prompt = torch.randint(10, QWEN_TINY["vocab_size"], (size["prompt"],), generator=generator).tolist()
        responses = [torch.randint(10, QWEN_TINY["vocab_size"], (size["response"],), generator=generator).tolist()
                     for _ in range(size["group_size"])]
        rewards = [float(i % 2) for i in range(size["group_size"])]
        groups.append(Group(prompt="", prompt_ids=prompt, truth={}, responses=[""] * size["group_size"],
                            response_ids=responses, rewards=rewards, step=0))
    return Batch([BatchGroup(group, "fresh") for group in groups])


def measure_ours(args, size: dict) -> dict[str, int]:
    """The trainer's counts: fp32 weights, and with `--dtype bfloat16` the GPU preset's bf16 compute."""
    from omegaconf import OmegaConf

    from src.build import build_optimizer
    from src.loss.rloo import RlooObjective
    from src.loss.trainer import Trainer
    from src.policy.forward import Forward
    from src.policy.model import compile_layers, frozen_copy

    device = args.device
    policy = qwen_model(device, torch.float32, args.layers)
    reference = frozen_copy(policy)
    if args.compile:
        compile_layers(policy)
        compile_layers(reference)
    autocast = None if args.dtype == "float32" else args.dtype
    forward = Forward(0, size["micro"], None, autocast, fused=True, pack=args.pack)
    trainer = Trainer(RlooObjective(1.0), forward, kl_coef=args.kl_coef, entropy_coef=1e-3)
    optimizer = build_optimizer(policy, OmegaConf.create({"learning_rate": 1e-6, "weight_decay": 1e-4,
                                                          "betas": [0.9, 0.999]}))
    batch = synthetic_batch(size)
    trainer.update(policy, reference, optimizer, batch)  # warm-up: optimizer state, compile
    return Counter(device)(lambda: trainer.update(policy, reference, optimizer, batch))


def table(ours: dict, reference: dict) -> list[str]:
    keys = [key for key in ("syncs", "optimizer_syncs", "nonzero", "device_syncs", "casts", "ops") if key in ours]
    lines = ["| count | ours | plain loop | ratio |", "|---|---:|---:|---:|"]
    for key in keys:
        ratio = ours[key] / reference[key] if reference[key] else float("inf") if ours[key] else 1.0
        lines.append(f"| {key} | {ours[key]} | {reference[key]} | {ratio:.2f} |")
    return lines


def targets(ours: dict, reference: dict, optimizer_steps: int) -> dict[str, bool]:
    """The targets: syncs <= optimizer steps + 2, casts and ops within 1.5x of the plain loop's."""
    return {"syncs": ours["syncs"] <= optimizer_steps + EXTRA_SYNCS,
            "casts": ours["casts"] <= TARGET_RATIO * reference["casts"],
            "ops": ours["ops"] <= TARGET_RATIO * reference["ops"]}


def parse(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    parser.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32",
                        help="float32: fp32 throughout; bfloat16: ours fp32 weights + bf16 compute (hardware=h100), "
                             "the plain loop bf16 weights")
    parser.add_argument("--groups", type=int, default=4)
    parser.add_argument("--group-size", type=int, default=4)
    parser.add_argument("--prompt", type=int, default=16)
    parser.add_argument("--response", type=int, default=16)
    parser.add_argument("--micro", type=int, default=4, help="rows per micro-batch")
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--kl-coef", type=float, default=0.0, help="ours only; != 0 adds the reference forward")
    parser.add_argument("--pack", action="store_true", help="ours with trainer.pack_rows")
    parser.add_argument("--compile", action="store_true", help="trainer.compile; the plain loop's bf16+compile")
    parser.add_argument("--json", type=Path, default=None, help="write every figure to this file")
    parser.add_argument("--reference", type=Path, default=None,
                        help=f"the plain loop's file (default: {REFERENCE_PATH.relative_to(PROJECT_ROOT.parent)} "
                             "beside the repository)")
    args = parser.parse_args(argv)
    for key in ("groups", "group_size", "prompt", "response", "micro", "layers"):
        if getattr(args, key) < 1:
            parser.error(f"--{key.replace('_', '-')}={getattr(args, key)}: must be at least 1")
    if args.group_size < 2:
        parser.error(f"--group-size={args.group_size}: RLOO needs at least 2 responses per group")
    if args.device == "cuda" and not torch.cuda.is_available():
        parser.error("--device cuda: no CUDA device is visible; run with --device cpu")
    return args


def measure(args) -> dict:
    """Every figure of one run: the size, both loops' counts, their ratios and the targets."""
    size = dict(groups=args.groups, group_size=args.group_size, rows=args.groups * args.group_size,
                prompt=args.prompt, response=args.response, micro=args.micro, chunk=4096)
    reference = measure_reference(args, size)
    ours = measure_ours(args, size)
    ratios = {key: (ours[key] / reference[key] if reference[key] else None) for key in ours}
    return {"device": args.device, "dtype": args.dtype, "compile": args.compile, "pack": args.pack,
            "kl_coef": args.kl_coef, "torch": torch.__version__, "size": size, "optimizer_steps": 1,
            "reference_file": str(args.reference or REFERENCE_PATH),
            "ours": ours, "reference": reference, "ratios": ratios, "targets": targets(ours, reference, 1)}


def main(argv=None) -> int:
    args = parse(argv)
    result = measure(args)
    size = result["size"]
    print(f"one update, {args.device} {args.dtype}: {size['rows']} rows x ({size['prompt']} + {size['response']}) "
          f"tokens, micro-batches of {size['micro']}, {args.layers} Qwen2 layers"
          f"{', compiled' if args.compile else ''}{', packed' if args.pack else ''}")
    print("\n".join(table(result["ours"], result["reference"])))
    print("targets: " + ", ".join(f"{key} {'met' if ok else 'MISSED'}" for key, ok in result["targets"].items()))
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
