"""The memory plan of a data-parallel (FSDP2) trainer: what one GPU holds for a policy on T GPUs.

The policy is built on the meta device from its architecture (conf/policy/shapes/<hub id>.json, the
model's published config.json written out locally), so a plan needs no weights and no download. Per
GPU, in bytes, for P parameters, L layers, hidden size h, vocabulary V and n tokens per micro-batch:

  sharded, fp32 (1/T each)   master weights 4P, gradients 4P, AdamW moments 8P
  gathered, bf16             the root unit (embeddings, head, final norm: R parameters) and two decoder
                             layers (the one running and the one prefetched), 2 (R + 2 P_layer); FSDP
                             streams them (`src.distributed.data_parallel`; its gathered fallback, for
                             ranks too short of rows to match micro-batches, holds 2P + 4P instead)
  unsharded gradients, fp32  the root unit's before its reduce-scatter, 4R
  whole                      the frozen reference policy pi_ref in fp32, 4P (built by `frozen_copy`)
  activations, bf16          34 n h per layer kept for backward; with activation checkpointing 2 n h per
                             layer plus one layer's 34 n h (Korthikanti et al. 2022, sdpa: no n^2 term)
  output head                14 n V: bf16 logits, fp32 upcast, log-softmax and softmax (entropy) kept
  headroom                   CUDA context and allocator: 2 GiB + 10 %

With `policy.engine=vllm` each rank runs a vLLM engine on its GPU beside its trainer shard (`EngineShare`): the
engine holds `policy.vllm.gpu_memory_utilization` of the GPU, its bf16 copy of the weights (2P) and the KV cache in
the rest. Awake all the time it leaves training the remainder; asleep while training (`policy.vllm.sleep`, vLLM's
level-1 sleep: weights to host memory, KV cache freed) it leaves training the whole GPU less its CUDA context, and
generation must then fit beside what the trainer keeps resident (its shards, the reference policy). Each step's
weight sync gathers every parameter whole in the trainer's dtype, one at a time, on every rank.

On the host, each rank loads the whole policy in fp32 (`from_pretrained` on the CPU, 4P) before moving
it to its GPU and sharding it, beside about 3 GiB of its own (Python, torch, the CUDA libraries): the
node's ranks together need T (4P + 3 GiB), which the SLURM request (`mem_gb`) must cover.

Usage: python -m src.distributed.memory Qwen/Qwen2.5-7B
"""

from __future__ import annotations

import functools
import json
import sys
from dataclasses import dataclass
from pathlib import Path

import torch
from transformers import AutoConfig, AutoModelForCausalLM

from src.paths import CONFIG_DIR

SHAPES = CONFIG_DIR / "policy" / "shapes"
GIB = 2 ** 30
H100_GIB = 79.0       # what torch reports free on an 80 GB H100
GPU_COUNTS = (1, 2, 4, 8)
MICRO_BATCH_TOKENS = (16384, 8192, 4096, 2048, 1024)  # tried largest first


def shape_file(name_or_path: str) -> Path:
    """The local config.json of a preset's policy, by its hub id."""
    path = SHAPES / f"{name_or_path.replace('/', '__')}.json"
    if not path.is_file():
        known = ", ".join(sorted(p.stem.replace("__", "/") for p in SHAPES.glob("*.json")))
        raise FileNotFoundError(f"policy.name_or_path={name_or_path}: no architecture in {SHAPES} for a memory "
                                f"plan; known: {known} (add its config.json as {path.name})")
    return path


def meta_policy(name_or_path: str) -> torch.nn.Module:
    """The policy's architecture with every parameter on the meta device: shapes, no memory, no weights."""
    config = AutoConfig.for_model(**json.loads(shape_file(name_or_path).read_text()))
    with torch.device("meta"):
        return AutoModelForCausalLM.from_config(config)


@dataclass(frozen=True)
class Shape:
    parameters: int
    layer_parameters: int  # one decoder layer's
    layers: int
    hidden: int
    vocab: int
    largest: int = 0       # the largest parameter tensor's elements (the embedding): a weight sync's peak

    @classmethod
    def of(cls, model: torch.nn.Module) -> "Shape":
        config = model.config
        layer = sum(p.numel() for p in model.model.layers[0].parameters())
        return cls(sum(p.numel() for p in model.parameters()), layer, config.num_hidden_layers, config.hidden_size,
                   config.vocab_size, max(p.numel() for p in model.parameters()))

    @property
    def root_parameters(self) -> int:
        """The root FSDP unit's: everything outside the decoder layers (embeddings, head, final norm)."""
        return self.parameters - self.layers * self.layer_parameters


def gpu_bytes(shape: Shape, gpus: int, micro_batch_tokens: int, activation_checkpointing: bool) -> dict[str, float]:
    """Bytes one of `gpus` GPUs holds at the peak of an update, by what holds them (module docstring)."""
    p, n, h = shape.parameters, micro_batch_tokens, shape.hidden
    kept = (2 * shape.layers + 34) if activation_checkpointing else 34 * shape.layers
    root = shape.root_parameters
    parts = {"sharded fp32 weights, gradients, AdamW": 16 * p / gpus,
             "gathered bf16 weights": 2 * (root + 2 * shape.layer_parameters),
             "unsharded fp32 gradients": 4 * root,
             "reference policy (fp32)": 4 * p,
             "activations": kept * n * h,
             "output head": 14 * n * shape.vocab}
    parts["headroom"] = 2 * GIB + 0.1 * sum(parts.values())
    return parts


PROCESS_GIB = 3.0  # one rank's process on the host beside the policy: Python, torch, CUDA libraries, tokenizer


def host_gib(shape: Shape, ranks: int) -> float:
    """GiB of host memory the node's `ranks` ranks hold at once while each loads the whole fp32 policy."""
    return ranks * (4 * shape.parameters / GIB + PROCESS_GIB)


@functools.lru_cache(maxsize=16)  # a sweep asks once a cell; building a 7B on the meta device takes a while
def policy_shape(name_or_path: str) -> Shape:
    """The shape of a preset's policy (conf/policy/shapes), built once on the meta device."""
    return Shape.of(meta_policy(name_or_path))


@dataclass(frozen=True)
class Fit:
    gpus: int
    activation_checkpointing: bool | None   # None: nothing fits
    micro_batch_tokens: int | None
    peak_gib: float


def best_fit(shape: Shape, gpus: int, gpu_gib: float = H100_GIB) -> Fit:
    """The largest micro-batch (in tokens) that fits, without activation checkpointing if it can."""
    for tokens in MICRO_BATCH_TOKENS:
        for checkpointing in (False, True):
            peak = sum(gpu_bytes(shape, gpus, tokens, checkpointing).values()) / GIB
            if peak <= gpu_gib:
                return Fit(gpus, checkpointing, tokens, peak)
    smallest = sum(gpu_bytes(shape, gpus, MICRO_BATCH_TOKENS[-1], True).values()) / GIB
    return Fit(gpus, None, None, smallest)


def plan_lines(name_or_path: str, gpu_gib: float = H100_GIB) -> list[str]:
    shape = policy_shape(name_or_path)
    lines = [f"{name_or_path}: {shape.parameters / 1e9:.2f} B parameters, {shape.layers} layers, hidden "
             f"{shape.hidden}, vocabulary {shape.vocab}; GPUs of {gpu_gib:g} GiB"]
    for gpus in GPU_COUNTS:
        fit = best_fit(shape, gpus, gpu_gib)
        if fit.micro_batch_tokens is None:
            lines.append(f"  {gpus} GPU(s): does not fit (needs {fit.peak_gib:.1f} GiB at "
                         f"{MICRO_BATCH_TOKENS[-1]} tokens with activation checkpointing)")
        else:
            lines.append(f"  {gpus} GPU(s): FSDP over {gpus}, micro-batch {fit.micro_batch_tokens} tokens, activation "
                         f"checkpointing {'on' if fit.activation_checkpointing else 'off'}: {fit.peak_gib:.1f} GiB")
    return lines


ASLEEP_GIB = 2.0  # what a sleeping vLLM engine keeps on its GPU: CUDA context, captured graphs, sampler state


@dataclass(frozen=True)
class EngineShare:
    """A vLLM engine beside each trainer rank (`policy.vllm`): its share of the GPU (`gpu_memory_utilization`) and
    whether it sleeps while the trainer trains (`sleep`)."""

    share: float
    sleep: bool
    tensor_parallel: int = 1  # GPUs one engine spans (`policy.vllm.tensor_parallel_size`): each holds 1/tp of it

    def training_gib(self, gpu_gib: float) -> float:
        """What an update may use of the GPU: the whole less a sleeping engine's context, or less its share."""
        return gpu_gib - ASLEEP_GIB if self.sleep else gpu_gib * (1 - self.share)


@dataclass(frozen=True)
class GenerationPlan:
    """One GPU's engine in GiB: its share, the bf16 weights and KV cache in it, the trainer's resident state beside
    it while it generates, and each step's weight sync (gathered per rank, its largest tensor)."""

    share: float
    weights: float
    kv_cache: float
    resident: float
    sync: float
    sync_peak: float
    split_to_fit: int | None = None  # the fewest GPUs (a power of two up to 8) one engine must span for its weights

    def problem(self, gpu_gib: float) -> str | None:
        if self.kv_cache <= 0:
            split = (f" or split each engine over {self.split_to_fit} GPUs (policy.vllm.tensor_parallel_size="
                     f"{self.split_to_fit})" if self.split_to_fit else "")
            return (f"vLLM's bf16 weights take {self.weights:.1f} GiB of its {self.share:.1f} GiB share: no room for a "
                    f"KV cache; raise policy.vllm.gpu_memory_utilization{split}")
        if self.resident + self.share > gpu_gib:
            return (f"generating, the trainer keeps {self.resident:.1f} GiB beside the engine's {self.share:.1f} GiB "
                    f"(a GPU holds {gpu_gib:g}); lower policy.vllm.gpu_memory_utilization or shard over more GPUs")
        return None


def generation_plan(shape: Shape, gpus: int, engine: EngineShare, master_bytes: int,
                    gpu_gib: float = H100_GIB) -> GenerationPlan:
    """The engine's side of one GPU (module docstring); `master_bytes`: the trainer's weights' bytes per element."""
    share, whole = engine.share * gpu_gib, 2 * shape.parameters / GIB
    weights = whole / engine.tensor_parallel  # vLLM shards each layer over the engine's GPUs
    split = next((tp for tp in GPU_COUNTS if tp > engine.tensor_parallel and tp <= gpus and whole / tp < share), None)
    # Asleep while training, the engine wakes beside the trainer's sharded weights and AdamW moments (12 P / T; the
    # step frees its gradients, `src.train.learn`), pi_ref (4 P) and the CUDA context; awake throughout, the
    # training plan already left it its share.
    resident = (12 * shape.parameters / gpus + 4 * shape.parameters) / GIB + 2.0 if engine.sleep else 0.0
    return GenerationPlan(share, weights, share - weights, resident, master_bytes * shape.parameters / GIB,
                          master_bytes * shape.largest / GIB, split)


def job_plan_lines(names: list[str], gpus: int, engine: EngineShare | None = None, master_bytes: int = 4) -> list[str]:
    """The memory plan of each distinct policy in `names` that has a written architecture, trained data-parallel
    over `gpus` GPUs (the job's trainer ranks), with each rank's vLLM engine (`engine`) when it has one."""
    lines = []
    for name in sorted(set(names)):
        if not (SHAPES / f"{name.replace('/', '__')}.json").is_file():
            continue  # the tiny policy or a local folder: nothing to plan
        shape = policy_shape(name)
        fit = best_fit(shape, gpus, engine.training_gib(H100_GIB) if engine else H100_GIB)
        where = f"memory plan: {name} trained data-parallel (FSDP) over the job's {gpus} GPU(s)"
        host = f"; host: {host_gib(shape, gpus):.0f} GiB while the ranks load it"
        lines.append(f"{where}: does not fit, {fit.peak_gib:.1f} GiB per GPU at the smallest micro-batch"
                     if fit.micro_batch_tokens is None else
                     f"{where}: training {fit.peak_gib:.1f} GiB per GPU at micro-batch {fit.micro_batch_tokens} "
                     f"tokens, activation checkpointing {'on' if fit.activation_checkpointing else 'off'}{host}")
        if engine is not None:
            lines.append(generation_line(name, generation_plan(shape, gpus, engine, master_bytes), gpus, engine))
    return lines


def generation_line(name: str, plan: GenerationPlan, gpus: int, engine: EngineShare) -> str:
    when = ("asleep while training (weights to the host, KV cache freed), awake beside the trainer's "
            f"{plan.resident:.1f} GiB" if engine.sleep else "awake throughout, beside the training")
    problem = plan.problem(H100_GIB)
    tp, engines = engine.tensor_parallel, max(1, gpus // engine.tensor_parallel)
    where = (f"a vLLM engine on each of the {gpus} GPU(s)" if tp == 1 else
             f"{engines} vLLM engine(s), each split over {tp} GPUs (tensor parallelism)")
    return (f"generation plan: {name}: {where}, each sampling 1/{engines} of every "
            f"step's groups: {plan.share:.1f} GiB per GPU (bf16 weights {plan.weights:.1f}, KV cache "
            f"{plan.kv_cache:.1f}), {when}; weight sync per step: {plan.sync:.1f} GiB gathered on each rank, one "
            f"tensor at a time (largest {plan.sync_peak:.2f} GiB)" + (f"; does not fit: {problem}" if problem else ""))


@functools.lru_cache(maxsize=16)  # a sweep asks once a cell
def fewest_gpus(name: str, gpu_gib: float = H100_GIB) -> tuple[Fit, int | None]:
    """The plan of `name` on each GPU count, smallest first, until one fits: (the 1-GPU plan's misfit or fit,
    the fewest GPUs that fit; None if none of GPU_COUNTS does)."""
    shape = policy_shape(name)
    fits = {gpus: best_fit(shape, gpus, gpu_gib) for gpus in GPU_COUNTS}
    return fits, next((gpus for gpus, fit in fits.items() if fit.micro_batch_tokens is not None), None)


if __name__ == "__main__":
    for name in sys.argv[1:] or sorted(p.stem.replace("__", "/") for p in SHAPES.glob("*.json")):
        print("\n".join(plan_lines(name)))
