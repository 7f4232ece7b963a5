"""Fresh-rollout collection (`sampling` config group; SPEC 3 step 2): prompts -> K responses -> verifier.

`StandardSampling` samples the step's prompts once; `DynamicSampling` (DAPO, seed 003) samples in
rounds of oversampled prompts and keeps only effective groups until the fresh slots are full. Both
generate with the behaviour policy (the current one unless `behaviour=stale/diverse`, seed 002),
score every response once (one fresh verifier evaluation each), let the prompt sampler see every
outcome, and attach log mu when the sampler was not the policy being trained.
"""

from __future__ import annotations

import dataclasses
import math
import time
from dataclasses import dataclass, field

from src.batch import Group, is_effective
from src.policy.forward import Forward
from src.rollout.interface import RolloutEngine, SamplingParams
from src.task.base import Task
from src.task.prompts import PromptFormat
from src.variant import Variant, check_recipe, float_knob, int_knob


def generation_seed(base_seed: int, step: int) -> int:
    """A per-step sampling seed, so a resumed run generates exactly what the uninterrupted one would."""
    return base_seed * 1_000_003 + step


def round_seed(base_seed: int, step: int, round_index: int) -> int:
    """The sampling seed of a step's round (sampling=dynamic generates in rounds; round 0 is the step's seed)."""
    return generation_seed(base_seed, step) + round_index * 2**40


@dataclass
class FreshGroups:
    """A step's fresh groups and what it took to get them."""

    fresh: list[Group]                 # the groups the batch gets, in generation order
    generated: list[Group]             # every group generated and scored (DAPO: also the rejected ones)
    off_policy: bool                   # sampled by a stale or tempered behaviour: carries its log mu
    lag: int = 0
    temperature: float = 1.0
    timings: dict[str, float] = field(default_factory=dict)
    metrics: dict[str, float] = field(default_factory=dict)

    @property
    def evaluations(self) -> int:
        """Fresh verifier calls: one per generated response (SPEC 5)."""
        return sum(group.size for group in self.generated)

    @property
    def generated_tokens(self) -> int:
        """Response tokens generated this step (seed 001 counts compute in tokens as well as samples)."""
        return sum(len(ids) for group in self.generated for ids in group.response_ids)


class StandardSampling(Variant):
    """`sampling=standard`: one round of `count` prompts, K responses each."""

    @classmethod
    def plain(cls, node) -> bool:
        return True

    def __init__(self, engine: RolloutEngine, sampler, behaviour, prompts: PromptFormat, forward: Forward,
                 task: Task, group_size: int, max_new_tokens: int, top_p: float = 1.0, top_k: int | None = None,
                 seed: int = 0, name: str = "standard") -> None:
        self.engine, self.sampler, self.behaviour, self.prompts, self.forward = engine, sampler, behaviour, prompts, forward
        self.task = task
        self.group_size = int(group_size)
        self.max_new_tokens, self.top_p, self.top_k, self.seed = max_new_tokens, top_p, top_k, int(seed)

    def fresh_groups(self, policy, count: int, step: int) -> FreshGroups:
        sampler_model, lag = self.behaviour.model_for_step(policy)
        temperature = self.behaviour.temperature
        if sampler_model is not policy:
            self.engine.sync_weights(sampler_model)  # back to the policy after the update, as every step
        sampling = self.sampling_params(temperature)
        timings = {"generate": 0.0, "score": 0.0}
        fresh, generated, rounds = self.rounds(count, step, sampling, timings)
        off_policy = self.behaviour.is_off_policy(lag)
        if off_policy:  # log mu of the stale/tempered sampler, for the truncated IS weight (seed 002 eq. 3)
            started = time.perf_counter()
            fresh = self.forward.with_sampled_logprobs(fresh, sampler_model, temperature)
            timings["behaviour_logprobs"] = time.perf_counter() - started
        return FreshGroups(fresh, generated, off_policy, lag, temperature, timings, self.round_metrics(count, fresh,
                                                                                                     generated, rounds))

    def sampling_params(self, temperature: float) -> SamplingParams:
        return SamplingParams(temperature=temperature, top_p=self.top_p, top_k=self.top_k,
                              max_new_tokens=self.max_new_tokens)

    def generate_groups(self, instances, step: int, seed: int, logprobs: bool = False) -> FreshGroups:
        """`instances`' groups from the engine's current weights at the behaviour temperature, scored once each;
        with `logprobs`, carrying log mu per response and token from the engine's own logits.

        An asynchronous rollout worker's unit of work (SPEC 11): whoever calls it chose the prompts and
        the seed and tells the prompt sampler the outcome, so nothing here depends on which worker ran it.
        """
        timings = {"generate": 0.0, "score": 0.0}
        sampling = dataclasses.replace(self.sampling_params(self.behaviour.temperature), logprobs=logprobs)
        groups = self.score_groups(instances, sampling, seed, step, timings)
        return FreshGroups(groups, groups, False, 0, self.behaviour.temperature, timings)

    def rounds(self, count: int, step: int, sampling: SamplingParams, timings) -> tuple[list, list, int]:
        groups = self.sample_groups(self.sampler.sample(count), sampling, round_seed(self.seed, step, 0), step, timings)
        return groups, groups, 1

    def round_metrics(self, wanted: int, fresh: list[Group], generated: list[Group], rounds: int) -> dict:
        return {}

    def sample_groups(self, instances, sampling: SamplingParams, seed: int, step: int, timings) -> list[Group]:
        """Generate K responses for each instance's prompt, score each once, tell the prompt sampler."""
        groups = self.score_groups(instances, sampling, seed, step, timings)
        self.sampler.observe(instances, [group.rewards for group in groups], step)
        return groups

    def score_groups(self, instances, sampling: SamplingParams, seed: int, step: int, timings) -> list[Group]:
        """Generate K responses for each instance's prompt and score each once with the verifier."""
        started = time.perf_counter()
        prompts = [self.prompts.format(instance) for instance in instances]
        generated = self.engine.generate(prompts, self.group_size, sampling, seed=seed)
        generate_done = time.perf_counter()
        groups = []
        for instance, prompt, prompt_ids, completions in zip(instances, prompts, generated.prompt_ids,
                                                             generated.completions):
            rewards = [verdict.reward for verdict in self.task.verify_all([c.text for c in completions], instance)]
            group = Group(prompt=prompt, prompt_ids=prompt_ids, truth=self.task.truth(instance),
                          responses=[c.text for c in completions], response_ids=[c.token_ids for c in completions],
                          rewards=rewards, step=step)
            if sampling.logprobs:
                tokens = [c.logprobs for c in completions]
                group = group.with_behaviour_logprobs([sum(t) for t in tokens], None, tokens)
            groups.append(group)
        timings["generate"] += generate_done - started
        timings["score"] += time.perf_counter() - generate_done
        return groups


class DynamicSampling(StandardSampling):
    """`sampling=dynamic` (DAPO): rounds of ceil(missing x oversample) prompts, keeping effective groups only."""

    knobs = {"oversample": float_knob(1, 100, "1.5", why="each round samples ceil(missing x oversample) prompts"),
             "max_rounds": int_knob(1, 1_000, "8", why="generation rounds per step before giving up")}

    @classmethod
    def plain(cls, node) -> bool:
        return False

    cell_tag = "-dapo"

    reader_tag = "DAPO dynamic sampling"

    @classmethod
    def budget_is_floor(cls, node) -> bool:
        return True  # it generates until its batch is full of effective groups: the plan is its floor

    @classmethod
    def check(cls, node, run) -> None:
        check_recipe("sampling", "DAPO", "dynamic sampling", node, run)

    def __init__(self, oversample: float = 1.5, max_rounds: int = 8, mechanism_only: bool = False,
                 **settings) -> None:
        # mechanism_only only lifts src/command/config.py's check that the loss and KL are DAPO's: sampling is the same.
        super().__init__(**settings)
        self.oversample = float(oversample)
        self.max_rounds = int(max_rounds)

    def rounds(self, count: int, step: int, sampling: SamplingParams, timings) -> tuple[list, list, int]:
        fresh, generated = [], []
        for round_index in range(self.max_rounds):
            instances = self.sampler.sample(math.ceil((count - len(fresh)) * self.oversample))
            groups = self.sample_groups(instances, sampling, round_seed(self.seed, step, round_index), step, timings)
            generated += groups
            fresh += [group for group in groups if is_effective(group)][: count - len(fresh)]
            if len(fresh) == count:
                break
        return fresh, generated, round_index + 1

    def round_metrics(self, wanted: int, fresh: list[Group], generated: list[Group], rounds: int) -> dict:
        """What the rounds generated against what the batch kept."""
        return {"dynamic/rounds": rounds, "dynamic/generated_groups": len(generated),
                "dynamic/kept_groups": len(fresh), "dynamic/shortfall": wanted - len(fresh)}
