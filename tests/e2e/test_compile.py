"""`trainer.compile`: decoder layers through torch.compile give the eager update's numbers."""

from __future__ import annotations

import pytest
import torch

from src.settings import RunSettings
from src.batch import Batch, BatchGroup, Group
from src.loss.rloo import RlooObjective
from src.loss.trainer import Trainer
from src.policy.forward import Forward
from src.policy.model import compile_layers, frozen_copy, load_policy


def one_update(policy_dir, pack: bool, **compile_options):
    """Loss, log-probs and gradients of one RLOO update (KL and entropy on), eager or with compiled layers."""
    torch.manual_seed(0)
    policy, _ = load_policy(str(policy_dir), "cpu", "float32")
    reference = frozen_copy(policy)
    with torch.no_grad():  # pi away from pi_ref, so the KL term has a gradient
        for parameter in policy.parameters():
            parameter.add_(0.05 * torch.randn(parameter.shape))
    if compile_options:
        compile_layers(policy, **compile_options)
        compile_layers(reference, **compile_options)
    rows = [(5, 6, 7, 8, 9), (5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16), (7, 8, 9, 10, 11, 12, 13)]
    group = Group(prompt="", prompt_ids=(3, 4), truth={"numbers": [1, 2, 3], "target": 6}, responses=[""] * 3,
                  response_ids=rows, rewards=[1.0, 0.0, 0.1], step=0)
    trainer = Trainer(RlooObjective(3.0), Forward(0, 2, pack=pack), kl_coef=0.05, entropy_coef=0.01)
    result = trainer.update(policy, reference, torch.optim.SGD(policy.parameters(), lr=0.0),
                            Batch([BatchGroup(group, "fresh")]))
    return result, [p.grad.clone() for p in policy.parameters()]


def counting(backend: str, graphs: list):
    """`backend`, noting each graph it compiles (so a test knows the layers did not run eagerly)."""
    compile_graph = torch._dynamo.lookup_backend(backend)

    def compiled(graph, example_inputs):
        graphs.append(graph)
        return compile_graph(graph, example_inputs)

    return compiled


def assert_same_update(a, b) -> None:
    (first, first_grads), (second, second_grads) = a, b
    assert first.loss == pytest.approx(second.loss, rel=1e-5) and first.kl == pytest.approx(second.kl, rel=1e-4)
    torch.testing.assert_close(first.logprobs, second.logprobs, rtol=1e-5, atol=1e-5)
    for x, y in zip(first_grads, second_grads):
        torch.testing.assert_close(x, y, rtol=1e-4, atol=1e-6)


@pytest.mark.parametrize("pack", [False, True])
def test_traced_layers_give_the_eager_update(random_policy_dir, pack):
    """The layers through TorchDynamo and AOTAutograd (backend aot_eager: graph capture, forward and backward,
    without inductor's C++ build), two micro-batches of different shapes, padded and packed."""
    torch._dynamo.reset()
    graphs = []
    assert_same_update(one_update(random_policy_dir, pack),
                       one_update(random_policy_dir, pack, backend=counting("aot_eager", graphs), dynamic=True))
    assert len(graphs) >= 2  # the policy's layer and the reference's (5 here: with and without grad, two shapes)


@pytest.mark.slow
@pytest.mark.long  # make test-long (docs/testing.md): inductor compiles for over a minute on 2 cores
def test_inductor_compiled_layers_give_the_eager_update(random_policy_dir):
    """The knob's own compile (inductor, C++ kernels on the CPU): about 30-60 s here, most of it compiling."""
    torch._dynamo.reset()
    graphs = []
    assert_same_update(one_update(random_policy_dir, True),
                       one_update(random_policy_dir, True, backend=counting("inductor", graphs), dynamic=True))
    assert graphs


def test_trainer_compile_compiles_the_layers_of_policy_and_reference_only(random_policy_dir, compose_config):
    from omegaconf import OmegaConf

    from src.build import build_components
    from src.task import countdown

    cfg = compose_config("trainer.compile=true", "trainer.groups_per_step=2", "trainer.group_size=2",
                         "behaviour=stale", "behaviour.lag=1")
    cfg = OmegaConf.merge(cfg, {"policy": {"name_or_path": str(random_policy_dir)}})
    parts = build_components(RunSettings(cfg), countdown.generate_instances(8, seed=1))
    for model in (parts.policy, parts.reference):
        assert all(layer._compiled_call_impl is not None for layer in model.get_decoder().layers)
    assert parts.behaviour.stale_model.get_decoder().layers[0]._compiled_call_impl is None  # copied before
    assert parts.reference.get_decoder().layers[0] is not parts.policy.get_decoder().layers[0]


@pytest.mark.parametrize("fused", [False, True])
def test_compiled_layers_get_no_kv_cache_and_eager_ones_keep_transformers_default(random_policy_dir, fused):
    """A compiled layer handed a KV cache recompiles on its writes until the recompile limit leaves the rest
    eager: compiled layers score without one. Eager layers keep the default, whose forward has no host sync
    (without a cache transformers checks the positions for packed rows with one: test_update_ops counts)."""
    policy, _ = load_policy(str(random_policy_dir), "cpu", "float32")
    assert policy.config.use_cache  # the saved config asks for a cache
    rows = [((3, 4), (5, 6, 7)), ((3,), (5, 6))]

    def caches_seen() -> list:
        seen = []
        layer = policy.get_decoder().layers[0]
        hook = layer.register_forward_pre_hook(lambda module, args, kwargs: seen.append(kwargs.get("past_key_values")),
                                               with_kwargs=True)
        try:
            Forward(0, 2, fused=fused).token_stats(policy, rows, with_entropy=True)
        finally:
            hook.remove()
        return seen

    eager = caches_seen()
    assert eager and all(cache is not None for cache in eager)
    torch._dynamo.reset()
    compile_layers(policy, backend="eager")
    compiled = caches_seen()
    assert compiled and all(cache is None for cache in compiled)


def test_the_hf_engine_samples_eagerly_from_compiled_layers(random_policy_dir):
    """Generate hands each layer its KV cache: compiled, the layers would recompile at each write until torch's
    recompile limit, which would then leave the update's own shapes eager. The engine samples with them eager."""
    from src.rollout.engine import HFGenerateEngine
    from src.rollout.interface import SamplingParams

    torch._dynamo.reset()
    policy, tokenizer = load_policy(str(random_policy_dir), "cpu", "float32")
    graphs = []
    compile_layers(policy, backend=counting("eager", graphs), dynamic=True)
    sampling = SamplingParams(temperature=1.0, top_p=1.0, top_k=0, max_new_tokens=12, logprobs=True)
    generation = HFGenerateEngine(policy, tokenizer).generate(["1 2 3", "4 5"], 2, sampling, seed=0)
    assert [len(group) for group in generation.completions] == [2, 2] and graphs == []
    Forward(0, 2).token_stats(policy, [((3, 4), (5, 6, 7)), ((3,), (5, 6))], with_entropy=True)
    assert graphs  # the same layers still compile for the update
