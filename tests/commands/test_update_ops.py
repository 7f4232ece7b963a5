"""The update shaped for the card: no host sync in the micro-batch loop, bf16 compute weights cast once
per update with fp32 master weights, the fused head in the compiled region, and the counts of
`benchmarks.update_ops` against the plain reference loop."""

from __future__ import annotations

import pytest
import torch

from benchmarks import update_ops
from src.batch import Batch, BatchGroup, Group
from src.loss.rloo import RlooObjective
from src.loss.trainer import Trainer
from src.policy.forward import Forward
from src.policy.model import compile_layers, frozen_copy

TINY = ["--groups", "2", "--group-size", "2", "--prompt", "4", "--response", "4", "--micro", "2", "--layers", "1"]

needs_reference = pytest.mark.skipif(not update_ops.REFERENCE_PATH.is_file(),
                                     reason=f"the plain reference loop is not at {update_ops.REFERENCE_PATH}")


@needs_reference
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_one_update_has_no_host_sync_and_the_plain_loops_casts_and_ops(dtype):
    """The update's targets at a tiny size: no `.item()` and no boolean-mask indexing outside the optimizer step
    (the plain loop has none either), casts and aten ops within 1.5x of the plain loop's."""
    result = update_ops.measure(update_ops.parse([*TINY, "--dtype", dtype]))
    ours, reference = result["ours"], result["reference"]
    assert ours["syncs"] == 0 and ours["nonzero"] == 0
    assert ours["optimizer_syncs"] == reference["optimizer_syncs"]  # AdamW's CPU step counters, alike
    assert result["targets"] == {"syncs": True, "casts": True, "ops": True}, (ours, reference)


def test_a_missing_reference_loop_is_one_line_naming_where_it_was_looked_for(monkeypatch, tmp_path):
    monkeypatch.setattr(update_ops, "REFERENCE_PATH", tmp_path / "update_reference.py")
    with pytest.raises(SystemExit, match="reference loop is missing: expected .*update_reference.py"):
        update_ops.reference_module()


def tiny_update(micro: int, autocast: str | None, fused: bool = True, compile_options=None):
    """(policy, optimizer, result) of one RLOO update of a 1-layer Qwen2 model on 2 groups of 2 (KL on)."""
    policy = update_ops.qwen_model("cpu", torch.float32, layers=1)
    reference = frozen_copy(policy)
    with torch.no_grad():  # pi away from pi_ref, so the KL term has a gradient
        for parameter in policy.parameters():
            parameter.add_(0.02 * torch.randn(parameter.shape, generator=torch.Generator().manual_seed(2)))
    if compile_options is not None:
        compile_layers(policy, **compile_options)
        compile_layers(reference, **compile_options)
    batch = update_ops.synthetic_batch(dict(groups=2, group_size=2, prompt=4, response=3))
    trainer = Trainer(RlooObjective(1.0), Forward(0, micro, autocast=autocast, fused=fused), kl_coef=0.05,
                      entropy_coef=0.01)
    optimizer = torch.optim.AdamW(policy.parameters(), lr=1e-3)
    return policy, optimizer, trainer.update(policy, reference, optimizer, batch)


class WeightCasts(torch.utils._python_dispatch.TorchDispatchMode):
    """Counts fp32 -> bf16 casts of tensors shaped like a weight matrix (two dims, none of them the batch's)."""

    def __init__(self, shapes) -> None:
        super().__init__()
        self.shapes, self.count = shapes, 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if func in (torch.ops.aten._to_copy.default, torch.ops.aten.copy_.default):
            source = args[1] if func is torch.ops.aten.copy_.default else args[0]
            target = out
            self.count += (source.dtype == torch.float32 and target.dtype == torch.bfloat16
                           and tuple(source.shape) in self.shapes)
        return out


def test_bf16_compute_weights_are_cast_once_per_update_whatever_the_micro_batches():
    """Under autocast every micro-batch cast each fp32 weight again (4 micro-batches: 4x); the compute copies are
    made once per update, however many micro-batches it has."""
    shapes = {tuple(p.shape) for p in update_ops.qwen_model("cpu", torch.float32, 1).parameters() if p.dim() == 2}
    counts = {}
    for micro in (4, 1):
        policy = update_ops.qwen_model("cpu", torch.float32, layers=1)
        matrices = sum(1 for p in policy.parameters() if p.dim() == 2)
        casts = WeightCasts(shapes)
        with casts:
            tiny_update(micro, "bfloat16")
        counts[micro] = casts.count
    # Each weight matrix once for the policy and once for the reference (the KL term reads it).
    assert counts[1] == counts[4] == 2 * matrices


def relative_error(grads, reference) -> float:
    flat, expected = torch.cat([g.flatten() for g in grads]), torch.cat([g.flatten() for g in reference])
    return float((flat - expected).norm() / expected.norm())


def test_bf16_compute_keeps_fp32_master_weights_gradients_and_optimizer_state():
    """The optimizer steps fp32 weights with fp32 gradients accumulated over the micro-batches; they match one
    micro-batch's and the fp32 update's to bf16 rounding, and so do the update's numbers."""
    policy, optimizer, result = tiny_update(1, "bfloat16")
    whole_policy, _, whole = tiny_update(4, "bfloat16")
    fp32_policy, _, fp32 = tiny_update(1, None)
    for parameter in policy.parameters():
        assert parameter.dtype == torch.float32 and parameter.grad.dtype == torch.float32
        assert all(value.dtype == torch.float32 for value in optimizer.state[parameter].values()
                   if value.dim() > 0)
    grads = [p.grad for p in policy.parameters()]
    assert relative_error(grads, [p.grad for p in whole_policy.parameters()]) < 0.02
    assert relative_error(grads, [p.grad for p in fp32_policy.parameters()]) < 0.02
    assert result.loss == pytest.approx(fp32.loss, rel=0.02) and whole.loss == pytest.approx(fp32.loss, rel=0.02)
    torch.testing.assert_close(result.logprobs, fp32.logprobs, rtol=0.02, atol=0.05)


@pytest.mark.slow
def test_the_fused_head_runs_in_the_compiled_region_and_gives_the_eager_update():
    """`trainer.compile` compiles the fused head (projection, log-probs, entropies) with the layers: a graph with
    the vocabulary's logsumexp is compiled, and the update's numbers are the eager ones (slow: 1-3 min of
    tracing on a 2-core CPU)."""
    torch._dynamo.reset()
    graphs = []
    backend = torch._dynamo.lookup_backend("aot_eager")

    def counting(graph, example_inputs):
        graphs.append(graph)
        return backend(graph, example_inputs)

    eager_policy, _, eager = tiny_update(2, None)
    policy, _, compiled = tiny_update(2, None, compile_options=dict(backend=counting, dynamic=True))
    assert any("logsumexp" in graph.code for graph in graphs)
    assert compiled.loss == pytest.approx(eager.loss, rel=1e-5)
    torch.testing.assert_close(compiled.logprobs, eager.logprobs, rtol=1e-5, atol=1e-5)
    for parameter, reference in zip(policy.parameters(), eager_policy.parameters()):
        torch.testing.assert_close(parameter, reference, rtol=1e-5, atol=1e-6)


@needs_reference
def test_python_m_benchmarks_update_ops_writes_its_figures_as_docs_show(tmp_path):
    """`python -m benchmarks.update_ops --json PATH` as docs/benchmarks.md gives it, at its default small size."""
    import json
    import subprocess
    import sys

    from src.paths import PROJECT_ROOT

    target = tmp_path / "update_ops.json"
    done = subprocess.run([sys.executable, "-m", "benchmarks.update_ops", "--json", str(target)], cwd=PROJECT_ROOT,
                          capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-2000:]
    figures = json.loads(target.read_text())
    assert figures["device"] == "cpu" and figures["size"]["rows"] == 16
    assert all(figures["targets"].values()), figures["targets"]
    assert "MISSED" not in done.stdout and "targets:" in done.stdout
