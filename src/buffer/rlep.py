"""RLEP: replay verified successes into each fresh group (Zhang et al. 2025, arXiv 2507.07451; docs/papers.md#rlep).

Section 3.2 ("RL training with Experience Replay"): for each prompt the current policy samples G responses
(step i), M verified-correct responses to the same prompt are drawn at random from an experience pool and
appended (step ii, G' = G + M), and the clipped token-mean GRPO objective (Eq. 4) trains on the mixed group
with the advantage standardised over all G' rewards (Eq. 5). The paper fills the pool before training from a
finished run's samples; this store fills it online, from this run's own verified successes (the form the
paper's Figure 2 draws with the pool beside the loop, and the issue's second form):

* `store` keeps every fresh response whose reward is the task's correct reward (`Task.correct_reward`),
  as sampled (the paper's pool keeps each verified-correct sample of 64; it says nothing of duplicates), the
  newest `per_prompt` of a prompt and the newest `capacity` in all. An appended success is not stored again.
* `compose` appends, to each fresh group whose prompt has at least max(M, min_successes) stored successes,
  M of them drawn uniformly without replacement (the authors' code draws `random.sample(candidates, M)` at
  each load; the paper's pool admits a question with at least 2 successes, section 4.2). A group whose
  prompt has too few keeps its G responses: groups of G and of G + M then share a batch, and each group's
  advantages come from its own rewards (`src.loss.inputs.RowInputs.of`).
* In the batch the grown group is one fresh entry for its G rows and one replayed entry a success (its age
  the steps since it was sampled), so the fresh and replay splits of the metrics stay apart; the advantage
  of every row comes from the group's G + M rewards. A replayed success is weighted as a fresh response:
  the authors' trainer recomputes log pi_theta_old of the whole G' with the current actor, so no
  importance weight corrects towards the pool's policy (its log mu is left unset: mu = pi_theta now). Where the
  fresh rows carry a stale behaviour's log mu (behaviour=stale), the replayed rows get the current policy's
  (`measure`), which is what the trainer computes for fresh rows otherwise.
* The stored reward is reused: the verifier is deterministic, so re-scoring (as the authors' code does) would
  only spend verifier calls. RLEP replays add no fresh evaluation: the plan stays B fresh groups a step.

Under `runtime=async` (`RlepQueue`, seed 001's pipeline) the same pool sits in the rollout queue: each group a worker
puts gets M of its prompt's successes from earlier puts appended (G' = G + M, the advantage over G' as above), its
G + M rollouts are trained once each, newest first, as `buffer=none`'s LIFO trains them, and its own fresh
successes then join the pool. An appended success keeps the version that generated it (its off-policiness is
counted from there) and that worker's log mu: under this runtime every rollout is weighed against the weights
that sampled it, and the queue, a process without the policy, cannot take log pi now as the synchronous step does.
"""

from __future__ import annotations

import dataclasses
from collections import OrderedDict
from dataclasses import dataclass

from src.batch import Batch, BatchGroup, Group
from src.buffer.rollouts import LifoQueue, Rollout
from src.buffer.store import QUEUE_KNOBS, Measure, ReplayStore
from src.validate.checks import check_int
from src.variant import int_knob


@dataclass(frozen=True)
class Success:
    """One verified-correct response kept in the pool, with the step (`runtime=async`: the weights' version) that
    sampled it, and under `runtime=async` its sampler's log mu (per response, and per token where kept)."""

    response: str
    response_ids: tuple[int, ...]
    reward: float
    step: int
    logprob: float | None = None
    token_logprobs: tuple[float, ...] | None = None

    @classmethod
    def of(cls, item: dict) -> "Success":
        """A success read back from a checkpoint's plain data (one written before log mu was kept has none)."""
        tokens = item.get("token_logprobs")
        return cls(str(item["response"]), tuple(int(t) for t in item["response_ids"]), float(item["reward"]),
                   int(item["step"]), None if item.get("logprob") is None else float(item["logprob"]),
                   None if tokens is None else tuple(float(t) for t in tokens))


class SuccessPool:
    """The experience pool of both forms: verified successes by prompt, the newest `per_prompt` of a prompt and the
    newest `capacity` in all, oldest dropped first."""

    def __init__(self, per_prompt: int, capacity: int) -> None:
        self.per_prompt = check_int("buffer.per_prompt", per_prompt, 1)
        self.capacity = check_int("buffer.capacity", capacity, 1)
        self.added = self.evicted = 0
        self._next_key = 0
        # key -> (prompt ids, success), oldest first; and each prompt's keys, oldest first.
        self._pool: OrderedDict[int, tuple[tuple[int, ...], Success]] = OrderedDict()
        self._by_prompt: dict[tuple[int, ...], list[int]] = {}

    def __len__(self) -> int:
        return len(self._pool)

    def successes(self, prompt_ids: tuple[int, ...], before: int | None = None) -> list[Success]:
        """The stored successes of a prompt (sampled before step `before`, where given), oldest first."""
        found = [self._pool[key][1] for key in self._by_prompt.get(tuple(prompt_ids), ())]
        return found if before is None else [success for success in found if success.step < before]

    def ready(self, need: int) -> tuple[int, int]:
        """The prompts stored, and those with at least `need` successes."""
        return len(self._by_prompt), sum(len(keys) >= need for keys in self._by_prompt.values())

    def add(self, prompt: tuple[int, ...], success: Success) -> None:
        key, self._next_key = self._next_key, self._next_key + 1
        self._pool[key] = (prompt, success)
        keys = self._by_prompt.setdefault(prompt, [])
        keys.append(key)
        self.added += 1
        if len(keys) > self.per_prompt:
            self._evict(keys[0])
        while len(self._pool) > self.capacity:
            self._evict(next(iter(self._pool)))

    def _evict(self, key: int) -> None:
        prompt, _ = self._pool.pop(key)
        keys = self._by_prompt[prompt]
        keys.remove(key)
        if not keys:
            del self._by_prompt[prompt]
        self.evicted += 1

    # ---- persistence: plain data, oldest first ----
    def contents(self) -> list[dict]:
        return [{"prompt_ids": list(prompt), **dataclasses.asdict(success)} for prompt, success in self._pool.values()]

    def restore(self, contents: list[dict]) -> None:
        self._pool, self._by_prompt = OrderedDict(), {}
        for key, item in enumerate(contents):
            prompt = tuple(int(token) for token in item["prompt_ids"])
            self._pool[key] = (prompt, Success.of(item))
            self._by_prompt.setdefault(prompt, []).append(key)
        self._next_key = len(contents)


class RlepPool(ReplayStore):
    """`buffer=rlep`: each fresh group of G gets M of its prompt's earlier verified successes (RLEP section 3.2)."""

    settings = ("replays", "min_successes", "per_prompt", "capacity", "correct_reward")
    counters = ("added", "evicted", "merged_groups")
    knobs = {"ratio": ReplayStore.knobs["ratio"], "max_age": ReplayStore.knobs["max_age"],
             "batch_rollouts": QUEUE_KNOBS["batch_rollouts"],
             "replays": int_knob(1, 1_000, "2", why="M: successes appended to each fresh group (RLEP: 2)"),
             "min_successes": int_knob(1, 1_000, "2", why="a prompt's stored successes before any is replayed"),
             "per_prompt": int_knob(1, 100_000, "64", why="successes kept per prompt (RLEP's pool: up to 64)"),
             "capacity": int_knob(1, 100_000_000, "100000", why="successes kept in all, oldest dropped first"),
             "queue": int_knob(1, 100_000_000, "4096", queue_only=True, id_omitted_at=(4096,),
                               why="the LIFO queue's bound in rollouts, queued plus in flight (workers wait above it)")}
    cell_tag = "rlep"
    plans_replay = False  # rho = 0: the successes join fresh groups, no replay is planned
    reader_tag = "RLEP"

    @classmethod
    def cell_label(cls, node, cfg) -> str:
        return f"rlep{node.replays}"

    @classmethod
    def reader_label(cls, node, cfg) -> str:
        return f"RLEP (M={node.replays})"

    @classmethod
    def rollout_queue(cls, node, trainers: int) -> tuple[type, dict]:
        """Under `runtime=async`: the LIFO pipe of `buffer=none` with the pool in it (`RlepQueue`)."""
        return RlepQueue, {"capacity": node.queue, "replays": node.replays, "min_successes": node.min_successes,
                           "per_prompt": node.per_prompt, "pool_capacity": node.capacity}

    def __init__(self, replays: int = 2, min_successes: int = 2, per_prompt: int = 64, capacity: int = 100_000,
                 correct_reward: float = 1.0, name: str = "rlep", ratio: float = 0.0, max_age: int = 0,
                 queue: int = 4096, allow_infeasible: bool = False, groups_per_step: int = 0, seed: int = 0,
                 batch_rollouts: int | None = None) -> None:
        if ratio != 0 or max_age != 0:
            raise ValueError(f"buffer=rlep with buffer.ratio={ratio}, buffer.max_age={max_age}: RLEP samples all B "
                             "groups fresh and appends stored successes to each; leave ratio=0 and max_age=0")
        super().__init__(seed)
        self.replays = check_int("buffer.replays", replays, 1, "RLEP appends M = 2 successes to each group.")
        self.min_successes = check_int("buffer.min_successes", min_successes, 1)
        self.pool = SuccessPool(per_prompt, capacity)
        self.per_prompt, self.capacity, self.queue = self.pool.per_prompt, self.pool.capacity, int(queue)
        self.correct_reward = float(correct_reward)
        self.merged_groups = 0
        self._merged_now = 0
        self._grown: dict[tuple, int] = {}  # this step's groups with successes appended -> their G fresh rows

    # The pool's counters, as a checkpoint saves and restores a store's (`ReplayStore.counters`).
    added = property(lambda self: self.pool.added, lambda self, value: setattr(self.pool, "added", value))
    evicted = property(lambda self: self.pool.evicted, lambda self, value: setattr(self.pool, "evicted", value))

    def __len__(self) -> int:
        return len(self.pool)

    def successes(self, prompt_ids: tuple[int, ...], step: int) -> list[Success]:
        """The stored successes of a prompt sampled before `step`, oldest first."""
        return self.pool.successes(prompt_ids, before=step)

    # ---- the step's calls ----
    def compose(self, fresh: list[BatchGroup], replayed: list[BatchGroup], step: int, measure: Measure) -> Batch:
        """Each fresh group with M of its prompt's stored successes appended, where the prompt has enough."""
        entries = []
        self._merged_now, self._grown = 0, {}
        for entry in fresh:
            pooled = self.successes(entry.group.prompt_ids, step)
            if len(pooled) < max(self.replays, self.min_successes):
                entries.append(entry)
                continue
            drawn, size = self._rng.sample(pooled, self.replays), entry.group.size
            grown = self._appended(entry.group, drawn, measure)
            self._grown[(grown.step, grown.prompt_ids, grown.response_ids)] = size
            # One group, so one baseline over G + M (Eq. 5); its appended rows are replayed rows of their own age,
            # right after the fresh ones (a store keeps the group's rows in that order).
            entries.append(dataclasses.replace(entry, group=grown, responses=tuple(range(size))))
            entries += [BatchGroup(grown, "replay", step - success.step, (size + i,))
                        for i, success in enumerate(drawn)]
            self._merged_now += 1
        self.merged_groups += self._merged_now
        return Batch(entries + replayed)

    def _appended(self, group: Group, drawn: list[Success], measure: Measure) -> Group:
        """G' = G + M (step ii): the fresh responses first, then the drawn successes."""
        merged = Group(prompt=group.prompt, prompt_ids=group.prompt_ids, truth=group.truth,
                       responses=group.responses + tuple(s.response for s in drawn),
                       response_ids=group.response_ids + tuple(s.response_ids for s in drawn),
                       rewards=group.rewards + tuple(s.reward for s in drawn), step=group.step)
        if group.behaviour_logprobs is None:
            return merged  # every row's mu is the current policy, as the authors' trainer recomputes it for G'
        now = measure([merged])[0]  # the replayed rows' log pi now; the fresh rows keep their stale behaviour's mu
        size = group.size
        tokens = (group.behaviour_token_logprobs + now.behaviour_token_logprobs[size:]
                  if group.behaviour_token_logprobs is not None else None)
        return merged.with_behaviour_logprobs(group.behaviour_logprobs + now.behaviour_logprobs[size:], None, tokens)

    def store(self, groups: list[Group], step: int) -> None:
        """Keep this step's fresh verified successes (not the appended ones); drop the oldest over a bound."""
        for group in groups:
            fresh = self._grown.get((group.step, group.prompt_ids, group.response_ids), group.size)
            for response, ids, reward in list(zip(group.responses, group.response_ids, group.rewards))[:fresh]:
                if reward == self.correct_reward:  # the task's correct answer (`Task.correct_reward`)
                    self.pool.add(tuple(group.prompt_ids), Success(response, tuple(ids), float(reward), group.step))

    def metrics(self, step: int) -> dict[str, float]:
        """The pool's size, the prompts it can replay for, and this step's groups that got successes appended."""
        prompts, ready = self.pool.ready(max(self.replays, self.min_successes))
        return {"buffer/size": float(len(self.pool)), "rlep/prompts": float(prompts),
                "rlep/prompts_ready": float(ready), "rlep/merged_groups": float(self._merged_now),
                "rlep/replayed_rollouts": float(self._merged_now * self.replays)}

    # ---- persistence: plain data, oldest first ----
    def _contents(self) -> object:
        return self.pool.contents()

    def _restore(self, contents: object) -> None:
        self.pool.restore(contents)


class RlepQueue(LifoQueue):
    """`buffer=rlep` under `runtime=async`: each put group gets M of its prompt's successes from earlier puts appended
    (G' = G + M), then its fresh successes join the pool; the queue trains every rollout once, newest first.

    An appended success is a rollout of its own version under a group key of its own (negative: the pipeline's keys
    count up from 0), so a batch counts its age apart; every key of a grown group maps to the one G' group, whose
    rewards give each row its advantage (Eq. 5)."""

    name = "rlep"
    bound = "buffer.queue"

    def __init__(self, capacity: int, replays: int = 2, min_successes: int = 2, per_prompt: int = 64,
                 pool_capacity: int = 100_000, correct_reward: float = 1.0, seed: int = 0) -> None:
        super().__init__(capacity, seed)
        self.replays = check_int("buffer.replays", replays, 1, "RLEP appends M = 2 successes to each group.")
        self.min_successes = check_int("buffer.min_successes", min_successes, 1)
        self.pool = SuccessPool(per_prompt, pool_capacity)
        self.correct_reward = float(correct_reward)
        self.merged_groups = 0
        self._next_replay_key = -1

    @classmethod
    def label(cls, arguments: dict) -> str:
        return f"rlep{arguments['replays']}"

    def put(self, group_key: int, group: Group, version: int, wall: float,
            virtual: float | None = None) -> list[Rollout]:
        pooled = self.pool.successes(group.prompt_ids)
        drawn = (self._rng.sample(pooled, self.replays) if len(pooled) >= max(self.replays, self.min_successes)
                 else [])
        grown = appended(group, drawn) if drawn else group
        evicted = super().put(group_key, grown, version, wall, virtual)
        if drawn:  # the appended rollouts: each its own version and key, trained as the replay rows of G'
            size, self.merged_groups = group.size, self.merged_groups + 1
            for i, success in enumerate(drawn):
                rollout = next(r for r in self.rollouts if r.group_key == group_key and r.index == size + i)
                rollout.group_key, rollout.version = self._next_replay_key, success.step
                self.groups[self._next_replay_key] = grown
                self._next_replay_key -= 1
        for j in range(group.size):
            if group.rewards[j] == self.correct_reward:  # the task's correct answer (`Task.correct_reward`)
                self.pool.add(tuple(group.prompt_ids), success_of(group, j, version))
        return evicted

    def age(self, version: int) -> dict[str, float]:
        prompts, ready = self.pool.ready(max(self.replays, self.min_successes))
        return {**super().age(version), "rlep/pool": float(len(self.pool)), "rlep/prompts": float(prompts),
                "rlep/prompts_ready": float(ready), "rlep/merged_groups_total": float(self.merged_groups)}

    def state_dict(self) -> dict:
        return {**super().state_dict(), "pool": self.pool.contents(), "pool_counters": [
            self.pool.added, self.pool.evicted, self.merged_groups, self._next_replay_key],
            "pool_settings": [self.replays, self.min_successes, self.pool.per_prompt, self.pool.capacity]}

    def load_state_dict(self, state: dict) -> None:
        settings = [self.replays, self.min_successes, self.pool.per_prompt, self.pool.capacity]
        if state.get("pool_settings") != settings:
            raise ValueError(f"the checkpoint's RLEP queue has (replays, min_successes, per_prompt, capacity) = "
                             f"{state.get('pool_settings')}, this run's {settings}; resume with the buffer settings "
                             "the run started with")
        super().load_state_dict(state)
        self.pool.restore(state["pool"])
        self.pool.added, self.pool.evicted, self.merged_groups, self._next_replay_key = (
            int(value) for value in state["pool_counters"])


def appended(group: Group, drawn: list[Success]) -> Group:
    """G' = G + M under `runtime=async`: the fresh responses, then the drawn successes with their own log mu."""
    tokens = None
    if group.behaviour_token_logprobs is not None and all(s.token_logprobs is not None for s in drawn):
        tokens = group.behaviour_token_logprobs + tuple(s.token_logprobs for s in drawn)
    logprobs = (group.behaviour_logprobs + tuple(s.logprob for s in drawn)
                if group.behaviour_logprobs is not None and all(s.logprob is not None for s in drawn) else None)
    return Group(prompt=group.prompt, prompt_ids=group.prompt_ids, truth=group.truth,
                 responses=group.responses + tuple(s.response for s in drawn),
                 response_ids=group.response_ids + tuple(s.response_ids for s in drawn),
                 rewards=group.rewards + tuple(s.reward for s in drawn), step=group.step,
                 behaviour_logprobs=logprobs, behaviour_token_logprobs=tokens)


def success_of(group: Group, j: int, version: int) -> Success:
    """Response j of a put group as the pool keeps it: with the version and the log mu that sampled it."""
    logprob = None if group.behaviour_logprobs is None else group.behaviour_logprobs[j]
    tokens = None if group.behaviour_token_logprobs is None else group.behaviour_token_logprobs[j]
    return Success(group.responses[j], tuple(group.response_ids[j]), float(group.rewards[j]), int(version), logprob,
                   tokens)
