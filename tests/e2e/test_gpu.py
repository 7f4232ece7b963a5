"""Checks that need a CUDA GPU (`make test-gpu`, i.e. `pytest -m gpu`); skipped where there is none, CI included.

Results of the last run on a GPU are recorded in benchmarks/results/README.md.
"""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch

from src.paths import PROJECT_ROOT

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]


def needs_vllm() -> None:
    from src.rollout.vllm_engine import vllm_problem

    problem = vllm_problem()
    if problem is not None:
        pytest.skip(problem)


def run_module(*args: str, timeout: int = 900) -> subprocess.CompletedProcess:
    result = subprocess.run([sys.executable, "-m", *args], capture_output=True, text=True, timeout=timeout,
                            cwd=PROJECT_ROOT)
    print(result.stdout[-4000:], result.stderr[-4000:])
    return result


# First the check without an engine: each vLLM test starts one (about a minute), so a lease stage's limit that
# cuts the run short still leaves this one's outcome.
def test_the_trainers_logprobs_on_the_gpu_equal_the_cpus_plain_and_fused():
    from transformers import Qwen2Config, Qwen2ForCausalLM

    from src.policy.forward import response_token_stats

    torch.manual_seed(0)
    config = Qwen2Config(vocab_size=512, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=True)
    model = Qwen2ForCausalLM(config).eval()
    generator = torch.Generator().manual_seed(1)
    sequences = [(torch.randint(3, 512, (int(n),), generator=generator).tolist(),
                  torch.randint(3, 512, (int(m),), generator=generator).tolist())
                 for n, m in zip(torch.randint(4, 20, (6,), generator=generator),
                                 torch.randint(1, 30, (6,), generator=generator))]
    with torch.no_grad():
        on_cpu, _, mask = response_token_stats(model, sequences, 0, with_entropy=False)
        model.cuda()
        for fused in (False, True):
            on_gpu, _, gpu_mask = response_token_stats(model, sequences, 0, with_entropy=False, fused=fused)
            assert torch.equal(gpu_mask.cpu(), mask)
            gap = (on_gpu.cpu() - on_cpu)[mask].abs().max().item()
            assert gap < 1e-4, f"fused={fused}: |log-prob gap| {gap}"


def test_the_vllm_engine_on_the_gpu_samples_syncs_weights_in_place_and_matches_the_trainers_logprobs():
    needs_vllm()
    result = run_module("benchmarks.check_engine", "--device", "cuda")
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    for check in ("generate", "log-probs", "sync"):
        assert check in result.stdout.lower()
    assert "FAIL" not in result.stdout


def test_the_step_benchmark_times_every_phase_with_vllm_colocated(tmp_path):
    needs_vllm()
    result = run_module("benchmarks.gpu_step", "--tiny", "--engine", "vllm", "--enforce-eager",
                        "--response-tokens", "8,16", "--save", "--results", str(tmp_path))
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    for tokens in (8, 16):
        saved = json.loads(next(tmp_path.glob(f"gpu_step_*_{tokens}.json")).read_text())
        assert saved["engine"]["start_s"] > 0 and saved["engine"]["sync_s"] > 0
        assert [row["rho"] for row in saved["rows"]] == [0.0, 1.0, 2.0]
        assert [g["seeded"] for g in saved["generation"]] == [True, True, True, False]  # the last: the lever
        for row, generated in zip(saved["rows"], saved["generation"]):
            assert generated["engine"] == "vllm" and generated["rows"] == row["fresh_groups"] * 2
            assert 0 < generated["tokens"] <= generated["rows"] * tokens
            assert row["step_s"] == pytest.approx(row["generation_s"] + row["sync_s"] + row["update_s"])
