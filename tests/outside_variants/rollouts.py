"""A copy of `buffer=none` under a new name, outside src/, in both of its forms: under runtime=sync a store that
keeps nothing (fresh-only), under runtime=async seed 001's LIFO pipe (B.1), newest rollouts first, each used once.

It subclasses only the two interfaces, `ReplayStore` (the step's store) and `RolloutQueue` (the replay core, which
keeps the rollouts, their use statistics and events, and takes the LIFO order as a policy), and names its rollout
form itself
(`rollout_queue`), so one `buffer` option plugs into both runtimes with no file under src/ listing it
(tests/e2e/test_outside_variant.py, tests/e2e/test_runtime_ray.py).
"""

from __future__ import annotations

from src.buffer.rollouts import RolloutQueue
from src.buffer.store import ReplayStore
from src.variant import int_knob


class LifoCopyQueue(RolloutQueue):
    """Newest first, each rollout used once; workers wait while the queue and what is in flight would pass N: the
    core's other order, named here."""

    name = "lifo"
    replays = False
    order = "lifo"


class LifoCopyStore(ReplayStore):
    """Fresh-only in the synchronous step; the LIFO pipe under runtime=async."""

    knobs = {"capacity": int_knob(1, 100_000_000, "1024", why="the LIFO queue's bound in rollouts")}
    cell_tag, reader_tag = "rho0", "Fresh-only"

    @classmethod
    def fresh_only(cls, node) -> bool:
        return True

    @classmethod
    def plan_window(cls, node, steps: int) -> int | None:
        return 1

    @classmethod
    def rollout_queue(cls, node, trainers: int) -> tuple[type, dict]:
        return LifoCopyQueue, {"capacity": node.capacity}

    def __init__(self, capacity: int = 4096, ratio: float = 0.0, name: str = "lifocopy", groups_per_step: int = 0,
                 seed: int = 0) -> None:
        if ratio != 0:
            raise ValueError(f"buffer.ratio rho={ratio}: buffer=lifocopy replays nothing in the synchronous step")
        super().__init__(seed)

    def metrics(self, step: int) -> dict[str, float]:
        return {"buffer/size": 0}
