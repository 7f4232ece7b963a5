"""The asynchronous runtime's pure pieces (SPEC 11): formulas, rollout queues, lockstep clock, pipeline drivers."""

from __future__ import annotations

import math
from fractions import Fraction

import pytest

from tests.conftest import wall_clock
import torch

from src.batch import Group
from src.runtime import formulas
from src.runtime.pipeline import (FreePipeline, Generated, LockstepPipeline, PipelineError, PipelineSettings)
from src.buffer.rollouts import LifoQueue, RolloutQueue
from src.variant import described
from src.runtime.schedule import LockstepClock


def group(key: int, k: int = 4, correct=()) -> Group:
    rewards = [1.0 if i in correct else 0.1 for i in range(k)]
    return Group(prompt=f"p{key}", prompt_ids=(1, 2), truth={"numbers": [1, 2, 3], "target": 6}, responses=["x"] * k,
                 response_ids=[(3, 4)] * k, rewards=rewards, step=0, behaviour_logprobs=[-1.0] * k)


# --------------------------------------------------------------------------- formulas
def test_eq2_gives_spec_table1_and_table3_rows_and_the_paper_rounding_fits_mu_5_2():
    at = lambda mu: [round(g, 2) for g in formulas.gamma_table(mu).values()]  # noqa: E731
    assert at(5.28) == [1.27, 0.64, 0.42, 0.32, 0.21, 0.18]          # eq. 2 (SPEC 11)
    assert at(6.84) == [1.02, 0.51, 0.34, 0.26, 0.17, 0.15]          # Table 3, (6,2) = 0.51 per Figure 4
    assert at(5.2) == [1.29, 0.65, 0.43, 0.32, 0.22, 0.18]           # Table 1 as printed
    assert formulas.compute_per_update(6, 2, 5.28, buffer=True) == 4.0
    assert formulas.compute_per_update(6, 2, 5.28, buffer=False) == pytest.approx(6.28)


def test_footnote5_replay_counts_and_mu_from_counts():
    assert [round(formulas.expected_replay_count_from_rates(w, t, 5.28), 2) for w, t in ((6, 2), (5, 3), (4, 4))] \
        == [1.76, 3.17, 5.28]
    r = formulas.rollouts_per_step(60, 6, 2, 5.28)
    assert formulas.expected_replay_count(60, r) == pytest.approx(formulas.expected_replay_count_from_rates(6, 2, 5.28))
    assert formulas.mu_from_counts(trained=600, generated=300, workers=6, trainers=2) == 6.0
    assert math.isnan(formulas.mu_from_counts(10, 0, 1, 1))
    assert formulas.worker_cost_per_group(2.0, 1, 4, 8) == 1.0
    with pytest.raises(ValueError, match="mu"):
        formulas.compute_ratio(1, 1, 0)


def test_areal_block_rule():
    # B = 4, eta = 0: rollouts 1..4 may start at version 0, the 5th waits for version 1
    assert [formulas.may_start(n, 4, 0, 0) for n in (1, 4, 5)] == [True, True, False]
    assert formulas.may_start(8, 4, 1, 0) and not formulas.may_start(9, 4, 1, 0)
    assert formulas.may_start(8, 4, 0, 1) and not formulas.may_start(9, 4, 0, 1)
    assert formulas.may_start(12, 4, 1, 1) and not formulas.may_start(13, 4, 1, 1)
    assert formulas.may_start(10**6, 4, 0, None)


# --------------------------------------------------------------------------- queues
def test_buffer_keeps_the_n_newest_samples_distinct_and_removes_nothing():
    buffer = RolloutQueue(capacity=6, seed=0)
    evicted = []
    for key in range(3):
        evicted += buffer.put(key, group(key), version=key, wall=0.0)
    assert [r.uid for r in buffer.rollouts] == list(range(6, 12)) and [r.uid for r in evicted] == list(range(6))
    assert 0 not in buffer.groups and set(buffer.groups) == {1, 2}
    samples = buffer.take(6, step=3)
    assert sorted(s.rollout.uid for s in samples) == list(range(6, 12)) and len(buffer) == 6
    assert [s.off_policiness for s in samples if s.rollout.group_key == 2] == [1, 1, 1, 1]
    again = buffer.take(6, step=5)
    assert {s.since_last_use for s in again} == {2}
    assert buffer.replay_counts == {0: 6}


def test_independent_draws_repeat_within_a_batch_and_count_zero_steps_since_last_use():
    buffer = RolloutQueue(capacity=16, seed=1, mode="with_replacement")
    for key in range(4):
        buffer.put(key, group(key), 0, 0.0)
    samples = buffer.take(16, step=2)
    assert len({s.rollout.uid for s in samples}) < 16  # with this seed, some rollout is drawn twice
    seen = set()
    for sample in samples:  # D.3: "new" on first use, 0 for a repeat in the same batch
        assert sample.since_last_use == (0 if sample.rollout.uid in seen else None)
        seen.add(sample.rollout.uid)
    assert sum(r.uses for r in buffer.rollouts) == 16


def test_at_least_once_draws_every_queued_rollout_before_any_twice_per_shard():
    # Figure 18's rule in the one core, now also the pipeline's: two groups of K = 4 in two shards of 4
    buffer = RolloutQueue(capacity=8, seed=5, mode="at_least_once", shards=2)
    for key in range(2):
        buffer.put(key, group(key), 0, 0.0)
    first, second = buffer.take(4, step=1), buffer.take(4, step=2)
    assert all(s.since_last_use is None for s in first + second)  # all 8 new before any repeat
    assert sorted(s.rollout.uid for s in first + second) == list(range(8))
    assert sorted(s.rollout.uid % 2 for s in first) == [0, 0, 1, 1]
    third = buffer.take(4, step=3)
    assert len({s.rollout.uid for s in third}) == 4 and {s.use for s in third} == {2}


def test_positive_bias_keeps_freshest_share_plus_freshest_correct_rollouts():
    # D.4 example: N = 8, delta = 0.75 -> 2 freshest of any reward + 6 freshest correct older ones
    buffer = RolloutQueue(capacity=8, seed=0, positive_bias=0.75)
    buffer.put(0, group(0, k=4, correct=(0, 2)), 0, 0.0)
    buffer.put(1, group(1, k=4, correct=(1,)), 0, 0.0)
    buffer.put(2, group(2, k=4, correct=()), 0, 0.0)
    kept = [(r.group_key, r.index) for r in buffer.rollouts]
    assert kept == [(0, 0), (0, 2), (1, 1), (2, 2), (2, 3)]


def test_sharded_buffer_keeps_n_over_t_per_trainer_and_draws_b_over_t_from_each():
    buffer = RolloutQueue(capacity=8, seed=0, shards=2)
    for key in range(3):
        buffer.put(key, group(key), key, 0.0)
    assert [r.uid for r in buffer.rollouts] == [4, 5, 6, 7, 8, 9, 10, 11]  # 4 newest of each shard
    assert not buffer.ready(10) and buffer.ready(8)
    samples = buffer.take(4, step=3)
    assert sorted(s.rollout.uid % 2 for s in samples) == [0, 0, 1, 1]
    with pytest.raises(ValueError, match="multiple of T"):
        RolloutQueue(capacity=9, shards=2)


def test_lifo_takes_newest_first_and_uses_each_rollout_once():
    queue = LifoQueue(capacity=12)
    for key in range(3):
        queue.put(key, group(key), key, 0.0)
    first = queue.take(4, step=3)
    assert [s.rollout.uid for s in first] == [11, 10, 9, 8] and all(s.since_last_use is None for s in first)
    second = queue.take(6, step=4)
    assert [s.rollout.uid for s in second] == [7, 6, 5, 4, 3, 2] and len(queue) == 2
    assert queue.replay_counts == {1: 10} and set(queue.groups) == {0}
    assert queue.room(4, in_flight=4) and not queue.room(4, in_flight=8)


def test_queue_reports_its_replay_counts_distributions_and_drains_its_events():
    queue = LifoQueue(capacity=12)
    for key in range(3):
        queue.put(key, group(key), key, 0.0)
    queue.take(6, step=3)  # 6 retired after one use, 6 still queued and unused
    assert queue.replay_count_distribution() == {0: 6, 1: 6} and queue.replay_counts == {1: 6}
    assert queue.distributions() == {"off_policiness": {1: 4, 2: 2}, "replay_count": {0: 6, 1: 6},
                                     "since_last_use": {}, "new_uses": 6}
    events = queue.drain_events()
    assert [e["event"] for e in events] == ["put", "put", "put", "sample", "consume"]
    assert queue.drain_events() == [] and queue.size() == len(queue) == 6


def test_queue_state_survives_a_weights_only_checkpoint(tmp_path):
    buffer = RolloutQueue(capacity=6, seed=3)
    for key in range(3):
        buffer.put(key, group(key), key, float(key), virtual=float(key))
    buffer.take(4, step=3)
    torch.save(buffer.state_dict(), tmp_path / "q.pt")
    restored = RolloutQueue(capacity=6, seed=99)
    restored.load_state_dict(torch.load(tmp_path / "q.pt", weights_only=True))
    assert restored.rollouts == buffer.rollouts and restored.groups == buffer.groups
    assert [s.rollout.uid for s in restored.take(4, 4)] == [s.rollout.uid for s in buffer.take(4, 4)]
    with pytest.raises(ValueError, match="N=6"):
        LifoQueue(6).load_state_dict(buffer.state_dict())


# --------------------------------------------------------------------------- lockstep clock
def test_clock_breaks_ties_by_role_then_id_and_measures_idle_time():
    clock = LockstepClock(workers=2, worker_cost=1.0, trainer_cost=Fraction(1))
    clock.start("worker", 1)
    clock.start("worker", 0)
    clock.start("trainer", 0)
    assert clock.advance() == [("trainer", 0), ("worker", 0), ("worker", 1)] and clock.now == 1
    clock.start("worker", 0)
    clock.advance()
    assert clock.idle_ratio("trainer") == 0.5 and clock.idle_ratio("worker") == 0.25
    state = clock.state_dict()
    clock.start("trainer", 0)
    other = LockstepClock(2, 1.0)
    other.load_state_dict(state)
    other.start("trainer", 0)
    assert other.advance() == clock.advance()


# --------------------------------------------------------------------------- the pipeline drivers
class FakeWork:
    """Deterministic stand-in for the Ray work: a group's rewards follow from its key."""

    published, groups_per_request = 0, 1

    def __init__(self):
        self.running, self.preloaded, self.updates, self.versions_loaded = {}, {}, [], []
        self.arrived_at: list[int] = []  # the step counter each `result` and `poll` was given

    def start(self, worker, key, version):
        version = self.published if version is None else version
        groups = [Generated(k, worker, version, group(k, correct=(k % 4,)), 0.5, request=key)
                  for k in range(key, key + self.groups_per_request)]
        self.running.setdefault(worker, []).append(groups)

    def result(self, worker, version):
        self.arrived_at.append(version)
        return self.preloaded.pop(worker, None) or self.running[worker].pop(0)

    peek = lambda self, worker: self.running[worker][0]  # noqa: E731

    def preload(self, worker, groups):
        self.preloaded[worker] = groups

    def poll(self, timeout, version):  # each worker finishes its oldest request
        self.arrived_at.append(version)
        return [g for w in sorted(self.running) if self.running[w] for g in self.running[w].pop(0)]

    def train(self, step, samples, arrived, publish):
        self.updates.append((step, [(s.rollout.uid, s.rollout.version) for s in samples]))
        self.publishing = publish

    def trained(self):
        if self.publishing is not None:
            self.publish(self.publishing)
        return {"train/reward": 0.0}, None if self.publishing is None else 0.0

    def publish(self, version):
        self.versions_loaded.append(version)
        self.published = version
        return 0.0


def machine_free(metrics: list[dict]) -> list[dict]:
    """Metrics without the wall-clock ones (`time/`), which no two runs share."""
    return [{k: v for k, v in m.items() if not wall_clock(k)} for m in metrics]


def lockstep(queue="buffer", capacity=64, **settings):
    options = dict(workers=1, trainers=1, batch=8, group_size=4, mu=2.0) | settings
    kind = RolloutQueue if queue == "buffer" else LifoQueue
    return LockstepPipeline(PipelineSettings(**options), kind(capacity, seed=0), FakeWork())


def test_lockstep_measured_replay_ratio_equals_the_footnote5_prediction():
    # R is measured between the first and the latest trainer start: over whole periods of the schedule
    # (1, 2, 2 and 3 steps here; 30 is a multiple of each) it is exactly the rate footnote 5 assumes.
    for workers, trainers, mu in ((1, 1, 2.0), (2, 1, 4.0), (1, 2, 1.5), (3, 1, 6.0)):
        pipeline = lockstep(workers=workers, trainers=trainers, mu=mu, capacity=256)
        metrics = [pipeline.next_step() for _ in range(31)][-1]
        assert metrics["replay/ratio_measured"] == pytest.approx(mu * trainers / workers, rel=1e-12)
        assert metrics["replay/ratio_predicted"] == pytest.approx(mu * trainers / workers)


def test_lockstep_long_run_mean_replay_count_approaches_footnote5():
    pipeline = lockstep(mu=3.0, capacity=48)
    for _ in range(600):
        metrics = pipeline.next_step()
    assert metrics["replay/count_mean"] == pytest.approx(3.0, rel=0.02)
    assert metrics["replay/ratio_counts"] == pytest.approx(3.0, rel=0.02)


def test_arrivals_carry_the_one_step_counter_the_updates_the_clock_has_finished():
    """The curriculum records arriving groups with `Counters.version` (what `result` is given): under the lockstep
    clock a group that arrives while an update runs in virtual time counts it undone, though its work is done."""
    pipeline = lockstep(workers=2, mu=0.5, capacity=64)  # the trainer slower than the workers: arrivals mid-update
    finished = []
    for _ in range(6):
        pipeline.next_step()
        finished.append(pipeline.counters.version)
    arrivals = [e for e in pipeline.events if e["event"] in ("put", "update", "publish")]
    done, seen = 0, []
    for event in arrivals:  # the updates finished (published: sync_every=1) before each group is put
        if event["event"] == "publish":
            done = event["version"]
        elif event["event"] == "put":
            seen.append(done)
    # the queue's events reach the log at the step's end: the last arrivals are not in it yet
    assert pipeline.work.arrived_at[:len(seen)] == seen and len(seen) >= 40 and finished == [1, 2, 3, 4, 5, 6]
    # the update of step 0 runs for four rounds of the workers: their groups arrive with 0 updates done
    assert seen[:8] == [0] * 8 and sorted(set(seen)) == [0, 1, 2, 3, 4, 5]


def test_lockstep_is_deterministic_and_versions_never_exceed_the_trainers():
    runs = []
    for _ in range(2):
        pipeline = lockstep(workers=2, mu=3.0, capacity=24, sync_every=2)
        metrics = [pipeline.next_step() for _ in range(12)]
        runs.append(repr((pipeline.events, machine_free(metrics), pipeline.work.updates)))  # repr: nan == nan
    assert runs[0] == runs[1]
    for step, used in pipeline.work.updates:
        assert all(version <= step for _, version in used)
    assert max(m["offpolicy/max"] for m in metrics) >= 2  # sync_every=2 lets versions lag


def test_lockstep_lifo_uses_each_rollout_once_and_workers_wait_when_full():
    pipeline = lockstep("lifo", capacity=16, workers=3, mu=1.0)
    for _ in range(20):
        pipeline.next_step()
    used = [uid for _, batch in pipeline.work.updates for uid, _ in batch]
    assert len(used) == len(set(used)) == 160
    assert len(pipeline.queue) + 4 * len(pipeline.counters.in_flight) <= 16


def most_ahead(events, batch: int, group_size: int) -> int:
    """The largest floor((N_r - 1) / B) - i over the run's generate events (AReaL's rule bounds it by eta)."""
    started, version, worst = 0, 0, -10**9
    for event in events:
        if event["event"] == "generate":
            started += group_size
            worst = max(worst, (started - 1) // batch - version)
        elif event["event"] == "publish":
            version = event["version"]
    return worst


def test_block_bound_holds_areal_rule_and_drop_evicts_stale_rollouts():
    blocked, unbounded = lockstep(workers=4, mu=1.0, staleness=1), lockstep(workers=4, mu=1.0)
    for pipeline in (blocked, unbounded):
        for _ in range(20):
            pipeline.next_step()
    assert most_ahead(blocked.events, 8, 4) <= 1 < most_ahead(unbounded.events, 8, 4)
    dropped = lockstep(workers=1, mu=4.0, max_age=1, capacity=64)
    assert max(dropped.next_step()["offpolicy/max"] for _ in range(20)) <= 1


def max_off_policiness(queue: str, mode: str, eta: int | None, steps: int = 40) -> int:
    # Four workers at mu = 1 make rollouts four times faster than the trainer uses them: a FIFO of 64 then
    # keeps each rollout for several steps, and a LIFO of 32 keeps workers waiting on a full queue.
    # `block`: eta is AReaL's bound (runtime.staleness); `drop`: the age window (buffer.max_age).
    bound = {"staleness": eta} if mode == "block" else {"max_age": eta}
    pipeline = lockstep(queue, capacity=64 if queue == "buffer" else 32, workers=4, mu=1.0, **bound)
    return int(max(pipeline.next_step()["offpolicy/max"] for _ in range(steps)))


def test_block_bounds_generation_not_what_a_fifo_buffer_trains_on_and_drop_bounds_both_queues():
    # SPEC 11's eta: `block` (AReaL's rule) keeps generation within eta versions of the trainer, which bounds a
    # sample's off-policiness only when each rollout is trained once, soon after it is made. A FIFO buffer
    # keeps a rollout for N/R steps whatever eta is, and blocking slows generation, so the buffer's
    # rollouts get older, not younger. `drop` evicts what is more than eta versions old before each draw.
    assert max_off_policiness("buffer", "block", None) == 2
    assert [max_off_policiness("buffer", "block", eta) for eta in (0, 1, 2)] == [8, 8, 8]
    assert [max_off_policiness("buffer", "drop", eta) for eta in (0, 1, 2)] == [0, 1, 2]
    assert max_off_policiness("lifo", "block", None) == 1
    assert [max_off_policiness("lifo", "block", eta) for eta in (0, 1, 2)] == [0, 1, 1]
    assert [max_off_policiness("lifo", "drop", eta) for eta in (0, 1, 2)] == [0, 1, 1]


def test_compute_per_update_and_mu_from_counts_follow_the_queue():
    # Eq. 1 (seed 001 lines 136, 150): 1 + W/T with a buffer, 1 + mu without one. D.4's mu from counts
    # (lines 2426-2442) needs the buffer: a LIFO trains each rollout once, so the counts give W/T and gamma 1.
    buffered = lockstep(workers=3, mu=2.5, capacity=64).next_step()
    assert buffered["runtime/compute_per_update"] == pytest.approx(1 + 3 / 1)
    assert buffered["runtime/gamma_counts"] == pytest.approx(4 / (1 + buffered["runtime/mu_counts"]))
    streaming = lockstep("lifo", workers=3, mu=2.5, capacity=32)
    metrics = [streaming.next_step() for _ in range(6)][-1]
    assert metrics["runtime/compute_per_update"] == pytest.approx(1 + 2.5)
    assert "runtime/mu_counts" not in metrics and "runtime/gamma_counts" not in metrics


def test_lockstep_resume_continues_exactly(tmp_path):
    whole = lockstep(workers=2, mu=3.0, capacity=24)
    expected = [whole.next_step() for _ in range(10)]
    first = lockstep(workers=2, mu=3.0, capacity=24)
    got = [first.next_step() for _ in range(4)]
    torch.save(first.state_dict(), tmp_path / "p.pt")
    second = lockstep(workers=2, mu=3.0, capacity=24)
    second.load_state_dict(torch.load(tmp_path / "p.pt", weights_only=True))
    got += [second.next_step() for _ in range(6)]
    assert repr(machine_free(got)) == repr(machine_free(expected))


def test_requests_of_several_groups_keep_the_rates():
    pipeline = lockstep(workers=1, mu=2.0, groups_per_request=2, capacity=64)
    pipeline.work.groups_per_request = 2
    metrics = [pipeline.next_step() for _ in range(11)][-1]
    assert metrics["replay/ratio_measured"] == pytest.approx(2.0)
    generated = [e for e in pipeline.events if e["event"] == "generate"]
    assert [e["group"] for e in generated[:3]] == [0, 2, 4]
    assert [e["group"] for e in pipeline.events if e["event"] == "put"][:4] == [0, 1, 2, 3]


def test_a_stalled_pipeline_says_why():
    pipeline = lockstep("lifo", capacity=4)  # a batch of 8 can never fit in a LIFO of 4
    with pytest.raises(PipelineError, match="buffer.capacity=4"):
        pipeline.next_step()


def test_free_pipeline_finishes_and_counts_every_group():
    pipeline = FreePipeline(PipelineSettings(workers=2, trainers=1, batch=8, group_size=4), RolloutQueue(32),
                            FakeWork())
    for _ in range(5):
        metrics = pipeline.next_step()
    assert pipeline.counters.version == 5 and metrics["runtime/generated_rollouts"] >= 8
    assert all(v <= step for step, used in pipeline.work.updates for _, v in used)


def test_the_planner_prints_table1_and_the_expected_replay_count(capsys):
    from src.runtime.plan import main

    main(["--mu", "5.28", "--workers", "6", "--trainers", "2", "--batch", "60", "--capacity", "252"])
    out = capsys.readouterr().out
    assert all(value in out for value in ("1.27", "0.64", "0.42", "0.21", "0.18", "1.760", "7.392"))
    assert "Table 1, Qwen2.5-7B" in out                               # seed 001 line 170


def test_the_planner_titles_mu_6_84_table_3(capsys):
    from src.runtime.plan import main

    main(["--mu", "6.84"])
    out = capsys.readouterr().out
    assert "Table 3, Qwen3-0.6B" in out and "Table 1" not in out      # seed 001 lines 2458-2463
    main(["--mu", "4"])
    assert "Table" not in capsys.readouterr().out                     # no paper table at mu = 4


def seed001_lockstep(compose_config, *overrides):
    """The lockstep pipeline at seed 001's tiny preset's rates (model-free: FakeWork)."""
    cfg = compose_config("+experiment=seed001-async-tiny", *overrides)
    r, (kind, queue) = cfg.runtime, described(cfg.buffer).rollout_queue(cfg.buffer, 1)
    return lockstep(kind.name, capacity=queue["capacity"], workers=r.workers, trainers=r.trainers,
                    batch=cfg.buffer.batch_rollouts,
                    group_size=cfg.trainer.group_size, mu=r.mu, groups_per_request=r.groups_per_request)


def test_seed001s_lifo_baseline_keeps_every_worker_generating(compose_config):
    """The no-buffer cell ((W, T) = (6, 2), N = 252): one group a request, as B.2's worker generates, leaves room
    for all 6 workers' requests beside a batch; 4 groups (64 rollouts) a request held it to 3 of them."""
    lifo = ("buffer=none", "buffer.capacity=252")
    pipeline = seed001_lockstep(compose_config, *lifo)
    metrics = [pipeline.next_step() for _ in range(40)][-1]
    assert metrics["runtime/idle_workers"] == 0.0
    assert "replay/ratio_predicted" not in metrics  # footnote 5's prediction is a buffer's
    crowded = seed001_lockstep(compose_config, *lifo, "runtime.groups_per_request=4")
    assert [crowded.next_step() for _ in range(40)][-1]["runtime/idle_workers"] == pytest.approx(0.5, abs=0.05)
    buffered = [seed001_lockstep(compose_config).next_step() for _ in range(3)][-1]
    assert buffered["replay/ratio_predicted"] > 0


def test_leaving_for_rays_process_group_survives_a_group_that_is_gone_when_coming_back():
    """A run started by a shell's `( python -m src.run ... & )`: the subshell that led the run's process group
    has exited, so when the run moves to a group of its own for Ray's daemons, the group it left vanishes."""
    import pathlib
    import subprocess
    import sys
    import textwrap

    code = textwrap.dedent("""
        import os
        from src.runtime.ray_session import own_process_group
        reaped_r, reaped_w = os.pipe()
        done_r, done_w = os.pipe()
        leader = os.fork()
        if leader == 0:
            os.setpgid(0, 0)                 # the leader of a new group, as a job-control shell makes one
            os.close(reaped_w)
            if os.fork() == 0:               # the run, a member of that group
                os.read(reaped_r, 1)         # end of file once the leader is gone and reaped
                left = os.getpgrp()
                try:
                    with own_process_group():
                        inside = os.getpgrp()
                    os.write(done_w, f"ok {left != inside} {os.getpgrp() == inside}".encode())
                except Exception as error:
                    os.write(done_w, repr(error).encode())
                os._exit(0)
            os._exit(0)
        os.close(reaped_r)
        os.close(done_w)                     # end of file, not a wait, if the member dies before it writes
        os.waitpid(leader, 0)                # a zombie leader would keep its group alive
        os.close(reaped_w)
        print(os.read(done_r, 200).decode())
    """)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60,
                         cwd=pathlib.Path(__file__).resolve().parents[2])
    assert out.stdout.strip() == "ok True True", out.stdout + out.stderr
