"""Budget planning (SPEC 5): simulation with the real buffer vs the paper's closed form."""

import time

import pytest

from src.study.budget import (
    BudgetPlan,
    closed_form_fresh_evaluations,
    plan_fresh_evaluations,
    replay_demand_met,
)
from src.batch import plan_batch

PAPER = {0: 102_400, 0.5: 68_344, 1: 51_712, 1.5: 41_416, 2: 35_080}


@pytest.mark.parametrize("ratio, evaluations", sorted(PAPER.items()))
def test_paper_table(ratio, evaluations):
    plan = plan_fresh_evaluations(groups_per_step=128, group_size=8, steps=100, ratio=ratio, max_age=2)
    assert plan.fresh_evaluations == evaluations
    assert closed_form_fresh_evaluations(128, 8, 100, ratio) == evaluations
    assert plan.gap_fill_groups == 0
    b_fresh, b_replay = plan_batch(128, ratio)
    assert plan.fresh_groups_per_step == (128,) + (b_fresh,) * 99  # step 0 all fresh
    assert plan.replay_groups_per_step == (0,) + (b_replay,) * 99
    assert plan.achieved_ratio == pytest.approx(b_replay / b_fresh)


def test_simulation_is_fast():
    start = time.perf_counter()
    plan_fresh_evaluations(128, 8, 100, 2.0, 3)
    assert time.perf_counter() - start < 1.0


@pytest.mark.parametrize(
    "b, ratio, max_age",
    [
        (b, ratio, max_age)
        for b in (128, 96, 32, 8)
        for ratio in (0, 0.25, 0.5, 1, 1.5, 2, 2.5, 3)
        for max_age in (1, 2, 3)
        if ratio <= max_age
    ],
)
def test_simulation_matches_closed_form_when_ratio_within_age(b, ratio, max_age):
    steps = 30
    plan = plan_fresh_evaluations(b, 8, steps, ratio, max_age)
    closed = closed_form_fresh_evaluations(b, 8, steps, ratio)
    # For these B, ratio <= L implies B_replay <= L * B_fresh (no rounding shortfall; see below).
    assert replay_demand_met(b, ratio, max_age)
    assert plan.fresh_evaluations == closed
    assert plan.gap_fill_groups == 0


@pytest.mark.parametrize(
    "b, ratio, max_age",
    [
        (b, ratio, max_age)
        for b in range(1, 20)
        for ratio in (0.5, 0.9, 1, 1.5, 1.9, 2, 3)
        for max_age in (1, 2, 3)
        if round(b / (1 + ratio)) >= 1  # plan_batch refuses B_fresh = 0
    ],
)
def test_gap_fill_exactly_when_pool_too_small(b, ratio, max_age):
    # Exact feasibility: gap fill (and more fresh evaluations than the formula) iff B_replay > L * B_fresh.
    plan = plan_fresh_evaluations(b, 4, max_age + 5, ratio, max_age)
    closed = closed_form_fresh_evaluations(b, 4, max_age + 5, ratio)
    if replay_demand_met(b, ratio, max_age):
        assert plan.gap_fill_groups == 0 and plan.fresh_evaluations == closed
    else:
        assert plan.gap_fill_groups > 0 and plan.fresh_evaluations > closed


@pytest.mark.parametrize(
    "b, ratio, max_age, split",
    [
        (5, 1.0, 1, (2, 3)),  # round(2.5) = 2 (half to even): B_replay 3 > 1 * 2
        (64, 2.0, 2, (21, 43)),  # round(21.33) = 21: B_replay 43 > 2 * 21
    ],
)
def test_rounding_can_starve_the_pool_even_at_ratio_equal_to_age(b, ratio, max_age, split):
    assert plan_batch(b, ratio) == split
    assert not replay_demand_met(b, ratio, max_age)
    plan = plan_fresh_evaluations(b, 8, 10, ratio, max_age)
    assert plan.gap_fill_groups > 0
    assert plan.fresh_evaluations > closed_form_fresh_evaluations(b, 8, 10, ratio)


def test_ratio_above_age_shows_gap_fill():
    plan = plan_fresh_evaluations(128, 8, 100, ratio=2, max_age=1)
    closed = closed_form_fresh_evaluations(128, 8, 100, 2)
    assert plan.gap_fill_groups > 0
    assert plan.fresh_evaluations > closed
    assert plan.achieved_ratio < 2
    # Hand-traced: step 1 replays 85 of step 0's 128; step 2 finds only step 1's 43 (gap 42,
    # so 85 fresh); step 3 finds those 85 again. The schedule alternates.
    assert plan.replay_groups_per_step[:5] == (0, 85, 43, 85, 43)
    assert plan.fresh_groups_per_step[:5] == (128, 43, 85, 43, 85)
    assert plan.fresh_evaluations == sum(plan.fresh_groups_per_step) * 8


def test_ratio_zero_is_fresh_only():
    plan = plan_fresh_evaluations(128, 8, 100, 0, max_age=1)
    assert plan.replay_groups_per_step == (0,) * 100
    assert plan.achieved_ratio == 0.0
    assert plan.fresh_evaluations == 100 * 128 * 8


def test_single_step_run():
    plan = plan_fresh_evaluations(128, 8, 1, 1.0, 2)
    assert plan.fresh_evaluations == 128 * 8 == closed_form_fresh_evaluations(128, 8, 1, 1.0)
    assert plan.achieved_ratio != plan.achieved_ratio  # nan: no step after the first


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(groups_per_step=128, group_size=1, steps=10, ratio=1, max_age=2), "group_size"),
        (dict(groups_per_step=128, group_size=8, steps=0, ratio=1, max_age=2), "steps"),
        (dict(groups_per_step=128, group_size=8, steps=10, ratio=1, max_age=0), "max_age"),
        (dict(groups_per_step=0, group_size=8, steps=10, ratio=1, max_age=2), "groups_per_step"),
    ],
)
def test_validation(kwargs, match):
    with pytest.raises(ValueError, match=match):
        plan_fresh_evaluations(**kwargs)


def test_budget_plan_is_frozen():
    plan = plan_fresh_evaluations(16, 8, 5, 1, 2)
    assert isinstance(plan, BudgetPlan)
    with pytest.raises(AttributeError):
        plan.steps = 3


@pytest.mark.parametrize("ratio,max_age", [(1.0, 2), (2.0, 1), (0.5, 2), (1.5, 3), (3.0, 2)])
def test_long_plans_jump_over_repeating_cycles_exactly(ratio, max_age):
    """Counts-only reference: a step replays min(B_replay, groups stored over the last L steps)."""
    steps, groups = 5_000, 128
    b_fresh, b_replay = plan_batch(groups, ratio)
    fresh_counts = []
    for step in range(steps):
        pool = sum(fresh_counts[max(0, step - max_age):step])
        fresh_counts.append(b_fresh + b_replay - min(b_replay, pool))
    plan = plan_fresh_evaluations(groups, 8, steps, ratio, max_age)
    assert plan.fresh_groups_per_step == tuple(fresh_counts)
    assert plan.gap_fill_groups == sum(fresh_counts[1:]) - (steps - 1) * b_fresh


def test_an_absurd_step_count_is_refused_not_walked():
    with pytest.raises(ValueError, match="steps must be an integer between 1 and"):
        plan_fresh_evaluations(128, 8, 10**12, 1.0, 2)


def test_the_table_of_a_store_without_planned_replay_shows_the_age1_cost_at_other_ratios(compose_config):
    """buffer=none and buffer=popo replay nothing by their settings (rho = 0); the table's rows at rho > 0 show
    what replay would cost, planned with the age buffer at L = 1."""
    from src.study.budget import budget_table

    age1 = budget_table(compose_config("buffer=age1"), [1.0, 2.0])
    assert age1[1]["gap_fill_groups"] > 0 and age1[0]["L"] == 1  # rho = 2 > L = 1: the age buffer falls short
    for option in ("buffer=none", "buffer=popo"):
        rows = budget_table(compose_config(option), [0.0, 1.0, 2.0])
        assert rows[1:] == age1
        assert rows[0]["fresh_evaluations"] == rows[0]["closed_form"] and rows[0]["L"] is None


def test_the_table_says_how_many_groups_a_capacity_of_n_rollouts_holds_when_it_cuts_the_pool(compose_config):
    """`buffer.capacity` counts rollouts for the FIFO and the age buffer alike; a note on a plan it cuts says both."""
    from src.study.budget import budget_table

    small = ("trainer.groups_per_step=8", "trainer.group_size=4", "trainer.steps=6")
    fifo = budget_table(compose_config("buffer=fifo", "buffer.mode=without_replacement", "buffer.capacity=8",
                                       "buffer.allow_infeasible=true", *small))[0]
    assert "the FIFO keeps N=8 rollouts (2 groups of K=4), fewer than B_replay=4" in fifo["formula_note"]
    age = budget_table(compose_config("buffer=age2", "buffer.capacity=12", *small))[0]
    assert "buffer.capacity=12 rollouts (3 groups of K=4) < the L*B_fresh=8 groups the pool needs" in age["formula_note"]
