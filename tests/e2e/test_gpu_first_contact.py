"""The multi-GPU path's first-contact failures, emulated on the CPU (issue: the GPU path right before it meets a GPU).

What a CPU cannot run (NCCL, several GPUs, vLLM's CUDA executor) is read from the arguments the code hands to
torch and vLLM, and checked against torch's own parsing of them.
"""

from __future__ import annotations

import sys
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist
from torch.distributed.distributed_c10d import BackendConfig

from src.runs import ranks as ranks_module
from src.runtime import ray_work


@pytest.fixture
def captured_group(monkeypatch):
    """`init_process_group`'s arguments, the group itself not made (no NCCL on a CPU machine)."""
    calls: list[dict] = []
    monkeypatch.setattr(dist, "is_initialized", lambda: False)
    monkeypatch.setattr(dist, "init_process_group", lambda *args, **kwargs: calls.append({"args": args, **kwargs}))
    monkeypatch.setattr(torch.cuda, "set_device", lambda device: calls.append({"set_device": device}))
    return calls


def backend_map(call: dict) -> dict[str, str]:
    backend = call.get("backend", call["args"][0] if call["args"] else None)
    return {device: str(name) for device, name in BackendConfig(backend).get_device_backend_map().items()}


def test_torchrun_ranks_on_gpus_reduce_cpu_tensors_through_gloo(captured_group, monkeypatch):
    monkeypatch.setenv("WORLD_SIZE", "4")
    monkeypatch.setenv("RANK", "3")
    monkeypatch.setenv("LOCAL_RANK", "3")
    ranks_module.join(4, "cuda")
    group = [call for call in captured_group if "args" in call][-1]
    # Ranks.most, RankReducer.agree and first_row reduce CPU tensors every step: an NCCL-only group refuses them.
    assert backend_map(group) == {"cpu": "gloo", "cuda": "nccl"}
    assert group["device_id"] == torch.device("cuda", 3)
    assert {"set_device": 3} in captured_group


def test_async_trainer_ranks_on_gpus_reduce_cpu_tensors_through_gloo(captured_group):
    device = ray_work.join_trainer_ranks("cuda:2", rank=1, world=2, rendezvous="tcp://127.0.0.1:1")
    group = [call for call in captured_group if "args" in call][-1]
    assert device == "cuda:3"
    assert backend_map(group) == {"cpu": "gloo", "cuda": "nccl"}
    assert group["device_id"] == torch.device("cuda", 3)


def test_an_async_trainer_rank_with_a_gpu_from_ray_trains_on_the_one_it_sees(captured_group):
    # On a cluster of several nodes Ray gives each rank one GPU (CUDA_VISIBLE_DEVICES): cuda:0 whatever its rank.
    device = ray_work.join_trainer_ranks("cuda:0", rank=5, world=8, rendezvous="tcp://10.0.0.1:1", own_gpu=True)
    group = [call for call in captured_group if "args" in call][-1]
    assert device == "cuda:0" and group["device_id"] == torch.device("cuda", 0)
    assert {"set_device": "cuda:0"} in captured_group


@pytest.mark.parametrize("device", ["cpu", "cuda"])
def test_a_rank_waits_longer_than_torchs_ten_minutes_for_rank_0s_save(captured_group, monkeypatch, device):
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("RANK", "1")
    monkeypatch.setenv("LOCAL_RANK", "1")
    ranks_module.join(2, device)
    group = [call for call in captured_group if "args" in call][-1]
    assert group.get("timeout", timedelta(minutes=10)) >= timedelta(minutes=30)


def test_cpu_ranks_keep_gloo_alone(captured_group, monkeypatch):
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("LOCAL_RANK", "0")
    ranks_module.join(2, "cpu")
    group = [call for call in captured_group if "args" in call][-1]
    assert set(backend_map(group).values()) == {"gloo"}
    assert "device_id" not in group and not any("set_device" in call for call in captured_group)


# --------------------------------------------------------------------------- vLLM under ranks (stand-in vLLM)
from tests.unit.test_vllm_engine import FakeLLM, fake_vllm, policy, prompts  # noqa: E402,F401  (fixtures)
from src.rollout.engine import build_engine  # noqa: E402
from src.rollout.interface import SamplingParams  # noqa: E402


@pytest.fixture
def four_ranks(monkeypatch):
    """This process as rank 3 of 4 torchrun ranks (no group is made: only the engine's options are read)."""
    monkeypatch.setattr(dist, "is_initialized", lambda: True)
    monkeypatch.setattr(dist, "get_world_size", lambda group=None: 4)
    monkeypatch.setattr(dist, "get_rank", lambda group=None: 3)


@pytest.mark.parametrize("tp", [1, 2, 4])
def test_each_ranks_engine_is_its_own_on_its_own_gpu_at_every_tensor_parallel_size(fake_vllm, policy, four_ranks,
                                                                                   tp):
    model, tokenizer = policy
    build_engine("vllm", model, tokenizer, batch_size=8, seed=7, tensor_parallel_size=tp)
    options = FakeLLM.instances[-1].kwargs
    # external_launcher: the worker takes LOCAL_RANK's GPU (the uni-process executor would take GPU 0 on every rank)
    assert options["distributed_executor_backend"] == "external_launcher"
    assert options["tensor_parallel_size"] == tp
    # No vLLM data parallelism: engines do not step in lockstep, so a rank with nothing to sample cannot hang them.
    assert options.get("data_parallel_size", 1) == 1
    assert options["seed"] == 7 + 3 // tp  # each engine its own seed; the ranks of one engine share it


def test_one_process_keeps_vllms_own_executor_and_the_seed(fake_vllm, policy):
    model, tokenizer = policy
    build_engine("vllm", model, tokenizer, batch_size=8, seed=7)
    options = FakeLLM.instances[-1].kwargs
    assert "distributed_executor_backend" not in options and options["seed"] == 7


def test_vllms_context_is_the_prompt_allowance_plus_the_runs_response_tokens(fake_vllm, policy):
    from src.rollout.vllm_engine import PROMPT_TOKENS

    model, tokenizer = policy
    model.config.max_position_embeddings = 131072  # Qwen2.5-7B's own context, which vLLM would take
    build_engine("vllm", model, tokenizer, batch_size=8, max_new_tokens=1024)
    assert FakeLLM.instances[-1].kwargs["max_model_len"] == PROMPT_TOKENS + 1024 == 2048
    build_engine("vllm", model, tokenizer, batch_size=8, max_new_tokens=1024, max_model_len=4096)
    assert FakeLLM.instances[-1].kwargs["max_model_len"] == 4096  # an explicit setting stands
    model.config.max_position_embeddings = 512
    build_engine("vllm", model, tokenizer, batch_size=8, max_new_tokens=1024)
    assert FakeLLM.instances[-1].kwargs["max_model_len"] == 512  # never past the model's own


def test_a_prompt_that_leaves_no_room_for_the_response_is_refused_in_one_line(fake_vllm, policy):
    model, tokenizer = policy
    engine = build_engine("vllm", model, tokenizer, batch_size=8, max_model_len=64)
    sampling = SamplingParams(temperature=1.0, top_p=1.0, top_k=None, max_new_tokens=60)
    with pytest.raises(ValueError, match=r"set policy.vllm.max_model_len to at least \d+") as refused:
        engine.generate(prompts(2), 2, sampling, seed=0)
    assert "\n" not in str(refused.value)
    assert not FakeLLM.instances[-1].requests  # refused before vLLM saw it


class ReseedingLLM(FakeLLM):
    """vLLM's worker at start: `set_random_seed(engine seed)` on random, numpy and torch (vllm/utils/torch_utils.py)."""

    def __init__(self, model, **kwargs):
        import random

        import numpy

        random.seed(kwargs["seed"])
        numpy.random.seed(kwargs["seed"])
        torch.manual_seed(kwargs["seed"])
        super().__init__(model, **kwargs)


def test_building_an_engine_leaves_the_trainers_random_generators_as_they_were(fake_vllm, policy):
    import random

    import numpy

    fake_vllm.LLM = ReseedingLLM
    model, tokenizer = policy
    torch.manual_seed(1234)
    random.seed(1234)
    numpy.random.seed(1234)
    want = (torch.rand(3), random.random(), numpy.random.rand())
    torch.manual_seed(1234)
    random.seed(1234)
    numpy.random.seed(1234)
    build_engine("vllm", model, tokenizer, batch_size=8, seed=0)
    assert torch.equal(torch.rand(3), want[0])
    assert (random.random(), numpy.random.rand()) == want[1:]


# --------------------------------------------------------------------------- one sleep a step
def test_the_step_puts_its_engine_to_sleep_once_before_it_trains(random_policy_dir, compose_config):
    """Each vLLM sleep and wake copies the engine's weights across (14 GiB each way at 7B): a step releases the
    engine once, after its generation and before its first update (the engine's own test has a step generate
    twice with no sleep between: tests/unit/test_vllm_engine.py)."""
    from tests.unit.test_train import make_parts, small_config
    from src.batch import TrainState
    from src.train import train_step

    cfg = small_config(compose_config, "buffer=fifo", "buffer.extra_updates=1")
    parts, events = make_parts(random_policy_dir, cfg), []
    engine, update = parts.engine, parts.trainer.update

    class Recorded:
        def generate(self, *args, **kwargs):
            events.append("generate")
            return engine.generate(*args, **kwargs)

        def sleep(self):
            events.append("sleep")

        def sync_weights(self, model):
            events.append("sync")
            engine.sync_weights(model)

    def recorded_update(*args):
        events.append("update")
        return update(*args)

    parts.sampling.engine = parts.engine = Recorded()
    parts.trainer.update = recorded_update
    state = TrainState()
    train_step(parts, state)
    assert events == ["generate", "sleep", "update", "sync"]
    del events[:]
    train_step(parts, state)  # the fifo buffer's extra update (R = 2) trains under the same sleep
    assert events == ["generate", "sleep", "update", "update", "sync"]


@pytest.mark.parametrize("joined", [True, False])
def test_one_rank_under_torchrun_hosts_the_store_of_its_engines_own_group(joined):
    """vLLM 0.26's engine in one torchrun process makes its own tcp:// group; torchrun's agent-store setting made
    that process a client of a store nobody hosts, and on an H200 it waited ten minutes. After `join` the group
    forms; without it (the negative control) it fails at the probe's 5 s timeout."""
    import subprocess

    from src.paths import PROJECT_ROOT

    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "1",
               "tests/one_rank_store.py", "join" if joined else "none"]
    done = subprocess.run(command, cwd=PROJECT_ROOT, capture_output=True, text=True, timeout=120)
    assert ("group made" in done.stdout) is joined and (done.returncode == 0) is joined, done.stderr[-2000:]
