"""buffer=rlep (src/buffer/rlep.py): RLEP's G + M groups (arXiv 2507.07451 section 3.2, Eq. 5) against hand
computations, and its pool's rules."""

from __future__ import annotations

import math

import pytest
import torch

from src.batch import Batch, BatchGroup, Group, fresh_entries
from src.buffer.rlep import RlepPool, RlepQueue
from src.loss.inputs import Needs, RowInputs
from src.loss.variant_math import group_normalised_advantages
from src.runtime.ray_work import batch_of


def group(rewards, step, prompt=(3, 4), first=10, logprobs=None) -> Group:
    """A group of one prompt whose response j is the single token first + j."""
    size = len(rewards)
    return Group(prompt="p", prompt_ids=prompt, truth={"answer": "1"}, responses=[f"r{first + j}" for j in range(size)],
                 response_ids=[(first + j,) for j in range(size)], rewards=rewards, step=step,
                 behaviour_logprobs=logprobs)


def not_measured(groups):
    raise AssertionError("an on-policy group needs no measured log mu")


def test_the_advantage_of_a_group_and_its_appended_successes_is_over_all_g_plus_m():
    """Eq. 5 by hand: G = 4 fresh rewards [0, 0, 1, 0] and M = 2 stored successes give the six rewards
    [0, 0, 1, 0, 1, 1]: mean 1/2, sample std sqrt(6 * 1/4 / 5) = 0.5477, so A = +-0.5 / 0.5477 = +-0.9129."""
    pool = RlepPool(replays=2, seed=0)
    pool.store([group([1.0, 1.0, 0.0], step=0, first=20)], step=0)
    batch = pool.compose(fresh_entries([group([0.0, 0.0, 1.0, 0.0], step=1)]), [], 1, not_measured)
    grown = batch.groups[0]
    assert grown.rewards == (0.0, 0.0, 1.0, 0.0, 1.0, 1.0)
    assert sorted(grown.response_ids[4:]) == [(20,), (21,)]  # the two successes, not the failure
    # One fresh entry for the G rows, one replayed entry (age 1) a success, all of the one grown group.
    assert [(e.source, e.age, e.trained) for e in batch.entries] == [("fresh", 0, (0, 1, 2, 3)), ("replay", 1, (4,)),
                                                                       ("replay", 1, (5,))]
    assert all(e.group is grown for e in batch.entries) and batch.rows == [(0, 0), (0, 1), (0, 2), (0, 3), (1, 4),
                                                                           (2, 5)]
    rows = RowInputs.of(batch, group_normalised_advantages, Needs())
    a = 0.5 / math.sqrt(6 * 0.25 / 5)
    assert a == pytest.approx(0.9129, abs=1e-4)
    assert rows.advantages.tolist() == pytest.approx([-a, -a, a, -a, a, a], abs=1e-5)
    # Without the successes, the same four rewards alone: +-(3/4, 1/4) over their own std.
    alone = RowInputs.of(Batch(fresh_entries([group([0.0, 0.0, 1.0, 0.0], step=1)])), group_normalised_advantages,
                         Needs())
    assert alone.advantages[2] == pytest.approx(0.75 / math.sqrt(0.75 / 3), abs=1e-5)


def test_groups_of_g_and_of_g_plus_m_in_one_batch_each_get_their_own_advantages():
    sizes = [group([0.0, 1.0, 1.0, 0.0, 1.0, 1.0], 1), group([1.0, 0.0, 0.0, 0.0], 1, prompt=(5,))]
    rows = RowInputs.of(Batch(fresh_entries(sizes)), group_normalised_advantages, Needs())
    each = [group_normalised_advantages(torch.tensor([g.rewards]))[0] for g in sizes]
    torch.testing.assert_close(rows.advantages, torch.cat(each))


def test_a_prompt_is_appended_to_only_with_enough_earlier_successes():
    pool = RlepPool(replays=2, min_successes=3, seed=0)
    pool.store([group([1.0, 1.0, 0.0], step=0, first=20), group([1.0, 0.0], step=0, prompt=(7,), first=30)], step=0)
    fresh = [group([0.0, 0.0], 1), group([0.0, 0.0], 1, prompt=(7,)), group([0.0, 0.0], 1, prompt=(8,))]
    assert [g.size for g in pool.compose(fresh_entries(fresh), [], 1, not_measured).groups] == [2, 2, 2]
    pool.store([group([1.0, 0.0], step=1, first=22)], step=1)  # the third success of prompt (3, 4)
    assert pool.compose(fresh_entries(fresh), [], 1, not_measured).groups[0].size == 2  # sampled at step 1
    composed = pool.compose(fresh_entries(fresh), [], 2, not_measured)
    assert [(e.source, e.group.size, e.trained) for e in composed.entries] == [
        ("fresh", 4, (0, 1)), ("replay", 4, (2,)), ("replay", 4, (3,)), ("fresh", 2, (0, 1)), ("fresh", 2, (0, 1))]
    assert pool.metrics(2)["rlep/merged_groups"] == 1.0 and pool.metrics(2)["rlep/replayed_rollouts"] == 2.0


def test_the_pool_keeps_fresh_successes_only_and_drops_the_oldest_over_its_bounds():
    pool = RlepPool(replays=2, per_prompt=3, capacity=4, correct_reward=1.0, seed=0)
    pool.store([group([1.0, 0.5, 1.0], step=0, first=20)], step=0)  # 0.5 is below the task's correct reward
    fresh = group([1.0, 0.0], step=1, first=40)
    batch = pool.compose(fresh_entries([fresh]), [], 1, not_measured)
    # As the step stores it: the grown group once. (20,) and (22,) are in the pool already: only (40,) is new.
    pool.store(batch.fresh_to_store([fresh], lambda grown, row: grown), step=1)
    assert [s.response_ids for s in pool.successes((3, 4), 2)] == [(20,), (22,), (40,)]
    pool.store([group([1.0, 1.0], step=2, first=50)], step=2)  # 3 a prompt: (20,) and (22,) go
    assert [s.response_ids for s in pool.successes((3, 4), 3)] == [(40,), (50,), (51,)]
    pool.store([group([1.0, 1.0], step=3, prompt=(9,), first=60)], step=3)  # 4 in all: (40,) goes
    assert [s.response_ids for s in pool.successes((3, 4), 4)] == [(50,), (51,)] and len(pool) == 4
    assert pool.evicted == 3


def test_appended_rows_of_a_stale_sampler_get_the_current_policys_log_mu():
    """Fresh rows sampled by a stale behaviour keep their mu; the appended successes get log pi now (the authors'
    trainer recomputes old log-probs of all G' with the current actor)."""
    pool = RlepPool(replays=2, seed=0)
    pool.store([group([1.0, 1.0], step=0, first=20)], step=0)
    measured = []

    def measure(groups):
        measured.extend(groups)
        return [g.with_behaviour_logprobs([-9.0] * g.size, tokens=[[-9.0]] * g.size) for g in groups]

    stale = group([0.0, 1.0], 1, logprobs=[-1.0, -2.0])
    fresh, *appended = pool.compose(fresh_entries([stale], off_policy=True), [], 1, measure).entries
    assert fresh.off_policy and fresh.group.behaviour_logprobs == (-1.0, -2.0, -9.0, -9.0)
    assert [(e.source, e.off_policy, e.trained) for e in appended] == [("replay", False, (2,)), ("replay", False, (3,))]
    assert [g.size for g in measured] == [4]


def test_the_pool_resumes_from_its_state_dict_to_the_same_draws():
    pool = RlepPool(replays=2, seed=5)
    pool.store([group([1.0] * 6, step=0, first=20), group([1.0, 1.0, 0.0], step=0, prompt=(9,), first=40)], step=0)
    fresh = fresh_entries([group([0.0, 0.0], 1), group([0.0, 0.0], 1, prompt=(9,))])
    again = RlepPool(replays=2, seed=0)
    again.load_state_dict(pool.state_dict())
    assert again.compose(fresh, [], 1, not_measured).groups == pool.compose(fresh, [], 1, not_measured).groups
    assert again.added == pool.added == 8 and len(again) == 8
    with pytest.raises(ValueError, match="replays=2, this run's has replays=3"):
        RlepPool(replays=3).load_state_dict(pool.state_dict())


@pytest.mark.parametrize("setting", [{"ratio": 1.0}, {"max_age": 2}])
def test_planned_replay_is_refused_in_one_line(setting):
    with pytest.raises(ValueError, match="RLEP samples all B groups fresh"):
        RlepPool(**setting)


def test_a_trained_grown_group_is_stored_as_its_step_fresh_group():
    fresh = group([0.0, 1.0], 1)
    grown = Group(prompt="p", prompt_ids=(3, 4), truth={"answer": "1"}, responses=["r10", "r11", "r20"],
                  response_ids=[(10,), (11,), (20,)], rewards=[0.0, 1.0, 1.0], step=1)
    batch = Batch([BatchGroup(grown, "fresh")])
    assert batch.fresh_to_store([fresh], lambda g, row: (g.size, row)) == [(3, 0)]


# ---- runtime=async: the pool in the rollout queue (RlepQueue) ----

def queue(**settings) -> RlepQueue:
    return RlepQueue(capacity=64, seed=0, **settings)


def test_a_put_group_gets_earlier_successes_of_its_prompt_each_of_its_own_version_and_log_mu():
    """Version 0's group leaves two successes (log mu -1 and -3) in the pool; version 2's group of the same prompt
    gets both appended (G' = 4 + 2): its rewards are the six, the appended rollouts keep version 0 and their log mu,
    and a batch counts their age (2) apart from the fresh rows' (0), all of the one G' group."""
    rlep = queue(replays=2, min_successes=2)
    rlep.put(0, group([1.0, 0.0, 1.0], step=0, first=20, logprobs=[-1.0, -2.0, -3.0]), version=0, wall=0.0)
    assert rlep.take(3, step=0) and len(rlep.pool) == 2  # each rollout used once; the pool keeps the successes
    rlep.put(1, group([0.0, 0.0, 1.0, 0.0], step=2, logprobs=[-5.0] * 4), version=2, wall=1.0)
    grown = rlep.groups[1]
    assert grown.rewards == (0.0, 0.0, 1.0, 0.0, 1.0, 1.0)
    assert grown.response_ids[4:] in {((20,), (22,)), ((22,), (20,))}
    appended = {grown.response_ids[r.index]: r for r in rlep.rollouts if r.index >= 4}
    assert {ids: (r.version, r.group_key < 0) for ids, r in appended.items()} == {(20,): (0, True), (22,): (0, True)}
    assert dict(zip(grown.response_ids, grown.behaviour_logprobs))[(20,)] == -1.0
    assert dict(zip(grown.response_ids, grown.behaviour_logprobs))[(22,)] == -3.0
    batch = batch_of(rlep.take(6, step=2))
    assert sorted((e.age, tuple(sorted(e.trained))) for e in batch.entries) == [(0, (0, 1, 2, 3)), (2, (4,)),
                                                                                 (2, (5,))]
    assert all(e.group is grown for e in batch.entries)
    rows = RowInputs.of(batch, group_normalised_advantages, Needs())
    a = 0.5 / math.sqrt(6 * 0.25 / 5)  # Eq. 5 over the six rewards, as in the synchronous test above
    by_row = dict(zip(batch.rows, rows.advantages.tolist()))
    assert [by_row[row] for row in sorted(by_row, key=lambda row: row[1])] == pytest.approx([-a, -a, a, -a, a, a],
                                                                                          abs=1e-5)
    assert rlep.age(2)["rlep/merged_groups_total"] == 1.0 and len(rlep.pool) == 3  # the new group's success joined


def test_the_queue_appends_nothing_to_a_prompt_with_too_few_successes_and_only_the_tasks_correct_reward_counts():
    rlep = queue(replays=2, min_successes=3, correct_reward=1.0)
    rlep.put(0, group([1.0, 1.0, 0.5], step=0, first=20), version=0, wall=0.0)  # 0.5 is below the correct reward
    rlep.put(1, group([0.0, 0.0], step=1), version=1, wall=1.0)
    assert rlep.groups[1].size == 2 and len(rlep.pool) == 2 and rlep.merged_groups == 0
    rlep.put(2, group([1.0, 0.0], step=1, first=30), version=1, wall=2.0)  # the prompt's third success
    rlep.put(3, group([0.0, 0.0], step=2), version=2, wall=3.0)
    assert rlep.groups[3].size == 4 and rlep.merged_groups == 1


def test_the_queue_resumes_from_its_state_dict_to_the_same_draws_and_refuses_other_pool_settings():
    rlep = queue(replays=2, min_successes=2)
    rlep.put(0, group([1.0] * 5, step=0, first=20, logprobs=[-1.0] * 5), version=0, wall=0.0)
    again = queue(replays=2, min_successes=2)
    again.load_state_dict(rlep.state_dict())
    for each in (rlep, again):
        each.put(1, group([0.0, 0.0], step=1, logprobs=[-2.0, -2.0]), version=1, wall=1.0)
    assert again.groups[1] == rlep.groups[1] and again.rollouts == rlep.rollouts and again.pool.added == 5
    with pytest.raises(ValueError, match=r"\(replays, min_successes, per_prompt, capacity\) = \[2, 2, 64, 100000\], "
                                         r"this run's \[3, 2, 64, 100000\]"):
        queue(replays=3).load_state_dict(rlep.state_dict())


def test_buffer_rlep_names_its_async_cells_by_its_pool(compose_config):
    from src.runtime.runners import AsyncRuntime

    cfg = compose_config("runtime=async", "buffer=rlep")
    assert AsyncRuntime.cell_label(cfg.runtime, cfg).endswith("-rlep2")
    kind, arguments = AsyncRuntime.rollout_queue(cfg, cfg.runtime)
    assert kind is RlepQueue and arguments == {"capacity": 4096, "replays": 2, "min_successes": 2, "per_prompt": 64,
                                               "pool_capacity": 100000}
