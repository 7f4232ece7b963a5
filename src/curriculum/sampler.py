"""Training-prompt samplers selected by the `curriculum/` config group (SPEC 9; seed 004, sec. 3.1, app. B.3).

* curriculum=none -> `src.curriculum.uniform.PromptSampler`: uniform prompts, unchanged.
* curriculum=frontier | failure | goldilocks -> `CurriculumSampler.from_config`: the uniform batch of
  the inner PromptSampler with a fraction rho of its slots replaced by training prompts
  retrieved by similarity to a memory of recent frontier (or failed, or Goldilocks)
  prompts, q_t = (1 - rho) D + rho R(. | M_t) (seed 004 sec. 3.1).

Every sampler has the same interface, so the trainer calls them alike:
sample(count), observe(instances, rewards, step), metrics(), state_dict(), load_state_dict().
The curriculum changes only which prompts are sampled; it never touches rewards,
advantages or the loss (sec. 3.1).
"""

from __future__ import annotations

import random
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, fields
from itertools import groupby
from typing import NoReturn

from src.curriculum.frontier import (MODES, FrontierMemory, Instance, PromptBank, replacement_count,
                                     select_replacements)
from src.curriculum.uniform import PromptSampler
from src.task.base import Task
from src.variant import Variant, float_knob, int_knob

NAMES = ("none", *MODES)
KEYS = ("_target_", "name", "fraction", "capacity", "min_memory", "pool_factor", "goldilocks_band", "max_numbers")

# The retrieval RNG is seeded from the trainer seed plus this offset, so it is reproducible
# but never the inner uniform sampler's stream (which is random.Random(seed), as curriculum=none).
RETRIEVAL_SEED_OFFSET = 4004

_STATE_VERSION = 2


# --------------------------------------------------------------------------- config


def _fail(message: str) -> NoReturn:
    """Raise the ValueError every curriculum config check ends in."""
    raise ValueError(f"curriculum config: {message}")


def _integer(curriculum: Mapping, key: str, minimum: int, hint: str) -> int:
    """curriculum[key] as an int >= minimum, or a ValueError naming key, value and the fix."""
    value = curriculum[key]
    if isinstance(value, bool) or not isinstance(value, (int, float)) or int(value) != value or value < minimum:
        _fail(f"curriculum.{key}={value!r} must be an integer >= {minimum}; {hint}")
    return int(value)


def _real(curriculum: Mapping, key: str, low: float, high: float, hint: str) -> float:
    """curriculum[key] as a float in [low, high], or a ValueError naming key, value and the fix."""
    value = curriculum[key]
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not low <= value <= high:
        _fail(f"curriculum.{key}={value!r} must be a number in [{low}, {high}]; {hint}")
    return float(value)


def _settings(curriculum: Mapping) -> dict:
    """Validated settings of a curriculum config (name plus, unless none, every other key)."""
    name = curriculum.get("name")
    if name not in NAMES:
        _fail(f"curriculum.name={name!r} is unknown; choose one of {', '.join(NAMES)} (curriculum=frontier).")
    unknown = sorted(set(curriculum) - set(KEYS))
    if unknown:
        _fail(f"unknown key(s) {unknown}; the known keys are {list(KEYS)}.")
    if name == "none":
        return {"name": name}
    missing = [key for key in KEYS if key not in curriculum and key != "_target_"]  # instantiate consumes _target_
    if missing:
        _fail(f"curriculum={name} lacks key(s) {missing}; start from conf/curriculum/{name}.yaml.")
    settings = {
        "name": name,
        "fraction": _real(curriculum, "fraction", 0.0, 1.0, "seed 004 replaces 0.10 of each batch."),
        "capacity": _integer(curriculum, "capacity", 1, "the memory must hold at least one prompt (default 256)."),
        "min_memory": _integer(curriculum, "min_memory", 1, "retrieval needs at least one remembered prompt (default 8)."),
        "pool_factor": _integer(curriculum, "pool_factor", 1, "1 = deterministic top-n retrieval (default 4)."),
        "goldilocks_band": _real(curriculum, "goldilocks_band", 0.0, 0.5, "0.25 admits p in [1/4, 3/4]."),
        "max_numbers": _integer(curriculum, "max_numbers", 1, "Countdown 3to4 uses 4."),
    }
    if settings["min_memory"] > settings["capacity"]:
        # The memory never holds min_memory prompts, so retrieval would never start.
        _fail(
            f"curriculum.min_memory={settings['min_memory']} > curriculum.capacity={settings['capacity']}: "
            "retrieval would never start; lower min_memory or raise capacity."
        )
    return settings


def check_curriculum(curriculum: Mapping, *, group_size: int, groups_per_step: int) -> None:
    """Raise ValueError (naming the key, its value and the fix) for a curriculum config that cannot work."""
    settings = _settings(curriculum)
    name = settings["name"]
    if name == "none":
        return
    n = replacement_count(groups_per_step, settings["fraction"])
    if n == 0:
        _fail(
            f"curriculum.fraction={settings['fraction']} with trainer.groups_per_step B={groups_per_step} replaces "
            f"round(fraction * B) = 0 prompts per step, so curriculum={name} would change nothing; raise the "
            "fraction or B (seed 004: 0.10 of 64 -> 6), or use curriculum=none."
        )
    k = group_size
    if name in ("frontier", "goldilocks") and k < 2:
        _fail(f"curriculum={name} needs 0 < s < K, impossible with trainer.group_size K={k}; use K >= 2.")
    if name == "goldilocks":
        band = settings["goldilocks_band"]
        if not any(abs(s / k - 0.5) <= band for s in range(1, k)):
            _fail(
                f"curriculum.goldilocks_band={band} with trainer.group_size K={k} admits no success rate "
                f"p = s/K (0 < s < K) within the band around 1/2, so the memory stays empty; widen the band."
            )


def build_prompt_sampler(
    curriculum: Mapping, instances: Sequence[Instance], seed: int, task: Task | None = None
) -> PromptSampler | CurriculumSampler:
    """The training-prompt sampler for a curriculum config: PromptSampler for none, else CurriculumSampler
    (which asks `task` about the prompts)."""
    settings = _settings(curriculum)
    name = settings.pop("name")
    if name == "none":
        return PromptSampler(instances, seed)
    return CurriculumSampler(instances, seed, task=task, mode=name, **settings)


# --------------------------------------------------------------------------- sampler


@dataclass
class _Tally:
    """Counters behind metrics(): retrieval over sample() calls, admissions over observe() calls."""

    samples: int = 0  # sample() calls
    requested: int = 0
    retrieved: int = 0
    uniform: int = 0
    scores: list[float] = field(default_factory=list)  # c_m of each retrieved prompt
    admitted: int = 0
    observed: int = 0
    drawn: list[Instance] = field(default_factory=list)  # every prompt sample() returned

    def add(self, other: _Tally) -> None:
        """Add another tally's counts to this one."""
        for name in ("samples", "requested", "retrieved", "uniform", "admitted", "observed"):
            setattr(self, name, getattr(self, name) + getattr(other, name))
        self.scores += other.scores
        self.drawn += other.drawn

    def state(self, task: Task) -> dict:
        """Plain data (JSON-safe): the drawn prompts as the task's ground truth of each."""
        state = {f.name: getattr(self, f.name) for f in fields(self)}
        return {**state, "scores": list(self.scores), "drawn": [task.truth(x) for x in self.drawn]}

    @classmethod
    def from_state(cls, state: dict, task: Task) -> _Tally:
        """Inverse of state()."""
        drawn = [task.instance_from_truth(truth) for truth in state["drawn"]]
        return cls(**{**state, "scores": [float(c) for c in state["scores"]], "drawn": drawn})


class CurriculumSampler(Variant):
    """Uniform batch with round(fraction * count) slots replaced by memory-similar prompts (seed 004 app. B.3).

    A training step may call sample() and observe() in several rounds (dynamic sampling),
    once per round or once for all. The sampler learns the step number only from observe(),
    so it keeps two tallies: `_pending` (sample() calls since the last observe()) and
    `_step` (everything observed for step `_step_index`, merged at each observe() of that step).
    """

    knobs = {"fraction": float_knob(0, 1, "0.1"), "capacity": int_knob(1, 10_000_000, "256"),
             "min_memory": int_knob(0, 10_000_000, "8"), "pool_factor": int_knob(1, 1_000, "4"),
             "goldilocks_band": float_knob(0, 1, "0.25"), "max_numbers": int_knob(1, 100, "4")}

    @classmethod
    def from_config(cls, instances: Sequence[Instance], seed: int, task: Task | None = None,
                    **curriculum) -> PromptSampler | CurriculumSampler:
        """The `curriculum` group's `_target_`: its keys arrive as keyword arguments and are checked by name."""
        return build_prompt_sampler(curriculum, instances, seed, task)

    @classmethod
    def cell_label(cls, node, cfg) -> str:
        return f"-{node.name}"  # the memory criterion (frontier, failure, goldilocks) names the cell

    @classmethod
    def reader_label(cls, node, cfg) -> str:
        return f"{node.name} curriculum"

    @classmethod
    def check(cls, node, run) -> None:
        check_curriculum(node, group_size=run.trainer.group_size, groups_per_step=run.trainer.groups_per_step)

    def __init__(
        self,
        instances: Sequence[Instance],
        seed: int,
        *,
        task: Task,
        mode: str = "frontier",
        fraction: float = 0.10,
        capacity: int = 256,
        min_memory: int = 8,
        pool_factor: int = 4,
        goldilocks_band: float = 0.25,
        max_numbers: int = 4,
    ) -> None:
        self.inner = PromptSampler(instances, seed)  # the same uniform stream as curriculum=none
        self.task = task  # embeds the prompts, says which reward is correct and each prompt's truth
        self.bank = PromptBank(self.inner.instances, task, max_numbers)  # embedded once (app. B.3's bank B)
        self.memory = FrontierMemory(capacity, mode, task=task, max_numbers=max_numbers,
                                     goldilocks_band=goldilocks_band)
        replacement_count(1, fraction)  # validates the fraction now rather than at the first sample()
        self.fraction = float(fraction)
        self.min_memory = int(min_memory)
        self.pool_factor = int(pool_factor)
        self.rng = random.Random(seed + RETRIEVAL_SEED_OFFSET)
        self._step_index: int | None = None  # step of the last observe()
        self._step = _Tally()
        self._pending = _Tally()

    def sample(self, count: int) -> list[Instance]:
        """`count` prompts: the inner sampler's uniform ones, the last round(fraction * count) replaced."""
        batch = self.inner.sample(count)
        n = replacement_count(len(batch), self.fraction)
        # App. B.3: no arithmetic instance twice in one mixed batch. A step's batch may be drawn
        # in rounds, so the prompts of earlier rounds join the key filter (the fraction is
        # rescaled so that select_replacements still asks for exactly n prompts). At a step's
        # first round the sampler cannot yet tell a new step from another round, so it also skips
        # the previous step's prompts: at most a few batches out of the bank, and those were just
        # trained on (its frontier ones are in memory, hence excluded anyway).
        seen = self._step.drawn + self._pending.drawn + batch
        replacements = select_replacements(
            self.memory, self.bank, seen, n / len(seen) if seen else 0.0,
            min_memory=self.min_memory, rng=self.rng, pool_factor=self.pool_factor,
        )
        mixed = replacements.apply(batch)
        self._pending.add(_Tally(1, replacements.requested, replacements.retrieved, replacements.uniform,
                                 list(replacements.scores), drawn=mixed))
        return mixed

    def observe(self, instances: Sequence[Instance], rewards: Sequence[Sequence[float]], step: int) -> None:
        """Record rollout outcomes: s = rewards equal to the task's correct reward of K = len(rewards[i]) per
        prompt (app. B.1)."""
        if len(instances) != len(rewards):
            raise ValueError(
                f"observe() got {len(instances)} instances but {len(rewards)} reward lists; pass one list per prompt."
            )
        # Only fully correct responses count (not Countdown's 0.1 partial credit, app. B.1).
        correct = self.task.correct_reward
        outcomes = [(x, sum(r == correct for r in group), len(group)) for x, group in zip(instances, rewards)]
        admitted = 0
        # FrontierMemory.update takes one K; consecutive groups with equal K (normally all) go together.
        for k, run in groupby(outcomes, key=lambda o: o[2]):
            run = list(run)
            admitted += self.memory.update([o[0] for o in run], [o[1] for o in run], k, step)
        if step != self._step_index:  # the first observe() of a new step: the old tally was the last step's
            self._step_index, self._step = step, _Tally()
        self._pending.admitted, self._pending.observed = admitted, len(instances)
        self._step.add(self._pending)
        self._pending = _Tally()

    def metrics(self) -> dict[str, float]:
        """Retrieval counts of the sample() calls since the last observe() (if any, else of the last observed
        step, all its rounds), admissions of the last observed step, and the memory state."""
        sampled = self._pending if self._pending.samples else self._step
        step = self._step
        metrics = {
            "curriculum/memory_size": float(len(self.memory)),
            "curriculum/requested": float(sampled.requested),
            "curriculum/retrieved": float(sampled.retrieved),
            "curriculum/uniform_fallback": float(sampled.uniform),
            "curriculum/admitted": float(step.admitted),
            "curriculum/admitted_fraction": step.admitted / step.observed if step.observed else 0.0,
            "curriculum/dropped": float(self.memory.dropped),
        }
        if sampled.scores:
            metrics["curriculum/retrieval_score_mean"] = sum(sampled.scores) / len(sampled.scores)
        return metrics

    # ---- persistence (checkpoints) ----

    def state_dict(self) -> dict:
        """Inner sampler, retrieval RNG, memory and tallies (plain data): a restored sampler continues exactly."""
        return {
            "version": _STATE_VERSION,
            "inner": self.inner.state_dict(),
            # Not "rng": PromptSampler.load_state_dict must fail (KeyError), not take this stream, if a
            # curriculum checkpoint is resumed with curriculum=none.
            "retrieval_rng": self.rng.getstate(),
            "memory": self.memory.state_dict(),
            "step_index": self._step_index,
            "step": self._step.state(self.task),
            "pending": self._pending.state(self.task),
        }

    def load_state_dict(self, state: dict) -> None:
        """Restore a state_dict() snapshot; the curriculum config must match the one that wrote it."""
        if state.get("version") != _STATE_VERSION:
            raise ValueError(
                f"Unsupported curriculum sampler state version {state.get('version')!r}; expected {_STATE_VERSION}. "
                "A checkpoint written with curriculum=none holds a PromptSampler state: resume with curriculum=none."
            )
        self.memory.load_state_dict(state["memory"])  # first: it checks that the config matches
        self.inner.load_state_dict(state["inner"])
        version, internal, gauss = state["retrieval_rng"]
        self.rng.setstate((version, tuple(internal), gauss))  # tuple(): survives a JSON round trip too
        self._step_index = state["step_index"]
        self._step = _Tally.from_state(state["step"], self.task)
        self._pending = _Tally.from_state(state["pending"], self.task)
