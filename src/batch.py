"""What flows between the phases of a training step: a prompt's `Group` of K scored responses, the typed
`Batch` the update trains on (which groups, fresh or replayed, how old, which responses), and the
`TrainState` each step advances (counters and history, all of it saved in a checkpoint).
"""

from __future__ import annotations

import dataclasses
import json
import math
from dataclasses import dataclass, field
from fractions import Fraction
from typing import Any, Iterable


def _ints(values: Any) -> tuple[int, ...]:
    # Accept lists, tuples and 1-D tensors; store plain ints so the state is plain data.
    if hasattr(values, "tolist"):
        values = values.tolist()
    return tuple(int(v) for v in values)


def _plain_json(value: Any) -> Any:
    # The task's ground truth as plain JSON data (tuples become lists), so that a group read back from a
    # checkpoint equals the group that was saved; a value JSON cannot hold is refused here, not at saving.
    return json.loads(json.dumps(value, allow_nan=False))


def _floats(values: Any) -> tuple[float, ...]:
    if hasattr(values, "tolist"):
        values = values.tolist()
    return tuple(float(v) for v in values)


@dataclass(frozen=True)
class Group:
    """One prompt's group of K responses, as stored for replay (SPEC 3)."""

    prompt: str
    prompt_ids: tuple[int, ...]
    # The task's ground truth, opaque here: one plain JSON value that only the task builds (`Task.truth`) and
    # reads (`Task.instance_of`). Lists and dicts are no hash keys, and the rest of a group identifies it.
    truth: Any = field(hash=False)
    responses: tuple[str, ...]
    response_ids: tuple[tuple[int, ...], ...]
    rewards: tuple[float, ...]
    step: int  # optimizer step the group was sampled at
    # log mu(y|x) per response, filled in at first use by the trainer's own forward pass.
    behaviour_logprobs: tuple[float, ...] | None = None
    # log pi_ref per response token, also from first use: pi_ref is frozen, so a replayed group
    # needs no second reference forward pass.
    reference_logprobs: tuple[tuple[float, ...], ...] | None = None
    # log mu per response token (loss=grpo's token-level behaviour weight pi_prox/mu); None for loss=rloo,
    # which needs only the sequence log-prob above.
    behaviour_token_logprobs: tuple[tuple[float, ...], ...] | None = None

    def __post_init__(self) -> None:
        # Normalise to tuples of plain numbers so the group is immutable and serialisable.
        setter = object.__setattr__
        setter(self, "prompt_ids", _ints(self.prompt_ids))
        setter(self, "truth", _plain_json(self.truth))
        setter(self, "responses", tuple(self.responses))
        setter(self, "response_ids", tuple(_ints(ids) for ids in self.response_ids))
        setter(self, "rewards", _floats(self.rewards))
        setter(self, "step", int(self.step))
        if self.behaviour_logprobs is not None:
            setter(self, "behaviour_logprobs", _floats(self.behaviour_logprobs))
        if self.reference_logprobs is not None:
            setter(self, "reference_logprobs", tuple(_floats(tokens) for tokens in self.reference_logprobs))
        if self.behaviour_token_logprobs is not None:
            setter(self, "behaviour_token_logprobs", tuple(_floats(t) for t in self.behaviour_token_logprobs))

        # A length mismatch would silently break the leave-one-out baseline (paper B.3).
        lengths = {
            "responses": len(self.responses),
            "response_ids": len(self.response_ids),
            "rewards": len(self.rewards),
        }
        if self.behaviour_logprobs is not None:
            lengths["behaviour_logprobs"] = len(self.behaviour_logprobs)
        if self.reference_logprobs is not None:
            lengths["reference_logprobs"] = len(self.reference_logprobs)
        if self.behaviour_token_logprobs is not None:
            lengths["behaviour_token_logprobs"] = len(self.behaviour_token_logprobs)
        if len(set(lengths.values())) != 1:
            detail = ", ".join(f"{name}={n}" for name, n in lengths.items())
            raise ValueError(
                f"Group lists must all have length K; got {detail}. "
                "Build the group from one aligned list per response."
            )
        if self.size < 2:
            raise ValueError(
                f"Group has K={self.size} responses; leave-one-out advantages (eq. 1) need K >= 2."
            )

        if self.reference_logprobs is not None and any(
            len(tokens) != len(ids) for tokens, ids in zip(self.reference_logprobs, self.response_ids)
        ):
            raise ValueError("reference_logprobs must hold one value per response token")
        if self.behaviour_token_logprobs is not None and any(
            len(tokens) != len(ids) for tokens, ids in zip(self.behaviour_token_logprobs, self.response_ids)
        ):
            raise ValueError("behaviour_token_logprobs must hold one value per response token")

    @property
    def size(self) -> int:
        """Number of responses K in the group."""
        return len(self.responses)

    def age(self, step: int) -> int:
        """Age of the group at optimizer step `step` (step - sampled step)."""
        return int(step) - self.step

    def with_behaviour_logprobs(self, logprobs: Iterable[float],
                                reference: Iterable[Iterable[float]] | None = None,
                                tokens: Iterable[Iterable[float]] | None = None) -> "Group":
        """Return a copy carrying log mu(y|x) (optionally per-token log pi_ref and log mu), validated again."""
        reference = tuple(_floats(t) for t in reference) if reference is not None else None
        tokens = tuple(_floats(t) for t in tokens) if tokens is not None else None
        return dataclasses.replace(self, behaviour_logprobs=_floats(logprobs), reference_logprobs=reference,
                                   behaviour_token_logprobs=tokens)


def is_effective(group: Group) -> bool:
    """True when the group's rewards are not all equal: its advantages are not all zero (seed 003 Def. 3.1)."""
    return min(group.rewards) != max(group.rewards)


@dataclass(frozen=True)
class BatchGroup:
    """One group in an update batch and why it is there."""

    group: Group
    source: str = "fresh"                     # "fresh": sampled this step; "replay": drawn from the store
    age: int = 0                              # step - group.step: 0 for fresh groups
    responses: tuple[int, ...] | None = None  # the responses trained on; None: all K (a FIFO draw may keep fewer)
    off_policy: bool = False                  # fresh, but sampled by a stale or tempered behaviour (seed 002)

    @property
    def trained(self) -> tuple[int, ...]:
        return tuple(range(self.group.size)) if self.responses is None else self.responses


def whole_groups(entries: Iterable[BatchGroup]) -> Fraction:
    """Whole groups' worth of trained responses: K single rollouts drawn from a positive-bias FIFO are one group."""
    return sum((Fraction(len(entry.trained), entry.group.size) for entry in entries), Fraction(0))


def fresh_entries(groups: Iterable[Group], off_policy: bool = False) -> list[BatchGroup]:
    """This step's fresh groups as batch entries."""
    return [BatchGroup(group, "fresh", 0, None, off_policy) for group in groups]


@dataclass
class Batch:
    """The groups one update trains on; its rows are (group, response) pairs in this order."""

    entries: list[BatchGroup] = field(default_factory=list)
    # Fresh groups this step sampled but left out (POPO drops ineffective ones); a store may still keep them.
    dropped: list[Group] = field(default_factory=list)

    def __len__(self) -> int:
        return len(self.entries)

    @property
    def groups(self) -> list[Group]:
        return [entry.group for entry in self.entries]

    @property
    def rows(self) -> list[tuple[int, int]]:
        """(entry, response) index pairs of the trained responses, in batch order."""
        return [(g, j) for g, entry in enumerate(self.entries) for j in entry.trained]

    @property
    def fresh(self) -> list[BatchGroup]:
        return [entry for entry in self.entries if entry.source == "fresh"]

    @property
    def replayed(self) -> list[BatchGroup]:
        return [entry for entry in self.entries if entry.source == "replay"]

    def row_ages(self) -> list[int]:
        return [self.entries[g].age for g, _ in self.rows]

    def row_off_policy(self) -> list[bool]:
        return [self.entries[g].off_policy for g, _ in self.rows]

    def fresh_to_store(self, collected: list[Group], stored) -> list[Group]:
        """This step's fresh groups in generation order, as a store keeps them: a trained group through
        `stored(group, first_row)` (log mu and log pi_ref from the update), a dropped one as composed."""
        row = 0
        trained = []
        for entry in self.entries:
            if entry.source == "fresh":
                trained.append((entry.group, row))
            row += len(entry.trained)
        trained_iter, dropped_iter = iter(trained), iter(self.dropped)
        next_trained = next(trained_iter, None)
        out = []
        for group in collected:  # both lists keep generation order: merge them back
            if next_trained is not None and grown_from(next_trained[0], group):
                out.append(stored(*next_trained))
                next_trained = next(trained_iter, None)
            else:
                out.append(next(dropped_iter))
        return out


def grown_from(composed: Group, group: Group) -> bool:
    """Whether a composed batch's group is `group`, or `group` with responses appended (RLEP's G + M)."""
    return composed is group or (composed.step == group.step and composed.prompt_ids == group.prompt_ids
                                 and composed.response_ids[:group.size] == group.response_ids)


def plan_batch(groups_per_step: int, ratio: float) -> tuple[int, int]:
    """Split B groups into (B_fresh, B_replay) with B_fresh = round(B / (1 + ratio)) (SPEC 3.1)."""
    if isinstance(groups_per_step, bool) or int(groups_per_step) != groups_per_step or groups_per_step < 1:
        raise ValueError(f"groups_per_step (B) must be an integer >= 1, got {groups_per_step!r}.")
    ratio = float(ratio)
    if not math.isfinite(ratio) or ratio < 0:
        raise ValueError(f"replay ratio must be a finite number >= 0, got {ratio!r}; use 0 for fresh-only.")
    b = int(groups_per_step)
    b_fresh = round(b / (1.0 + ratio))  # Python round (half to even), as in the paper's table
    if b_fresh < 1:
        # With no fresh groups the buffer would never be refilled.
        raise ValueError(
            f"ratio={ratio} with groups_per_step={b} leaves B_fresh={b_fresh}; "
            "lower the ratio or raise groups_per_step so at least one fresh group is sampled per step."
        )
    return b_fresh, b - b_fresh


@dataclass
class StepCounts:
    """The run's budget counters (SPEC 5-6): what one step adds to them (`learn` counts it, the loop adds it),
    and, in `TrainState`, their totals so far."""

    fresh_evaluations: int = 0            # fresh verifier calls (SPEC 5), counted as they happen
    fresh_groups: int = 0
    replay_groups: float = 0.0            # whole groups' worth (a positive-bias FIFO draws single rollouts)
    gradient_steps: int = 0               # optimizer steps (grpo: updates_per_step per update; fifo extras)
    generated_tokens: int = 0             # response tokens generated (every fresh rollout, DAPO's rejected too)
    trained_tokens: int = 0               # response tokens in the loss, summed over every update batch
    groups_trained: int = 0               # groups in the update batches
    effective_groups_trained: int = 0     # ... of which had rewards not all equal (a non-zero advantage)


@dataclass
class TrainState(StepCounts):
    """Everything that changes during training; all of it goes into a checkpoint: the counters' totals so far, the
    next step and the summary's history. The loop that runs the steps owns it: `advance` is the one place a step
    is counted."""

    step: int = 0                         # next step to run
    history: list[dict] = field(default_factory=list)  # per-step headline numbers for the summary

    def counted(self, counts: StepCounts) -> "TrainState":
        """The counters as they stand once a step that adds `counts` is done (the step's budget metrics)."""
        return dataclasses.replace(self, history=[], **{
            name: getattr(self, name) + getattr(counts, name) for name in COUNTERS})

    def advance(self, counts: StepCounts) -> None:
        """A step is done: its counts added, the step counter moved on."""
        for name in COUNTERS:
            setattr(self, name, getattr(self, name) + getattr(counts, name))
        self.step += 1


COUNTERS = tuple(counter.name for counter in dataclasses.fields(StepCounts))
