"""Seed 001's positive-bias retention (section 5 and appendix D.4), written once for both of its buffers: the store of
whole groups (`src.buffer.fifo`, buffer=fifo) and the async pipeline's rollout buffer (`src.buffer.rollouts`).

"Instead of keeping the freshest N generated rollouts in the buffer, we keep the freshest (1 - delta)N generated
rollouts along with the freshest delta N correct rollouts not included in those (1 - delta)N trajectories."
Pure: a stream of correct/incorrect flags in, the positions kept out; each buffer says what "correct" is.
"""

from __future__ import annotations

from typing import Sequence


def keep_freshest(correct: Sequence[bool], n_fresh: int, n_correct: int) -> list[int]:
    """Seed 001 D.4 on a rollout stream listed oldest first: positions kept (ascending), the freshest
    `n_fresh` whatever their reward plus the freshest `n_correct` correct ones older than those."""
    start = max(0, len(correct) - n_fresh)
    older: list[int] = []
    for i in range(start - 1, -1, -1):
        if len(older) == n_correct:
            break
        if correct[i]:
            older.append(i)
    return older[::-1] + list(range(start, len(correct)))


def positive_bias_keep(correct: Sequence[bool], capacity: int, delta: float, unit: int = 1) -> list[int]:
    """The positions (ascending) a buffer of `capacity` with positive bias `delta` keeps of the rollout stream
    `correct` (oldest first): the freshest (capacity - round(delta capacity)) x `unit` rollouts plus the freshest
    round(delta capacity) x `unit` correct ones older than those. `unit` is K where the capacity counts groups of K
    (the group store rounds delta N to whole groups, so no fresh group is split), 1 where it counts rollouts."""
    n_correct = round(delta * capacity)
    return keep_freshest(correct, (capacity - n_correct) * unit, n_correct * unit)
