"""FIFO replay buffer rules (SPEC 9; seeds 001 and 002), each on hand-built groups."""

import json
import pickle
import random
from pathlib import Path

import pytest

from tests.conftest import through_checkpoint

from src.batch import Group
from src.buffer.fifo import (
    FifoReplayBuffer,
    extra_updates,
    use_statistics,
)
from src.buffer.positive_bias import positive_bias_keep


K = 2  # make_group's group size: a FIFO of n such groups holds N = n * K rollouts


def make_group(step: int, tag: str = "", rewards=(1.0, 0.0), logprobs: bool = True) -> Group:
    k = len(rewards)
    return Group(
        prompt=f"p{step}{tag}",
        prompt_ids=[1, 2, 3],
        truth={"numbers": [3, 5, 7], "target": 15},
        responses=[f"r{i}" for i in range(k)],
        response_ids=[[10 + i, 11] for i in range(k)],
        rewards=rewards,
        step=step,
        behaviour_logprobs=[-1.5] * k if logprobs else None,
    )


def prompts(draws) -> list[str]:
    return [d.group.prompt for d in draws]


# ---- validation ----


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(capacity=4, mode="random"), "mode must be one of"),
        (dict(capacity=4, correct_reward="yes"), "correct_reward"),
    ],
)
def test_constructor_rejects_bad_settings(kwargs, match):
    with pytest.raises(ValueError, match=match):
        FifoReplayBuffer(**kwargs)


def test_add_requires_groups_with_behaviour_logprobs_in_step_order():
    buf = FifoReplayBuffer(capacity=4 * K)
    with pytest.raises(ValueError, match="behaviour_logprobs"):
        buf.add([make_group(0, logprobs=False)])
    with pytest.raises(TypeError, match="Group"):
        buf.add(["not a group"])
    buf.add([make_group(3)])
    with pytest.raises(ValueError, match="step order"):
        buf.add([make_group(2)])
    assert [g.step for g in buf.groups] == [3]


def test_sample_rejects_negative_count():
    buf = FifoReplayBuffer(capacity=4 * K)
    with pytest.raises(ValueError, match="count"):
        buf.sample(-1, step=1)


# ---- capacity (FIFO) ----


def test_keeps_last_n_groups_and_drops_oldest_first():
    buf = FifoReplayBuffer(capacity=3 * K)
    buf.add([make_group(0, "a"), make_group(0, "b")])
    buf.add([make_group(1, "c"), make_group(1, "d")])  # 4 > 3: "p0a" leaves
    assert [g.prompt for g in buf.groups] == ["p0b", "p1c", "p1d"]
    buf.add([make_group(2, t) for t in "efgh"])  # more than N in one call: only the last N stay
    assert [g.prompt for g in buf.groups] == ["p2f", "p2g", "p2h"]
    assert (buf.added, buf.dropped, buf.dropped_rollouts) == (8, 5, 10)
    assert len(buf) == 3 and buf.rollouts == 6


def test_replayed_groups_stay_stored():
    buf = FifoReplayBuffer(capacity=3 * K, seed=1)
    buf.add([make_group(0, "a")])
    for t in (1, 2, 3):
        assert prompts(buf.sample(1, step=t)) == ["p0a"]
        assert len(buf) == 1


def test_no_age_limit_only_capacity():
    buf = FifoReplayBuffer(capacity=2 * K)
    buf.add([make_group(0)])
    assert prompts(buf.sample(1, step=1000)) == ["p0"]
    assert buf.age_histogram(10) == {10: 1}


# ---- the current-step rule ----


def test_group_added_this_step_is_never_drawn_this_step():
    for mode in ("with_replacement", "without_replacement", "at_least_once"):
        buf = FifoReplayBuffer(capacity=4 * K, mode=mode)
        assert buf.sample(3, step=0) == []
        buf.add([make_group(0, "a")])
        assert buf.sample(3, step=0) == [] and buf.eligible(0) == []
        buf.add([make_group(1, "b")])
        # At step 1 only the step-0 group is eligible.
        assert set(prompts(buf.sample(3, step=1))) == {"p0a"}


def test_empty_draw_consumes_no_randomness():
    buf = FifoReplayBuffer(capacity=4 * K, seed=5)
    before = buf.state_dict()["rng_state"]
    assert buf.sample(4, step=0) == [] and buf.sample(0, step=3) == []
    assert buf.state_dict()["rng_state"] == before


# ---- sampling modes ----


def test_with_replacement_returns_count_draws_from_a_small_pool():
    buf = FifoReplayBuffer(capacity=8 * K, seed=2)
    buf.add([make_group(0, "a"), make_group(0, "b")])
    draws = buf.sample(5, step=1)
    assert len(draws) == 5 and set(prompts(draws)) <= {"p0a", "p0b"}


def test_with_replacement_is_the_default_and_uniform():
    n_groups, draws, per_draw = 10, 3000, 5
    buf = FifoReplayBuffer(capacity=n_groups * K, seed=123)
    assert buf.mode == "with_replacement"
    buf.add([make_group(0, tag=str(i)) for i in range(n_groups)])
    counts = {g.prompt: 0 for g in buf.groups}
    for t in range(draws):
        for d in buf.sample(per_draw, step=1 + t):
            counts[d.group.prompt] += 1
    expected = draws * per_draw / n_groups
    chi2 = sum((c - expected) ** 2 / expected for c in counts.values())
    # 9 degrees of freedom: P(chi2 > 40) is about 1e-5; a biased sampler lands far above.
    assert chi2 < 40, counts


def test_without_replacement_draws_distinct_groups_up_to_the_pool():
    buf = FifoReplayBuffer(capacity=20 * K, mode="without_replacement", seed=1)
    buf.add([make_group(4, tag=str(i)) for i in range(6)])
    drawn = buf.sample(4, step=5)
    assert len(drawn) == 4 and len(set(prompts(drawn))) == 4
    everything = buf.sample(50, step=6)
    assert sorted(prompts(everything)) == sorted(g.prompt for g in buf.groups)


def test_at_least_once_hand_worked():
    buf = FifoReplayBuffer(capacity=10 * K, mode="at_least_once", seed=0)
    buf.add([make_group(0, t) for t in "ABCDE"])
    first = set(prompts(buf.sample(3, step=1)))
    assert len(first) == 3  # three of the five never-drawn groups
    second = buf.sample(3, step=2)
    never_before = {"p0A", "p0B", "p0C", "p0D", "p0E"} - first
    # The two never-drawn groups must come first; only the third slot may repeat a group.
    assert never_before <= set(prompts(second)) and len(set(prompts(second))) == 3
    assert [d.use for d in second[:2]] == [1, 1] and second[2].use == 2
    buf.add([make_group(2, "F")])  # a new group is drawn before any further repeat
    third = buf.sample(2, step=3)
    assert prompts(third)[0] == "p2F" and third[0].use == 1 and third[1].use >= 2
    # Asking for more than is eligible gives every eligible group once, no duplicates.
    assert sorted(prompts(buf.sample(10, step=4))) == ["p0A", "p0B", "p0C", "p0D", "p0E", "p2F"]


def test_at_least_once_never_repeats_while_a_never_drawn_group_is_left_out():
    rng = random.Random(0)
    buf = FifoReplayBuffer(capacity=12 * K, mode="at_least_once", seed=4)
    seen: set[str] = set()
    for t in range(60):
        never = {g.prompt for g in buf.eligible(t)} - seen
        draws = buf.sample(rng.randint(0, 7), step=t)
        names = prompts(draws)
        assert len(set(names)) == len(names)
        assert [d.use == 1 for d in draws] == [n not in seen for n in names]
        if any(n in seen for n in names):  # a repeat only once every never-drawn group is in the batch
            assert never <= set(names)
        seen |= set(names)
        buf.add([make_group(t, tag=str(i)) for i in range(rng.randint(0, 4))])


# ---- positive-bias sampling (seed 001 section 5, appendix D.4) ----

# Appendix D.4: N = 8, delta = 0.75, rollouts z_{t-9} .. z_t, buffer = z_{t-8} z_{t-7} z_{t-5} .. z_t.
# The red/green colours are lost in the text; the listed result forces z_{t-8}, z_{t-7}, z_{t-5},
# z_{t-4}, z_{t-3}, z_{t-2} correct and z_{t-6} incorrect. z_{t-9} (beyond the six-correct budget)
# and z_{t-1}, z_t (inside the freshest two) give the same buffer either way: both are tried.
PAPER_KEPT = [1, 2, 4, 5, 6, 7, 8, 9]  # positions of z_{t-8}, z_{t-7}, z_{t-5}, ..., z_t in z_{t-9} .. z_t


@pytest.mark.parametrize("z9", [True, False])
@pytest.mark.parametrize("z1, z0", [(True, True), (False, False), (False, True)])
def test_positive_bias_rule_on_the_papers_example(z9, z1, z0):
    correct = [z9, True, True, False, True, True, True, True, z1, z0]  # z_{t-9} .. z_t
    assert positive_bias_keep(correct, capacity=8, delta=0.75) == PAPER_KEPT


def test_positive_bias_rule_edge_cases():
    correct = [True, False, True, False]
    assert positive_bias_keep(correct, capacity=2, delta=0.0) == [2, 3]  # plain FIFO
    assert positive_bias_keep(correct, capacity=2, delta=1.0) == [0, 2]  # correct ones only
    assert positive_bias_keep(correct, capacity=2, delta=0.5) == [2, 3]  # newest 1 + 1 older correct
    # The rule holds before the buffer is full too: an incorrect rollout outside the fresh window is not kept.
    assert positive_bias_keep(correct, capacity=4, delta=0.5) == [0, 2, 3]
    assert positive_bias_keep(correct, capacity=10, delta=0.5) == [0, 1, 2, 3]  # all four in the freshest 5


@pytest.mark.parametrize("z9", [1.0, 0.0])
def test_positive_bias_buffer_reproduces_the_papers_example_with_groups_of_two(z9):
    # The same ten rollouts as five K=2 groups; N = 4 groups = 8 rollouts, delta = 0.75:
    # the freshest group stays whole, plus the freshest 3 * 2 = 6 older correct rollouts.
    rewards = [(z9, 1.0), (1.0, 0.0), (1.0, 1.0), (1.0, 1.0), (0.0, 0.1)]  # (z_{t-9}, z_{t-8}), ..., (z_{t-1}, z_t)
    groups = [make_group(s, rewards=r) for s, r in enumerate(rewards)]

    one_by_one = FifoReplayBuffer(capacity=4 * K, positive_bias=0.75)
    for g in groups:
        one_by_one.add([g])
    at_once = FifoReplayBuffer(capacity=4 * K, positive_bias=0.75)
    at_once.add(groups)

    for buf in (one_by_one, at_once):
        kept = [(g.step, idx) for g, idx in zip(buf.groups, buf.stored_responses)]
        # z_{t-8} | z_{t-7} | z_{t-5} z_{t-4} | z_{t-3} z_{t-2} | z_{t-1} z_t
        assert kept == [(0, (1,)), (1, (0,)), (2, (0, 1)), (3, (0, 1)), (4, (0, 1))]
        assert buf.rollouts == 8
        # A trimmed group keeps all K rewards: its advantages are those of the whole group (D.2).
        assert buf.groups[1].rewards == (1.0, 0.0)
        assert buf.dropped_rollouts == 2 and buf.dropped == 0


def test_positive_bias_hand_worked_k4():
    # N = 16 rollouts (n = 4 groups of K = 4), delta = 0.5: the freshest 2 groups whole, plus the freshest
    # 2 * 4 = 8 older correct responses.
    buf = FifoReplayBuffer(capacity=4 * 4, positive_bias=0.5)
    buf.add([make_group(0, "a", rewards=(1.0, 1.0, 1.0, 0.0)),  # correct: 0 1 2
             make_group(0, "b", rewards=(0.0, 0.0, 0.1, 0.0)),  # none correct
             make_group(1, "c", rewards=(1.0, 0.0, 1.0, 1.0)),  # correct: 0 2 3
             make_group(1, "d", rewards=(0.0, 1.0, 1.0, 0.0))])  # correct: 1 2
    # The rule holds before the buffer is full too: a and b are outside the window (c, d), so a
    # keeps its correct responses and b, with none, is gone.
    assert [g.prompt for g in buf.groups] == ["p0a", "p1c", "p1d"]
    assert buf.stored_responses == ((0, 1, 2), (0, 1, 2, 3), (0, 1, 2, 3))
    buf.add([make_group(2, "e", rewards=(0.0, 0.0, 0.0, 1.0)),  # correct: 3
             make_group(2, "f", rewards=(0.1, 0.1, 0.1, 0.1))])  # none correct
    # Window (e, f); older correct: a 3 + c 3 + d 2 = 8, exactly the budget.
    assert [g.prompt for g in buf.groups] == ["p0a", "p1c", "p1d", "p2e", "p2f"]
    assert buf.stored_responses == ((0, 1, 2), (0, 2, 3), (1, 2), (0, 1, 2, 3), (0, 1, 2, 3))
    assert len(buf) == 5 > buf.capacity // 4 and buf.rollouts == 16  # more groups than n, never more than N rollouts
    buf.add([make_group(3, "g", rewards=(1.0, 1.0, 0.0, 0.0)),
             make_group(3, "h", rewards=(0.0, 0.0, 0.0, 0.0))])
    # Window (g, h); freshest 8 older correct, newest first: e3, d2 d1, c3 c2 c0, a2 a1 (a0 and f are gone).
    assert [g.prompt for g in buf.groups] == ["p0a", "p1c", "p1d", "p2e", "p3g", "p3h"]
    assert buf.stored_responses == ((1, 2), (0, 2, 3), (1, 2), (3,), (0, 1, 2, 3), (0, 1, 2, 3))
    assert (buf.dropped, buf.dropped_rollouts) == (2, 8 * 4 - buf.rollouts)  # b and f gone; 32 added, 16 kept


def test_positive_bias_zero_is_plain_fifo():
    plain, zero = FifoReplayBuffer(capacity=3 * K), FifoReplayBuffer(capacity=3 * K, positive_bias=0.0)
    for buf in (plain, zero):
        buf.add([make_group(s, rewards=(0.0, 0.0)) for s in range(5)])
    assert plain.groups == zero.groups and [g.step for g in plain.groups] == [2, 3, 4]


def test_positive_bias_needs_one_group_size():
    buf = FifoReplayBuffer(capacity=4 * K, positive_bias=0.5)
    with pytest.raises(ValueError, match="K=3 but got K=2"):
        buf.add([make_group(0, rewards=(1.0, 0.0, 0.0)), make_group(0, rewards=(1.0, 0.0))])
    assert len(buf) == 0 and buf.group_size is None  # a refused call changes nothing
    buf.add([make_group(0, rewards=(1.0, 0.0))])
    with pytest.raises(ValueError, match="K=2 but got K=3"):
        buf.add([make_group(1, rewards=(1.0, 0.0, 0.0))])


def trimmed_k4_buffer(mode: str = "with_replacement", seed: int = 9) -> FifoReplayBuffer:
    """The end state of the hand-worked K = 4 example: 16 rollouts kept, three groups trimmed."""
    buf = FifoReplayBuffer(capacity=4 * 4, positive_bias=0.5, mode=mode, seed=seed)
    for step, tags, rewards in ((0, "ab", ((1.0, 1.0, 1.0, 0.0), (0.0, 0.0, 0.1, 0.0))),
                                (1, "cd", ((1.0, 0.0, 1.0, 1.0), (0.0, 1.0, 1.0, 0.0))),
                                (2, "ef", ((0.0, 0.0, 0.0, 1.0), (0.1, 0.1, 0.1, 0.1))),
                                (3, "gh", ((1.0, 1.0, 0.0, 0.0), (0.0, 0.0, 0.0, 0.0)))):
        buf.add([make_group(step, tag, rewards=r) for tag, r in zip(tags, rewards)])
    assert buf.stored_responses == ((1, 2), (0, 2, 3), (1, 2), (3,), (0, 1, 2, 3), (0, 1, 2, 3))
    return buf


def test_positive_bias_draws_every_stored_rollout_at_the_same_rate():
    """Seed 001 D.4 "uniformly sample from these N samples": per rollout. The lone correct rollout kept
    in group e is drawn as often as each rollout of a whole group (drawing groups by stored responses and
    training all of them used it at 1/K of that rate)."""
    buf = trimmed_k4_buffer()
    uses: dict[tuple[str, int], int] = {}
    draws = 20_000
    for _ in range(draws):
        drawn = buf.sample(1, step=4)  # one group's worth: K = 4 rollouts
        assert sum(len(d.responses) for d in drawn) == 4
        for d in drawn:
            for i in d.responses:
                uses[(d.group.prompt, i)] = uses.get((d.group.prompt, i), 0) + 1
    assert len(uses) == buf.rollouts == 16
    expected = draws * 4 / 16
    chi2 = sum((n - expected) ** 2 / expected for n in uses.values())
    assert chi2 < 45, uses  # 15 degrees of freedom: P(chi2 > 45) is about 1e-4
    assert uses[("p2e", 3)] / draws == pytest.approx(0.25, abs=0.02)
    assert uses[("p3g", 0)] / draws == pytest.approx(0.25, abs=0.02)


def test_positive_bias_distinct_modes_draw_distinct_rollouts():
    buf = trimmed_k4_buffer("without_replacement")
    drawn = buf.sample(3, step=4)  # 12 of the 16 rollouts, none twice
    picked = [(d.group.prompt, i) for d in drawn for i in d.responses]
    assert len(picked) == 12 == len(set(picked))
    assert [d.uid for d in drawn] == sorted(d.uid for d in drawn)  # grouped, oldest group first
    assert sum(len(d.responses) for d in buf.sample(9, step=4)) == 16  # the pool, not more
    once = trimmed_k4_buffer("at_least_once", seed=3)
    seen = [(d.group.prompt, i) for _ in range(4) for d in once.sample(1, step=4) for i in d.responses]
    assert len(seen) == 16 == len(set(seen))  # every rollout once before any twice
    again = [(d.group.prompt, i) for d in once.sample(1, step=4) for i in d.responses]
    assert len(again) == 4 and set(again) <= set(seen)


# ---- statistics (seed 001 section 3.2, appendix D.3) ----


def test_steps_since_last_use_follows_the_papers_illustration():
    # D.3: a rollout used once in batch B_3 and three times in B_5 maps to new, 2, 0, 0.
    buf = FifoReplayBuffer(capacity=1 * K)
    buf.add([make_group(0)])
    draws = buf.sample(1, step=3) + buf.sample(3, step=5)
    assert [d.steps_since_last_use for d in draws] == [None, 2, 0, 0]
    assert [d.use for d in draws] == [1, 2, 3, 4]
    assert [d.age for d in draws] == [3, 5, 5, 5]
    stats = use_statistics(draws)
    assert stats.draws == 4 and stats.new == 1
    assert stats.age_mean == 4.5 and stats.age_max == 5 and stats.age_histogram == {3: 1, 5: 3}
    assert stats.since_last_use_histogram == {0: 2, 2: 1}
    assert stats.since_last_use_mean == pytest.approx(2 / 3)
    assert stats.metrics() == {
        "fifo/draws": 4.0, "fifo/new_draws": 1.0, "fifo/age_at_use_mean": 4.5,
        "fifo/age_at_use_max": 5.0, "fifo/steps_since_last_use_mean": pytest.approx(2 / 3),
    }


def test_use_statistics_of_no_draws_leaves_means_undefined():
    stats = use_statistics([])
    assert stats.age_mean is None and stats.since_last_use_mean is None
    assert stats.metrics() == {"fifo/draws": 0.0, "fifo/new_draws": 0.0}


def test_replay_counts_cover_stored_and_dropped_rollouts():
    buf = FifoReplayBuffer(capacity=2 * K, mode="without_replacement", seed=0)
    assert buf.replay_counts().mean is None
    buf.add([make_group(0, "a"), make_group(0, "b")])
    buf.sample(2, step=1)  # a: 1, b: 1
    buf.sample(2, step=2)  # a: 2, b: 2
    buf.add([make_group(2, "c")])  # capacity 2: "a" leaves with its final count 2
    buf.sample(2, step=3)  # b: 3, c: 1
    counts = buf.replay_counts()
    # per rollout (seed 001 D.3): a whole group's K = 2 rollouts share its count
    assert (counts.rollouts, counts.histogram, counts.mean, counts.max) == (6, {1: 2, 2: 2, 3: 2}, 2.0, 3)
    buf.add([make_group(3, "d"), make_group(3, "e")])  # b and c leave; d and e are unused so far
    final = buf.replay_counts()
    assert final.histogram == {0: 4, 1: 2, 2: 2, 3: 2} and final.mean == pytest.approx(6 / 5)
    assert final.metrics() == {"fifo/replay_count_rollouts": 10.0, "fifo/replay_count_mean": pytest.approx(1.2),
                               "fifo/replay_count_max": 3.0}


# ---- seed 002: R - 1 extra updates per fresh batch ----


def test_extra_updates_is_r_minus_one():
    assert extra_updates(1) == 0 and extra_updates(4) == 3
    with pytest.raises(ValueError, match="replay_factor"):
        extra_updates(0)


def test_extra_update_batches_follow_algorithm_1():
    buf = FifoReplayBuffer(capacity=16 * K, mode="without_replacement", seed=3)
    # Step 0: the buffer is empty, so no extra update is taken.
    assert buf.extra_update_batches(replay_factor=3, batch_size=2, step=0) == []
    buf.add([make_group(0, t) for t in "abc"])  # fresh batch of step 0, added after its updates
    # Fresh update at RL step 3, then R - 1 = 2 extra batches, drawn at the same RL step.
    batches = buf.extra_update_batches(replay_factor=3, batch_size=2, step=3)
    assert [[d.step for d in b] for b in batches] == [[3, 3], [3, 3]]
    assert [[d.age for d in b] for b in batches] == [[3, 3], [3, 3]]
    assert all(len(set(prompts(b))) == 2 for b in batches)
    assert buf.extra_update_batches(replay_factor=1, batch_size=2, step=6) == []
    buf.add([make_group(6, "d")])
    with pytest.raises(ValueError, match="after extra_update_batches"):
        buf.extra_update_batches(replay_factor=2, batch_size=2, step=6)


# ---- save / restore ----


RUN_K = 3  # _run's groups: a FIFO of n of them holds N = n * RUN_K rollouts


def _run(buf: FifoReplayBuffer, start: int, stop: int) -> list:
    """Drive sample-then-add; return everything observable about each step's draws."""
    out = []
    for t in range(start, stop):
        draws = buf.sample(3, step=t)
        out.append([(d.uid, d.group.prompt, d.responses, d.age, d.use, d.steps_since_last_use) for d in draws])
        rewards = [(1.0, 0.0, 0.0), (0.0, 0.0, 0.0), (1.0, 1.0, 0.1)]
        buf.add([make_group(t, tag=str(i), rewards=rewards[(t + i) % 3]) for i in range(2)])
    return out


@pytest.mark.parametrize("mode", ["with_replacement", "without_replacement", "at_least_once"])
@pytest.mark.parametrize("delta", [0.0, 0.5])
def test_state_dict_restores_future_draws_exactly(mode, delta):
    reference = FifoReplayBuffer(capacity=5 * RUN_K, mode=mode, positive_bias=delta, seed=7)
    _run(reference, 0, 6)
    restored = FifoReplayBuffer(capacity=5 * RUN_K, mode=mode, positive_bias=delta, seed=999)  # seed must not matter
    restored.load_state_dict(reference.state_dict())
    assert restored.groups == reference.groups
    assert restored.stored_responses == reference.stored_responses
    assert _run(restored, 6, 20) == _run(reference, 6, 20)
    assert restored.replay_counts() == reference.replay_counts()


def test_save_load_file_roundtrip_continues_identically(tmp_path):
    reference = FifoReplayBuffer(capacity=4 * RUN_K, mode="at_least_once", positive_bias=0.5, seed=11)
    _run(reference, 0, 6)
    restored = through_checkpoint(reference, FifoReplayBuffer(capacity=4 * RUN_K, mode="at_least_once",
                                                              positive_bias=0.5), tmp_path / "fifo.pt")
    assert (restored.capacity, restored.mode, restored.positive_bias) == (4 * RUN_K, "at_least_once", 0.5)
    assert restored.groups == reference.groups and restored.group_size == 3
    assert restored.groups[0].behaviour_logprobs == (-1.5, -1.5, -1.5)
    assert _run(restored, 6, 20) == _run(reference, 6, 20)


def test_uninterrupted_equals_interrupted_run():
    straight = FifoReplayBuffer(capacity=4 * RUN_K, seed=3)
    full = _run(straight, 0, 12)
    first = FifoReplayBuffer(capacity=4 * RUN_K, seed=3)
    head = _run(first, 0, 5)
    second = FifoReplayBuffer(capacity=4 * RUN_K, seed=0)
    second.load_state_dict(first.state_dict())
    assert head + _run(second, 5, 12) == full


@pytest.mark.parametrize("other", [dict(capacity=5 * RUN_K), dict(mode="at_least_once"), dict(positive_bias=0.5)])
def test_load_state_dict_rejects_different_settings(other):
    state = FifoReplayBuffer(capacity=4 * RUN_K).state_dict()
    name = next(iter(other))
    with pytest.raises(ValueError, match=name):
        FifoReplayBuffer(**{"capacity": 4 * RUN_K, **other}).load_state_dict(state)


@pytest.mark.parametrize("delta", [0.0, 0.5])
def test_a_checkpoint_written_while_n_counted_groups_resumes_as_n_times_k_rollouts(delta):
    """A checkpoint of the group store written while N counted groups has no `capacity_unit`: it resumes into the
    FIFO of N * K rollouts, which keeps what it kept, and goes on as the uninterrupted run; another N is refused."""
    settings = dict(mode="at_least_once", positive_bias=delta)
    full = _run(FifoReplayBuffer(capacity=4 * RUN_K, seed=3, **settings), 0, 12)
    first = FifoReplayBuffer(capacity=4 * RUN_K, seed=3, **settings)
    head = _run(first, 0, 5)
    state = first.state_dict()
    written = {name: value for name, value in state["settings"].items() if name != "capacity_unit"}
    old = {**state, "settings": {**written, "capacity": 4}}  # N = 4 groups, as the group store wrote it
    second = FifoReplayBuffer(capacity=4 * RUN_K, **settings)
    second.load_state_dict(old)
    assert head + _run(second, 5, 12) == full
    with pytest.raises(ValueError, match=f"capacity={4 * RUN_K}, this run's has capacity={5 * RUN_K}"):
        FifoReplayBuffer(capacity=5 * RUN_K, **settings).load_state_dict(old)


def test_n_counts_rollouts_and_keeps_the_newest_whole_groups_that_fit():
    buf = FifoReplayBuffer(capacity=5)  # five rollouts: two groups of K = 2, and no half of a third
    buf.add([make_group(0, t) for t in "abc"])
    assert [g.prompt for g in buf.groups] == ["p0b", "p0c"] and buf.rollouts == 4
    buf.add([make_group(1, "d", rewards=(1.0, 0.0, 0.0))])  # a group of three fills the five with c
    assert [g.prompt for g in buf.groups] == ["p0c", "p1d"] and buf.rollouts == 5
    assert (buf.dropped, buf.dropped_rollouts) == (2, 4)


def test_state_dict_is_plain_data():
    buf = FifoReplayBuffer(capacity=3 * RUN_K, positive_bias=0.5)
    _run(buf, 0, 4)
    state = buf.state_dict()
    assert all(isinstance(group, dict) for _, group in state["contents"]["queue"]["groups"])
    assert pickle.loads(pickle.dumps(state)) == state


def test_age_at_use_in_updates_counts_every_extra_update_as_seed_001_does(tmp_path):
    """R = 3. The group sampled at step 0 (update 0; no extras then, nothing was stored) is drawn at step 1
    for its main update (update 1) and both extras (updates 2, 3): 1 step old each time, 1, 2, 3 updates old."""
    buf = FifoReplayBuffer(capacity=8 * K, extra_updates=2, groups_per_step=1, seed=0)
    buf.draw(1, 0)
    assert buf.extra_batches(0) == []  # nothing stored yet: no extra update, no update counted
    buf.store([make_group(0)], 0)
    buf.draw(1, 1)
    buf.extra_batches(1)
    metrics = buf.metrics(1)
    assert metrics["fifo/age_at_use_mean"] == 1.0  # RL steps
    assert metrics["fifo/age_at_use_updates_mean"] == pytest.approx((1 + 2 + 3) / 3)  # updates 1, 2, 3 after 0
    assert metrics["fifo/age_at_use_updates_max"] == 3.0
    restored = through_checkpoint(buf, FifoReplayBuffer(capacity=8 * K, extra_updates=2, groups_per_step=1),
                                  tmp_path / "store.pt")
    assert restored.updates == buf.updates == 4


SLOTS = json.loads((Path(__file__).parent / "checkpoints" / "fifo_slots.json").read_text())


@pytest.mark.parametrize("case", SLOTS["cases"], ids=lambda c: f"{c['mode']}-pb{c['positive_bias']}")
def test_a_checkpoint_of_slots_resumes_into_the_one_core_and_draws_as_it_would_have(case):
    """tests/unit/checkpoints/fifo_slots.json holds checkpoints the store wrote while it kept one slot per group
    (before the one replay core), with the draws that store made after each: the converter (`slots_as_queue`)
    restores them, and the same groups and responses are drawn at the same ages. Use numbers and steps since last
    use are the group's where whole groups are drawn; with positive bias the core keeps them per rollout."""
    buf = FifoReplayBuffer(capacity=SLOTS["capacity"], mode=case["mode"], positive_bias=case["positive_bias"])
    buf.load_state_dict(case["state"])
    observed = [[[uid, prompt, list(responses), *rest] for uid, prompt, responses, *rest in draws]
                for draws in _run(buf, 5, 12)]
    whole = case["positive_bias"] == 0
    assert [[d[:4] for d in draws] for draws in observed] == [[d[:4] for d in draws] for draws in case["draws"]]
    if whole:
        assert observed == case["draws"]
        assert sorted(buf.replay_counts().histogram.items()) == [(u, n * RUN_K) for u, n in case["replay_counts"]]
