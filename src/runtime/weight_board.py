"""The weight board (SPEC 11): a small actor holding the newest published weights' (version, [object ref]).

It lives in a module of its own, which imports nothing heavy: Ray imports an actor's module in the actor's
process, and `src.runtime.ray_work` imports torch (about 10 CPU-seconds a run for an actor that only holds a
reference).
"""

from __future__ import annotations


class WeightBoard:
    """A worker of the free schedule asks it when it starts a group, so a group queued early still starts with
    the newest weights."""

    def __init__(self) -> None:
        self.latest: tuple[int, list] | None = None

    def set(self, version: int, weights: list) -> None:
        self.latest = (version, weights)

    def get(self) -> tuple[int, list]:
        return self.latest
