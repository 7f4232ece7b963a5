"""Evaluation protocol (SPEC 7): seeded repeats of sampling on held-out prompts, scored and summarised.

One function serves every protocol; the caller picks the settings, e.g. canonical
(50 prompts, 16 samples, 5 repeats, estimator "first_k") or the best-of-N probe
(64 samples, estimator "unbiased"). Each protocol passes its own `seed`, so their
seed namespaces never overlap and their results stay apart.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Sequence

import pandas as pd

from src.passk import ESTIMATORS, answer_unique_rate, first_k_pass_at_k, t_half_width, unbiased_pass_at_k
from src.rollout.interface import RolloutEngine, SamplingParams
from src.task.base import Task
from src.task.failures import category_counts


@dataclass
class EvalResult:
    """One protocol's results: summary over repeats, and the per-repeat and per-prompt tables."""

    name: str
    summary: dict[str, float]  # mean over repeats per metric, plus "<metric>_hw" (95% t half-width)
    per_repeat: pd.DataFrame  # one row per repeat: repeat, seed, every metric
    per_prompt: pd.DataFrame  # one row per (repeat, prompt)
    # sample completions (SAMPLE_COLUMNS; category "" when correct); see `evaluate`'s `samples`
    samples: pd.DataFrame = field(default_factory=pd.DataFrame)


# The problem in the task's own words (`Task.brief`), then the prompt as the policy saw it, and the verdict.
SAMPLE_COLUMNS = ["problem", "prompt", "response", "reward", "reason", "category"]



def failure_summary(per_repeat: pd.DataFrame, categories: Sequence[str]) -> dict[str, float]:
    """Failure taxonomy per evaluation: rollouts and failed rollouts per repeat (means), each category's
    count per repeat, and its share of all failed rollouts pooled over repeats (NaN without failures)."""
    failed = int(per_repeat["failed"].sum())
    summary = {"failures/rollouts": float(per_repeat["rollouts"].mean()),
               "failures/failed": float(per_repeat["failed"].mean())}
    for category in categories:
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
    instances: Sequence[Any],
    prompt: Callable[[Any], str],
    *,
    task: Task,
    name: str,
    samples_per_prompt: int,
    repeats: int,
    ks: Sequence[int],
    estimator: str,
    sampling: SamplingParams,
    seed: int,
    on_repeat: Callable[[int], None] | None = None,
    samples: int = 0,
) -> EvalResult:
    """Run `repeats` seeded repeats (engine seed `seed + r`) and return pass@k, reward, correction and unique rates.

    `prompt(instance)` is the text the policy sees (a `PromptFormat.format`); `task` verifies, extracts the
    answers for the unique rate and names the failure categories. A response as long as the token budget
    counts as truncated. `on_repeat(r)` is called after each repeat (a progress display). `samples` of the first
    repeat's completions (the first one of each prompt, prompts in order) are kept as `EvalResult.samples`.
    """
    _check_settings(instances, samples_per_prompt, repeats, ks, estimator)
    prompts = [prompt(inst) for inst in instances]
    categories = tuple(task.failure_categories)
    pass_cols = [f"pass@{k}" for k in ks]

    repeat_rows, prompt_rows, sample_rows = [], [], []
    for r in range(repeats):
        generation = engine.generate(prompts, samples_per_prompt, sampling, seed + r)
        if len(generation.completions) != len(prompts) or any(
            len(c) != samples_per_prompt for c in generation.completions
        ):
            raise RuntimeError(f"engine returned the wrong number of completions in repeat {r}")
        rows = []
        for p, (inst, completions) in enumerate(zip(instances, generation.completions)):
            row, sample = _score_prompt(task, inst, completions, categories, sampling.max_new_tokens, ks, estimator)
            if r == 0 and p < samples:
                sample_rows.append({"problem": task.brief(inst), "prompt": prompts[p], **sample})
            rows.append({"repeat": r, "prompt_index": p, **row})
        repeat_rows.append(_repeat_row(r, seed + r, pd.DataFrame(rows), pass_cols, categories))
        prompt_rows += rows
        if on_repeat is not None:
            on_repeat(r)

    per_repeat = pd.DataFrame(repeat_rows)
    return EvalResult(name=name, summary=_summary(per_repeat, pass_cols, categories), per_repeat=per_repeat,
                      per_prompt=pd.DataFrame(prompt_rows),
                      samples=pd.DataFrame(sample_rows, columns=SAMPLE_COLUMNS))


def _check_settings(instances: Sequence[Any], samples_per_prompt: int, repeats: int, ks: Sequence[int],
                    estimator: str) -> None:
    """The protocol's settings, checked up front so no generation is wasted."""
    if estimator not in ESTIMATORS:
        raise ValueError(f"unknown estimator {estimator!r}; valid: {', '.join(ESTIMATORS)}")
    if repeats < 1 or not instances:
        raise ValueError("need repeats >= 1 and at least one instance")
    bad_ks = [k for k in ks if not 1 <= k <= samples_per_prompt]
    if bad_ks:
        raise ValueError(f"every k must be in [1, samples_per_prompt={samples_per_prompt}], got {bad_ks}")


def _score_prompt(task: Task, instance: Any, completions: Sequence[Any], categories: Sequence[str],
                  max_new_tokens: int, ks: Sequence[int], estimator: str) -> tuple[dict, dict]:
    """One prompt's completions verified: its per-prompt row and its first completion as a sample (no prompt)."""
    texts = [c.text for c in completions]
    verdicts = task.verify_all(texts, instance)
    rewards = [v.reward for v in verdicts]
    correct = [reward == task.correct_reward for reward in rewards]
    truncated = [len(c.token_ids) >= max_new_tokens for c in completions]
    labels = [None if ok else task.classify_failure(t, v, cut)
              for t, v, ok, cut in zip(texts, verdicts, correct, truncated)]
    failures = category_counts(labels, categories)
    row = {
        **task.describe(instance),
        "samples": len(texts),
        "correct": sum(correct),
        "mean_reward": sum(rewards) / len(rewards),
        "unique_rate": answer_unique_rate(texts, task.extract),
        "failed": len(texts) - sum(correct),
        **{f"fail_{category}": count for category, count in failures.items()},
        **{f"pass@{k}": _pass_at_k(correct, k, estimator) for k in ks},
    }
    sample = {"response": texts[0], "reward": rewards[0], "reason": verdicts[0].reason, "category": labels[0] or ""}
    return row, sample


def _repeat_row(repeat: int, seed: int, table: pd.DataFrame, pass_cols: list[str],
                categories: Sequence[str]) -> dict:
    """One repeat's metrics from its per-prompt table."""
    # Every prompt has the same number of samples, so means over prompts equal means over samples.
    return {
        "repeat": repeat,
        "seed": seed,
        **{col: table[col].mean() for col in pass_cols},
        "mean_reward": table["mean_reward"].mean(),
        "correction_rate": table["correct"].sum() / table["samples"].sum(),
        "unique_rate": table["unique_rate"].mean(),
        "rollouts": int(table["samples"].sum()),
        "failed": int(table["failed"].sum()),
        **{f"fail_{category}": int(table[f"fail_{category}"].sum()) for category in categories},
    }


def _summary(per_repeat: pd.DataFrame, pass_cols: list[str], categories: Sequence[str]) -> dict[str, float]:
    """Mean over repeats and its 95% t half-width per metric, then the failure taxonomy."""
    summary: dict[str, float] = {}
    for metric in [*pass_cols, "mean_reward", "correction_rate", "unique_rate"]:
        summary[metric] = float(per_repeat[metric].mean())
        summary[f"{metric}_hw"] = t_half_width(per_repeat[metric].tolist())
    summary.update(failure_summary(per_repeat, categories))
    return summary
