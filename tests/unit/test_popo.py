"""POPO batch composition (SPEC 9; seed 003 sections 4.1 and 5.3), on hand-built groups."""

import random

import pytest

from tests.conftest import through_checkpoint

from src.batch import Group
from src.buffer.popo import (
    EffectiveGroupMemory,
    compose_batch,
    is_effective,
    make_memory,
)

MIXED = (1.0, 0.0, 0.0, 1.0)  # effective: rewards differ
ALL_RIGHT = (1.0, 1.0, 1.0, 1.0)  # ineffective: zero variance
ALL_WRONG = (0.0, 0.0, 0.0, 0.0)
ALL_FORMAT = (0.1, 0.1, 0.1, 0.1)


def make_group(step: int, tag: str, rewards=MIXED, logprobs: bool = True) -> Group:
    k = len(rewards)
    return Group(
        prompt=f"s{step}{tag}",
        prompt_ids=[1, 2],
        truth={"numbers": [3, 5, 7], "target": 15},
        responses=[f"r{i}" for i in range(k)],
        response_ids=[[10 + i] for i in range(k)],
        rewards=rewards,
        step=step,
        behaviour_logprobs=[-1.0] * k if logprobs else None,
    )


def names(groups) -> list[str]:
    return [g.prompt for g in groups]


def online_3_of_8_ineffective(step: int = 5) -> list[Group]:
    """Eight online groups of one step; the 2nd, 5th and 7th (b, e, g) have zero reward variance."""
    rewards = {"b": ALL_RIGHT, "e": ALL_WRONG, "g": ALL_FORMAT}
    return [make_group(step, t, rewards.get(t, MIXED)) for t in "abcdefgh"]


# ---- is_effective ----


@pytest.mark.parametrize(
    "rewards, effective",
    [(MIXED, True), ((0.1, 0.0), True), ((1.0, 0.1, 0.1), True),
     (ALL_RIGHT, False), (ALL_WRONG, False), (ALL_FORMAT, False)],
)
def test_is_effective_means_rewards_not_all_equal(rewards, effective):
    assert is_effective(make_group(0, "x", rewards)) is effective


# ---- the pinned example: 3 of 8 online groups are ineffective ----


def test_popo_drops_three_ineffective_groups_and_refills_with_the_three_most_recent():
    memory = make_memory("popo", batch_size=8)
    assert memory.capacity == 8 and memory.effective_only
    memory.add([make_group(3, t) for t in "pqr"])
    memory.add([make_group(4, t) for t in "xyz"])
    online = online_3_of_8_ineffective(step=5)

    batch = compose_batch(online, memory, batch_size=8, variant="popo", step=5)

    assert names(batch.online) == ["s5a", "s5c", "s5d", "s5f", "s5h"]  # online order kept
    assert names(batch.dropped) == ["s5b", "s5e", "s5g"]
    assert names(batch.replayed) == ["s4x", "s4y", "s4z"]  # the FIFO tail, not s3*
    assert names(batch.groups) == ["s5a", "s5c", "s5d", "s5f", "s5h", "s4x", "s4y", "s4z"]
    assert batch.shortfall == 0
    assert batch.effective_sample_ratio == 1.0
    assert batch.on_policy_share == 5 / 8
    assert batch.online_effective_ratio == 5 / 8
    assert batch.metrics() == {
        "popo/effective_sample_ratio": 1.0, "popo/on_policy_share": 0.625, "popo/online_effective_ratio": 0.625,
        "popo/online_groups": 5.0, "popo/replayed_groups": 3.0, "popo/dropped_groups": 3.0, "popo/shortfall": 0.0,
    }

    # After the update the memory takes in the 5 effective online groups; 3 + 3 + 5 > 8 drops s3p, s3q, s3r.
    assert memory.add(online) == 5
    assert names(memory.groups) == ["s4x", "s4y", "s4z", "s5a", "s5c", "s5d", "s5f", "s5h"]
    assert (memory.rejected, memory.dropped) == (3, 3)


def test_popo_ineff_refills_with_the_most_recent_groups_whatever_their_rewards():
    memory = make_memory("popo-ineff", batch_size=8)
    assert not memory.effective_only
    memory.add([make_group(3, "p"), make_group(3, "q")])
    memory.add([make_group(4, "x"), make_group(4, "y", ALL_WRONG), make_group(4, "z", ALL_RIGHT)])

    batch = compose_batch(online_3_of_8_ineffective(5), memory, batch_size=8, variant="popo-ineff", step=5)

    assert names(batch.online) == ["s5a", "s5c", "s5d", "s5f", "s5h"]  # ineffective online groups still dropped
    assert names(batch.replayed) == ["s4x", "s4y", "s4z"]
    assert batch.effective_sample_ratio == 6 / 8  # s4y and s4z carry no signal
    assert batch.on_policy_share == 5 / 8
    assert memory.add(online_3_of_8_ineffective(5)) == 8  # stores every online group


def test_popo_stale_draws_random_effective_groups_from_an_n_times_larger_memory():
    memory = make_memory("popo-stale", batch_size=8, stale_factor=2, seed=7)
    assert memory.capacity == 16
    for step in range(5):
        memory.add([make_group(step, t) for t in "pqr"])
    memory.add([make_group(4, "w", ALL_WRONG)])  # refused: the memory holds effective groups only
    pool = list(memory.groups)
    assert len(pool) == 15 and memory.rejected == 1

    batch = compose_batch(online_3_of_8_ineffective(5), memory, batch_size=8, variant="popo-stale", step=5)

    # Uniform without replacement from the whole memory, with the memory's own seeded RNG.
    assert list(batch.replayed) == random.Random(7).sample(pool, 3)
    assert len(set(names(batch.replayed))) == 3 and batch.effective_sample_ratio == 1.0


# ---- edge cases ----


def test_empty_memory_leaves_a_shortfall_and_generates_nothing():
    memory = make_memory("popo", batch_size=8)
    batch = compose_batch(online_3_of_8_ineffective(0), memory, batch_size=8, step=0)
    assert batch.replayed == () and len(batch.groups) == 5 and batch.shortfall == 3
    assert batch.effective_sample_ratio == 1.0 and batch.on_policy_share == 1.0


def test_all_ineffective_and_nothing_to_replay_gives_an_empty_batch():
    memory = make_memory("popo", batch_size=2)
    batch = compose_batch([make_group(0, "a", ALL_WRONG), make_group(0, "b", ALL_RIGHT)], memory, 2, step=0)
    assert batch.groups == () and batch.shortfall == 2
    assert (batch.effective_sample_ratio, batch.on_policy_share, batch.online_effective_ratio) == (0.0, 0.0, 0.0)


def test_all_effective_online_needs_no_replay():
    memory = make_memory("popo", batch_size=3)
    memory.add([make_group(0, "old")])
    batch = compose_batch([make_group(1, t) for t in "abc"], memory, 3, step=1)
    assert batch.replayed == () and batch.on_policy_share == 1.0


def test_groups_of_the_current_step_are_never_replayed():
    memory = EffectiveGroupMemory(capacity=4)
    memory.add([make_group(4, "old"), make_group(5, "now")])  # "now" added too early by a caller
    batch = compose_batch([make_group(5, "a", ALL_WRONG)], memory, batch_size=2, step=5)
    assert names(batch.replayed) == ["s4old"] and batch.shortfall == 1
    assert memory.most_recent(5, step=5) == list(memory.groups[:1])
    assert memory.random(5, step=5) == list(memory.groups[:1])


def test_replayed_groups_stay_in_memory_and_can_be_replayed_again():
    memory = make_memory("popo", batch_size=2)
    memory.add([make_group(0, "m")])
    for step in (1, 2):
        batch = compose_batch([make_group(step, "a", ALL_WRONG)], memory, 2, step=step)
        assert names(batch.replayed) == ["s0m"]
        memory.add(batch.online)  # nothing effective online: the memory is unchanged
    assert names(memory.groups) == ["s0m"]


# ---- validation ----


def test_variant_and_memory_must_match():
    with pytest.raises(ValueError, match="effective_only=False"):
        compose_batch([], make_memory("popo", 4), 4, variant="popo-ineff", step=0)
    with pytest.raises(ValueError, match="make_memory"):
        compose_batch([], make_memory("popo-ineff", 4), 4, variant="popo", step=0)
    with pytest.raises(ValueError, match="variant must be one of"):
        compose_batch([], make_memory("popo", 4), 4, variant="dapo", step=0)
    with pytest.raises(ValueError, match="stale_factor"):
        make_memory("popo", 4, stale_factor=10)


def test_more_online_groups_than_the_batch_is_refused():
    with pytest.raises(ValueError, match="batch_size=2"):
        compose_batch([make_group(0, t) for t in "abc"], make_memory("popo", 2), 2, step=0)


def test_memory_add_checks_groups():
    memory = EffectiveGroupMemory(capacity=4)
    with pytest.raises(ValueError, match="behaviour_logprobs"):
        memory.add([make_group(0, "a", logprobs=False)])
    assert memory.add([make_group(0, "b", ALL_WRONG, logprobs=False)]) == 0  # refused before it needs mu
    with pytest.raises(TypeError, match="Group"):
        memory.add([object()])
    memory.add([make_group(3, "c")])
    with pytest.raises(ValueError, match="step order"):
        memory.add([make_group(2, "d")])
    with pytest.raises(ValueError, match="capacity"):
        EffectiveGroupMemory(capacity=0)


# ---- save / restore ----


def _run(memory: EffectiveGroupMemory, variant: str, start: int, stop: int) -> list[list[str]]:
    out = []
    for step in range(start, stop):
        online = [make_group(step, str(i), (MIXED, ALL_WRONG, ALL_RIGHT)[(step + i) % 3]) for i in range(4)]
        batch = compose_batch(online, memory, 4, variant, step=step)
        out.append(names(batch.groups))
        memory.add(online)
    return out


@pytest.mark.parametrize("variant", ["popo", "popo-ineff", "popo-stale"])
def test_state_dict_restores_future_batches_exactly(variant, tmp_path):
    factor = 3 if variant == "popo-stale" else 1
    reference = make_memory(variant, 4, stale_factor=factor, seed=5)
    _run(reference, variant, 0, 6)
    restored = through_checkpoint(reference, make_memory(variant, 4, stale_factor=factor), tmp_path / "popo.pt")
    assert restored.groups == reference.groups and restored.capacity == 4 * factor
    assert _run(restored, variant, 6, 20) == _run(reference, variant, 6, 20)


def test_load_state_dict_rejects_a_different_variant():
    with pytest.raises(ValueError, match="effective_only"):
        make_memory("popo-ineff", 4).load_state_dict(make_memory("popo", 4).state_dict())
