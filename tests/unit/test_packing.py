"""Packed micro-batches (`trainer.pack_rows`): the padded path's numbers, without its padding."""

from __future__ import annotations

import pytest
import torch

from src.batch import Batch, BatchGroup, Group
from src.loss.rloo import RlooObjective
from src.loss.trainer import Trainer
from src.policy.forward import Forward, micro_batches, response_token_stats
from src.policy.model import frozen_copy, load_policy
from src.policy.packing import packed_layout, packed_micro_batches, packed_response_token_stats

# Lengths 6, 14, 8, 10 and 25 tokens.
FIVE = [((1,) * 5, (2,) * n) for n in (1, 9, 3, 5, 20)]


def test_packed_micro_batches_fill_a_real_token_budget_first_fit_by_decreasing_length():
    assert packed_micro_batches(FIVE, 10, 30) == [[4], [1, 3, 0], [2]]  # 25, 14 + 10 + 6 = 30, 8 real tokens
    assert packed_micro_batches(FIVE, 10, 20) == [[4], [1, 0], [3, 2]]  # 25 > 20 goes alone
    assert packed_micro_batches(FIVE, 2, None) == [[4, 1], [3, 2], [0]]  # rows only
    # The padded split of the same budget pays rows x longest row: 3 x 10 + 14 + 25 = 69 for 63 real tokens.
    assert micro_batches(FIVE, 10, 30) == [[0, 2, 3], [1], [4]]


def test_packed_layout_shares_lanes_restarts_positions_and_reads_response_positions_in_mask_order():
    ids, positions, predicting, mask = packed_layout([((1, 2), (3, 4)), ((5,), (6,)), ((7,), (8,))])
    assert ids.tolist() == [[1, 2, 3, 4], [5, 6, 7, 8]]  # lanes as long as the longest row: two short rows share one
    assert positions.tolist() == [[0, 1, 2, 3], [0, 1, 0, 1]]
    assert predicting.tolist() == [1, 2, 4, 6]  # flat positions: 1, 2 predict 3, 4; 4 predicts 6; 6 predicts 8
    assert mask.tolist() == [[False, True, True], [True, False, False], [True, False, False]]
    ids, positions, _, _ = packed_layout([((1, 2), (3,)), ((4,), (5,))], pad_id=9)
    assert ids.tolist() == [[1, 2, 3], [4, 5, 9]] and positions.tolist() == [[0, 1, 2], [0, 1, 0]]  # a pad tail


@pytest.fixture(scope="module")
def float64_policy(random_policy_dir):
    model, tokenizer = load_policy(str(random_policy_dir), "cpu", "float64")
    return model, tokenizer


def mixed_rows(vocab: int, seed: int = 0) -> list[tuple[tuple[int, ...], tuple[int, ...]]]:
    """Rows of very different lengths (4 to 70 tokens), random ids, the pad id among them."""
    generator = torch.Generator().manual_seed(seed)
    shapes = [(3, 1), (20, 50), (2, 7), (12, 3), (30, 40), (5, 18)]
    return [(tuple(torch.randint(0, vocab, (p,), generator=generator).tolist()),
             tuple(torch.randint(0, vocab, (r,), generator=generator).tolist())) for p, r in shapes]


@pytest.mark.parametrize("fused, temperature", [(False, 1.0), (True, 1.0), (False, 0.7), (True, 0.7)])
def test_packed_and_padded_token_stats_agree_and_no_row_sees_another(float64_policy, fused, temperature):
    model, tokenizer = float64_policy
    rows = mixed_rows(len(tokenizer))
    padded = response_token_stats(model, rows, tokenizer.pad_token_id, True, temperature, fused)
    packed = packed_response_token_stats(model, rows, True, temperature, fused, tokenizer.pad_token_id)
    assert packed_layout(rows)[0].shape[0] < len(rows)  # some rows share a lane
    assert torch.equal(padded[2], packed[2])
    mask = packed[2]
    for a, b in zip(padded[:2], packed[:2]):
        torch.testing.assert_close(a[mask], b[mask], rtol=1e-12, atol=1e-12)
        assert not b[~mask].any()  # zeros off the response
    for row, sequence in enumerate(rows):  # block-diagonal: each row's values are its values alone
        alone, _, alone_mask = packed_response_token_stats(model, [sequence], False, temperature, fused)
        torch.testing.assert_close(alone[alone_mask], packed[0][row][mask[row]], rtol=1e-12, atol=1e-12)


def groups_of(rows, rewards) -> list[Group]:
    """Groups of three rows each, the second one replayed with a stored log mu."""
    groups = []
    for g in range(0, len(rows), 3):
        responses = [response for _, response in rows[g : g + 3]]
        group = Group(prompt="", prompt_ids=rows[g][0], truth={"numbers": [1, 2, 3], "target": 6}, responses=[""] * 3,
                      response_ids=responses, rewards=rewards[g : g + 3], step=0)
        groups.append(group if g == 0 else group.with_behaviour_logprobs([-0.5 * len(r) for r in responses]))
    return groups


def update_with(policy, reference, groups, pack: bool, micro_batch_tokens: int | None):
    forward = Forward(0, micro_batch_size=4, micro_batch_tokens=micro_batch_tokens, pack=pack)
    trainer = Trainer(RlooObjective(3.0), forward, kl_coef=0.05, entropy_coef=0.01)
    policy.zero_grad(set_to_none=True)
    batch = Batch([BatchGroup(groups[0], "fresh"), BatchGroup(groups[1], "replay", 1)])
    result = trainer.update(policy, reference, torch.optim.SGD(policy.parameters(), lr=0.0), batch)
    return result, [p.grad.clone() for p in policy.parameters()]


@pytest.mark.parametrize("dtype, tolerance", [("float64", 1e-10), ("float32", 2e-5)])
def test_packed_update_gives_the_padded_loss_weights_and_gradients(random_policy_dir, dtype, tolerance):
    """One RLOO update (KL, entropy, a replayed group's weights), rows of 4 to 70 tokens, two token budgets."""
    torch.set_default_dtype(getattr(torch, dtype))  # as src.build does for a float64 run (conftest restores it)
    policy, tokenizer = load_policy(str(random_policy_dir), "cpu", dtype)
    reference = frozen_copy(policy)
    with torch.no_grad():  # pi away from pi_ref, so the KL term has a gradient
        for parameter in policy.parameters():
            parameter.add_(0.05 * torch.randn(parameter.shape, generator=torch.Generator().manual_seed(1),
                                              dtype=parameter.dtype))
    drawn = mixed_rows(len(tokenizer), seed=2)
    rows = [(drawn[0 if i < 3 else 3][0], response) for i, (_, response) in enumerate(drawn)]  # a group's prompt
    groups = groups_of(rows, [1.0, 0.0, 0.1, 0.0, 1.0, 0.1])
    padded, padded_grads = update_with(policy, reference, groups, pack=False, micro_batch_tokens=None)
    assert padded.kl > 0 and 0 < padded.weights[3:].max() <= 3.0
    for budget in (None, 90):  # 90: several packed micro-batches
        packed, packed_grads = update_with(policy, reference, groups, pack=True, micro_batch_tokens=budget)
        for key in ("loss", "policy_loss", "kl", "entropy"):
            assert getattr(packed, key) == pytest.approx(getattr(padded, key), rel=tolerance, abs=tolerance), key
        for key in ("logprobs", "raw_weights", "weights", "kl_sums"):
            torch.testing.assert_close(getattr(packed, key), getattr(padded, key), rtol=tolerance, atol=tolerance)
        for a, b in zip(packed.reference_tokens, padded.reference_tokens):
            assert a == pytest.approx(b, rel=tolerance, abs=tolerance)
        for a, b in zip(packed_grads, padded_grads):
            torch.testing.assert_close(a, b, rtol=tolerance, atol=tolerance)
    assert len(Forward(0, 4, 90, pack=True).batches(rows)) > 1


@pytest.fixture
def threads_kept():
    """The golden settings run on one thread (hardware.threads=1, a process-wide setting): restore it after."""
    before = torch.get_num_threads()
    yield
    torch.set_num_threads(before)


@pytest.mark.parametrize("cell, extra", [("fresh-only", []), ("fresh-only", ["trainer.fused_logprobs=true"]),
                                         ("age2-rho2-c1", []), ("grpo-popo", []), ("ipo", [])])
def test_packed_rows_reproduce_the_golden_numbers(compose_config, threads_kept, cell, extra):
    """Three steps of golden cells with trainer.pack_rows=true and a real-token budget, against the pins
    of the padded path (float64, to the golden tolerance)."""
    from src.task import countdown
    from tests.e2e.test_golden import CELLS, GOLDEN, PINNED, golden_config, mismatches, run_steps

    cfg = golden_config(compose_config, ["hardware.dtype=float64", *CELLS[cell], "trainer.pack_rows=true",
                                         "trainer.micro_batch_tokens=150", *extra])
    history = run_steps(cfg, countdown.generate_instances(64, seed=1), steps=3)
    assert not mismatches(GOLDEN[cell], [{key: step[key] for key in PINNED if key in step} for step in history])
