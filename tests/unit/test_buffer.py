"""Replay buffer rules (SPEC 3), each tested on hand-built groups."""

import random

import pytest

from tests.conftest import through_checkpoint

from src.batch import Group
from src.buffer.age import ReplayBuffer


def make_group(step: int, tag: str = "", k: int = 2, logprobs: bool = True) -> Group:
    return Group(
        prompt=f"p{step}{tag}",
        prompt_ids=[1, 2, 3],
        truth={"numbers": [3, 5, 7], "target": 15},
        responses=[f"r{i}" for i in range(k)],
        response_ids=[[10 + i, 11] for i in range(k)],
        rewards=[1.0] + [0.0] * (k - 1),
        step=step,
        behaviour_logprobs=[-1.5] * k if logprobs else None,
    )


# ---- Group ----


def test_group_normalises_lists_to_tuples_and_reports_size_and_age():
    g = make_group(step=3, k=4)
    assert g.size == 4
    assert isinstance(g.responses, tuple) and isinstance(g.response_ids[0], tuple)
    assert g.rewards == (1.0, 0.0, 0.0, 0.0)
    assert g.age(3) == 0 and g.age(5) == 2


@pytest.mark.parametrize(
    "field, value",
    [
        ("responses", ["a", "b", "c"]),
        ("response_ids", [[1], [2], [3]]),
        ("rewards", [1.0, 0.0, 0.1]),
        ("behaviour_logprobs", [-1.0, -2.0, -3.0]),
    ],
)
def test_group_rejects_mismatched_lengths(field, value):
    kwargs = dict(
        prompt="p", prompt_ids=[1], truth={"numbers": [1, 2, 3], "target": 6},
        responses=["a", "b"], response_ids=[[1], [2]], rewards=[1.0, 0.0],
        step=0, behaviour_logprobs=[-1.0, -2.0],
    )
    kwargs[field] = value
    with pytest.raises(ValueError, match=field):
        Group(**kwargs)


def test_group_rejects_k_below_two():
    with pytest.raises(ValueError, match="K >= 2"):
        make_group(step=0, k=1)


def test_with_behaviour_logprobs_copies_and_validates():
    g = make_group(step=0, logprobs=False)
    assert g.behaviour_logprobs is None
    g2 = g.with_behaviour_logprobs([-0.5, -0.25])
    assert g2.behaviour_logprobs == (-0.5, -0.25) and g.behaviour_logprobs is None
    with pytest.raises(ValueError, match="behaviour_logprobs=3"):
        g.with_behaviour_logprobs([-1.0, -1.0, -1.0])


def test_reference_logprobs_are_per_token_and_survive_save_and_load(tmp_path):
    g = make_group(step=0, logprobs=False).with_behaviour_logprobs([-0.5, -0.25], [[-0.1, -0.2], [-0.3, -0.4]])
    assert g.reference_logprobs == ((-0.1, -0.2), (-0.3, -0.4))
    with pytest.raises(ValueError, match="one value per response token"):
        make_group(step=0).with_behaviour_logprobs([-0.5, -0.25], [[-0.1], [-0.3, -0.4]])
    with pytest.raises(ValueError, match="reference_logprobs=1"):
        make_group(step=0).with_behaviour_logprobs([-0.5, -0.25], [[-0.1, -0.2]])
    buffer = ReplayBuffer(max_age=2)
    buffer.add([g])
    assert through_checkpoint(buffer, ReplayBuffer(max_age=2), tmp_path / "buffer.pt").groups == (g,)


def test_with_behaviour_logprobs_accepts_a_tensor():
    torch = pytest.importorskip("torch")
    g = make_group(step=0, logprobs=False).with_behaviour_logprobs(torch.tensor([-0.5, -0.25]))
    assert g.behaviour_logprobs == (-0.5, -0.25)


# ---- ReplayBuffer ----


def test_max_age_must_be_positive():
    with pytest.raises(ValueError, match="max_age"):
        ReplayBuffer(max_age=0)


def test_add_requires_behaviour_logprobs():
    buf = ReplayBuffer(max_age=2)
    with pytest.raises(ValueError, match="behaviour_logprobs"):
        buf.add([make_group(step=0, logprobs=False)])
    assert len(buf) == 0


def test_group_added_this_step_is_never_replayed_this_step():
    buf = ReplayBuffer(max_age=3)
    # step 0: buffer empty, nothing to replay; add after the update.
    assert buf.sample(5, step=0) == []
    buf.add([make_group(0, "a")])
    # Even if the trainer asked again at step 0, the age-0 group is not eligible.
    assert buf.sample(5, step=0) == []
    assert buf.eligible(0) == []
    buf.evict(0)
    # Next step it has age 1 and is eligible.
    assert [g.prompt for g in buf.sample(5, step=1)] == ["p0a"]


def test_eligibility_is_tested_per_group_with_mixed_ages():
    buf = ReplayBuffer(max_age=2)
    groups = [make_group(s) for s in (7, 8, 9, 10)]  # ages at step 10: 3, 2, 1, 0
    buf.add(groups)
    assert {g.step for g in buf.eligible(10)} == {8, 9}
    drawn = buf.sample(10, step=10)
    assert sorted(g.step for g in drawn) == [8, 9]


def test_group_replayable_exactly_at_steps_s_plus_1_to_s_plus_L_then_gone():
    L = 2
    buf = ReplayBuffer(max_age=L)
    buf.add([make_group(5)])
    assert buf.evict(5) == 0
    for t in (6, 7):  # s+1 .. s+L
        assert len(buf.sample(1, step=t)) == 1
        assert buf.evict(t) == 0  # age <= L: not older than L yet (appendix B.3)
    assert buf.sample(1, step=8) == []  # age L + 1: stored, but not eligible
    assert buf.evict(8) == 1 and len(buf) == 0  # older than L at the end of step s + L + 1: dropped


def test_over_age_groups_dropped_and_counted():
    buf = ReplayBuffer(max_age=1)
    buf.add([make_group(0), make_group(0), make_group(1)])
    assert buf.evict(1) == 0  # ages 1, 1, 0 at step 1: none older than L
    assert buf.evict(2) == 2  # the step-0 groups are 2 > L old at step 2
    assert [g.step for g in buf.groups] == [1]
    assert buf.evicted == 2


def test_buffer_holds_at_most_L_plus_1_generations_as_appendix_b3_bounds_it():
    """Through the store interface: after each step ages 0..L are kept, (L + 1) * B_fresh groups at most."""
    L, fresh = 2, 3
    buf = ReplayBuffer(max_age=L)
    sizes = []
    for t in range(8):
        buf.draw(2, t)
        sizes.append(buf.metrics(t)["buffer/size"])
        buf.store([make_group(t, tag=str(i)) for i in range(fresh)], t)
        assert sorted(buf.age_histogram(t)) == list(range(min(t, L) + 1))
    assert sizes == [0, 3, 6, 9, 9, 9, 9, 9]  # at the draw: ages 1..L+1, the oldest no longer eligible
    assert max(sizes) == (L + 1) * fresh


def test_sampled_groups_stay_stored_until_over_age():
    buf = ReplayBuffer(max_age=3)
    buf.add([make_group(0)])
    buf.evict(0)
    for t in (1, 2, 3):
        assert len(buf.sample(1, step=t)) == 1
        assert len(buf) == 1  # reused groups are not removed (nor re-added)
        buf.evict(t)
    assert len(buf) == 1  # age 3 = L: kept to the end of step 4
    buf.evict(4)
    assert len(buf) == 0


def test_sample_returns_min_of_count_and_eligible_without_duplicates():
    buf = ReplayBuffer(max_age=2, seed=1)
    buf.add([make_group(4, tag=str(i)) for i in range(20)])
    drawn = buf.sample(7, step=5)
    assert len(drawn) == 7
    assert len({g.prompt for g in drawn}) == 7
    everything = buf.sample(50, step=5)
    assert len(everything) == 20 and len({g.prompt for g in everything}) == 20
    assert buf.sample(0, step=5) == []
    with pytest.raises(ValueError, match="count"):
        buf.sample(-1, step=5)


def test_sampling_is_uniform():
    n_groups, draws, per_draw = 10, 5000, 3
    buf = ReplayBuffer(max_age=1, seed=123)
    buf.add([make_group(0, tag=str(i)) for i in range(n_groups)])
    counts = {g.prompt: 0 for g in buf.groups}
    for _ in range(draws):
        for g in buf.sample(per_draw, step=1):
            counts[g.prompt] += 1
    expected = draws * per_draw / n_groups
    chi2 = sum((c - expected) ** 2 / expected for c in counts.values())
    # 9 degrees of freedom: P(chi2 > 40) is about 1e-5; a biased sampler lands far above.
    assert chi2 < 40, counts


def test_capacity_safety_net_drops_oldest():
    buf = ReplayBuffer(max_age=10, capacity=8)  # N = 8 rollouts: four groups of K = 2
    buf.add([make_group(0, "a"), make_group(0, "b")])
    buf.add([make_group(1, "c"), make_group(1, "d")])
    buf.add([make_group(2, "e")])
    assert len(buf) == 4 and buf.capacity_drops == 1
    assert [g.prompt for g in buf.groups] == ["p0b", "p1c", "p1d", "p2e"]


def test_age_histogram():
    buf = ReplayBuffer(max_age=3)
    buf.add([make_group(3), make_group(3), make_group(4), make_group(5)])
    assert buf.age_histogram(5) == {0: 1, 1: 1, 2: 2}


def _run(buf: ReplayBuffer, start: int, stop: int) -> list[list[str]]:
    """Drive the SPEC 3 step order; return the prompts replayed at each step."""
    out = []
    for t in range(start, stop):
        replay = buf.sample(3, step=t)
        out.append([g.prompt for g in replay])
        buf.add([make_group(t, tag=str(i)) for i in range(4)])
        buf.evict(t)
    return out


def test_state_dict_restores_future_samples_exactly():
    reference = ReplayBuffer(max_age=2, seed=7)
    _run(reference, 0, 5)
    state = reference.state_dict()
    restored = ReplayBuffer(max_age=2, seed=999)  # a different seed must not matter
    restored.load_state_dict(state)
    assert restored.groups == reference.groups
    assert _run(restored, 5, 15) == _run(reference, 5, 15)


def test_save_load_file_roundtrip_continues_identically(tmp_path):
    reference = ReplayBuffer(max_age=3, seed=11)
    _run(reference, 0, 6)
    restored = through_checkpoint(reference, ReplayBuffer(max_age=3), tmp_path / "buffer.pt")
    assert restored.max_age == 3 and restored.capacity == reference.capacity
    assert restored.groups == reference.groups
    assert restored.groups[0].behaviour_logprobs == (-1.5, -1.5)
    assert _run(restored, 6, 20) == _run(reference, 6, 20)


def test_uninterrupted_equals_interrupted_run():
    straight = ReplayBuffer(max_age=2, seed=3)
    full = _run(straight, 0, 12)
    first = ReplayBuffer(max_age=2, seed=3)
    head = _run(first, 0, 4)
    second = ReplayBuffer(max_age=2, seed=0)
    second.load_state_dict(first.state_dict())
    assert head + _run(second, 4, 12) == full


def test_load_state_dict_rejects_different_max_age():
    buf = ReplayBuffer(max_age=2)
    with pytest.raises(ValueError, match="max_age"):
        ReplayBuffer(max_age=1).load_state_dict(buf.state_dict())


def test_state_dict_is_plain_data():
    import pickle

    buf = ReplayBuffer(max_age=2)
    _run(buf, 0, 3)
    state = buf.state_dict()
    assert all(isinstance(g, dict) for g in state["contents"])
    assert pickle.loads(pickle.dumps(state)) == state
    random.Random().setstate((state["rng_state"][0], tuple(state["rng_state"][1]), state["rng_state"][2]))
