"""The vLLM rollout engine (`policy.engine=vllm`): fast sampling colocated with the trainer on one GPU.

vLLM runs inside the training process (`vllm.LLM`, no server), on the training GPU, with a
configurable share of its memory (`gpu_memory_utilization`; the trainer's weights, optimizer
and activations live in the rest), bf16 weights and prefix caching on. It implements the
`RolloutEngine` protocol, so the trainer is unchanged:

- `generate` tokenises the prompts with the trainer's tokenizer and hands vLLM the token ids
  (so the prompt ids the trainer scores are the ones vLLM conditioned on), makes one
  `LLM.generate` call with `n = samples_per_prompt`, and returns each response's token ids as
  sampled (never re-tokenised) with the text the trainer's tokenizer decodes from them, grouped
  per prompt in prompt order: the same `Generation` as `HFGenerateEngine`. Sampling stops at
  EOS/pad or after the token that completes `</answer>` (kept in the response), as there.
- `sync_weights` copies the trainer's current parameters into vLLM's model in place (the
  model's own `load_weights`, run inside the vLLM worker through `LLM.apply_model`; no reload
  from disk, no new engine), then resets the prefix cache, whose KV blocks were computed with
  the old weights. The engine calls it once at construction too: the trainer's policy may
  already differ from the folder vLLM loads (a resumed run, `evaluate --checkpoint`).

Supported vLLM: `SUPPORTED_VLLM` below (>=0.27,<0.33). Every release in that range pins
torch==2.13.0, the torch the project pins for its CPU path, and needs transformers 5, which
the project's tokenizer loading relies on. The internal paths this module uses were read in
the 0.27.0 and 0.32.0 wheels: `LLM.apply_model(fn)` -> engine `collective_rpc("apply_model")`
-> worker `fn(worker.get_model())`; with `VLLM_ENABLE_V1_MULTIPROCESSING=0` the engine core is
an in-process client whose uni-process executor calls `fn` directly, so the trainer's CUDA
tensors are passed by reference (a multi-process engine would have to serialise them).
`LLM.reset_prefix_cache()`, `SamplingParams(top_k=0)` meaning "no top-k", and the n samples
of a request being seeded `seed, seed + 1, ..., seed + n - 1` are the same in both. Targeted
release: 0.32.0 (what `pip install -e .[gpu]` resolves today). This module has not yet run
against a real vLLM on a GPU: `make check-gpu` (benchmarks/check_gpu.py) is that check, and
tests/test_vllm_engine.py checks the contract on CPU against a stand-in vllm module. Outside
the range it refuses to start unless `allow_untested_version=True`
(`policy.vllm.allow_untested_version=true`), which only warns; run `make check-gpu` first.

Reproducibility: each prompt gets its own seed derived from (seed, prompt index), so one call
is reproducible draw for draw. vLLM's logits can still differ in the last bits with batch
composition and prefix-cache hits, so a resumed run is statistically, not bitwise, identical
to the uninterrupted one (unlike the HF engine on a CPU). Seeded requests sample through a
per-request generator, which vLLM handles in a Python loop per decode step;
`per_request_seeds=False` trades that reproducibility for throughput.
"""

from __future__ import annotations

import hashlib
import logging
import os
from typing import Any

import torch
from packaging.specifiers import SpecifierSet
from packaging.version import InvalidVersion, Version
from transformers import PreTrainedModel, PreTrainedTokenizerBase

from src.rollout.engine import STOP_STRING, Completion, Generation, SamplingParams

log = logging.getLogger(__name__)

SUPPORTED_VLLM = ">=0.27,<0.33"
TARGETED_VLLM = "0.32.0"
INSTALL_HINT = "install the GPU extra on a CUDA node (`pip install -e '.[gpu]'`), or use policy.engine=hf"
# Wrapper prefixes that torch.compile and DistributedDataParallel put in front of parameter names.
WRAPPER_PREFIXES = ("_orig_mod.", "module.")


class VLLMUnavailableError(RuntimeError):
    """vLLM is missing or outside the supported range; the message names the version and the fix."""


def import_vllm(allow_untested_version: bool = False):
    """Import vLLM and check its version against `SUPPORTED_VLLM`, or raise `VLLMUnavailableError`."""
    try:
        import vllm
    except ImportError as error:
        raise VLLMUnavailableError(
            f"policy.engine=vllm needs vLLM {SUPPORTED_VLLM} (targeted: {TARGETED_VLLM}), but vLLM is not "
            f"installed here ({error}): {INSTALL_HINT}"
        ) from error
    installed = getattr(vllm, "__version__", "unknown")
    try:
        supported = SpecifierSet(SUPPORTED_VLLM).contains(Version(installed), prereleases=True)
    except InvalidVersion:
        supported = False
    if not supported:
        message = (f"vLLM {installed} is installed, but this engine supports vLLM {SUPPORTED_VLLM} "
                   f"(targeted: {TARGETED_VLLM}); vLLM's internal APIs move between releases")
        if not allow_untested_version:
            raise VLLMUnavailableError(
                f"{message}. Fix: {INSTALL_HINT}; or set policy.vllm.allow_untested_version=true "
                "after `make check-gpu` passes with this version"
            )
        log.warning("%s; going on because allow_untested_version is set", message)
    return vllm


def request_seed(seed: int, prompt_index: int) -> int:
    """The seed of one prompt's request: vLLM seeds its n samples seed, seed+1, ..., so prompts need far-apart bases."""
    digest = hashlib.blake2b(f"{seed}:{prompt_index}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "big") >> 2  # 62 bits: seed + n stays a valid int64 and torch seed


def trainer_weights(model: torch.nn.Module) -> list[tuple[str, torch.Tensor]]:
    """The trainer's parameters under their checkpoint names, which is what vLLM's `load_weights` expects.

    `named_parameters()` lists a tied embedding once (as the input embedding), and vLLM ties its
    LM head to that same tensor. Buffers are left out: vLLM computes its own (e.g. rotary tables).
    """
    weights = []
    for name, parameter in model.named_parameters():
        while name.startswith(WRAPPER_PREFIXES):
            name = name.split(".", 1)[1]
        weights.append((name, parameter.detach()))
    return weights


def _model_path(model: PreTrainedModel) -> str:
    """The folder or hub name the trainer's model was loaded from (vLLM builds its own copy from it)."""
    path = getattr(model, "name_or_path", "") or getattr(getattr(model, "config", None), "_name_or_path", "")
    if not path:
        raise ValueError("the vLLM engine starts from the policy's folder or hub name, but this model has none: "
                         "load it with from_pretrained (src.policy.model.load_policy) or pass model_path=")
    return str(path)


class VLLMEngine:
    """Sampling with an in-process `vllm.LLM` on the trainer's GPU; weights synced in place after each step."""

    def __init__(self, model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase, *,
                 gpu_memory_utilization: float = 0.3, enforce_eager: bool = False, dtype: str = "bfloat16",
                 max_model_len: int | None = None, max_num_seqs: int | None = None, seed: int = 0,
                 per_request_seeds: bool = True, allow_untested_version: bool = False,
                 model_path: str | None = None):
        vllm = import_vllm(allow_untested_version)
        self._vllm = vllm
        self.tokenizer = tokenizer
        self.per_request_seeds = per_request_seeds
        # Stop where HFGenerateEngine stops: the trainer's EOS and pad ids (vLLM adds its own EOS too).
        self.stop_token_ids = sorted({tokenizer.eos_token_id, tokenizer.pad_token_id} - {None})
        # Weight sync hands the trainer's CUDA tensors to the vLLM worker by reference, which needs
        # the engine core in this process. vLLM reads this when the engine starts.
        if os.environ.get("VLLM_ENABLE_V1_MULTIPROCESSING", "0") != "0":
            log.warning("VLLM_ENABLE_V1_MULTIPROCESSING is set; the colocated vLLM engine needs it off, setting 0")
        os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
        options: dict[str, Any] = dict(
            dtype=dtype,
            gpu_memory_utilization=gpu_memory_utilization,
            enforce_eager=enforce_eager,
            enable_prefix_caching=True,  # the K samples of a prompt, and replayed prompts, share its KV blocks
            seed=seed,
        )
        if max_model_len is not None:
            options["max_model_len"] = max_model_len
        if max_num_seqs is not None:
            options["max_num_seqs"] = max_num_seqs
        self.llm = vllm.LLM(model=model_path or _model_path(model), **options)
        self._check_in_process()
        self.sync_weights(model)  # the trainer's policy may already differ from the folder's weights

    def _check_in_process(self) -> None:
        """Refuse an engine core in another process (vLLM caches its settings once an engine has started)."""
        client = getattr(getattr(self.llm, "llm_engine", None), "engine_core", None)
        if client is not None and type(client).__name__ != "InprocClient":
            raise RuntimeError(
                f"vLLM started its engine core out of process ({type(client).__name__}); the colocated engine "
                "syncs weights by reference and needs VLLM_ENABLE_V1_MULTIPROCESSING=0 before vLLM first starts "
                "in this process"
            )

    def sync_weights(self, model: torch.nn.Module) -> None:
        """Copy the trainer's current weights into vLLM's model in place, then drop KV blocks made with the old ones."""
        weights = trainer_weights(model)

        def load(vllm_model: torch.nn.Module) -> int:
            # Runs inside the vLLM worker: the model's own loader maps checkpoint names onto vLLM's
            # fused layout (qkv_proj, gate_up_proj) and copies into the existing tensors, so CUDA
            # graphs captured on them stay valid.
            return len(vllm_model.load_weights(weights) or ())

        loaded = self.llm.apply_model(load)
        if not any(loaded):
            raise RuntimeError(f"vLLM's load_weights took none of the trainer's {len(weights)} tensors")
        if self.llm.reset_prefix_cache() is False:
            raise RuntimeError("vLLM could not reset its prefix cache after a weight sync (requests still running?); "
                               "cached KV blocks from the old weights would be reused")

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

    def generate(self, prompts: list[str], samples_per_prompt: int, sampling: SamplingParams, seed: int) -> Generation:
        """Sample `samples_per_prompt` responses per prompt in one vLLM call; seeded per prompt from `seed`."""
        prompt_ids = [tuple(self.tokenizer(prompt, add_special_tokens=False)["input_ids"]) for prompt in prompts]
        if not prompts:
            return Generation(prompt_ids=[], completions=[])
        requests = [{"prompt_token_ids": list(ids)} for ids in prompt_ids]
        params = [self.sampling_params(sampling, samples_per_prompt,
                                       request_seed(seed, index) if self.per_request_seeds else None)
                  for index in range(len(prompts))]
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
        return Generation(prompt_ids=prompt_ids, completions=completions)
