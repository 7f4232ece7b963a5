"""Seed 001's positive-bias retention (D.4) is one function in the one replay core, and both of the core's forms keep
the same rollouts with it: the synchronous store (buffer=fifo, delta N in whole groups) and the async pipeline's
rollout buffer (delta N in rollouts)."""

from __future__ import annotations

import random

import pytest

from src.batch import Group
from src.buffer import positive_bias
from src.buffer.fifo import FifoReplayBuffer
from src.buffer import rollouts
from src.buffer.rollouts import RolloutQueue


def test_both_forms_keep_with_the_one_core_and_its_one_rule():
    assert isinstance(FifoReplayBuffer(capacity=8, positive_bias=0.5).fifo, RolloutQueue)
    assert rollouts.positive_bias_keep is positive_bias.positive_bias_keep


def a_group(step: int, rewards: list[float]) -> Group:
    k = len(rewards)
    return Group(prompt=f"p{step}", prompt_ids=(1, 2), truth={"numbers": [1, 2, 3], "target": 6}, responses=["x"] * k,
                 response_ids=[(3, 4)] * k, rewards=rewards, step=step, behaviour_logprobs=[-1.0] * k)


@pytest.mark.parametrize("k, groups, delta", [(2, 4, 0.5), (2, 4, 0.75), (2, 8, 0.25), (3, 5, 0.4), (4, 2, 0.5)])
def test_the_group_store_and_the_rollout_buffer_keep_the_same_rollouts(k, groups, delta):
    """Where delta n is whole groups (delta n K = round(delta n) K), both buffers of N = n K rollouts keep the same:
    after every group of a random reward stream they hold the same (group, response) pairs."""
    rng = random.Random(k * 100 + groups)
    store = FifoReplayBuffer(capacity=groups * k, positive_bias=delta, correct_reward=1.0)
    rollouts = RolloutQueue(capacity=groups * k, positive_bias=delta, correct_reward=1.0)
    for step in range(30):
        group = a_group(step, [rng.choice((0.0, 0.1, 1.0)) for _ in range(k)])
        store.add([group])
        rollouts.put(step, group, step, 0.0)
        by_store = [(g.step, i) for g, kept in zip(store.groups, store.stored_responses) for i in kept]
        by_queue = [(r.group_key, r.index) for r in rollouts.rollouts]
        assert by_store == by_queue, step
