"""loss=m2po (src/loss/m2po.py): the second-moment mask and the masked objective against hand-worked numbers,
and one update through the shared trainer."""

from __future__ import annotations

import dataclasses
import math
import threading

import pytest
import torch

from src.loss.m2po import M2po, _Mask, second_moment_mask
from src.loss.reducer import Reducer
from src.loss.trainer import MicroBatch, Totals
from tests.unit.test_train import make_parts, policy_update, sample_groups, small_config

# (log r)^2 of five tokens in two rows; their mean is 0.42 / 5 = 0.084.
ROWS = [torch.tensor([0.0, 0.01, 0.30]), torch.tensor([0.02, 0.09])]


@pytest.mark.parametrize("tau, kept, after", [
    (0.1, [[True, True, True], [True, True]], 0.084),     # 0.084 <= 0.1: nothing masked
    (0.04, [[True, True, False], [True, True]], 0.03),    # without 0.30: 0.12 / 4 = 0.03 <= 0.04
    (0.02, [[True, True, False], [True, False]], 0.01),   # 0.03 > 0.02; without 0.09 too: 0.03 / 3 = 0.01
    (0.001, [[True, False, False], [False, False]], 0.0),  # down to the 0.0 token: 0.01 / 2 = 0.005 > 0.001
])
def test_the_mask_removes_the_largest_squared_log_ratios_until_the_mean_of_the_rest_is_at_most_tau(tau, kept, after):
    mask, diagnostics = second_moment_mask(ROWS, tau, Reducer())
    assert [row.tolist() for row in mask] == kept
    assert diagnostics["m2po/m2_before"] == pytest.approx(0.084)
    assert diagnostics["m2po/m2_after"] == pytest.approx(after, rel=1e-6, abs=1e-12)  # float32 inputs
    assert diagnostics["m2po/masked_frac"] == pytest.approx(1 - sum(map(sum, kept)) / 5)


def test_every_token_is_masked_where_each_alone_exceeds_tau():
    mask, diagnostics = second_moment_mask([torch.tensor([0.5, 0.6])], 0.04, Reducer())
    assert mask[0].tolist() == [False, False] and diagnostics["m2po/masked_frac"] == 1.0


class ThreadRanks(Reducer):
    """Two 'ranks' in two threads: each total and maximum is taken over both, as a collective would."""

    def __init__(self, barrier: threading.Barrier, slots: list, rank: int) -> None:
        self.barrier, self.slots, self.rank = barrier, slots, rank

    def _both(self, value: float, combine) -> float:
        self.slots[self.rank] = value
        self.barrier.wait()
        both = combine(self.slots)
        self.barrier.wait()  # nobody writes the next value before both have read this one
        return both

    def total(self, value: float) -> float:
        return self._both(value, sum)

    def maximum(self, value: float) -> float:
        return self._both(value, max)


def test_ranks_that_hold_parts_of_the_batch_mask_as_the_whole_batch_is_masked():
    barrier, slots, masks = threading.Barrier(2), [0.0, 0.0], {}

    def rank(r: int) -> None:
        masks[r] = second_moment_mask([ROWS[r]], 0.02, ThreadRanks(barrier, slots, r))

    threads = [threading.Thread(target=rank, args=(r,)) for r in (0, 1)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=60)
    whole, diagnostics = second_moment_mask(ROWS, 0.02, Reducer())
    assert [masks[r][0][0].tolist() for r in (0, 1)] == [row.tolist() for row in whole]
    assert masks[0][1] == masks[1][1] == diagnostics


def test_the_objective_is_minus_the_token_mean_of_mask_times_ratio_times_advantage():
    """Two rows (prompt of one token, responses of 3 and 2 tokens), the middle token of row 0 masked."""
    policy = torch.tensor([[-1.0, -2.0, -0.5], [-1.5, -0.7, 0.0]], requires_grad=True)
    mask = torch.tensor([[1.0, 1.0, 1.0], [1.0, 1.0, 0.0]])
    behaviour = torch.tensor([[-1.2, -0.1, -0.5], [-1.5, -1.0, 0.0]])  # mu per token, as the trainer lays it out
    fixed = _Mask(kept=[torch.tensor([True, False, True]), torch.tensor([True, True])], diagnostics={})
    lp = MicroBatch([0, 1], [((7,), (1, 2, 3)), ((7,), (4, 5))], policy, None, None, mask,
                    advantages=torch.tensor([1.0, -0.5]), behaviour_tokens=behaviour,
                    proximal=torch.zeros(2, 3), state=fixed)
    loss = M2po(m2_threshold=0.04, updates_per_step=1)(lp, Totals(rows=2, tokens=5))
    # row 0: e^{0.2} * 1 + (masked) + e^{0} * 1; row 1: e^{0} * -0.5 + e^{0.3} * -0.5
    expected = -(math.exp(0.2) + 1.0 - 0.5 - 0.5 * math.exp(0.3)) / 5
    assert loss.loss.item() == pytest.approx(expected, rel=1e-6)
    loss.loss.backward()
    assert policy.grad[0, 1] == 0.0 and policy.grad[1, 2] == 0.0  # the masked token and the padding
    assert policy.grad[0, 0].item() == pytest.approx(-math.exp(0.2) / 5, rel=1e-6)  # d/dlogpi of r A = r A


def test_an_update_masks_only_the_tokens_of_a_far_stale_replay(random_policy_dir, compose_config):
    """Fresh rows (mu = pi_prox) have log r = 0 and are never masked; a replayed group whose stored mu is far from
    pi has the largest (log r)^2, so its tokens are the ones masked, and the update's numbers are M2PO's."""
    cfg = small_config(compose_config, "loss=m2po", "loss.updates_per_step=2")
    parts = make_parts(random_policy_dir, cfg)
    groups = sample_groups(parts.tokenizer)
    far = [tuple([-20.0] * len(ids)) for ids in groups[1].response_ids]
    groups[1] = dataclasses.replace(groups[1], behaviour_token_logprobs=far)
    fresh = [dataclasses.replace(groups[0], behaviour_logprobs=None)]
    on_policy = policy_update(parts.policy, parts.reference, parts.optimizer, fresh, cfg.trainer, loss_cfg=cfg.loss)
    assert on_policy.extras["m2po/m2_before"] == 0.0 and on_policy.extras["m2po/masked_frac"] == 0.0
    assert on_policy.weights.tolist() == [1.0] * 3 and on_policy.optimizer_steps == 2
    mixed = policy_update(parts.policy, parts.reference, parts.optimizer, [fresh[0], groups[1]], cfg.trainer,
                          loss_cfg=cfg.loss)
    assert mixed.extras["m2po/m2_before"] > 0.04 >= mixed.extras["m2po/m2_after"]
    assert mixed.weights[:3].tolist() == [1.0] * 3 and all(w < 1.0 for w in mixed.weights[3:].tolist())
    assert [len(t) for t in mixed.behaviour_tokens] == [len(r) for g in groups for r in g.response_ids]
