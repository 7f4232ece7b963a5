"""The benchmark scripts run (smoke runs on tiny settings, so they cannot rot between GPU sessions)."""

from __future__ import annotations

import json
import math
import os
import re
import subprocess
import sys

import pytest
import torch

from src.paths import PROJECT_ROOT


@pytest.mark.vllm
@pytest.mark.long  # make test-long (docs/testing.md): a benchmark; its smoke run stays
def test_gpu_step_times_the_vllm_engine_colocated_with_the_trainer(tmp_path):
    """The vLLM phase of `make bench-gpu` on the CPU build: each ratio's generate call, the sync, the step sum."""
    pytest.importorskip("vllm")
    result = subprocess.run([sys.executable, "-m", "benchmarks.gpu_step", "--tiny", "--device", "cpu", "--engine",
                             "vllm", "--vllm-kv-gib", "1", "--response-tokens", "8", "--save", "--results",
                             str(tmp_path)], cwd=PROJECT_ROOT, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]
    saved = json.loads(next(tmp_path.glob("gpu_step_cpu_8.json")).read_text())
    assert saved["engine"]["start_s"] > 0 and saved["engine"]["sync_s"] > 0
    assert [g["seeded"] for g in saved["generation"]] == [True, True, True, False]  # the last: the lever
    for row, generated in zip(saved["rows"], saved["generation"]):
        assert generated["rows"] == row["fresh_groups"] * 2 and 0 < generated["tokens"] <= generated["rows"] * 8
        assert row["step_s"] == pytest.approx(row["generation_s"] + row["sync_s"] + row["update_s"])


def test_gpu_step_benchmark_smoke_run_on_cpu():
    result = subprocess.run([sys.executable, "-m", "benchmarks.gpu_step", "--tiny", "--device", "cpu"],
                            cwd=PROJECT_ROOT, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    lines = result.stdout.splitlines()
    step_table = lines[next(i for i, line in enumerate(lines) if line.startswith("| rho |")):]
    rows = [line for line in step_table if line.startswith("| ") and line[2].isdigit()]
    assert [row.split("|")[1].strip() for row in rows] == ["0", "1", "2"]  # rho = 0, 1, 2
    assert "4/0" in rows[0] and "1/3" in rows[2]  # B_fresh / B_replay at B = 4
    assert any(line.startswith("| HF generate | 2 | fp32+autocast, dynamic KV cache") for line in lines)  # 2 rows


def test_gpu_step_refuses_bad_response_lengths_in_one_line(monkeypatch, capsys):
    from benchmarks import gpu_step

    result = subprocess.run([sys.executable, "-m", "benchmarks.gpu_step", "--tiny", "--device", "cpu",
                             "--response-tokens", "abc"], cwd=PROJECT_ROOT, capture_output=True, text=True, timeout=120)
    assert result.returncode == 2 and "expected whole numbers" in result.stderr and "Traceback" not in result.stderr
    for option, value, why in (("--response-tokens", "256,0", "must be >= 1"),  # the same parser, in this process
                               ("--lengths", "uniform:0:1", "0 < LO <= HI <= 1"),
                               ("--lengths", "normal:0.5:1", "fixed or uniform:LO:HI")):
        monkeypatch.setattr(sys, "argv", ["gpu_step", "--tiny", "--device", "cpu", option, value])
        with pytest.raises(SystemExit) as exited:
            gpu_step.parse_args()
        assert exited.value.code == 2 and why in capsys.readouterr().err


SPREAD = ("--tiny", "--device", "cpu", "--group-size", "8", "--response-tokens", "32", "--lengths", "uniform:0.25:1",
          "--ratios", "0", "--micro-batch-tokens", "1024")


def test_gpu_step_draws_seeded_response_lengths_from_the_spread():
    from benchmarks.gpu_step import response_lengths

    lengths = response_lengths(1000, 32, (0.25, 1.0), torch.Generator().manual_seed(0))
    assert min(lengths) == 8 and max(lengths) == 32 and 19 < sum(lengths) / 1000 < 21
    assert lengths == response_lengths(1000, 32, (0.25, 1.0), torch.Generator().manual_seed(0))
    assert response_lengths(3, 32, None, torch.Generator()) == [32, 32, 32]


@pytest.mark.slow
@pytest.mark.long  # make test-long (docs/testing.md): the suite runs its smoke run
def test_gpu_step_spread_lengths_show_real_and_computed_tokens_padded_and_packed():
    """Seeded response lengths between 0.25 and 1 x 32 tokens: the real tokens, and what the micro-batches compute
    (two runs of the benchmark, 10-30 s each here, most of it HF generate)."""
    counted = {}
    for pack in ((), ("--pack",)):
        result = subprocess.run([sys.executable, "-m", "benchmarks.gpu_step", *SPREAD, *pack], cwd=PROJECT_ROOT,
                                capture_output=True, text=True, timeout=300)
        assert result.returncode == 0, result.stderr[-3000:]
        line = next(line for line in result.stdout.splitlines() if line.startswith("tokens: "))
        counted[bool(pack)] = line
    # 4 groups of 8 rows, prompts of 8 tokens: padded, two length-sorted micro-batches of rows x longest row;
    # packed, one micro-batch whose short rows share lanes as long as its longest row.
    assert counted[False].startswith("tokens: 892 real, 1,228 computed in 2 micro-batches (27.4% padding)")
    assert counted[True].startswith("tokens: 892 real, 1,040 computed in 1 micro-batches (14.2% padding)")


def test_the_vllm_phase_prompts_are_one_id_a_word_at_the_full_vocabulary():
    """Each prompt word is one id, so the engine's context (prompt + response + 16) holds every prompt: special
    tokens that prefixed other words once cut 128-word prompts into up to 194 ids on the card."""
    from benchmarks.vllm_phase import prompts, word_tokenizer

    vocab = 151_936  # Qwen2.5's
    tokenizer = word_tokenizer(vocab)
    texts = prompts(64, 128, vocab, torch.Generator().manual_seed(2))
    for text in texts:
        ids = tokenizer(text)["input_ids"]
        assert len(ids) == 128 and tokenizer.decode(ids) == text
    assert tokenizer.eos_token_id == vocab - 1 and tokenizer.pad_token_id == 0


def test_async_vs_sync_overlap_is_the_share_of_the_shorter_role_hidden():
    """1 when a step takes the slower role alone, 0 when it takes both in turn; the workers' busy seconds come back
    from the pipeline's running rates and idle share."""
    from benchmarks.async_vs_sync import overlap, workers_busy

    roles = {"train": 10.0, "generate": 6.0}  # over 10 updates: 1.0 s and 0.6 s an update
    assert overlap(10.0, 10, roles) == pytest.approx(1.0)
    assert overlap(16.0, 10, roles) == pytest.approx(0.0)
    assert overlap(13.0, 10, roles) == pytest.approx(0.5)
    assert math.isnan(overlap(13.0, 10, {"train": 10.0, "generate": 0.0}))  # no worker seconds: no share to give
    # 40 rollouts at 4/s: 10 s of wall; 2 workers idle a quarter of it: 15 busy seconds
    metrics = {"runtime/generated_rollouts": 40.0, "time/rollouts_per_s": 4.0, "time/idle_workers": 0.25}
    assert workers_busy(metrics, 2) == pytest.approx(15.0)


def test_async_vs_sync_summary_takes_each_runtimes_median_and_range_over_rounds():
    """Rounds of every runtime in turn (--repeats): the table gives each runtime's median over rounds, the range
    of its ratio to sync and of the share it hid, and how many rounds it read. The command's own test runs one."""
    import argparse

    from rich.console import Console

    from benchmarks.async_vs_sync import gains, summary

    args = argparse.Namespace(groups=2, group_size=2, steps=4, lifo_batches=2)
    phases = {"train": 4.0, "generate": 2.0}  # 1.0 s and 0.5 s a step: fully overlapped, 1.5x the sync rate
    rounds = []
    for sync_s, lifo_s, hidden in ((6.0, 5.0, 0.2), (6.0, 4.0, 0.6), (6.0, 4.5, 0.5)):
        rows = {"sync, 1 thread": (sync_s, 4, 16), "async lifo, W=1 T=1 free": (lifo_s, 4, 16)}
        rounds.append((rows, gains(rows, phases, 4), {"async lifo, W=1 T=1 free": hidden}))
    assert rounds[0][1]["ideal"] == pytest.approx(1.5) and rounds[1][1]["async lifo, W=1 T=1 free"] == pytest.approx(1.5)
    console = Console(record=True, width=200)
    console.print(summary(args, rounds))
    text = console.export_text()
    assert "LIFO of 2 B, median of 3 rounds" in text, text
    lifo = next(line for line in text.splitlines() if "async lifo" in line)
    # ratios 1.20, 1.50, 1.33: median 1.33x, range 1.20-1.50x; shares of the 0.5 possible: 40 %, 100 %, 67 %
    assert re.search(r"1\.33x .*1\.20-1\.50x .*67% .*50% \(20%-60%\)", lifo), lifo
    assert "the slower synchronous phase alone allows 1.50x (1.50-1.50x)" in text, text


PROBE = "python -m benchmarks.vllm_probe --tiny --device cpu --waves 8,16 --response-tokens 8 --prompt-tokens 16 " \
        "--json probe.json"  # docs/benchmarks.md's rehearsal, as typed


@pytest.mark.slow  # one vLLM engine start on the CPU
@pytest.mark.vllm  # in .venv-vllm, with the CPU build of vLLM
def test_the_vllm_probe_times_each_variant_of_a_wave_and_profiles_one_call(tmp_path):
    """One engine, each variant's call of each wave (the same tokens whatever the variant: every sequence runs to
    its length), and the profiled call's functions after the first wave, as docs/benchmarks.md types it for the
    CPU."""
    words = PROBE.split()
    done = subprocess.run([sys.executable, *words[1:]], cwd=tmp_path, capture_output=True, text=True, timeout=600,
                          env={**os.environ, "PYTHONPATH": str(PROJECT_ROOT)})
    assert done.returncode == 0, (done.stdout + done.stderr)[-3000:]
    figures = json.loads((tmp_path / "probe.json").read_text())
    assert figures["engine_start_s"] > 0 and sorted(figures["waves"]) == ["16", "8"]
    for wave, variants in figures["waves"].items():
        assert list(variants) == ["project", "unseeded", "token_stop", "gc_frozen"]
        assert {row["tokens"] for row in variants.values()} == {int(wave) * 8}, variants
        assert all(row["seconds"] > 0 and row["tokens_per_s"] > 0 for row in variants.values())
    profiled = figures["profile"]
    assert profiled["sequences"] == 8, "the profile follows the first wave, so a probe cut short still has one"
    assert "generate" in " ".join(row["function"] for row in profiled["functions"][:5])
    assert len(profiled["functions"]) == 25
    assert "16 sequences x 8 tokens: tokens/s project" in done.stdout


def test_the_vllm_probe_refuses_a_wave_that_is_not_whole_groups():
    done = subprocess.run([sys.executable, "-m", "benchmarks.vllm_probe", "--waves", "12"], cwd=PROJECT_ROOT,
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 2 and "--waves=12: each wave is prompts x 8 samples" in done.stderr
    assert "Traceback" not in done.stderr


def test_a_vllm_probe_stopped_after_its_first_wave_keeps_that_wave_and_its_profile(tmp_path, monkeypatch):
    """The lease stops the probe at its limit (launch/gpu_lease.py): the figures are written after every wave, so
    what was measured before the stop comes back. The engine is a stand-in; the second wave never ends."""
    from benchmarks import vllm_probe

    calls = []

    def one_call(engine, variant, wave, args, profile=None):
        calls.append((variant, wave))
        if wave == 16:
            raise KeyboardInterrupt  # the limit's signal, in the second wave
        if profile is not None:
            profile.enable()
            sum(range(1000))
            profile.disable()
        return {"seconds": 1.0, "sequences": wave, "tokens": wave * 8, "tokens_per_s": wave * 8.0}

    monkeypatch.setattr(vllm_probe, "start_engine", lambda args: (object(), 12.5))
    monkeypatch.setattr(vllm_probe, "one_call", one_call)
    target = tmp_path / "probe.json"
    with pytest.raises(KeyboardInterrupt):
        vllm_probe.main(["--waves", "8,16", "--json", str(target)])
    figures = json.loads(target.read_text())
    assert list(figures["waves"]) == ["8"] and list(figures["waves"]["8"]) == list(vllm_probe.VARIANTS)
    assert figures["profile"]["sequences"] == 8 and figures["engine_start_s"] == 12.5
    assert ("project", 16) in calls and ("unseeded", 16) not in calls
