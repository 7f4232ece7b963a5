"""The planner equals the trainer: for random valid configs, planned per-step fresh groups = counted ones.

The trainer runs for real (its buffer, its draws, its gap fill) on the committed tiny policy; only the
rollout engine is a stub that answers instantly, some responses correct (the solver's demonstration),
the rest wrong, so positive-bias FIFO buffers keep and trim groups as they would in a run.
"""

from __future__ import annotations

import random

import pytest

from src.settings import RunSettings
from src.study.budget import plan_for_config
from src.command.config import ConfigError, validate
from src.rollout.interface import Completion, Generation
from src.task import countdown


def counted_fresh_groups_per_step(cfg, engine_for) -> list[int]:
    """Run the trainer for cfg.trainer.steps steps and return `batch/fresh_groups` of each step.

    The one place that knows how to build and step the trainer (adapt it when the step's API changes).
    `engine_for(tokenizer, train_set)` returns the rollout engine to use in place of the configured one.
    """
    from src.build import build_components
    from src.batch import TrainState
    from src.train import train_step

    train_set = countdown.generate_instances(64, seed=cfg.task.seed)
    parts = build_components(RunSettings(cfg), train_set)
    parts.engine = parts.sampling.engine = engine_for(parts.tokenizer, train_set)  # the collection generates
    state, counted = TrainState(), []
    while state.step < cfg.trainer.steps:  # train_step advances state.step
        counted.append(int(train_step(parts, state)["batch/fresh_groups"]))
    return counted


class StubEngine:
    """Answers each prompt of the training set instantly: response j of a prompt is the solver's correct
    demonstration when (prompt number + j) % 3 == 0, else a wrong answer; deterministic per prompt."""

    def __init__(self, tokenizer, train_set, template):
        self.tokenizer = tokenizer
        self.instances = {countdown.format_prompt(instance, template): (number, instance)
                          for number, instance in enumerate(train_set)}

    def sync_weights(self, model) -> None:
        pass

    def sleep(self) -> None:
        pass

    def generate(self, prompts, samples_per_prompt, sampling, seed) -> Generation:
        completions = []
        for prompt in prompts:
            number, instance = self.instances[prompt]
            texts = [countdown.demonstration(instance) if (number + j) % 3 == 0 else " 1 + 1 </think>\n<answer> 0 </answer>"
                     for j in range(samples_per_prompt)]
            completions.append([Completion(tuple(self.tokenizer(text, add_special_tokens=False)["input_ids"]), text)
                                for text in texts])
        prompt_ids = [tuple(self.tokenizer(prompt, add_special_tokens=False)["input_ids"]) for prompt in prompts]
        return Generation(prompt_ids=prompt_ids, completions=completions)


def random_valid_config(compose_config, rng: random.Random):
    """A config validation accepts, with a small buffer (age or FIFO, any mode, positive bias, small capacity);
    a validation that refuses every draw fails the test with its last message rather than drawing forever."""
    refused = None
    for _ in range(200):
        buffer = rng.choice(["age1", "age2", "age3", "fifo", "fifo"])
        overrides = [f"buffer={buffer}", f"buffer.ratio={rng.choice([0.5, 1, 1.5, 2, 3])}", "clip=tight",
                     f"trainer.groups_per_step={rng.randint(3, 8)}", "trainer.group_size=2",
                     f"trainer.steps={rng.randint(3, 6)}", f"trainer.seed={rng.randint(0, 99)}",
                     "trainer.micro_batch_size=16", "policy.max_new_tokens=8", "hardware.threads=1",
                     f"buffer.allow_infeasible={rng.choice(['true', 'false'])}"]
        overrides.append(f"buffer.capacity={2 * rng.randint(1, 6)}")  # N rollouts: 1 to 6 groups of K = 2
        if buffer == "fifo":
            overrides += [f"buffer.mode={rng.choice(['with_replacement', 'without_replacement', 'at_least_once'])}",
                          f"buffer.positive_bias={rng.choice([0, 0.25, 0.5])}",
                          f"buffer.extra_updates={rng.choice([0, 0, 1])}"]
        cfg = compose_config(*overrides)
        try:
            validate(cfg, check_device=False)
        except ConfigError as error:
            refused = error
            continue
        return cfg
    raise AssertionError(f"validation refused 200 random draws; the last: {refused}")


@pytest.mark.parametrize("draw", range(10))
def test_planned_fresh_groups_equal_the_trainers_per_step(compose_config, draw):
    cfg = random_valid_config(compose_config, random.Random(1000 + draw))
    plan = plan_for_config(cfg)
    counted = counted_fresh_groups_per_step(cfg, lambda tokenizer, train_set: StubEngine(
        tokenizer, train_set, cfg.task.prompt_template))
    planned = list(plan.fresh_groups_per_step)
    if plan.reward_dependent:  # the plan assumed no correct rollout: the smallest pool, the most gap fill
        assert all(c <= p for c, p in zip(counted, planned)), (planned, counted)
    else:
        assert counted == planned


@pytest.mark.parametrize("overrides, planned, formula", [
    # The audit's two misses (7-step and 6-step runs, B=8, K=2, rho=1: B_fresh = B_replay = 4).
    (["buffer=fifo", "buffer.positive_bias=0.5", "buffer.mode=without_replacement", "buffer.capacity=8",
      "trainer.steps=7"], 88, 64),
    (["buffer=age2", "buffer.capacity=4", "buffer.allow_infeasible=true", "trainer.steps=6"], 76, 56),
])
def test_the_audits_misses_are_planned_as_the_trainer_counts_them(compose_config, overrides, planned, formula):
    """With a stub engine that is never correct, a positive-bias FIFO keeps only its freshest (1 - delta) N groups."""
    cfg = compose_config("trainer.groups_per_step=8", "trainer.group_size=2", "clip=tight", "hardware.threads=1",
                         "trainer.micro_batch_size=16", *overrides)
    validate(cfg, check_device=False)
    plan = plan_for_config(cfg)
    assert plan.fresh_evaluations == planned
    assert cfg.trainer.group_size * (8 + (cfg.trainer.steps - 1) * 4) == formula

    class NeverCorrect(StubEngine):
        def generate(self, prompts, samples_per_prompt, sampling, seed):
            generation = super().generate(prompts, samples_per_prompt, sampling, seed)
            wrong = " 1 + 1 </think>\n<answer> 0 </answer>"
            ids = tuple(self.tokenizer(wrong, add_special_tokens=False)["input_ids"])
            return Generation(generation.prompt_ids, [[Completion(ids, wrong)] * samples_per_prompt for _ in prompts])

    counted = counted_fresh_groups_per_step(cfg, lambda tokenizer, train_set: NeverCorrect(
        tokenizer, train_set, cfg.task.prompt_template))
    assert counted == list(plan.fresh_groups_per_step)
    assert cfg.trainer.group_size * sum(counted) == planned
