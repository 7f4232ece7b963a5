"""Replay-RLOO training: one optimizer step reads as SPEC 3 (paper section 3, appendix B.3).

    collect: plan -> draw replayed groups -> collect fresh groups (gap fill counted) -> compose the batch
    learn:   update (advantages eq. 1, weights eq. 2, loss eq. 3) -> store fresh groups -> metrics

`train_step` composes the two halves; they pass a typed `StepBatch`, so a runtime can run them apart.

Fresh-only RLOO is the same step with rho = 0. Every variant (SPEC 9) enters through the components
the step is given, never through a branch here: the replay store (`buffer` group: age window,
FIFO, POPO's refill, none), the objective (`loss`: RLOO, GRPO's clipped surrogate, IPO), the
fresh-rollout collection (`sampling`: standard, DAPO rounds) with its behaviour policy
(`behaviour`: current, stale, tempered) and the prompt sampler (`curriculum`).
"""

from __future__ import annotations

import logging
import random
import time
from dataclasses import dataclass, field

import torch

from src.batch import Batch, Group, StepCounts, fresh_entries, is_effective, whole_groups, plan_batch
from src.components import Components
from src.loss.trainer import UpdateResult
from src.loss.rloo_math import clip_fraction, effective_sample_size
from src.sampling.collection import FreshGroups
from src.batch import TrainState

log = logging.getLogger(__name__)

AGE_BUCKETS = ("age0", "age1", "age2", "age3plus")


def train_step(parts: Components, state: TrainState) -> dict[str, float]:
    """Run optimizer step `state.step` (SPEC 3) and return its metrics: collect, learn, then count the step."""
    metrics, counts = learn(parts, state, collect(parts, state.step))
    state.advance(counts)
    return metrics


@dataclass
class StepBatch:
    """What `collect` hands to `learn`: the step's batch, the fresh groups behind it, and its phase times."""

    step: int
    batch: Batch
    collected: FreshGroups
    gap_fill: int                                   # fresh groups generated in place of missing replays
    laps: dict[str, float] = field(default_factory=dict)
    update: UpdateResult | None = None              # set by `learn`: per-row weights (the completions table reads them)

    def completions(self, count: int) -> list["Completion"]:
        """Up to `count` responses the step trained on (every generated one when nothing was trained), a draw seeded
        by the step, so a resumed run that redoes the step picks the same ones."""
        update = self.update
        rows = [(entry.group, j, entry.source, entry.age) for entry in self.batch.entries for j in entry.trained] \
            if update is not None else [(group, j, "fresh", 0) for group in self.collected.generated
                                        for j in range(group.size)]
        picked = sorted(random.Random(self.step).sample(range(len(rows)), min(count, len(rows))))
        return [Completion(self.step, *rows[row], row_weight(update, row)) for row in picked]


@dataclass(frozen=True)
class Completion:
    """One response of a step for the run's completions table: its group and index in the group, where it came
    from, and the importance weight its gradient used (the mean over tokens where the objective weights tokens;
    NaN when nothing was trained)."""

    step: int
    group: Group
    index: int
    source: str
    age: int
    weight: float


def row_weight(update: UpdateResult | None, row: int) -> float:
    """The importance weight an update used for a batch row; NaN without an update."""
    if update is None:
        return float("nan")
    if update.token_weights is not None:
        return float(update.token_weights[row].float().mean()) if len(update.token_weights[row]) else float("nan")
    return float(update.weights[row])


def picked_completions(collection: StepBatch, counts: tuple[int, ...]) -> dict[int, list[Completion]]:
    """The step's completions for each count the run logs or prints (`TrackingSettings.completion_counts`): each its own
    draw, so what is logged does not depend on what is printed."""
    return {count: collection.completions(count) for count in set(counts) if count}


def collect(parts: Components, step: int) -> StepBatch:
    """Steps 1-4 of SPEC 3: plan, draw replayed groups, generate and score fresh ones, compose the batch.

    Reads the store and the policy but changes no training state, so a runtime may call it apart
    from `learn` (another process, another time); `step` is the policy version the batch is for.
    """
    clock = Clock()
    # 1. Plan: B_fresh = round(B / (1 + rho)), B_replay = B - B_fresh.
    planned_fresh, planned_replay = plan_batch(parts.groups_per_step, parts.buffer.ratio)

    # 2. Draw replayed groups (ageL: age in [1, L], uniform without replacement). Drawn before
    #    generating, so fresh and gap-fill groups share one generate call: the draw cannot depend on
    #    this step's fresh groups, which the store only sees after the update.
    replayed = parts.buffer.draw(planned_replay, step)
    gap_fill = planned_replay - int(whole_groups(replayed))  # too few eligible (e.g. step 0): fill with fresh
    clock.lap("replay_draw")

    # 3. Collect fresh groups: sample prompts, K responses each from the behaviour policy, score each
    #    once. Every generated response is one fresh verifier evaluation (SPEC 5).
    collected = parts.sampling.fresh_groups(parts.policy, planned_fresh + gap_fill, step)
    clock.lap("collect")

    # 4. Compose the batch: fresh groups first, then replayed ones (POPO drops and refills here).
    batch = parts.buffer.compose(fresh_entries(collected.fresh, collected.off_policy), replayed, step,
                                measure=parts.measure_behaviour)
    clock.lap("compose")
    return StepBatch(step, batch, collected, gap_fill, clock.laps)


def learn(parts: Components, state: TrainState, collection: StepBatch) -> tuple[dict[str, float], StepCounts]:
    """Steps 5-7 of SPEC 3: update on the batch (advantages eq. 1, weights eq. 2, loss eq. 3), store the
    fresh groups, count the budget. Returns the step's metrics and what it adds to the counters of `state`,
    which it only reads: whoever runs the steps counts them (`TrainState.advance`)."""
    clock, batch, collected, step = Clock(), collection.batch, collection.collected, collection.step
    parts.engine.sleep()  # vLLM's sleep mode: its weights and KV cache off the GPU while the step trains, once a step

    # 5. Update on the batch; then any further updates the store asks for (seed 002's R - 1), all
    #    before this step's fresh groups are stored.
    update = parts.trainer.update(parts.policy, parts.reference, parts.optimizer, batch) if batch else None
    updates = [update] if update else []
    collection.update = update
    updates += [parts.trainer.update(parts.policy, parts.reference, parts.optimizer, extra)
                for extra in parts.buffer.extra_batches(step)]
    parts.optimizer.zero_grad(set_to_none=True)  # their memory back before a sleeping vLLM engine wakes
    clock.lap("train")
    parts.engine.sync_weights(parts.policy)  # vLLM: the updated weights into its own copy (HF: nothing to do)
    clock.lap("weight_sync")

    # 6. Store the fresh groups with log mu and log pi_ref from this step's forward pass (so they
    #    cannot be replayed at the step that sampled them); the store drops what it can no longer draw.
    if update is not None:
        parts.buffer.store(batch.fresh_to_store(collected.fresh, update.stored), step)
    clock.lap("buffer_update")

    # 7. Bookkeeping (SPEC 6): budget in verifier calls, optimizer steps and tokens (seed 001's compute).
    counts = StepCounts(
        fresh_evaluations=collected.evaluations,
        fresh_groups=len(collected.fresh),
        replay_groups=float(whole_groups(batch.replayed)),
        gradient_steps=sum(done.optimizer_steps for done in updates),
        generated_tokens=collected.generated_tokens,
        trained_tokens=sum(int(done.token_counts.sum()) for done in updates),
        groups_trained=len(batch),
        effective_groups_trained=sum(is_effective(group) for group in batch.groups))
    metrics = {**step_metrics(batch, update, parts.loss.weight_ceiling, collected.generated,
                              parts.task.correct_reward),
               **collected.metrics, **parts.behaviour.metrics(collected, batch, update),
               **parts.curriculum.metrics(), **parts.buffer.metrics(step),
               **batch_metrics(state.counted(counts), collected, batch, collection.gap_fill),
               **clock.metrics(collection.laps, collected)}
    return metrics, counts


class Clock:
    """Wall time of a step's phases."""

    def __init__(self) -> None:
        self.started = self.last = time.perf_counter()
        self.laps: dict[str, float] = {}

    def lap(self, name: str) -> None:
        now = time.perf_counter()
        self.laps[name], self.last = now - self.last, now

    def metrics(self, collect_laps: dict[str, float], collected: FreshGroups) -> dict[str, float]:
        """The learn half's laps after `collect_laps`; time/step is both halves' time."""
        done = time.perf_counter()
        laps = {**collect_laps, **self.laps, "bookkeeping": done - self.last}
        # "collect" is reported by its phases (generate, score, ...), which the collection times itself
        return {**{f"time/{name}": seconds for name, seconds in laps.items() if name != "collect"},
                "time/step": sum(laps.values()),
                **{f"time/{phase}": seconds for phase, seconds in collected.timings.items()}}


# --------------------------------------------------------------------------- bookkeeping
def batch_metrics(state: TrainState, collected: FreshGroups, batch: Batch, gap_fill: int) -> dict[str, float]:
    """Budget and batch composition (SPEC 5-6); `state`: the counters with this step counted."""
    fresh, generated, replayed = collected.fresh, collected.generated, float(whole_groups(batch.replayed))
    nan = float("nan")
    return {
        "budget/fresh_evaluations": state.fresh_evaluations,
        "budget/gradient_steps": state.gradient_steps,
        "budget/generated_tokens": state.generated_tokens,
        "budget/trained_tokens": state.trained_tokens,
        "batch/fresh_groups": len(fresh),
        "batch/replay_groups": replayed,
        "batch/gap_fill_groups": gap_fill,
        "batch/replay_ratio": replayed / len(fresh) if fresh else nan,
        "batch/replay_ratio_cumulative": state.replay_groups / state.fresh_groups if state.fresh_groups else nan,
        "batch/effective_fraction": sum(map(is_effective, batch.groups)) / len(batch) if batch else nan,
        "batch/effective_fraction_fresh": sum(map(is_effective, generated)) / len(generated) if generated else nan,
        "batch/effective_fraction_cumulative": (state.effective_groups_trained / state.groups_trained
                                                if state.groups_trained else nan),
    }


def step_metrics(batch: Batch, update: UpdateResult | None, weight_ceiling: float, generated: list[Group],
                 correct_reward: float) -> dict[str, float]:
    """SPEC 6 per-step diagnostics, overall and split by source (fresh/replay) and by age bucket; a reward is
    correct when it equals the task's `correct_reward`."""
    if update is None:  # nothing trained this step: the sampled rewards still show where the policy is
        rewards = torch.tensor([r for group in generated for r in group.rewards])
        return {"train/reward": rewards.mean().item(), "train/correct_fraction": (rewards == correct_reward).float().mean().item()}
    groups = batch.groups
    rewards = torch.tensor([groups[g].rewards[j] for g, j in batch.rows])
    response_ages = torch.tensor(batch.row_ages())
    metrics = {"train/loss": update.loss, "train/policy_loss": update.policy_loss, "train/kl": update.kl,
               "train/entropy": update.entropy}
    selections = {"all": torch.ones_like(response_ages, dtype=torch.bool),
                  "fresh": response_ages == 0, "replay": response_ages > 0}
    selections.update({bucket: response_ages.clamp(max=3) == n for n, bucket in enumerate(AGE_BUCKETS)})
    for name, selected in selections.items():
        if not selected.any():
            continue
        suffix = "" if name == "all" else f"/{name}"
        raw, clipped = update.weights_of(selected)
        metrics.update({
            f"train/reward{suffix}": rewards[selected].mean().item(),
            f"train/correct_fraction{suffix}": (rewards[selected] == correct_reward).float().mean().item(),
            f"train/kl_per_token{suffix}": (update.kl_sums[selected].sum() / update.token_counts[selected].sum()).item(),
            f"weights/raw_mean{suffix}": raw.mean().item(),
            f"weights/raw_max{suffix}": raw.max().item(),
            f"weights/clipped_mean{suffix}": clipped.mean().item(),
            f"weights/clipped_max{suffix}": clipped.max().item(),
        })
        reused = selected & (response_ages > 0)
        if reused.any():  # clip fraction and ESS are about reused responses (or their tokens) only
            reused_raw, reused_clipped = update.weights_of(reused)
            metrics[f"weights/clip_fraction{suffix}"] = clip_fraction(reused_raw, weight_ceiling)
            metrics[f"weights/ess{suffix}"] = effective_sample_size(reused_clipped)
    metrics.update(update.extras)
    return metrics
