"""Seed 001's planning numbers without a model (SPEC 11): its table of gamma for any mu, the expected replay count.

    python -m src.runtime.plan --mu 5.28                               # Table 1 (eq. 2) at mu = 5.28
    python -m src.runtime.plan --mu 6.84                               # Table 3 (Qwen3-0.6B)
    python -m src.runtime.plan --mu 5.28 --workers 6 --trainers 2 --batch 60 --capacity 252

For a split (W, T) it prints the compute per update with and without a buffer (eq. 1), gamma
(eq. 2), R = B W / (mu T) rollouts added per trainer step, the expected replay count B/R
(footnote 5) and the staleness horizon N/R (steps a rollout stays in a FIFO of N).
"""

from __future__ import annotations

import argparse

from rich.console import Console
from rich.table import Table

from src.runtime import formulas


# The paper's tables of gamma and the mu each was printed for (seed 001 line 170: Table 1, Qwen2.5-7B;
# lines 2458-2463: Table 3, Qwen3-0.6B). Any other mu is eq. 2 alone.
PAPER_TABLES = {5.28: "Table 1, Qwen2.5-7B", 6.84: "Table 3, Qwen3-0.6B"}


def table1(mu: float) -> Table:
    source = f"seed 001 eq. 2, {PAPER_TABLES[mu]}" if mu in PAPER_TABLES else "seed 001 eq. 2"
    table = Table(title=f"gamma = (1 + W/T) / (1 + mu) at mu = {mu:g} ({source})")
    table.add_column("(W, T)")
    table.add_column("gamma", justify="right")
    table.add_column("replay count mu T / W", justify="right")
    for (w, t), gamma in formulas.gamma_table(mu).items():
        table.add_row(f"({w}, {t})", f"{gamma:.2f}", f"{formulas.expected_replay_count_from_rates(w, t, mu):.2f}")
    return table


def split(mu: float, workers: int, trainers: int, batch: int, capacity: int | None) -> Table:
    r = formulas.rollouts_per_step(batch, workers, trainers, mu)
    table = Table(title=f"W = {workers}, T = {trainers}, B = {batch} rollouts, mu = {mu:g}")
    table.add_column("quantity")
    table.add_column("value", justify="right")
    rows = [("compute per update with a buffer, 1 + W/T (eq. 1)", formulas.compute_per_update(workers, trainers, mu)),
            ("compute per update without one, 1 + mu (eq. 1)", formulas.compute_per_update(workers, trainers, mu, False)),
            ("gamma (eq. 2)", formulas.compute_ratio(workers, trainers, mu)),
            ("R, rollouts added per trainer step", r),
            ("expected replay count B/R (footnote 5)", formulas.expected_replay_count(batch, r))]
    if capacity:
        rows.append((f"staleness horizon N/R at N = {capacity}", capacity / r))
    for name, value in rows:
        table.add_row(name, f"{value:.3f}")
    return table


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--mu", type=float, default=5.28, help="inference cost of a batch over its trainer cost")
    parser.add_argument("--workers", type=int, help="W inference workers")
    parser.add_argument("--trainers", type=int, default=1, help="T trainers")
    parser.add_argument("--batch", type=int, default=60, help="B, rollouts per update (seed 001: 60)")
    parser.add_argument("--capacity", type=int, help="N, the FIFO's rollouts")
    args = parser.parse_args(argv)
    console = Console()
    try:
        console.print(table1(args.mu))
        if args.workers:
            console.print(split(args.mu, args.workers, args.trainers, args.batch, args.capacity))
    except ValueError as error:
        parser.error(str(error))


if __name__ == "__main__":
    main()


class _Placeholder:
    """The pipeline's work without a model: every group scores 0 (positive bias then keeps the least)."""

    def __init__(self, group_size: int, groups_per_request: int) -> None:
        from src.batch import Group

        self.group = Group(prompt="", prompt_ids=(0,), truth=None, responses=[""] * group_size,
                           response_ids=[(0,)] * group_size, rewards=[0.0] * group_size, step=0)
        self.size, self.running, self.arrived = groups_per_request, {}, []

    def start(self, worker: int, key: int, version) -> None:
        from src.runtime.pipeline import Generated

        self.running[worker] = [Generated(k, worker, version or 0, self.group, request=key)
                                for k in range(key, key + self.size)]

    def result(self, worker: int, version: int):
        return self.running.pop(worker)

    def train(self, step: int, samples, arrived, publish) -> None:
        self.arrived.append(len(arrived))

    def trained(self) -> tuple[dict[str, float], float | None]:
        return {}, None  # the lockstep schedule publishes on its clock

    def publish(self, version: int) -> float:
        return 0.0


def async_budget_plan(run):
    """`src.study.budget.BudgetPlan` of a runtime=async config: the groups that reach the trainer before each step,
    from its lockstep schedule (the free schedule's count depends on the machine: this is its lockstep twin)."""
    from src.study.budget import BudgetPlan
    from src.build import build_runtime
    from src.runtime.pipeline import LockstepPipeline

    runtime, trainer = build_runtime(run), run.trainer
    work = _Placeholder(int(trainer.group_size), runtime.settings.groups_per_request)
    pipeline = LockstepPipeline(runtime.settings, runtime.build_pipeline(work).queue, work)
    for _ in range(int(trainer.steps)):
        pipeline.next_step()
    return BudgetPlan(ratio=0.0, max_age=0, groups_per_step=int(trainer.groups_per_step),
                      group_size=int(trainer.group_size), steps=int(trainer.steps),
                      fresh_groups_per_step=tuple(work.arrived), replay_groups_per_step=(0,) * len(work.arrived),
                      gap_fill_groups=0, reward_dependent=runtime.queue_arguments.get("positive_bias", 0) > 0)
