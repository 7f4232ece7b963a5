"""Evaluation protocol (SPEC 7): seeded repeats of sampling on held-out prompts, scored and summarised.

One function serves every protocol; the caller picks the settings, e.g. canonical
(50 prompts, 16 samples, 5 repeats, estimator "first_k") or the best-of-N probe
(64 samples, estimator "unbiased"). Each protocol passes its own `seed`, so their
seed namespaces never overlap and their results stay apart.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Sequence

import pandas as pd

from src.eval.failures import CATEGORIES, category_counts, classify_failure
from src.eval.passk import ESTIMATORS, answer_unique_rate, first_k_pass_at_k, t_half_width, unbiased_pass_at_k
from src.rollout.interface import RolloutEngine, SamplingParams
from src.task import countdown
from src.task.countdown import Instance



@dataclass
class EvalResult:
    """One protocol's results: summary over repeats, and the per-repeat and per-prompt tables."""

    name: str
    summary: dict[str, float]  # mean over repeats per metric, plus "<metric>_hw" (95% t half-width)
    per_repeat: pd.DataFrame  # one row per repeat: repeat, seed, every metric
    per_prompt: pd.DataFrame  # one row per (repeat, prompt)


def failure_summary(per_repeat: pd.DataFrame) -> dict[str, float]:
    """Failure taxonomy per evaluation: rollouts and failed rollouts per repeat (means), each category's
    count per repeat, and its share of all failed rollouts pooled over repeats (NaN without failures)."""
    failed = int(per_repeat["failed"].sum())
    summary = {"failures/rollouts": float(per_repeat["rollouts"].mean()),
               "failures/failed": float(per_repeat["failed"].mean())}
    for category in CATEGORIES:
        total = int(per_repeat[f"fail_{category}"].sum())
        summary[f"failures/{category}"] = total / len(per_repeat)
        summary[f"failure_share/{category}"] = total / failed if failed else float("nan")
    return summary


def _pass_at_k(correct: list[bool], k: int, estimator: str) -> float:
    if estimator == "first_k":
        return first_k_pass_at_k(correct, k)
    return unbiased_pass_at_k(len(correct), sum(correct), k)


def evaluate(
    engine: RolloutEngine,
    instances: Sequence[Instance],
    template: str,
    *,
    name: str,
    samples_per_prompt: int,
    repeats: int,
    ks: Sequence[int],
    estimator: str,
    sampling: SamplingParams,
    seed: int,
    on_repeat: Callable[[int], None] | None = None,
) -> EvalResult:
    """Run `repeats` seeded repeats (engine seed `seed + r`) and return pass@k, reward, correction and unique rates.

    `on_repeat(r)` is called after each repeat (a progress display).
    """
    if estimator not in ESTIMATORS:
        raise ValueError(f"unknown estimator {estimator!r}; valid: {', '.join(ESTIMATORS)}")
    if repeats < 1 or not instances:
        raise ValueError("need repeats >= 1 and at least one instance")
    bad_ks = [k for k in ks if not 1 <= k <= samples_per_prompt]
    if bad_ks:  # checked up front so no generation is wasted
        raise ValueError(f"every k must be in [1, samples_per_prompt={samples_per_prompt}], got {bad_ks}")
    prompts = [countdown.format_prompt(inst, template) for inst in instances]
    pass_cols = [f"pass@{k}" for k in ks]

    repeat_rows, prompt_rows = [], []
    for r in range(repeats):
        generation = engine.generate(prompts, samples_per_prompt, sampling, seed + r)
        if len(generation.completions) != len(prompts) or any(
            len(c) != samples_per_prompt for c in generation.completions
        ):
            raise RuntimeError(f"engine returned the wrong number of completions in repeat {r}")
        rows = []
        for p, (inst, completions) in enumerate(zip(instances, generation.completions)):
            texts = [c.text for c in completions]
            verdicts = [countdown.verify(t, inst.numbers, inst.target) for t in texts]
            rewards = [v.reward for v in verdicts]
            correct = [reward == countdown.REWARD_CORRECT for reward in rewards]
            failures = category_counts(None if ok else classify_failure(t, v)
                                       for t, v, ok in zip(texts, verdicts, correct))
            row = {
                "repeat": r,
                "prompt_index": p,
                "numbers": str(list(inst.numbers)),
                "target": inst.target,
                "samples": len(texts),
                "correct": sum(correct),
                "mean_reward": sum(rewards) / len(rewards),
                "unique_rate": answer_unique_rate(texts),
                "failed": len(texts) - sum(correct),
                **{f"fail_{category}": count for category, count in failures.items()},
            }
            row.update({col: _pass_at_k(correct, k, estimator) for col, k in zip(pass_cols, ks)})
            rows.append(row)
        table = pd.DataFrame(rows)
        # Every prompt has the same number of samples, so means over prompts equal means over samples.
        repeat_rows.append(
            {
                "repeat": r,
                "seed": seed + r,
                **{col: table[col].mean() for col in pass_cols},
                "mean_reward": table["mean_reward"].mean(),
                "correction_rate": table["correct"].sum() / table["samples"].sum(),
                "unique_rate": table["unique_rate"].mean(),
                "rollouts": int(table["samples"].sum()),
                "failed": int(table["failed"].sum()),
                **{f"fail_{category}": int(table[f"fail_{category}"].sum()) for category in CATEGORIES},
            }
        )
        prompt_rows += rows
        if on_repeat is not None:
            on_repeat(r)

    per_repeat = pd.DataFrame(repeat_rows)
    summary: dict[str, float] = {}
    for metric in [*pass_cols, "mean_reward", "correction_rate", "unique_rate"]:
        summary[metric] = float(per_repeat[metric].mean())
        summary[f"{metric}_hw"] = t_half_width(per_repeat[metric].tolist())
    summary.update(failure_summary(per_repeat))
    return EvalResult(name=name, summary=summary, per_repeat=per_repeat, per_prompt=pd.DataFrame(prompt_rows))
