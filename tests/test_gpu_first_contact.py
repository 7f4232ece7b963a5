"""The multi-GPU path's first-contact failures, emulated on the CPU (issue: the GPU path right before it meets a GPU).

What a CPU cannot run (NCCL, several GPUs, vLLM's CUDA executor) is read from the arguments the code hands to
torch and vLLM, and checked against torch's own parsing of them.
"""

from __future__ import annotations

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
