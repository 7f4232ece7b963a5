"""Fresh verifier-evaluation budget planning (SPEC 5; paper appendix B.4).

`simulate_plan` runs the real step order with the store the trainer builds, driven through its
`draw` and `store` calls with placeholder groups (no model), so gap fill from a too-small pool
(ratio > L, B_fresh rounded down, a small capacity, distinct draws from a small FIFO) shows up
exactly as it would in a run. `plan_for_config` asks the buffer group's store class what to
simulate (`src.buffer.store.ReplayStore.plan_store`, `plan_window`), never its name; a runtime with
a schedule of its own plans itself (`src.variant.Variant.budget_plan`).
A positive-bias FIFO keeps incorrect rollouts only among its freshest (1 - delta) N groups, so
with distinct draws its pool can depend on rewards: the plan assumes no correct rollout (the
smallest pool), is exact then and whenever that pool never runs short, and is otherwise an
upper bound (`BudgetPlan.reward_dependent`).
`closed_form_fresh_evaluations` is the paper's formula K * (B + (steps - 1) * B_fresh),
exact whenever the replay demand can be met after step 0, i.e. B_replay <= L * B_fresh
(`replay_demand_met`). ratio <= L implies it except where rounding B_fresh down breaks
it at ratio near L: e.g. B=64 (or 16, 256), ratio=2, L=2 gives B_fresh=21, B_replay=43 > 42.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from omegaconf import OmegaConf

from src.batch import Group, plan_batch, whole_groups
from src.buffer.age import ReplayBuffer
from src.buffer.store import ReplayStore
from src.validate.checks import composition_error
from src.settings import RunSettings
from src.variant import VARIANT_GROUPS, described

AGE_BUFFER_GROUPS = 4096  # conf/buffer/age.yaml's safety net: N = 4096 groups' worth of rollouts


@dataclass(frozen=True)
class BudgetPlan:
    """Per-step fresh/replay group counts of a simulated run."""

    ratio: float
    max_age: int
    groups_per_step: int
    group_size: int
    steps: int
    fresh_groups_per_step: tuple[int, ...]  # per step, including gap fill
    replay_groups_per_step: tuple[int, ...]
    gap_fill_groups: int  # fresh groups added at steps >= 1 because too few were eligible
    # A positive-bias FIFO with distinct draws whose smallest (all-incorrect) pool ran short: the trainer
    # generates this many fresh groups if no kept rollout is correct, fewer otherwise (an upper bound).
    reward_dependent: bool = False

    @property
    def fresh_evaluations(self) -> int:
        """Fresh verifier evaluations: K per fresh group (SPEC 3.2)."""
        return self.group_size * sum(self.fresh_groups_per_step)

    @property
    def achieved_ratio(self) -> float:
        """Replay / fresh groups over steps >= 1 (step 0 is all fresh); nan for a 1-step run."""
        fresh = sum(self.fresh_groups_per_step[1:])
        if fresh == 0:
            return float("nan")
        return sum(self.replay_groups_per_step[1:]) / fresh


MAX_STEPS = 10_000_000  # the plan keeps one count per step; src.validate.schema caps trainer.steps far below


def _check_sizes(groups_per_step: int, group_size: int, steps: int) -> None:
    if int(group_size) != group_size or group_size < 2:
        raise ValueError(f"group_size (K) must be an integer >= 2 for leave-one-out, got {group_size!r}.")
    if int(steps) != steps or not 1 <= steps <= MAX_STEPS:
        raise ValueError(f"steps must be an integer between 1 and {MAX_STEPS:,}, got {steps!r}.")
    # groups_per_step and ratio are validated by plan_batch.


def planning_max_age(buffer, steps: int) -> int:
    """The age window L the budget simulation uses, as the store says (`plan_window`: buffer.max_age, at
    least 1, for the age buffer); a store without one (the FIFO: every stored group of age >= 1 is
    eligible) has the run's length as its L.
    """
    window = described(buffer, ReplayStore).plan_window(buffer, steps)
    return int(steps) if window is None else int(window)


def replay_demand_met(groups_per_step: int, ratio: float, max_age: int) -> bool:
    """True when the steady-state pool L * B_fresh covers B_replay, so no gap fill ever occurs."""
    b_fresh, b_replay = plan_batch(groups_per_step, ratio)
    return b_replay <= int(max_age) * b_fresh


def closed_form_fresh_evaluations(groups_per_step: int, group_size: int, steps: int, ratio: float) -> int:
    """Paper formula K * (B + (steps - 1) * B_fresh) (SPEC 5); exact when replay_demand_met()."""
    _check_sizes(groups_per_step, group_size, steps)
    b_fresh, _ = plan_batch(groups_per_step, ratio)
    return int(group_size) * (int(groups_per_step) + (int(steps) - 1) * b_fresh)


def plan_fresh_evaluations(
    groups_per_step: int, group_size: int, steps: int, ratio: float, max_age: int, *,
    capacity: int | None = None,
) -> BudgetPlan:
    """The plan of the age buffer (max_age L, `capacity` rollouts at most; by default 4096 groups' worth):
    `simulate_plan` with `ReplayBuffer`."""
    capacity = AGE_BUFFER_GROUPS * int(group_size) if capacity is None else capacity
    return simulate_plan(groups_per_step, group_size, steps, ratio,
                         lambda: ReplayBuffer(max_age=max_age, capacity=capacity), window=max_age)


def simulate_plan(groups_per_step: int, group_size: int, steps: int, ratio: float, make_store,
                  window: int | None, reward_dependent: bool = False) -> BudgetPlan:
    """Simulate the store's schedule step by step (SPEC 3 order) and count fresh groups.

    `make_store()` builds the store (only when something is replayed); each step draws from it as the
    trainer does and stores the step's fresh groups (gap fill included) through `store`. `window` is the
    store's age window L (groups of age 1..L are drawn), or None for a store that draws from every stored
    group of age >= 1: it decides when the schedule repeats. `reward_dependent`: the store keeps groups by
    their rewards, so with the all-zero placeholders a short pool makes the plan an upper bound.
    """
    _check_sizes(groups_per_step, group_size, steps)
    b_fresh, b_replay = plan_batch(groups_per_step, ratio)
    buffer = make_store() if b_replay > 0 else None

    fresh_counts: list[int] = []
    replay_counts: list[int] = []
    gap_total = 0
    seen: dict[tuple[int, ...], int] = {}  # window of the last L + 1 fresh counts -> the step it ended at
    for step in range(int(steps)):
        # The trainer's draw and gap rule (src/train.py): a positive-bias FIFO draws b_replay * K rollouts.
        replayed = int(whole_groups(buffer.draw(b_replay, step))) if buffer is not None else 0
        gap = b_replay - replayed  # too few eligible: fill with fresh groups (SPEC 3.3)
        fresh = b_fresh + gap
        if step > 0:
            gap_total += gap  # step 0 is all fresh by design, not a shortfall
        fresh_counts.append(fresh)
        replay_counts.append(replayed)
        if buffer is not None:  # after the update, as the trainer stores them
            buffer.store([_placeholder(step, group_size) for _ in range(fresh)], step)
        # An age pool holds only the last L steps' groups (draws never consume them; the capacity keeps
        # a suffix of them), so a step's counts depend on the previous L fresh counts alone; a pool without
        # an age window (every stored group) on how many it holds; no store, on nothing. Once that state
        # repeats, the schedule cycles: jumping over the whole cycles makes a million-step plan cost what a
        # few steps do.
        if buffer is None:
            state: tuple[int, ...] = ()
        else:
            state = (len(buffer),) if window is None else tuple(fresh_counts[-(int(window) + 1):])
        if step > 0 and state in seen:
            start = seen[state]
            cycle_fresh, cycle_replay = fresh_counts[start + 1:], replay_counts[start + 1:]
            remaining = int(steps) - step - 1
            fresh_counts += [cycle_fresh[i % len(cycle_fresh)] for i in range(remaining)]
            replay_counts += [cycle_replay[i % len(cycle_replay)] for i in range(remaining)]
            gap_total += sum(b_replay - replay_counts[i] for i in range(step + 1, int(steps)))
            break
        seen[state] = step

    return BudgetPlan(
        ratio=float(ratio),
        max_age=int(steps) if window is None else int(window),
        groups_per_step=int(groups_per_step),
        group_size=int(group_size),
        steps=int(steps),
        fresh_groups_per_step=tuple(fresh_counts),
        replay_groups_per_step=tuple(replay_counts),
        gap_fill_groups=gap_total,
        reward_dependent=bool(reward_dependent and gap_total > 0),
    )


def plan_for_config(cfg) -> BudgetPlan:
    """The plan of a composed config (`plan_for` its typed settings)."""
    return plan_for(RunSettings(cfg))


def plan_for(run: RunSettings) -> BudgetPlan:
    """The plan of a run: its sizes, and the store the trainer builds (`src.build.build_store`), as its class
    says to simulate it; or the plan of a runtime with its own schedule (runtime=async)."""
    runtime = run.groups["runtime"]
    own = described(runtime).budget_plan(runtime, run)
    if own is not None:
        return own
    trainer, buffer = run.trainer, run.groups["buffer"]
    store = described(buffer, ReplayStore)
    return simulate_plan(trainer.groups_per_step, trainer.group_size, trainer.steps, buffer.ratio,
                         lambda: store.plan_store(buffer, buffer.ratio, trainer.groups_per_step),
                         store.plan_window(buffer, trainer.steps), store.reward_dependent(buffer))


def budget_is_floor(groups) -> bool:
    """True when some component may generate more than the plan counts (sampling=dynamic): the plan is a minimum.
    `groups`: a composed config, or a run's component nodes (`RunSettings.groups`)."""
    return any(described(groups.get(group)).budget_is_floor(groups.get(group)) for group in VARIANT_GROUPS)


def formula_break(cfg) -> str | None:
    """Why SPEC 5's K(B + (steps - 1) B_fresh) is not this config's budget, or None when it is.

    The formula assumes every step after the first draws all B_replay groups. It fails when the pool of
    replayable groups is smaller: B_replay > L * B_fresh (rho > L, or B_fresh = round(B / (1 + rho)) rounded
    down: B=64, rho=2, L=2 gives 43 > 42), a capacity below the pool, or a FIFO that keeps too few groups.
    """
    plan = plan_for_config(cfg)
    if plan.gap_fill_groups == 0:
        return None
    trainer, buffer = cfg.trainer, cfg.buffer
    b_fresh, b_replay = plan_batch(trainer.groups_per_step, buffer.ratio)
    per_step = f"{plan.gap_fill_groups} fresh gap-fill groups over the run"
    store = described(buffer, ReplayStore)
    if store.plan_window(buffer, trainer.steps) is None:  # no age window: the store keeps too few groups
        return store.short_pool(buffer, b_replay, per_step, trainer.group_size)
    max_age = planning_max_age(buffer, trainer.steps)
    if b_replay > max_age * b_fresh:
        why = (f"rho={buffer.ratio:g} > L={max_age}" if buffer.ratio > max_age else
               f"B_fresh=round({trainer.groups_per_step}/(1+{buffer.ratio:g}))={b_fresh} rounds down")
        return (f"formula does not hold: B_replay={b_replay} > L*B_fresh={max_age}*{b_fresh}={max_age * b_fresh} "
                f"({why}): {per_step}")
    held = f"{buffer.capacity // trainer.group_size} groups of K={trainer.group_size}"
    return (f"formula does not hold: buffer.capacity={buffer.capacity} rollouts ({held}) < the "
            f"L*B_fresh={max_age * b_fresh} groups the pool needs: {per_step}")


def _placeholder(step: int, group_size: int) -> Group:
    # Cheapest valid group of the run's K (a FIFO keeps N // K of them): empty responses, only its step matters.
    return Group(
        prompt="",
        prompt_ids=(),
        truth=None,
        responses=("",) * group_size,
        response_ids=((),) * group_size,
        rewards=(0.0,) * group_size,
        step=step,
        behaviour_logprobs=(0.0,) * group_size,
    )



# --------------------------------------------------------------------------- command line
def budget_table(cfg, ratios: list[float] | None = None):
    """Rows of the planning table for a composed config, over `ratios` (default: the config's own rho)."""
    trainer, buffer = cfg.trainer, cfg.buffer
    has_window = described(buffer, ReplayStore).plan_window(buffer, trainer.steps) is not None
    rows = []
    for ratio in ratios if ratios is not None else [float(buffer.ratio)]:
        max_age = planning_max_age(buffer, trainer.steps)
        at_ratio = OmegaConf.merge(cfg, {"buffer": {"ratio": float(ratio)}})
        plan = plan_for_config(at_ratio)
        b_fresh, b_replay = plan_batch(trainer.groups_per_step, ratio)
        rows.append({
            "rho": ratio, "L": max_age if ratio > 0 and has_window else None,  # FIFO: no age window
            "B_fresh": b_fresh, "B_replay": b_replay,
            "fresh_evaluations": plan.fresh_evaluations,
            "closed_form": closed_form_fresh_evaluations(trainer.groups_per_step, trainer.group_size, trainer.steps, ratio),
            "gap_fill_groups": plan.gap_fill_groups, "achieved_ratio": plan.achieved_ratio,
            "formula_note": formula_break(at_ratio) or "", "upper_bound": plan.reward_dependent,
        })
    return rows


class BudgetInputError(ValueError):
    """Bad command-line input; the message is the one line to print."""


def _ratios(text: str | None) -> list[float] | None:
    if text is None:
        return None
    try:
        ratios = [float(value) for value in text.split(",")]
    except ValueError:
        ratios = []
    if not ratios or not all(math.isfinite(ratio) and ratio >= 0 for ratio in ratios):
        raise BudgetInputError(f"--ratios {text}: give comma-separated numbers >= 0, e.g. --ratios 0,0.5,1,2")
    return ratios


def compose_for_budget(argv: list[str] | None):
    """(config, ratios) from the command line; BudgetInputError for any input that cannot be planned."""
    import argparse

    from hydra import compose, initialize_config_dir
    from hydra.errors import HydraException
    from omegaconf.errors import OmegaConfBaseException

    import src.command.config  # (registers the ${root:} resolver)
    from src.paths import CONFIG_DIR

    parser = argparse.ArgumentParser(prog="replay-rloo-budget", description="Planned fresh verifier evaluations "
                                     "(SPEC 5), simulated with the real replay buffer; no model is loaded.")
    parser.add_argument("--ratios", help="comma-separated rho values (default: the config's buffer.ratio)")
    parser.add_argument("overrides", nargs="*", help="Hydra overrides, e.g. trainer=paper buffer=age2")
    args = parser.parse_args(argv)
    ratios = _ratios(args.ratios)
    try:
        with initialize_config_dir(str(CONFIG_DIR), version_base="1.3"):
            cfg = compose("config", overrides=args.overrides)
        src.command.config.validate(cfg, check_device=False)
    except (HydraException, OmegaConfBaseException) as error:
        raise BudgetInputError(composition_error(error, args.overrides)) from None
    except src.command.config.ConfigError as error:
        raise BudgetInputError(str(error)) from None
    return cfg, ratios


def main(argv: list[str] | None = None) -> None:
    """`python -m src.study.budget [--ratios 0,1,2] [hydra overrides]`: the planned budget, no model loaded."""
    from rich.console import Console
    from rich.table import Table

    try:
        cfg, ratios = compose_for_budget(argv)
        rows = budget_table(cfg, ratios)
    except (BudgetInputError, ValueError) as error:  # ValueError: a ratio the batch plan refuses
        Console(stderr=True).print(f"[bold red]error:[/bold red] {error}", soft_wrap=True, highlight=False)
        raise SystemExit(2) from None
    trainer = cfg.trainer
    table = Table(title=f"Fresh verifier evaluations: B={trainer.groups_per_step}, K={trainer.group_size}, "
                        f"{trainer.steps} steps")
    for column in ("rho", "L", "B_fresh", "B_replay", "fresh evals", "formula", "gap fill", "rho reached"):
        table.add_column(column, justify="right")
    for row in rows:
        table.add_row(f"{row['rho']:g}", "-" if row["L"] is None else str(row["L"]), str(row["B_fresh"]),
                      str(row["B_replay"]), ("≤ " if row["upper_bound"] else "") + f"{row['fresh_evaluations']:,}",
                      f"{row['closed_form']:,}",
                      str(row["gap_fill_groups"]), f"{row['achieved_ratio']:.3f}")
    console = Console()
    console.print(table)
    for row in rows:
        if row["formula_note"]:
            console.print(f"rho={row['rho']:g}: {row['formula_note']}", highlight=False)
    console.print("fresh evals: simulated with the replay buffer; formula: K(B + (steps-1) B_fresh), exact "
                  "when no gap fill is needed; gap fill: fresh groups generated because too few were eligible")


if __name__ == "__main__":
    main()
