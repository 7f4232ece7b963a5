"""The lockstep schedule's virtual clock (SPEC 11 "Schedules"), pure Python.

Workers and trainers take turns on a virtual clock that keeps the configured rates: a trainer
step takes `trainer_cost` units (1 by default), a worker's group of K takes `worker_cost` units
(mu T K / B from `src.runtime.formulas.worker_cost_per_group`, or set directly). Times are exact
fractions, so two events meant to coincide do coincide, and ties break by (time, role, id):
trainers before workers, lower ids first. Nothing here depends on a machine's speed: the same
settings give the same order of events everywhere.
"""

from __future__ import annotations

import heapq
from fractions import Fraction

ROLES = ("trainer", "worker")  # tie order: a trainer finishing at t publishes before a worker starting at t loads


def exact(value: float | int | str | Fraction) -> Fraction:
    """`value` as an exact fraction; a float through its shortest decimal form (5.28 is 132/25, not 5.2800000000000002)."""
    if isinstance(value, Fraction):
        return value
    return Fraction(str(value)) if isinstance(value, float) else Fraction(value)


class LockstepClock:
    """Which role finishes next on the virtual clock, and how much of the time each one was busy."""

    def __init__(self, workers: int, worker_cost: float | Fraction, trainer_cost: float | Fraction = 1) -> None:
        self.costs = {"trainer": exact(trainer_cost), "worker": exact(worker_cost)}
        for role, cost in self.costs.items():
            if not cost > 0:
                raise ValueError(f"runtime.{role}_cost={float(cost)}: a {role}'s work must take time > 0")
        self.now = Fraction(0)
        self.members = [("trainer", 0)] + [("worker", i) for i in range(int(workers))]
        self._pending: list[tuple[Fraction, int, int]] = []  # (finish time, role rank, id)
        self._started: dict[tuple[str, int], Fraction] = {}
        self._busy = {member: Fraction(0) for member in self.members}

    def running(self, role: str, ident: int) -> bool:
        return (role, ident) in self._started

    def has_pending(self) -> bool:
        return bool(self._pending)

    def idle(self, role: str) -> list[int]:
        """Ids of the members of `role` that have nothing running, in id order."""
        return [i for r, i in self.members if r == role and (r, i) not in self._started]

    def start(self, role: str, ident: int) -> Fraction:
        """Start a job of `role` member `ident` now; returns its finish time."""
        if self.running(role, ident):
            raise ValueError(f"{role} {ident} is busy until its current job finishes")
        finish = self.now + self.costs[role]
        self._started[(role, ident)] = self.now
        heapq.heappush(self._pending, (finish, ROLES.index(role), ident))
        return finish

    def advance(self) -> list[tuple[str, int]]:
        """Move to the next finish time; returns every job finishing then, in (role, id) order."""
        if not self._pending:
            raise ValueError("nothing is running: the lockstep clock cannot advance")
        time = self._pending[0][0]
        done = []
        while self._pending and self._pending[0][0] == time:
            _, rank, ident = heapq.heappop(self._pending)
            member = (ROLES[rank], ident)
            self._busy[member] += time - self._started.pop(member)
            done.append(member)
        self.now = time
        return done

    def busy(self, role: str, ident: int) -> Fraction:
        """Time member (role, ident) has spent working up to now, its running job included."""
        running = self.now - self._started[(role, ident)] if self.running(role, ident) else 0
        return self._busy[(role, ident)] + running

    def idle_ratio(self, role: str) -> float:
        """Share of the elapsed virtual time the members of `role` spent waiting (mean over members)."""
        if self.now == 0:
            return 0.0
        members = [i for r, i in self.members if r == role]
        return float(sum(1 - self.busy(role, i) / self.now for i in members) / len(members))

    def state_dict(self) -> dict:
        """Plain data: fractions as strings."""
        return {"costs": {role: str(cost) for role, cost in self.costs.items()}, "now": str(self.now),
                "pending": [[str(t), rank, ident] for t, rank, ident in sorted(self._pending)],
                "started": [[role, ident, str(t)] for (role, ident), t in self._started.items()],
                "busy": [[role, ident, str(t)] for (role, ident), t in self._busy.items()]}

    def load_state_dict(self, state: dict) -> None:
        costs = {role: Fraction(cost) for role, cost in state["costs"].items()}
        if costs != self.costs:
            raise ValueError(f"the checkpoint's lockstep costs are {state['costs']}, this run's "
                             f"{ {r: str(c) for r, c in self.costs.items()} }; resume with the same runtime settings")
        self.now = Fraction(state["now"])
        self._pending = [(Fraction(t), int(rank), int(ident)) for t, rank, ident in state["pending"]]
        heapq.heapify(self._pending)
        self._started = {(role, int(ident)): Fraction(t) for role, ident, t in state["started"]}
        self._busy = {(role, int(ident)): Fraction(t) for role, ident, t in state["busy"]}
