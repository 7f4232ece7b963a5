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
"""

from __future__ import annotations

import dataclasses
from collections import OrderedDict
from dataclasses import dataclass

from src.batch import Batch, BatchGroup, Group
from src.buffer.store import Measure, ReplayStore
from src.validate.checks import check_int
from src.variant import int_knob


@dataclass(frozen=True)
class Success:
    """One verified-correct response kept in the pool, with the step that sampled it."""

    response: str
    response_ids: tuple[int, ...]
    reward: float
    step: int


class RlepPool(ReplayStore):
    """`buffer=rlep`: each fresh group of G gets M of its prompt's earlier verified successes (RLEP section 3.2)."""

    settings = ("replays", "min_successes", "per_prompt", "capacity", "correct_reward")
    counters = ("added", "evicted", "merged_groups")
    knobs = {"ratio": ReplayStore.knobs["ratio"], "max_age": ReplayStore.knobs["max_age"],
             "replays": int_knob(1, 1_000, "2", why="M: successes appended to each fresh group (RLEP: 2)"),
             "min_successes": int_knob(1, 1_000, "2", why="a prompt's stored successes before any is replayed"),
             "per_prompt": int_knob(1, 100_000, "64", why="successes kept per prompt (RLEP's pool: up to 64)"),
             "capacity": int_knob(1, 100_000_000, "100000", why="successes kept in all, oldest dropped first")}
    cell_tag = "rlep"
    plans_replay = False  # rho = 0: the successes join fresh groups, no replay is planned
    reader_tag = "RLEP"

    @classmethod
    def cell_label(cls, node, cfg) -> str:
        return f"rlep{node.replays}"

    @classmethod
    def reader_label(cls, node, cfg) -> str:
        return f"RLEP (M={node.replays})"

    def __init__(self, replays: int = 2, min_successes: int = 2, per_prompt: int = 64, capacity: int = 100_000,
                 correct_reward: float = 1.0, name: str = "rlep", ratio: float = 0.0, max_age: int = 0,
                 allow_infeasible: bool = False, groups_per_step: int = 0, seed: int = 0) -> None:
        if ratio != 0 or max_age != 0:
            raise ValueError(f"buffer=rlep with buffer.ratio={ratio}, buffer.max_age={max_age}: RLEP samples all B "
                             "groups fresh and appends stored successes to each; leave ratio=0 and max_age=0")
        super().__init__(seed)
        self.replays = check_int("buffer.replays", replays, 1, "RLEP appends M = 2 successes to each group.")
        self.min_successes = check_int("buffer.min_successes", min_successes, 1)
        self.per_prompt = check_int("buffer.per_prompt", per_prompt, 1)
        self.capacity = check_int("buffer.capacity", capacity, 1)
        self.correct_reward = float(correct_reward)
        self.added = self.evicted = self.merged_groups = 0
        self._merged_now = 0
        self._next_key = 0
        # key -> (prompt ids, success), oldest first; and each prompt's keys, oldest first.
        self._pool: OrderedDict[int, tuple[tuple[int, ...], Success]] = OrderedDict()
        self._by_prompt: dict[tuple[int, ...], list[int]] = {}
        self._grown: dict[tuple, int] = {}  # this step's groups with successes appended -> their G fresh rows

    def __len__(self) -> int:
        return len(self._pool)

    def successes(self, prompt_ids: tuple[int, ...], step: int) -> list[Success]:
        """The stored successes of a prompt sampled before `step`, oldest first."""
        return [success for key in self._by_prompt.get(tuple(prompt_ids), ())
                if (success := self._pool[key][1]).step < step]

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
                    self._add(tuple(group.prompt_ids), Success(response, tuple(ids), float(reward), group.step))

    def _add(self, prompt: tuple[int, ...], success: Success) -> None:
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

    def metrics(self, step: int) -> dict[str, float]:
        """The pool's size, the prompts it can replay for, and this step's groups that got successes appended."""
        ready = sum(len(keys) >= max(self.replays, self.min_successes) for keys in self._by_prompt.values())
        return {"buffer/size": float(len(self._pool)), "rlep/prompts": float(len(self._by_prompt)),
                "rlep/prompts_ready": float(ready), "rlep/merged_groups": float(self._merged_now),
                "rlep/replayed_rollouts": float(self._merged_now * self.replays)}

    # ---- persistence: plain data, oldest first ----
    def _contents(self) -> object:
        return [{"prompt_ids": list(prompt), **dataclasses.asdict(success)} for prompt, success in self._pool.values()]

    def _restore(self, contents: object) -> None:
        self._pool, self._by_prompt, self._next_key = OrderedDict(), {}, 0
        for key, item in enumerate(contents):
            prompt = tuple(int(token) for token in item["prompt_ids"])
            self._pool[key] = (prompt, Success(str(item["response"]), tuple(int(t) for t in item["response_ids"]),
                                               float(item["reward"]), int(item["step"])))
            self._by_prompt.setdefault(prompt, []).append(key)
        self._next_key = len(contents)
