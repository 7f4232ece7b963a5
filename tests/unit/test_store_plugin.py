"""A replay store written outside `src/` plugs in by config alone (`buffer._target_=...`): one class, no edits."""

from __future__ import annotations

from src.batch import BatchGroup, Group
from src.buffer.store import ReplayStore
from src.task import countdown
from tests.e2e.test_golden import golden_config, run_steps


class NewestGroupsStore(ReplayStore):
    """Replays the most recently stored groups (age >= 1), keeping at most `capacity` of them."""

    counters = ("stored",)

    def __init__(self, ratio: float, capacity: int, groups_per_step: int, seed: int = 0, **_) -> None:
        super().__init__(seed)
        self.ratio, self.capacity, self.stored = float(ratio), int(capacity), 0
        self.kept: list[Group] = []

    @property
    def groups(self) -> tuple[Group, ...]:
        return tuple(self.kept)

    def _draw(self, count: int, step: int) -> list[BatchGroup]:
        eligible = [group for group in self.kept if group.age(step) >= 1]
        return [BatchGroup(group, "replay", group.age(step)) for group in eligible[-count:]] if count else []

    def store(self, groups: list[Group], step: int) -> None:
        self.kept = (self.kept + groups)[-self.capacity:]
        self.stored += len(groups)

    def age_histogram(self, step: int) -> dict[int, int]:
        ages = [group.age(step) for group in self.kept]
        return {age: ages.count(age) for age in sorted(set(ages))}

    def _contents(self) -> list:
        return [group.__dict__ for group in self.kept]


def test_a_store_defined_in_a_test_file_runs_two_steps_by_config_alone(compose_config):
    cfg = golden_config(compose_config, ["buffer=age1", f"buffer._target_={__name__}.NewestGroupsStore",
                                         "buffer.capacity=3"])
    history = run_steps(cfg, countdown.generate_instances(64, seed=1), steps=2)
    assert [step["batch/replay_groups"] for step in history] == [0, 2]  # step 0 has nothing of age >= 1
    assert [step["batch/fresh_groups"] for step in history] == [4, 2]
    assert history[1]["buffer/size"] == 3 and history[1]["buffer/age1"] == 3  # capacity 3 of step 0's 4 groups
    assert history[1]["budget/fresh_evaluations"] == (4 + 2) * 4
    assert history[1]["weights/raw_mean/replay"] > 0  # replayed rows were weighted against their stored mu
