"""Frontier curriculum (SPEC 9, seed 004 app. B): embedding, priorities, memory, retrieval, duplicates."""

import json
import math
import random

import pytest
import torch

from src.curriculum.frontier import (
    FrontierMemory,
    PromptBank,
    frontier_priority,
    prompt_embedding,
    replacement_count,
    retrieval_scores,
    select_replacements,
)
from src.task import countdown
from src.task.countdown import CountdownTask, Instance

TASK = CountdownTask()  # the curriculum asks the task for the features and truth of its prompts


def I(numbers, target):  # noqa: E743 - short constructor for readable fixtures
    return Instance(numbers=tuple(numbers), target=target)


def prompt_features(instance, max_numbers=4):
    """Countdown's phi(x) (the task's, seed 004 app. B.2) as the tensor the curriculum builds from it."""
    return torch.tensor(countdown.prompt_features(instance, max_numbers), dtype=torch.float64)


# --------------------------------------------------------------------------- embedding


def test_features_hand_worked_four_numbers():
    phi = prompt_features(I((40, 10, 30, 20), 50))
    # t/100 = 0.5; n/4 = 1; min 0.1; max 0.4; mean 25 -> 0.25; population std sqrt((225+25+25+225)/4)
    # = sqrt(125) = 11.18034 -> 0.1118034; S = 100 -> 1/3; S - t = 50 -> 1/6; |S - t| -> 1/6;
    # parity: no odd numbers -> 0; sorted 10, 20, 30, 40 -> 0.1 .. 0.4.
    expected = [0.5, 1.0, 0.1, 0.4, 0.25, 0.1118034, 1 / 3, 1 / 6, 1 / 6, 0.0, 0.1, 0.2, 0.3, 0.4]
    assert phi.shape == (14,)
    torch.testing.assert_close(phi, torch.tensor(expected, dtype=torch.float64))
    # ||phi||^2 = 0.25 + 1 + 0.01 + 0.16 + 0.0625 + 0.0125 + 1/9 + 1/36 + 1/36 + 0 + 0.01 + 0.04 + 0.09 + 0.16
    #           = 1177/600 = 1.9616667 -> ||phi|| = 1.4005951.
    e = prompt_embedding(I((40, 10, 30, 20), 50), TASK)
    torch.testing.assert_close(e, phi / 1.4005951116102993)
    assert torch.linalg.vector_norm(e).item() == pytest.approx(1.0, abs=1e-12)


def test_features_hand_worked_three_numbers_padded():
    phi = prompt_features(I((44, 19, 35), 98))
    # n = 3 -> 0.75; S = 98 = t so both gap features are 0; mean 32.666667; deviations 11.333, -13.667,
    # 2.333 -> squares sum 320.6667, / 3 = 106.8889 -> std 10.338708; odd: 19 and 35 -> parity 2/3;
    # sorted 19, 35, 44, padded with 0 in the fourth slot.
    expected = [0.98, 0.75, 0.19, 0.44, 0.32666667, 0.10338708, 98 / 300, 0.0, 0.0, 2 / 3, 0.19, 0.35, 0.44, 0.0]
    torch.testing.assert_close(prompt_features(I((44, 19, 35), 98)), torch.tensor(expected, dtype=torch.float64))
    assert phi[-1].item() == 0.0


def test_embedding_is_order_free_and_signed_gap():
    assert torch.equal(prompt_embedding(I((1, 2, 3, 4), 24), TASK), prompt_embedding(I((4, 3, 2, 1), 24), TASK))
    # S - t keeps its sign: S = 10 < t = 24 -> (10 - 24)/300 = -0.0466667 while |S - t| = +0.0466667.
    phi = prompt_features(I((1, 2, 3, 4), 24))
    assert phi[7].item() == pytest.approx(-14 / 300) and phi[8].item() == pytest.approx(14 / 300)


def test_embedding_validates():
    with pytest.raises(ValueError, match="max_numbers=4"):
        prompt_embedding(I((1, 2, 3, 4, 5), 10), TASK)
    with pytest.raises(ValueError, match="max_numbers"):
        prompt_embedding(I((1, 2, 3), 10), TASK, max_numbers=0)
    assert prompt_embedding(I((1, 2, 3, 4, 5), 10), TASK, max_numbers=5).shape == (15,)


# --------------------------------------------------------------------------- priorities


@pytest.mark.parametrize(
    "mode, expected",
    [
        # 4p(1-p), K = 8: s=1 -> 4 * 1/8 * 7/8 = 0.4375; s=2 -> 0.75; s=4 -> 1; s=6 -> 0.75; s in {0, 8} excluded.
        ("frontier", {0: None, 1: 0.4375, 2: 0.75, 4: 1.0, 6: 0.75, 7: 0.4375, 8: None}),
        # failure-based: only s = 0, all with priority 1.
        ("failure", {0: 1.0, 1: None, 4: None, 8: None}),
        # Goldilocks, band 0.25: p in [1/4, 3/4], u = 1 - 2|p - 1/2|: s=2 -> 0.5, s=3 -> 0.75, s=4 -> 1.
        ("goldilocks", {0: None, 1: None, 2: 0.5, 3: 0.75, 4: 1.0, 6: 0.5, 7: None, 8: None}),
    ],
)
def test_frontier_priority_table(mode, expected):
    for s, u in expected.items():
        got = frontier_priority(s, 8, mode)
        assert got == (None if u is None else pytest.approx(u)), (mode, s)


def test_frontier_priority_validates():
    with pytest.raises(ValueError, match=r"\[0, K=8\]"):
        frontier_priority(9, 8)
    with pytest.raises(ValueError, match="mode"):
        frontier_priority(1, 8, mode="hard")


# --------------------------------------------------------------------------- memory


def test_memory_update_admits_frontier_with_priorities():
    mem = FrontierMemory(capacity=10, task=TASK)
    prompts = [I((1, 2, 3), t) for t in (10, 11, 12, 13, 14)]
    admitted = mem.update(prompts, [0, 4, 8, 2, 1], K=8, step=3)
    assert admitted == 3
    assert [e.instance.target for e in mem.entries] == [11, 13, 14]
    assert [e.priority for e in mem.entries] == pytest.approx([1.0, 0.75, 0.4375])
    assert all(e.step == 3 and e.k == 8 for e in mem.entries)
    fail = FrontierMemory(capacity=10, task=TASK, mode="failure")
    assert fail.update(prompts, [0, 4, 8, 2, 1], K=8, step=3) == 1
    assert fail.entries[0].instance.target == 10 and fail.entries[0].priority == 1.0


def test_memory_is_bounded_and_keeps_the_most_recent():
    mem = FrontierMemory(capacity=2, task=TASK)
    a, b, c = I((1, 2, 3), 10), I((1, 2, 3), 11), I((1, 2, 3), 12)
    mem.update([a, b], [4, 4], K=8, step=0)
    mem.update([a], [2], K=8, step=1)  # refresh a: new priority and step, now the newest
    assert [e.instance for e in mem.entries] == [b, a]
    assert mem.entries[1].priority == pytest.approx(0.75) and mem.entries[1].step == 1
    mem.update([c], [4], K=8, step=2)  # over capacity: the oldest (b) is dropped
    assert [e.instance for e in mem.entries] == [a, c] and mem.dropped == 1
    # A stored prompt re-observed off the frontier (solved 8/8) leaves the memory.
    mem.update([I((3, 2, 1), 10)], [8], K=8, step=3)  # same key as a, numbers in another order
    assert [e.instance for e in mem.entries] == [c]


def test_memory_update_validates_before_mutating():
    mem = FrontierMemory(capacity=4, task=TASK)
    mem.update([I((1, 2, 3), 10)], [4], K=8, step=0)
    with pytest.raises(ValueError, match="correct count"):
        mem.update([I((1, 2, 3), 11), I((1, 2, 3), 10)], [4, 9], K=8, step=1)
    assert [e.instance.target for e in mem.entries] == [10] and mem.entries[0].step == 0
    with pytest.raises(ValueError, match="one count per prompt"):
        mem.update([I((1, 2, 3), 11)], [4, 4], K=8, step=1)
    with pytest.raises(ValueError, match="capacity"):
        FrontierMemory(capacity=0, task=TASK)
    with pytest.raises(ValueError, match="mode"):
        FrontierMemory(capacity=4, task=TASK, mode="hard")


def test_memory_state_dict_round_trip():
    mem = FrontierMemory(capacity=3, task=TASK, mode="goldilocks")
    mem.update([I((1, 2, 3), t) for t in range(10, 15)], [4, 3, 2, 5, 6], K=8, step=7)
    state = json.loads(json.dumps(mem.state_dict()))  # JSON-safe
    restored = FrontierMemory(capacity=3, task=TASK, mode="goldilocks")
    restored.load_state_dict(state)
    assert [(e.instance, e.priority, e.correct, e.k, e.step) for e in restored.entries] == [
        (e.instance, e.priority, e.correct, e.k, e.step) for e in mem.entries
    ]
    assert restored.dropped == mem.dropped == 2
    torch.testing.assert_close(restored.matrices()[0], mem.matrices()[0])
    with pytest.raises(ValueError, match="mode"):
        FrontierMemory(capacity=3, task=TASK, mode="frontier").load_state_dict(state)
    with pytest.raises(ValueError, match="capacity"):
        FrontierMemory(capacity=5, task=TASK, mode="goldilocks").load_state_dict(state)


# --------------------------------------------------------------------------- retrieval


def test_retrieval_scores_hand_worked():
    memory = torch.tensor([[1.0, 0.0], [0.0, 1.0]])
    priorities = torch.tensor([1.0, 0.5])
    candidates = torch.tensor([[1.0, 0.0], [0.0, 1.0], [0.6, 0.8], [-1.0, 0.0]])
    # c_m = max_j (e_m . e_j) u_j:
    #   (1, 0): max(1 * 1, 0 * 0.5) = 1;  (0, 1): max(0, 1 * 0.5) = 0.5;
    #   (0.6, 0.8): max(0.6 * 1, 0.8 * 0.5) = 0.6;  (-1, 0): max(-1 * 1, 0 * 0.5) = 0.
    torch.testing.assert_close(retrieval_scores(candidates, memory, priorities), torch.tensor([1.0, 0.5, 0.6, 0.0]))
    with pytest.raises(ValueError, match="empty"):
        retrieval_scores(candidates, torch.zeros(0, 2), torch.zeros(0))
    with pytest.raises(ValueError, match="max_numbers"):
        retrieval_scores(candidates, torch.zeros(1, 3), torch.ones(1))


@pytest.mark.parametrize("batch, fraction, n", [(64, 0.10, 6), (128, 0.10, 13), (10, 0.10, 1), (4, 0.10, 0)])
def test_replacement_count(batch, fraction, n):
    # 64 * 0.1 = 6.4 -> 6 (the paper's "58 uniform + 6 retrieved"); 12.8 -> 13; 1.0 -> 1; 0.4 -> 0.
    assert replacement_count(batch, fraction) == n


# A memory of two frontier prompts and a candidate bank seeded with exact duplicates: of memory
# prompts (same and permuted numbers), of batch prompts, and of other candidates.
MEM_A = I((10, 20, 30, 40), 50)
MEM_B = I((3, 7, 25), 75)
BATCH = [I((10, 20, 30, 41), 50), I((12, 13, 14), 39), I((2, 9, 50, 60), 8), I((5, 6, 7), 100)]


def _memory():
    mem = FrontierMemory(capacity=8, task=TASK)
    mem.update([MEM_A, MEM_B], [4, 2], K=8, step=0)  # priorities 1.0 and 0.75
    return mem


def _candidates():
    dups = [
        MEM_A,
        I((40, 30, 20, 10), 50),  # MEM_A permuted: same key
        MEM_B,
        I((25, 3, 7), 75),
        BATCH[0],
        I((41, 30, 20, 10), 50),  # BATCH[0] permuted
        BATCH[1],
        BATCH[3],
    ]
    fresh = [
        I((10, 20, 30, 40), 51),
        I((10, 20, 30, 40), 51),  # a candidate duplicated inside the bank
        I((11, 20, 30, 40), 50),
        I((10, 21, 30, 40), 50),
        I((3, 7, 26), 75),
        I((3, 7, 26), 75),
        I((26, 7, 3), 75),
        I((4, 7, 25), 75),
        I((90, 80, 2), 600),
        I((1, 1, 1, 1), 4),
        I((50, 60, 70), 3),
        I((8, 8, 9), 17),
    ]
    return dups + fresh


def _forbidden():
    return {MEM_A.key, MEM_B.key} | {x.key for x in BATCH}


def test_retrieval_without_filter_would_pick_duplicates():
    # The duplicates of memory prompts are the most similar candidates (cosine 1, times priority 1):
    # only the key filter keeps them out.
    mem, bank = _memory(), PromptBank(_candidates(), TASK)
    scores = retrieval_scores(bank.embeddings, *mem.matrices())
    assert scores[0].item() == pytest.approx(1.0) and scores[1].item() == pytest.approx(1.0)
    assert int(scores.argmax()) in (0, 1)


def test_retrieval_deterministic_top_n_skips_duplicates():
    mem, bank = _memory(), PromptBank(_candidates(), TASK)
    out = select_replacements(mem, bank, BATCH * 5, fraction=0.10, min_memory=1, rng=random.Random(0), pool_factor=1)
    # 20 * 0.1 = 2 picks: the two highest-scoring candidates whose keys are new, in score order.
    scores = retrieval_scores(bank.embeddings, *mem.matrices()).tolist()
    seen, expected = set(_forbidden()), []
    for idx in sorted(range(len(bank)), key=lambda i: -scores[i]):
        if bank.keys[idx] not in seen and len(expected) < 2:
            expected.append(bank.instances[idx])
            seen.add(bank.keys[idx])
    assert out.prompts == expected and out.retrieved == 2 and out.uniform == 0 and out.requested == 2
    assert out.scores == pytest.approx([scores[bank.instances.index(x)] for x in expected])
    assert out.scores[0] >= out.scores[1]


@pytest.mark.parametrize("pool_factor", [1, 2, 4])
@pytest.mark.parametrize("fraction", [0.25, 0.5, 1.0])
def test_retrieval_never_returns_a_duplicate_key(pool_factor, fraction):
    forbidden = _forbidden()
    candidates = _candidates()
    distinct_valid = {x.key for x in candidates} - forbidden  # 9 distinct new keys
    for seed in range(12):
        for min_memory in (1, 3):  # 3 > len(memory): the uniform fall-back path
            out = select_replacements(
                _memory(),
                candidates,
                BATCH,
                fraction=fraction,
                min_memory=min_memory,
                rng=random.Random(seed),
                pool_factor=pool_factor,
            )
            keys = [x.key for x in out.prompts]
            assert not set(keys) & forbidden, (seed, keys)
            assert len(keys) == len(set(keys)), (seed, keys)
            assert len(keys) == min(out.requested, len(distinct_valid))


def test_retrieval_asks_for_more_than_the_valid_candidates():
    batch = BATCH * 8  # 32 prompts, fraction 1.0 -> 32 requested, only 9 distinct valid keys exist
    out = select_replacements(_memory(), _candidates(), batch, fraction=1.0, min_memory=1, rng=random.Random(1))
    assert out.requested == 32 and len(out.prompts) == 9
    assert out.retrieved == 9 and out.uniform == 0  # the top pool (4 * 32) covers every valid key
    mixed = out.apply(batch)
    assert len(mixed) == 32 and mixed[:23] == batch[:23] and mixed[23:] == out.prompts


def test_retrieval_with_only_duplicate_candidates_returns_nothing():
    only_dups = _candidates()[:8]
    for min_memory in (1, 5):
        out = select_replacements(_memory(), only_dups, BATCH * 5, min_memory=min_memory, rng=random.Random(0))
        assert out.prompts == [] and out.requested == 2
        assert out.apply(BATCH * 5) == BATCH * 5


def test_small_memory_falls_back_to_uniform():
    out = select_replacements(_memory(), _candidates(), BATCH * 5, min_memory=3, rng=random.Random(0))
    assert out.retrieved == 0 and out.uniform == 2 and out.scores == []
    # The fall-back is uniform over candidates: across seeds every valid key shows up.
    seen = set()
    for seed in range(200):
        out = select_replacements(_memory(), _candidates(), BATCH * 5, min_memory=3, rng=random.Random(seed))
        seen |= {x.key for x in out.prompts}
    assert seen == {x.key for x in _candidates()} - _forbidden()


def test_retrieval_is_reproducible_and_resumable():
    mem = _memory()
    first = select_replacements(mem, _candidates(), BATCH * 5, fraction=0.5, min_memory=1, rng=random.Random(3))
    restored = FrontierMemory(capacity=8, task=TASK)
    restored.load_state_dict(json.loads(json.dumps(mem.state_dict())))
    again = select_replacements(restored, _candidates(), BATCH * 5, fraction=0.5, min_memory=1, rng=random.Random(3))
    assert again == first


def test_select_replacements_validates():
    mem = _memory()
    with pytest.raises(ValueError, match="fraction"):
        select_replacements(mem, _candidates(), BATCH, fraction=1.5, min_memory=1, rng=random.Random(0))
    with pytest.raises(ValueError, match="min_memory"):
        select_replacements(mem, _candidates(), BATCH, min_memory=0, rng=random.Random(0))
    with pytest.raises(ValueError, match="rng"):
        select_replacements(mem, _candidates(), BATCH, min_memory=1, rng=0)
    with pytest.raises(ValueError, match="max_numbers"):
        select_replacements(
            mem, PromptBank(_candidates(), TASK, max_numbers=5), BATCH, min_memory=1, rng=random.Random(0)
        )


def test_cosine_ranks_near_neighbours_first():
    # A sanity check of the embedding as a retriever: a one-unit change of the target is closer to the
    # memory prompt than an unrelated instance.
    e = prompt_embedding(MEM_A, TASK)
    near = prompt_embedding(I((10, 20, 30, 40), 51), TASK)
    far = prompt_embedding(I((90, 80, 2), 600), TASK)
    assert (e @ near).item() > 0.999 > (e @ far).item()
    assert math.isclose((e @ e).item(), 1.0, abs_tol=1e-12)
