"""Evaluation protocol (SPEC 7) with a scripted fake engine and hand-computed metrics."""

import math

import pytest

from src.eval.protocol import evaluate
from src.rollout.interface import Completion, Generation, SamplingParams
from src.task.countdown import DEFAULT_PROMPT_TEMPLATE, CountdownTask, Instance, format_prompt

INSTANCES = [Instance((1, 2, 3), 6), Instance((4, 5, 6), 26)]
SAMPLING = SamplingParams(temperature=0.6, top_p=0.95, top_k=20, max_new_tokens=1024)

# Scripted responses, with score / correct / normalised answer:
SCRIPT = [
    [
        "<answer>1+2</answer>",  # 0.1, F, "1+2"
        "<answer>1+2+3</answer>",  # 1.0, T, "1+2+3"
        "<answer> 1 + 2 + 3 </answer>",  # 1.0, T, "1+2+3"
        "thinking, no answer",  # 0.0, F, ""
    ],  # mean reward 0.525, c = 2, unique 3/4
    [
        "no answer",  # 0.0, F, ""
        "<answer>4+5+6</answer>",  # 0.1, F, "4+5+6"
        "<answer>(4+5)*6</answer>",  # 0.1, F, "(4+5)*6"
        "<answer>4*5+6</answer>",  # 1.0, T, "4*5+6"
    ],  # mean reward 0.3, c = 1, unique 4/4
]


class FakeEngine:
    """Returns `script(prompt_index, seed)` for every prompt, recording each call."""

    def __init__(self, script):
        self.script = script
        self.calls = []

    def generate(self, prompts, samples_per_prompt, sampling, seed):
        self.calls.append({"prompts": list(prompts), "samples": samples_per_prompt, "sampling": sampling, "seed": seed})
        completions = [
            [Completion(token_ids=(), text=text) for text in self.script(p, seed)[:samples_per_prompt]]
            for p in range(len(prompts))
        ]
        return Generation(prompt_ids=[() for _ in prompts], completions=completions)

    def sync_weights(self, model):
        pass


def run(engine, *, estimator="first_k", repeats=1, ks=(1, 2, 4), seed=100):
    return evaluate(
        engine,
        INSTANCES,
        lambda instance: format_prompt(instance, DEFAULT_PROMPT_TEMPLATE),
        task=CountdownTask(),
        name="test",
        samples_per_prompt=4,
        repeats=repeats,
        ks=ks,
        estimator=estimator,
        sampling=SAMPLING,
        seed=seed,
    )


@pytest.mark.parametrize(
    "estimator, expected_pass",
    [
        # ordered: prompt 0 [F,T,T,F] -> 0,1,1; prompt 1 [F,F,F,T] -> 0,0,1
        ("first_k", {"pass@1": 0.0, "pass@2": 0.5, "pass@4": 1.0}),
        # (n,c) = (4,2): 1/2, 5/6, 1; (4,1): 1/4, 1/2, 1
        ("unbiased", {"pass@1": 0.375, "pass@2": (5 / 6 + 0.5) / 2, "pass@4": 1.0}),
    ],
)
def test_metrics_match_hand_computed(estimator, expected_pass):
    result = run(FakeEngine(lambda p, seed: SCRIPT[p]), estimator=estimator)
    expected = {**expected_pass, "mean_reward": 0.4125, "correction_rate": 3 / 8, "unique_rate": 0.875}
    assert result.name == "test"
    for metric, value in expected.items():
        assert result.summary[metric] == pytest.approx(value), metric
        assert result.per_repeat.loc[0, metric] == pytest.approx(value), metric
        assert math.isnan(result.summary[f"{metric}_hw"])  # one repeat: no interval
    prompts = result.per_prompt
    assert prompts["correct"].tolist() == [2, 1]
    assert prompts["mean_reward"].tolist() == pytest.approx([0.525, 0.3])
    assert prompts["unique_rate"].tolist() == pytest.approx([0.75, 1.0])
    assert prompts["numbers"].tolist() == ["[1, 2, 3]", "[4, 5, 6]"]
    assert prompts["target"].tolist() == [6, 26]
    assert prompts["samples"].tolist() == [4, 4]


def test_repeats_use_consecutive_seeds_one_call_each():
    engine = FakeEngine(lambda p, seed: SCRIPT[p])
    result = run(engine, repeats=3, seed=1000)
    assert [call["seed"] for call in engine.calls] == [1000, 1001, 1002]
    assert result.per_repeat["seed"].tolist() == [1000, 1001, 1002]
    assert result.per_repeat["repeat"].tolist() == [0, 1, 2]
    # One generate call per repeat, with every prompt and the protocol's sampling settings.
    expected_prompts = [format_prompt(inst, DEFAULT_PROMPT_TEMPLATE) for inst in INSTANCES]
    assert all(call["prompts"] == expected_prompts for call in engine.calls)
    assert all(call["samples"] == 4 and call["sampling"] == SAMPLING for call in engine.calls)
    assert len(result.per_prompt) == 3 * len(INSTANCES)
    assert result.per_prompt[["repeat", "prompt_index"]].values.tolist() == [[r, p] for r in range(3) for p in range(2)]


def test_half_width_finite_with_three_repeats():
    # Repeat r (seed 7 + r) makes the first r + 1 samples of every prompt correct:
    # correction rate 1/4, 2/4, 3/4 -> mean 0.5, sd 0.25, hw = t_{0.975,2} * 0.25 / sqrt(3) = 0.6210
    answers = ["<answer>1+2+3</answer>", "<answer>4*5+6</answer>"]

    def script(p, seed):
        n_correct = seed - 7 + 1
        return [answers[p]] * n_correct + ["no answer"] * (4 - n_correct)

    result = run(FakeEngine(script), repeats=3, seed=7)
    assert result.per_repeat["correction_rate"].tolist() == pytest.approx([0.25, 0.5, 0.75])
    assert result.summary["correction_rate"] == pytest.approx(0.5)
    assert result.summary["correction_rate_hw"] == pytest.approx(0.6210, abs=1e-4)
    assert all(math.isfinite(v) for v in result.summary.values())
    # pass@1 is 1 in every repeat (sample 0 always correct): zero spread, zero half-width.
    assert result.summary["pass@1"] == 1.0 and result.summary["pass@1_hw"] == pytest.approx(0.0, abs=1e-12)


def test_unknown_estimator_names_the_valid_ones():
    with pytest.raises(ValueError, match="first_k.*unbiased"):
        run(FakeEngine(lambda p, seed: SCRIPT[p]), estimator="biased")


def test_k_larger_than_samples_is_refused_before_generating():
    engine = FakeEngine(lambda p, seed: SCRIPT[p])
    with pytest.raises(ValueError, match="samples_per_prompt"):
        run(engine, ks=(1, 8))
    assert engine.calls == []


def test_failure_taxonomy_per_evaluation():
    # SCRIPT's 5 failures: prompt 0 "1+2" (invalid number use), "thinking, no answer" (format);
    # prompt 1 "no answer" (format), "4+5+6" = 15 and "(4+5)*6" = 54 (wrong target, numbers right).
    result = run(FakeEngine(lambda p, seed: SCRIPT[p]), repeats=2)
    prompts = result.per_prompt
    assert prompts["failed"].tolist() == [2, 3, 2, 3]
    assert prompts["fail_format_error"].tolist() == [1, 1, 1, 1]
    assert prompts["fail_invalid_number_use"].tolist() == [1, 0, 1, 0]
    assert prompts["fail_wrong_target"].tolist() == [0, 2, 0, 2]
    assert result.per_repeat["failed"].tolist() == [5, 5]
    assert result.per_repeat["rollouts"].tolist() == [8, 8]
    summary = result.summary
    assert summary["failures/rollouts"] == 8 and summary["failures/failed"] == 5
    assert summary["failures/format_error"] == 2 and summary["failures/wrong_target"] == 2
    assert summary["failures/invalid_number_use"] == 1 and summary["failures/arithmetic_error"] == 0
    assert summary["failure_share/format_error"] == pytest.approx(0.4)
    assert summary["failure_share/wrong_target"] == pytest.approx(0.4)
    assert summary["failure_share/invalid_number_use"] == pytest.approx(0.2)
    assert summary["failure_share/repetitive_or_incoherent"] == 0.0


def test_failure_shares_undefined_without_failures():
    result = run(FakeEngine(lambda p, seed: ["<answer>1+2+3</answer>", "<answer>4*5+6</answer>"][p:p + 1] * 4))
    assert result.summary["failures/failed"] == 0
    assert all(math.isnan(result.summary[f"failure_share/{c}"]) for c in ("format_error", "other"))
