"""Seed 001's shared buffer as a Ray actor (SPEC 11): the rollout queue lives in its own actor process.

`QueueActor` starts the run's rollout queue (the class and arguments the `buffer` option names,
`src.buffer.store.ReplayStore.rollout_queue`: those the driver would build) as a Ray actor and
answers the pipeline with the queue's own methods, each a `ray.get` on the actor but `put`, whose answer
nobody reads: the pipeline cannot tell it from a queue in its process, and
the queue's logic exists once. An actor runs its calls one at a time in the order they are sent, and
the pipeline sends them one after another, so the draws, the event log and the metrics are those of
the local queue to the last digit. The actor asks for no CPU slot (it waits most of the time).

It is not restarted by Ray: a new one would have lost the rollouts since the checkpoint. If it dies,
the run stops with one line and resumes from its last checkpoint (the checkpoint holds the queue,
taken with `state_dict` through this proxy) when relaunched.
"""

from __future__ import annotations

import ray
from ray.exceptions import RayActorError

from src.batch import Group
from src.runtime.pipeline import PipelineError
from src.buffer.rollouts import Rollout, RolloutQueue, Sample
from src.runtime.ray_session import first_line


class QueueActor:
    """The pipeline's queue in a Ray actor, behind the methods of `src.buffer.rollouts.RolloutQueue`."""

    def __init__(self, kind: type[RolloutQueue], arguments: dict) -> None:
        self.name, self.replays, self.capacity = kind.name, kind.replays, int(arguments["capacity"])
        self.actor = ray.remote(kind).options(num_cpus=0, max_restarts=0).remote(**arguments)
        self.sent: list[ray.ObjectRef] = []  # calls not waited for (`put`)
        self.size()  # wait for its process: its start belongs to the session's, not to the first step

    def _call(self, method: str, *args):
        try:
            answer = ray.get(getattr(self.actor, method).remote(*args))
            sent, self.sent = self.sent, []
            ray.get(sent)  # done before `method` ran (one call at a time, in order): raises what they raised
            return answer
        except RayActorError as error:
            cause = first_line(error).split(". ")[0]  # Ray's guesses at why follow the first sentence
            raise PipelineError(f"the buffer actor died ({cause}); the run stops: run the same command again to "
                                "resume from its last checkpoint") from None

    def put(self, group_key: int, group: Group, version: int, wall: float, virtual: float | None = None) -> None:
        """Sent without waiting (the pipeline reads no answer): a round trip a group was most of the driver's time
        between updates. The next call that waits raises whatever it raised."""
        self.sent.append(self.actor.put.remote(group_key, group, version, wall, virtual))

    def ready(self, batch: int) -> bool:
        return self._call("ready", batch)

    def room(self, rollouts: int, in_flight: int) -> bool:
        return self._call("room", rollouts, in_flight)

    def take(self, batch: int, step: int) -> list[Sample]:
        return self._call("take", batch, step)

    def drop_stale(self, step: int, eta: int) -> list[Rollout]:
        return self._call("drop_stale", step, eta)

    def age(self, version: int) -> dict[str, float]:
        return self._call("age", version)

    def size(self) -> int:
        return self._call("size")

    def __len__(self) -> int:
        return self.size()

    def drain_events(self) -> list[dict]:
        return self._call("drain_events")

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
