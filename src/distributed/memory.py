"""The memory plan of a data-parallel (FSDP2) trainer: what one GPU holds for a policy on T GPUs.

The policy is built on the meta device from its architecture (conf/policy/shapes/<hub id>.json, the
model's published config.json written out locally), so a plan needs no weights and no download. It plans the
cell's own settings (`Cell.of`): its micro-batch tokens, activation checkpointing, output head, dtype and vLLM
context. Per GPU, in bytes, for P parameters, L layers, hidden size h, MLP width I, vocabulary V and n tokens
per micro-batch:

  sharded, fp32 (1/T each)   master weights 4P, gradients 4P, AdamW moments 8P
  gathered, bf16             the root unit (embeddings, head, final norm: R parameters) and two decoder
                             layers (the one running and the one prefetched), 2 (R + 2 P_layer); FSDP
                             streams them (`src.distributed.data_parallel`; its gathered fallback, for
                             ranks too short of rows to match micro-batches, holds 2P + 4P instead). On one
                             GPU, autocast's cache of bf16 weights, 2P
  unsharded gradients, fp32  the root unit's before its reduce-scatter, 4R
  reference policy pi_ref    under ranks on GPUs a bf16 copy, 2P (`src.build.reference_policy`); in one process
                             the policy's whole copy in its own dtype, 4P in fp32 (`frozen_copy`)
  activations, bf16          (26 h + 8 I) n per layer kept for backward (`layer_activation_bytes`), with
                             activation checkpointing 2 n h per layer (its input) plus one layer's
  output head                8 n h (final norm, head input), and the logits: 16 n V unfused (bf16 logits, fp32
                             log-softmax, softmax, their fp32 and bf16 gradients); fused (`trainer.fused_logprobs`,
                             src/policy/token_stats.py) 4 n V (bf16 logits and their gradient) + 8 c V, two fp32
                             temporaries of a chunk of c = min(n, 4096) rows
  headroom                   CUDA context and allocator: 2 GiB + 10 %

With `policy.engine=vllm` each rank runs a vLLM engine on its GPU beside its trainer shard (`EngineShare`): the
engine holds `policy.vllm.gpu_memory_utilization` of the GPU. vLLM sizes its KV cache as that share less what it
measured at start (vllm/v1/worker/gpu_worker.py:740-744 in vLLM 0.32): its bf16 weights (2P / tp), the peak of its
profiling forward of `max_num_batched_tokens` (16,384 on an H100, vllm/engine/arg_utils.py:2936) and of its
dummy sampler (`engine_profile_bytes`), and its CUDA graphs' estimate (applied by default,
VLLM_MEMORY_PROFILER_ESTIMATE_CUDAGRAPHS, vllm/envs.py:2221). The KV cache must hold a sequence of the cell's
max_model_len (prompt + response tokens, `Cell.max_model_len`). Awake all the time the engine leaves training the
remainder; asleep while training (`policy.vllm.sleep`, vLLM's level-1 sleep: weights to pinned host memory,
vllm/device_allocator/cumem.py:268-272, KV cache freed) it leaves training the whole GPU less its context and
graphs, and generation must then fit beside what the trainer keeps resident (its shards, pi_ref). At start the
engine must find its share free beside the trainer's shards and pi_ref (vLLM refuses to start otherwise). Each
step's weight sync gathers every parameter whole in the trainer's dtype, one at a time, on every rank.

On the host, each rank loads the whole policy in fp32 (`from_pretrained` on the CPU, 4P) and shards it onto its
GPU (`src.build.build_components`); a sleeping engine then keeps its bf16 weights pinned in host memory (2P / tp),
beside about 3 GiB of the rank's own (Python, torch, the CUDA libraries): the node's T ranks need
T (max(4P, 2P / tp) + 3 GiB), which the SLURM request (`mem_gb`) must cover.

Usage: python -m src.distributed.memory Qwen/Qwen2.5-7B
"""

from __future__ import annotations

import functools
import json
import sys
from dataclasses import dataclass, replace
from pathlib import Path

import torch
from transformers import AutoConfig, AutoModelForCausalLM

from src.paths import CONFIG_DIR
from src.rollout.vllm_engine import PROMPT_TOKENS

SHAPES = CONFIG_DIR / "policy" / "shapes"
GIB = 2 ** 30
H100_GIB = 79.0       # what torch reports free on an 80 GB H100
GPU_COUNTS = (1, 2, 4, 8)
MICRO_BATCH_TOKENS = (16384, 12288, 8192, 4096, 2048, 1024)  # tried largest first
HEAD_CHUNK_ROWS = 4096  # src/policy/token_stats.py CHUNK_ROWS: rows of [rows, V] the fused head works at once
# Prompt tokens a vLLM context allows for when policy.vllm.max_model_len is null: the engine's context is then this
# plus the run's response tokens, at most the model's own (the engine's PROMPT_TOKENS).


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
    intermediate: int = 0  # the SwiGLU MLP's width I
    kv_width: int = 0      # key/value heads x head dimension (grouped-query attention)
    context: int = 0       # the model's own context length (max_position_embeddings)

    @classmethod
    def of(cls, model: torch.nn.Module) -> "Shape":
        config = model.config
        layer = sum(p.numel() for p in model.model.layers[0].parameters())
        head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
        return cls(sum(p.numel() for p in model.parameters()), layer, config.num_hidden_layers, config.hidden_size,
                   config.vocab_size, max(p.numel() for p in model.parameters()), config.intermediate_size,
                   config.num_key_value_heads * head_dim, config.max_position_embeddings)

    @property
    def root_parameters(self) -> int:
        """The root FSDP unit's: everything outside the decoder layers (embeddings, head, final norm)."""
        return self.parameters - self.layers * self.layer_parameters

    @property
    def kv_bytes_per_token(self) -> int:
        """vLLM's bf16 KV cache for one token: a key and a value of kv_width in every layer."""
        return 2 * self.layers * self.kv_width * 2


def layer_activation_bytes(shape: Shape) -> int:
    """Bytes one decoder layer (pre-norm attention and SwiGLU MLP, bf16) keeps for backward, per token.

    Each RMSNorm keeps its fp32 upcast input and its bf16 normalised output (4h + 2h, Qwen2RMSNorm); attention keeps
    its projections' input (2h), q, and k and v repeated to every query head (2h each: a padded micro-batch has a
    mask, so transformers runs sdpa on `repeat_kv`'s copies, transformers/integrations/sdpa_attention.py:52,137),
    sdpa's output (2h) and o_proj's contiguous input (2h); the MLP keeps its input (2h) and the gate, SiLU, up and
    product outputs, 2I each: 2 (6h) + 12h + 2h + 8I = 26h + 8I. Korthikanti et al. 2022's 34h (without the
    n^2 term) is a GeLU MLP of 4h with one LayerNorm's 2h each: about half of this for Qwen2.5-7B's I = 5.3h.
    """
    return 26 * shape.hidden + 8 * shape.intermediate


@dataclass(frozen=True)
class Cell:
    """What a cell trains with, as far as memory goes (`Cell.of` reads them from its config)."""

    micro_batch_tokens: int = 4096
    activation_checkpointing: bool = False
    fused_head: bool = True
    max_model_len: int | None = None     # None: PROMPT_TOKENS + max_new_tokens, at most the model's context
    max_new_tokens: int = 1024
    master_bytes: int = 4                # the trainer's weights' bytes per element (hardware.dtype)
    on_gpu: bool = True
    checkpointing_key: str = "hardware.activation_checkpointing"  # the setting that turns it on

    @classmethod
    def of(cls, cfg) -> "Cell":
        """The cell's settings: trainer.micro_batch_tokens (null: micro_batch_size rows of max_model_len), its
        activation checkpointing (trainer.gradient_checkpointing, or hardware.activation_checkpointing under
        ranks), trainer.fused_logprobs, hardware.dtype and device, policy.vllm.max_model_len."""
        ranks = int(cfg.hardware.get("ranks", 1) or 1)
        sharded = ranks > 1 and bool(cfg.hardware.get("activation_checkpointing", False))
        vllm = cfg.policy.get("vllm", {}) or {}
        cell = cls(fused_head=bool(cfg.trainer.fused_logprobs), max_model_len=vllm.get("max_model_len"),
                   max_new_tokens=int(cfg.policy.max_new_tokens),
                   activation_checkpointing=sharded or bool(cfg.trainer.get("gradient_checkpointing", False)),
                   master_bytes=2 if cfg.hardware.dtype in ("bfloat16", "float16") else 8 if
                   cfg.hardware.dtype == "float64" else 4, on_gpu=str(cfg.hardware.device).startswith("cuda"),
                   checkpointing_key="hardware.activation_checkpointing" if ranks > 1 else
                   "trainer.gradient_checkpointing")
        tokens = cfg.trainer.get("micro_batch_tokens")
        return replace(cell, micro_batch_tokens=int(tokens) if tokens else
                       int(cfg.trainer.micro_batch_size) * cell.context(None))

    def context(self, shape: Shape | None) -> int:
        """Tokens a sequence holds: max_model_len, or the prompt allowance plus the response budget."""
        wanted = self.max_model_len or PROMPT_TOKENS + self.max_new_tokens
        return min(wanted, shape.context) if shape is not None and shape.context and not self.max_model_len else wanted


def gpu_bytes(shape: Shape, gpus: int, cell: Cell) -> dict[str, float]:
    """Bytes one of `gpus` GPUs holds at the peak of an update, by what holds them (module docstring)."""
    p, n, h, v = shape.parameters, cell.micro_batch_tokens, shape.hidden, shape.vocab
    per_layer = layer_activation_bytes(shape)
    kept = 2 * h * shape.layers + per_layer if cell.activation_checkpointing else per_layer * shape.layers
    root = shape.root_parameters
    sharded = gpus > 1
    logits = 4 * n * v + 8 * min(n, HEAD_CHUNK_ROWS) * v if cell.fused_head else 16 * n * v
    parts = {"sharded fp32 weights, gradients, AdamW": 16 * p / gpus,
             "gathered bf16 weights": 2 * (root + 2 * shape.layer_parameters) if sharded else 2 * p,
             "unsharded fp32 gradients": 4 * root if sharded else 0,
             "reference policy": reference_bytes(gpus, cell) * p,
             "activations": kept * n,
             "output head": 8 * n * h + logits}
    parts["headroom"] = 2 * GIB + 0.1 * sum(parts.values())
    return parts


def reference_bytes(gpus: int, cell: Cell) -> int:
    """pi_ref's bytes a parameter: bf16 under ranks on GPUs (`src.build.reference_policy`), else the trainer's."""
    return 2 if gpus > 1 and cell.on_gpu else cell.master_bytes


def peak_gib(shape: Shape, gpus: int, cell: Cell) -> float:
    return sum(gpu_bytes(shape, gpus, cell).values()) / GIB


PROCESS_GIB = 3.0  # one rank's process on the host beside the policy: Python, torch, CUDA libraries, tokenizer


def host_gib(shape: Shape, ranks: int, engine: "EngineShare | None" = None) -> float:
    """GiB of host memory the node's `ranks` ranks hold at their peak: each loads the whole fp32 policy, and a
    sleeping engine later keeps its bf16 weights pinned there (module docstring)."""
    pinned = 2 * shape.parameters / engine.tensor_parallel if engine is not None and engine.sleep else 0
    return ranks * (max(4 * shape.parameters, pinned) / GIB + PROCESS_GIB)


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


def best_fit(shape: Shape, gpus: int, gpu_gib: float = H100_GIB, cell: Cell = Cell()) -> Fit:
    """The largest micro-batch (in tokens) that fits with the cell's head, without activation checkpointing if
    it can."""
    for tokens in MICRO_BATCH_TOKENS:
        for checkpointing in (False, True):
            peak = peak_gib(shape, gpus, replace(cell, micro_batch_tokens=tokens, activation_checkpointing=checkpointing))
            if peak <= gpu_gib:
                return Fit(gpus, checkpointing, tokens, peak)
    smallest = peak_gib(shape, gpus, replace(cell, micro_batch_tokens=MICRO_BATCH_TOKENS[-1],
                                             activation_checkpointing=True))
    return Fit(gpus, None, None, smallest)


def cell_fix(shape: Shape, gpus: int, cell: Cell, gpu_gib: float) -> str | None:
    """The one setting that makes the cell's update fit `gpu_gib`, as the option to type, or None: activation
    checkpointing, then the fused head, then the largest micro-batch that fits."""
    tries = [(f"{cell.checkpointing_key}=true", replace(cell, activation_checkpointing=True))] \
        if not cell.activation_checkpointing else []
    if not cell.fused_head:
        tries.append(("trainer.fused_logprobs=true", replace(cell, fused_head=True)))
    smaller = [tokens for tokens in MICRO_BATCH_TOKENS if tokens < cell.micro_batch_tokens]
    tries += [(f"trainer.micro_batch_tokens={tokens}", replace(cell, micro_batch_tokens=tokens)) for tokens in smaller]
    tries += [(f"{cell.checkpointing_key}=true trainer.micro_batch_tokens={tokens}",
               replace(cell, micro_batch_tokens=tokens, activation_checkpointing=True))
              for tokens in smaller if not cell.activation_checkpointing]
    for option, changed in tries:
        peak = peak_gib(shape, gpus, changed)
        if peak <= gpu_gib:
            return f"{option} ({peak:.1f} GiB)"
    return None


def describe(cell: Cell) -> str:
    return (f"micro-batch {cell.micro_batch_tokens} tokens, activation checkpointing "
            f"{'on' if cell.activation_checkpointing else 'off'}, {'fused' if cell.fused_head else 'unfused'} head")


def plan_lines(name_or_path: str, gpu_gib: float = H100_GIB) -> list[str]:
    shape = policy_shape(name_or_path)
    lines = [f"{name_or_path}: {shape.parameters / 1e9:.2f} B parameters, {shape.layers} layers, hidden "
             f"{shape.hidden}, vocabulary {shape.vocab}; GPUs of {gpu_gib:g} GiB; fused head"]
    for gpus in GPU_COUNTS:
        fit = best_fit(shape, gpus, gpu_gib)
        if fit.micro_batch_tokens is None:
            lines.append(f"  {gpus} GPU(s): does not fit (needs {fit.peak_gib:.1f} GiB at "
                         f"{MICRO_BATCH_TOKENS[-1]} tokens with activation checkpointing)")
        else:
            lines.append(f"  {gpus} GPU(s): FSDP over {gpus}, micro-batch {fit.micro_batch_tokens} tokens, activation "
                         f"checkpointing {'on' if fit.activation_checkpointing else 'off'}: {fit.peak_gib:.1f} GiB")
    return lines


ASLEEP_GIB = 2.0  # what a sleeping vLLM engine keeps on its GPU: its CUDA graphs (CUDA_GRAPHS_GIB), sampler state
CONTEXT_GIB = 2.0  # the CUDA context and allocator slack beside the trainer's resident tensors
# vLLM's estimate of its CUDA graphs (decode batches up to 512, src/rollout/vllm_engine.py CUDA_MAX_NUM_SEQS), taken
# from its share before the KV cache (vllm/v1/worker/gpu_worker.py:700-744); vLLM logs it at start ("Estimated
# CUDA graph memory"), about 1 GiB for 7B models. None without graphs (policy.vllm.enforce_eager=true).
CUDA_GRAPHS_GIB = 1.0
ENGINE_BATCHED_TOKENS = 16384  # vLLM's max_num_batched_tokens on an H100 (vllm/engine/arg_utils.py:2936)
ENGINE_SEQUENCES = 512         # src/rollout/vllm_engine.py CUDA_MAX_NUM_SEQS: the dummy sampler's rows


@dataclass(frozen=True)
class EngineShare:
    """A vLLM engine beside each trainer rank (`policy.vllm`): its share of the GPU (`gpu_memory_utilization`) and
    whether it sleeps while the trainer trains (`sleep`)."""

    share: float
    sleep: bool
    tensor_parallel: int = 1  # GPUs one engine spans (`policy.vllm.tensor_parallel_size`): each holds 1/tp of it
    eager: bool = False       # `policy.vllm.enforce_eager`: no CUDA graphs

    def training_gib(self, gpu_gib: float) -> float:
        """What an update may use of the GPU: the whole less a sleeping engine's graphs, or less its share."""
        return gpu_gib - ASLEEP_GIB if self.sleep else gpu_gib * (1 - self.share)


def engine_profile_bytes(shape: Shape, tensor_parallel: int = 1) -> float:
    """The peak vLLM measures at start beyond its weights (gpu_model_runner.py `profile_run`): a forward of
    ENGINE_BATCHED_TOKENS tokens, whose largest transient is the MLP's gate/up output and its SiLU product (bf16,
    2I + I) beside a few hidden-state tensors (about 4h), or its dummy sampler over ENGINE_SEQUENCES rows of fp32
    logits (logits, probabilities and the sorted copy top-p/top-k sample from: 3 x 4V), whichever is larger."""
    forward = ENGINE_BATCHED_TOKENS * (6 * shape.intermediate + 8 * shape.hidden) / tensor_parallel
    sampler = ENGINE_SEQUENCES * 12 * shape.vocab
    return max(forward, sampler)


@dataclass(frozen=True)
class GenerationPlan:
    """One GPU's engine in GiB: its share, what vLLM takes from it before the KV cache (bf16 weights, its profiling
    peak, its CUDA graphs), the KV cache and the sequences of max_model_len tokens it holds, the trainer's resident
    state beside it while it generates and when it starts, and each step's weight sync (gathered per rank, its
    largest tensor)."""

    share: float
    weights: float
    kv_cache: float
    resident: float
    sync: float
    sync_peak: float
    split_to_fit: int | None = None  # the fewest GPUs (a power of two up to 8) one engine must span for its weights
    profile: float = 0.0
    graphs: float = 0.0
    max_model_len: int = 0
    sequence: float = 0.0            # GiB of KV cache one sequence of max_model_len tokens takes
    startup: float = 0.0             # the trainer's GiB on the GPU when the engine starts: its shards, pi_ref

    @property
    def sequences(self) -> int:
        return int(self.kv_cache // self.sequence) if self.sequence else 0

    def problem(self, gpu_gib: float) -> str | None:
        if self.kv_cache <= 0 or self.kv_cache < self.sequence:
            split = (f" or split each engine over {self.split_to_fit} GPUs (policy.vllm.tensor_parallel_size="
                     f"{self.split_to_fit})" if self.split_to_fit else "")
            if self.weights >= self.share:
                return (f"vLLM's bf16 weights take {self.weights:.1f} GiB of its {self.share:.1f} GiB share: no room "
                        f"for a KV cache; raise policy.vllm.gpu_memory_utilization{split}")
            return (f"vLLM's {self.share:.1f} GiB share less its bf16 weights ({self.weights:.1f}), profiling peak "
                    f"({self.profile:.1f}) and CUDA graphs ({self.graphs:.1f}) leaves {max(self.kv_cache, 0):.1f} GiB of "
                    f"KV cache, and one sequence of max_model_len {self.max_model_len} needs {self.sequence:.2f}; lower "
                    f"policy.vllm.max_model_len, raise policy.vllm.gpu_memory_utilization{split}")
        if self.startup + self.share > gpu_gib:
            return (f"at start the trainer holds {self.startup:.1f} GiB beside the engine's {self.share:.1f} GiB (a GPU "
                    f"holds {gpu_gib:g}); lower policy.vllm.gpu_memory_utilization or shard over more GPUs")
        if self.resident + self.share > gpu_gib:
            return (f"generating, the trainer keeps {self.resident:.1f} GiB beside the engine's {self.share:.1f} GiB "
                    f"(a GPU holds {gpu_gib:g}); lower policy.vllm.gpu_memory_utilization or shard over more GPUs")
        return None


def generation_plan(shape: Shape, gpus: int, engine: EngineShare, cell: Cell = Cell(),
                    gpu_gib: float = H100_GIB) -> GenerationPlan:
    """The engine's side of one GPU (module docstring) for the cell's trainer dtype and vLLM context."""
    share, whole, tp = engine.share * gpu_gib, 2 * shape.parameters / GIB, engine.tensor_parallel
    weights = whole / tp  # vLLM shards each layer over the engine's GPUs
    profile = engine_profile_bytes(shape, tp) / GIB
    graphs = 0.0 if engine.eager else CUDA_GRAPHS_GIB
    context = cell.context(shape)
    sequence = context * shape.kv_bytes_per_token / GIB  # one sequence's KV cache, split over the engine's GPUs
    split = next((t for t in GPU_COUNTS if tp < t <= gpus and share - (whole + engine_profile_bytes(shape, t) / GIB
                                                                          + sequence) / t - graphs > 0), None)
    # The trainer's shards (4P / T at start; with AdamW's moments 12P / T once it has stepped: the step frees its
    # gradients, `src.train.learn`), pi_ref and the CUDA context. Awake throughout, the training plan already left
    # the engine its share.
    pi_ref = reference_bytes(gpus, cell) * shape.parameters / GIB
    startup = cell.master_bytes * shape.parameters / gpus / GIB + pi_ref + CONTEXT_GIB
    resident = 3 * cell.master_bytes * shape.parameters / gpus / GIB + pi_ref + CONTEXT_GIB if engine.sleep else 0.0
    return GenerationPlan(share, weights, share - weights - profile - graphs, resident,
                          cell.master_bytes * shape.parameters / GIB, cell.master_bytes * shape.largest / GIB, split,
                          profile, graphs, context, sequence / tp, startup)


def job_plan_lines(names: list[str], gpus: int, engine: EngineShare | None = None, cell: Cell = Cell(),
                   nodes: int = 1) -> list[str]:
    """The memory plan of each distinct policy in `names` that has a written architecture, trained data-parallel
    over `gpus` GPUs (the job's trainer ranks, on `nodes` nodes: the host memory counts a node's) with the cell's
    settings, with each rank's vLLM engine (`engine`) when it has one."""
    lines = []
    for name in sorted(set(names)):
        if not (SHAPES / f"{name.replace('/', '__')}.json").is_file():
            continue  # the tiny policy or a local folder: nothing to plan
        shape = policy_shape(name)
        room = engine.training_gib(H100_GIB) if engine else H100_GIB
        peak = peak_gib(shape, gpus, cell)
        where = (f"memory plan: {name} trained data-parallel (FSDP) over the job's {gpus} GPU(s)"
                 + (f" on {nodes} nodes" if nodes > 1 else ""))
        fits = (f"training {peak:.1f} GiB per GPU of {room:.1f} at {describe(cell)}" if peak <= room else
                f"does not fit, training needs {peak:.1f} GiB per GPU of {room:.1f} at {describe(cell)}; "
                + (f"fits with {fix}" if (fix := cell_fix(shape, gpus, cell, room)) else "no setting of it fits"))
        host = f"{host_gib(shape, gpus // nodes, engine):.0f} GiB" + (" a node" if nodes > 1 else "")
        lines.append(f"{where}: {fits}; host: {host} (each rank loads it in fp32"
                     + ("; a sleeping engine pins its bf16 weights there)" if engine and engine.sleep else ")"))
        if engine is not None:
            lines.append(generation_line(name, generation_plan(shape, gpus, engine, cell), gpus, engine))
    return lines


def generation_line(name: str, plan: GenerationPlan, gpus: int, engine: EngineShare) -> str:
    when = ("asleep while training (weights to pinned host memory, KV cache freed), awake beside the trainer's "
            f"{plan.resident:.1f} GiB" if engine.sleep else "awake throughout, beside the training")
    problem = plan.problem(H100_GIB)
    tp, engines = engine.tensor_parallel, max(1, gpus // engine.tensor_parallel)
    where = (f"a vLLM engine on each of the {gpus} GPU(s)" if tp == 1 else
             f"{engines} vLLM engine(s), each split over {tp} GPUs (tensor parallelism)")
    return (f"generation plan: {name}: {where}, each sampling 1/{engines} of every "
            f"step's groups: {plan.share:.1f} GiB per GPU (bf16 weights {plan.weights:.1f}, profiling peak "
            f"{plan.profile:.1f}, CUDA graphs {plan.graphs:.1f}, KV cache {plan.kv_cache:.1f}: {plan.sequences} "
            f"sequences of max_model_len {plan.max_model_len}), started beside the trainer's {plan.startup:.1f} GiB, "
            f"{when}; weight sync per step: {plan.sync:.1f} GiB gathered on each rank, one tensor at a time "
            f"(largest {plan.sync_peak:.2f} GiB)" + (f"; does not fit: {problem}" if problem else ""))


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
