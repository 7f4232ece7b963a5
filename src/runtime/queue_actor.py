"""Seed 001's shared buffer as a Ray actor (SPEC 11): the rollout queue lives in its own actor process.

`QueueActor` starts the run's rollout queue (the class and arguments the `buffer` option names,
`src.buffer.store.ReplayStore.rollout_queue`: those the driver would build) as a Ray actor and
answers the pipeline with the queue's own methods, each a `ray.get` on the actor but `put`, whose answer
nobody reads: the pipeline cannot tell it from a queue in its process, and
the queue's logic exists once. `take` answers with what the pipeline reads of each drawn sample (its
off-policiness and steps since its last use) and a reference to the samples, which the trainer actor
reads from the object store: a batch goes from the buffer actor to the trainer without a trip through
the driver. An actor runs its calls one at a time in the order they are sent, and
the pipeline sends them one after another, so the draws, the event log and the metrics are those of
the local queue to the last digit. The actor asks for no CPU slot (it waits most of the time).

It is not restarted by Ray: a new one would have lost the rollouts since the checkpoint. If it dies,
the run stops with one line and resumes from its last checkpoint (the checkpoint holds the queue,
taken with `state_dict` through this proxy) when relaunched.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, NamedTuple

import ray
from ray.exceptions import RayActorError

from src.batch import Group
from src.runtime.pipeline import PipelineError
from src.buffer.rollouts import Rollout, RolloutQueue
from src.runtime.ray_session import first_line


class Drawn(NamedTuple):
    """What the pipeline reads of a drawn sample (`src.runtime.pipeline.Pipeline.batch_measures`)."""

    off_policiness: int
    since_last_use: int | None


@dataclass(frozen=True)
class DrawnBatch:
    """A batch taken in the buffer actor: each sample's measures here, the samples themselves behind `ref`."""

    drawn: list[Drawn]
    ref: ray.ObjectRef

    def __len__(self) -> int:
        return len(self.drawn)

    def __iter__(self):
        return iter(self.drawn)


@dataclass(frozen=True)
class Stored:
    """A group a rollout worker left in Ray's object store: what the driver reads of it (its size; its instance and
    rewards, which the prompt sampler hears) and its reference, which Ray resolves in the buffer actor and the
    trainer actor. The driver never deserializes the group itself (Ray keeps an object under 100 KiB in the
    owner's in-process store and inlines it into the calls that take it, `max_direct_call_object_size`)."""

    ref: ray.ObjectRef
    size: int
    instance: Any
    rewards: list[float]

    def get(self) -> Group:
        return ray.get(self.ref)


def hosted(kind: type[RolloutQueue]) -> type[RolloutQueue]:
    """`kind` with `put_many` (the puts since the last call, in one call; each put's group an argument of its own,
    so that Ray resolves a worker's reference to it here) and `take_apart` (`take_ready` as two objects, two
    return values of a Ray call: the draw's measures with the queue's events, and the samples)."""

    class Hosted(kind):
        def put_many(self, puts: list[tuple], *groups: Group) -> None:
            for (group_key, version, wall, virtual), group in zip(puts, groups, strict=True):
                self.put(group_key, group, version, wall, virtual)

        def take_apart(self, batch: int, step: int) -> tuple[tuple[list[Drawn] | None, list[dict]], list | None]:
            samples = self.take_ready(batch, step)
            drawn = None if samples is None else [Drawn(s.off_policiness, s.since_last_use) for s in samples]
            return (drawn, self.drain_events()), samples

    Hosted.__name__ = Hosted.__qualname__ = kind.__name__  # the actor's name in Ray's process list
    return Hosted


class QueueActor:
    """The pipeline's queue in a Ray actor, behind the methods of `src.buffer.rollouts.RolloutQueue`."""

    def __init__(self, kind: type[RolloutQueue], arguments: dict) -> None:
        self.name, self.replays, self.capacity = kind.name, kind.replays, int(arguments["capacity"])
        self.actor = ray.remote(hosted(kind)).options(num_cpus=0, max_restarts=0).remote(**arguments)
        self.unsent: list[tuple] = []  # puts not sent yet: they go in one call before the next call
        self.sent: list[ray.ObjectRef] = []  # those calls, not waited for
        self.events: list[dict] = []  # the queue's events that came with a draw, not drained yet
        self.drained = False  # whether those are all its events: no call was sent since
        self.size()  # wait for its process: its start belongs to the session's, not to the first step

    def _send(self, method: str, *args, returns: int = 1):
        """Send the puts held back, then `method(*args)`: the actor runs its calls in the order they are sent."""
        self.drained = False
        try:
            if self.unsent:
                puts, self.unsent = self.unsent, []
                groups = [group.ref if isinstance(group, Stored) else group for _, group, *_ in puts]
                self.sent.append(self.actor.put_many.remote([(key, *rest) for key, _, *rest in puts], *groups))
            return getattr(self.actor, method).options(num_returns=returns).remote(*args)
        except RayActorError as error:
            raise self._died(error) from None

    def _call(self, method: str, *args):
        return self._wait(self._send(method, *args))

    def _wait(self, call: ray.ObjectRef):
        try:
            answer = ray.get(call)
            sent, self.sent = self.sent, []
            ray.get(sent)  # done before `call` ran (one call at a time, in order): raises what they raised
            return answer
        except RayActorError as error:
            raise self._died(error) from None

    @staticmethod
    def _died(error: RayActorError) -> PipelineError:
        cause = first_line(error).split(". ")[0]  # Ray's guesses at why follow the first sentence
        return PipelineError(f"the buffer actor died ({cause}); the run stops: run the same command again to "
                             "resume from its last checkpoint")

    def put(self, group_key: int, group: Group | Stored, version: int, wall: float, virtual: float | None = None
            ) -> None:
        """Held back and sent with the next call (the pipeline reads no answer): a round trip a group was most of
        the driver's time between updates, and a call a group most of the buffer actor's. A `Stored` group goes
        from the object store to the actor."""
        self.unsent.append((group_key, group, version, wall, virtual))

    def ready(self, batch: int) -> bool:
        return self._call("ready", batch)

    def room(self, rollouts: int, in_flight: int) -> bool:
        return self._call("room", rollouts, in_flight)

    def take_ready(self, batch: int, step: int) -> DrawnBatch | None:
        """A batch if the queue holds one: its measures here, its samples left in the object store for the trainer;
        the queue's events come with it (the pipeline drains them next)."""
        head, samples = self._send("take_apart", batch, step, returns=2)
        drawn, events = self._wait(head)
        self.events += events
        self.drained = True  # nothing was sent after it: the next drain needs no call
        return None if drawn is None else DrawnBatch(drawn, samples)

    def drop_stale(self, step: int, eta: int) -> list[Rollout]:
        return self._call("drop_stale", step, eta)

    def age(self, version: int) -> dict[str, float]:
        return self._call("age", version)

    def size(self) -> int:
        return self._call("size")

    def __len__(self) -> int:
        return self.size()

    def drain_events(self) -> list[dict]:
        events, self.events = self.events, []
        if self.drained and not self.unsent:  # the draw brought every event so far
            return events
        return events + self._call("drain_events")

    def replay_count_distribution(self) -> dict[int, int]:
        return self._call("replay_count_distribution")

    def distributions(self) -> dict:
        return self._call("distributions")

    def state_dict(self) -> dict:
        return self._call("state_dict")

    def load_state_dict(self, state: dict) -> None:
        self._call("load_state_dict", state)

    def close(self) -> None:
        ray.kill(self.actor, no_restart=True)
