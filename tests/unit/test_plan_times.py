"""The dry run's wall-time estimate (src/study/timing.py): its formula, and which cells a probe cannot time."""

from __future__ import annotations

import pytest

from src.study.timing import NOT_PROBED, PlanTimes, Timing, duration, evaluations, plan_times, probe_timing


class Job:
    def __init__(self, cell: str, status: str = "launch"):
        self.cell, self.status = cell, status


@pytest.mark.parametrize("settings, expected", [
    (["evaluation.at_start=true", "evaluation.every=0"], 2),   # start and end
    (["evaluation.at_start=false", "evaluation.every=0"], 1),  # the end only
    (["evaluation.at_start=true", "evaluation.every=10"], 7),  # start, steps 10..50, end (steps=60)
    (["evaluation.at_start=true", "evaluation.every=7"], 10),  # start, 7..56, end
])
def test_evaluations_counts_the_start_the_curve_and_the_end(compose_config, settings, expected):
    assert evaluations(compose_config("trainer.steps=60", *settings)) == expected


def test_a_cell_is_loading_steps_and_evaluations_and_a_replay_step_generates_its_fresh_share(compose_config):
    timing = Timing(once_s=10.0, step_s=4.0, evaluation_s=3.0, source="test", generate_s=2.0)
    fresh = compose_config("trainer.steps=5", "trainer.groups_per_step=4", "evaluation.at_start=true",
                           "evaluation.every=0")
    assert timing.cell_seconds(fresh) == 10 + 5 * 4 + 2 * 3
    # rho = 1 at B = 4: B_fresh = 2 groups generated, so half the generating time is saved
    replay = compose_config("trainer.steps=5", "trainer.groups_per_step=4", "evaluation.at_start=true",
                            "evaluation.every=0", "buffer=age1")
    assert timing.cell_step_s(replay) == 4.0 - 2.0 * 0.5
    assert timing.cell_seconds(replay) == 10 + 5 * 3 + 2 * 3


@pytest.mark.parametrize("seconds, said", [(42, "42 s"), (150, "2 min"), (3600 * 2 + 5 * 60, "2 h 05 min")])
def test_durations_read_as_people_say_them(seconds, said):
    assert duration(seconds) == said


@pytest.mark.parametrize("overrides, reason", [
    (["hardware.ranks=2"], "one-process cells only"),
    (["runtime=async"], "the synchronous runtime only (runtime=async)"),
    (["policy.engine=vllm"], "the transformers engine only (policy.engine=vllm)"),
])
def test_a_cell_the_probe_cannot_time_says_why_and_builds_nothing(compose_config, overrides, reason):
    assert reason in probe_timing(compose_config(*overrides), "cell")


def test_without_a_past_run_or_a_probe_the_plan_says_how_to_get_an_estimate(compose_config, tmp_path):
    cfgs = [compose_config("trainer=smoke"), compose_config("trainer=smoke", "buffer=age1")]
    times = plan_times([Job("rho0"), Job("rho1-L1-c1", "finished")], cfgs, f"sqlite:///{tmp_path}/m.db",
                       "replay-rloo", probe=False)
    assert times == PlanTimes({}, [f"no time estimate for 1 job(s): {NOT_PROBED}"])
    assert "hydra.sweeper.probe=true" in NOT_PROBED
