"""Fresh verifier-evaluation budget planning (SPEC 5; paper appendix B.4).

`plan_fresh_evaluations` simulates the real step order with the real `ReplayBuffer`
(placeholder groups, no model), so gap fill from a too-small pool (ratio > L, or
B_fresh rounded down) shows up exactly as it would in a run.
`closed_form_fresh_evaluations` is the paper's formula K * (B + (steps - 1) * B_fresh),
exact whenever the replay demand can be met after step 0, i.e. B_replay <= L * B_fresh
(`replay_demand_met`). ratio <= L implies it except where rounding B_fresh down breaks
it at ratio near L: e.g. B=64 (or 16, 256), ratio=2, L=2 gives B_fresh=21, B_replay=43 > 42.
"""

from __future__ import annotations

from dataclasses import dataclass

from src.objective import plan_batch
from src.replay.buffer import Group, ReplayBuffer


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


MAX_STEPS = 10_000_000  # the plan keeps one count per step; src.schema caps trainer.steps far below


def _check_sizes(groups_per_step: int, group_size: int, steps: int) -> None:
    if int(group_size) != group_size or group_size < 2:
        raise ValueError(f"group_size (K) must be an integer >= 2 for leave-one-out, got {group_size!r}.")
    if int(steps) != steps or not 1 <= steps <= MAX_STEPS:
        raise ValueError(f"steps must be an integer between 1 and {MAX_STEPS:,}, got {steps!r}.")
    # groups_per_step and ratio are validated by plan_batch.


def planning_max_age(buffer, steps: int) -> int:
    """The age window L the budget simulation uses: buffer.max_age (at least 1); buffer=fifo has no
    window (every stored group of age >= 1 is eligible), so it plans with L = steps. That is exact
    for FIFO: from step 1 on its pool holds at least the B groups of step 0 (fresh and gap fill),
    so demand B_replay < B is always met, by with_replacement draws from any non-empty pool and by
    distinct draws because validation requires capacity N >= B_replay for those modes.
    """
    return int(steps) if buffer.name == "fifo" else max(int(buffer.max_age), 1)


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
    groups_per_step: int, group_size: int, steps: int, ratio: float, max_age: int
) -> BudgetPlan:
    """Simulate the buffer schedule step by step (SPEC 3 order) and count fresh groups."""
    _check_sizes(groups_per_step, group_size, steps)
    b_fresh, b_replay = plan_batch(groups_per_step, ratio)
    buffer = ReplayBuffer(max_age=max_age) if b_replay > 0 else None  # validates max_age

    fresh_counts: list[int] = []
    replay_counts: list[int] = []
    gap_total = 0
    seen: dict[tuple[int, ...], int] = {}  # window of the last L + 1 fresh counts -> the step it ended at
    for step in range(int(steps)):
        replayed = buffer.sample(b_replay, step) if buffer is not None else []
        gap = b_replay - len(replayed)  # too few eligible: fill with fresh groups (SPEC 3.3)
        fresh = b_fresh + gap
        if step > 0:
            gap_total += gap  # step 0 is all fresh by design, not a shortfall
        fresh_counts.append(fresh)
        replay_counts.append(len(replayed))
        if buffer is not None:
            # After the update: store all fresh groups (gap fill included), then drop over-age ones.
            buffer.add(_placeholder(step) for _ in range(fresh))
            buffer.evict(step)
        # The pool holds only the last L steps' groups (draws never consume them), so a step's counts
        # depend on the previous L fresh counts alone: once that window repeats, the schedule cycles.
        # Jumping over the whole cycles makes a million-step plan cost what a few steps do.
        window = tuple(fresh_counts[-(max_age + 1):])
        if step > 0 and window in seen:
            start = seen[window]
            cycle_fresh, cycle_replay = fresh_counts[start + 1:], replay_counts[start + 1:]
            remaining = int(steps) - step - 1
            fresh_counts += [cycle_fresh[i % len(cycle_fresh)] for i in range(remaining)]
            replay_counts += [cycle_replay[i % len(cycle_replay)] for i in range(remaining)]
            gap_total += sum(b_replay - replay_counts[i] for i in range(step + 1, int(steps)))
            break
        seen[window] = step

    return BudgetPlan(
        ratio=float(ratio),
        max_age=int(max_age),
        groups_per_step=int(groups_per_step),
        group_size=int(group_size),
        steps=int(steps),
        fresh_groups_per_step=tuple(fresh_counts),
        replay_groups_per_step=tuple(replay_counts),
        gap_fill_groups=gap_total,
    )


def _placeholder(step: int) -> Group:
    # Cheapest valid group: K=2 empty responses; only its step matters to the schedule.
    return Group(
        prompt="",
        prompt_ids=(),
        numbers=(),
        target=0,
        responses=("", ""),
        response_ids=((), ()),
        rewards=(0.0, 0.0),
        step=step,
        behaviour_logprobs=(0.0, 0.0),
    )



# --------------------------------------------------------------------------- command line
def budget_table(cfg, ratios: list[float] | None = None):
    """Rows of the planning table for a composed config, over `ratios` (default: the config's own rho)."""
    trainer, buffer = cfg.trainer, cfg.buffer
    rows = []
    for ratio in ratios if ratios is not None else [float(buffer.ratio)]:
        max_age = planning_max_age(buffer, trainer.steps)
        plan = plan_fresh_evaluations(trainer.groups_per_step, trainer.group_size, trainer.steps, ratio, max_age)
        b_fresh, b_replay = plan_batch(trainer.groups_per_step, ratio)
        rows.append({
            "rho": ratio, "L": max_age if ratio > 0 else None, "B_fresh": b_fresh, "B_replay": b_replay,
            "fresh_evaluations": plan.fresh_evaluations,
            "closed_form": closed_form_fresh_evaluations(trainer.groups_per_step, trainer.group_size, trainer.steps, ratio),
            "gap_fill_groups": plan.gap_fill_groups, "achieved_ratio": plan.achieved_ratio,
        })
    return rows


def main(argv: list[str] | None = None) -> None:
    """`python -m src.budget [--ratios 0,1,2] [hydra overrides]`: the planned budget, no model loaded."""
    import argparse

    from hydra import compose, initialize_config_dir
    from rich.console import Console
    from rich.table import Table

    import src.config  # noqa: F401  (registers the ${root:} resolver)
    from src.paths import CONFIG_DIR

    parser = argparse.ArgumentParser(description="Planned fresh verifier evaluations (SPEC 5), simulated "
                                                 "with the real replay buffer; no model is loaded.")
    parser.add_argument("--ratios", help="comma-separated rho values (default: the config's buffer.ratio)")
    parser.add_argument("overrides", nargs="*", help="Hydra overrides, e.g. trainer=paper buffer=age2")
    args = parser.parse_args(argv)
    with initialize_config_dir(str(CONFIG_DIR), version_base="1.3"):
        cfg = compose("config", overrides=args.overrides)
    try:
        src.config.validate(cfg, check_device=False)
    except src.config.ConfigError as error:
        Console(stderr=True).print(f"[bold red]error:[/bold red] {error}", soft_wrap=True, highlight=False)
        raise SystemExit(2) from None
    ratios = [float(value) for value in args.ratios.split(",")] if args.ratios else None
    trainer = cfg.trainer
    table = Table(title=f"Fresh verifier evaluations: B={trainer.groups_per_step}, K={trainer.group_size}, "
                        f"{trainer.steps} steps")
    for column in ("rho", "L", "B_fresh", "B_replay", "fresh evals", "formula", "gap fill", "rho reached"):
        table.add_column(column, justify="right")
    for row in budget_table(cfg, ratios):
        table.add_row(f"{row['rho']:g}", "-" if row["L"] is None else str(row["L"]), str(row["B_fresh"]),
                      str(row["B_replay"]), f"{row['fresh_evaluations']:,}", f"{row['closed_form']:,}",
                      str(row["gap_fill_groups"]), f"{row['achieved_ratio']:.3f}")
    console = Console()
    console.print(table)
    console.print("fresh evals: simulated with the replay buffer; formula: K(B + (steps-1) B_fresh), exact "
                  "when no gap fill is needed; gap fill: fresh groups generated because too few were eligible")


if __name__ == "__main__":
    main()
