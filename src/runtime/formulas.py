"""Seed 001's compute and replay arithmetic, and AReaL's staleness rule, as pure functions (SPEC 11).

Sources (seed 001; docs/papers.md quotes each):

* eq. 1: compute per update, in units of one trainer step C: C(1 + mu) without a buffer
  (the workers must produce a fresh batch for every update), C(1 + W/T) with one (the W
  workers run all the time, whatever the trainers consume).
* eq. 2: the compute ratio gamma = (1 + W/T) / (1 + mu); Table 1 (mu = 5.28, Qwen2.5-7B) and
  Table 3 (mu = 6.84, Qwen3-0.6B).
* footnote 5: a rollout stays N/R steps in a FIFO of N and is drawn B/N times a step, so its
  expected replay count is B/R, R = rollouts added per trainer step. With the workers producing
  B rollouts every mu T / W step-times, R = B W / (mu T) and B/R = mu T / W.
* appendix D.4: mu estimated from counts, (K_training / T) / (K_inference / W).

The paper prints Table 1 as 1.29, 0.65, 0.43, 0.32, 0.22, 0.18; eq. 2 at mu = 5.28 gives 1.27,
0.64, 0.42, 0.32, 0.21, 0.18 (the printed row fits mu ~ 5.2: rounding in the paper). Table 3's
0.41 for (6, 2) is a misprint of 0.51 (Figure 4's caption). The functions follow eq. 2.
"""

from __future__ import annotations

import math

# The (W, T) splits of one 8-GPU node that Tables 1 and 3 list.
TABLE1_SPLITS: tuple[tuple[int, int], ...] = ((7, 1), (6, 2), (5, 3), (4, 4), (2, 6), (1, 7))


def _positive(name: str, value: float) -> float:
    value = float(value)
    if not (value > 0 and math.isfinite(value)):
        raise ValueError(f"{name}={value!r}: must be a finite number > 0")
    return value


def compute_per_update(workers: int, trainers: int, mu: float, buffer: bool = True) -> float:
    """Eq. 1 in units of one trainer step: 1 + W/T with a replay buffer, 1 + mu without one."""
    if buffer:
        return 1.0 + _positive("workers W", workers) / _positive("trainers T", trainers)
    return 1.0 + _positive("mu", mu)


def compute_ratio(workers: int, trainers: int, mu: float) -> float:
    """Eq. 2: gamma = (1 + W/T) / (1 + mu), the cost of an update with a buffer over one without."""
    return compute_per_update(workers, trainers, mu, buffer=True) / compute_per_update(workers, trainers, mu,
                                                                                      buffer=False)


def gamma_table(mu: float, splits: tuple[tuple[int, int], ...] = TABLE1_SPLITS) -> dict[tuple[int, int], float]:
    """Table 1 for any mu: gamma of each (W, T) split."""
    return {(w, t): compute_ratio(w, t, mu) for w, t in splits}


def rollouts_per_step(batch: int, workers: int, trainers: int, mu: float) -> float:
    """R, the rollouts the workers add per trainer step when a batch of B costs mu trainer steps to make."""
    return _positive("batch B", batch) * _positive("workers W", workers) / (_positive("mu", mu)
                                                                            * _positive("trainers T", trainers))


def expected_replay_count(batch: float, rollouts_added_per_step: float) -> float:
    """Footnote 5: the expected number of uses of a rollout, B / R."""
    return _positive("batch B", batch) / _positive("rollouts per step R", rollouts_added_per_step)


def expected_replay_count_from_rates(workers: int, trainers: int, mu: float) -> float:
    """Footnote 5 with R from the rates: B / R = mu T / W (independent of B and N)."""
    return _positive("mu", mu) * _positive("trainers T", trainers) / _positive("workers W", workers)


def mu_from_counts(trained: int, generated: int, workers: int, trainers: int) -> float:
    """Appendix D.4: mu ~ (K_training / T) / (K_inference / W), rollouts trained on over rollouts generated."""
    if generated <= 0 or trained < 0:
        return math.nan
    return (trained / _positive("trainers T", trainers)) / (generated / _positive("workers W", workers))


def mu_from_busy_times(worker_seconds_per_batch: float, trainer_seconds_per_batch: float) -> float:
    """mu from measured busy times: one worker's time to make a batch over the trainer's time to train on it."""
    if not (trainer_seconds_per_batch > 0 and worker_seconds_per_batch >= 0):
        return math.nan
    return worker_seconds_per_batch / trainer_seconds_per_batch


def worker_cost_per_group(mu: float, trainers: int, group_size: int, batch: int) -> float:
    """The lockstep clock's time for one worker to make a group of K, in trainer steps: mu T K / B.

    W workers then make B rollouts every mu T / W steps, the rate footnote 5's prediction assumes.
    """
    return (_positive("mu", mu) * _positive("trainers T", trainers) * _positive("group size K", group_size)
            / _positive("batch B", batch))


def may_start(started_rollouts: int, batch: int, version: int, eta: int | None) -> bool:
    """AReaL's staleness rule: a worker may start work while floor((N_r - 1) / B) <= i + eta.

    N_r counts every rollout started so far including the one about to start (for a group of K,
    the group's last), i is the trainer's version (updates done), B the batch in rollouts. The
    rule keeps a rollout from being generated more than eta versions ahead of the update that
    will first be able to train on it. `eta=None` turns the bound off (seed 001's setting).
    """
    if eta is None:
        return True
    if started_rollouts < 1:
        raise ValueError(f"started_rollouts={started_rollouts}: count the rollout about to start too (>= 1)")
    return (started_rollouts - 1) // int(batch) <= int(version) + int(eta)
