"""What an objective asks about the other ranks: the totals its loss is normalised by.

An objective normalises its loss by batch-wide totals (responses, response tokens). Under data
parallelism each rank holds a shard of the batch, so those totals are sums over ranks; the objective
asks its `Reducer` for them and never learns how many ranks run it. One process: `Reducer`, the
identity. Several: `src.distributed.data_parallel.RankReducer`.
"""

from __future__ import annotations


class Reducer:
    """One process: a local total is the batch's total, and gradients need no reduction before the step."""

    def total(self, value: float) -> float:
        """The batch-wide sum of `value` (this rank's share of a count)."""
        return value

    def maximum(self, value: float) -> float:
        """The batch-wide largest of `value`."""
        return value

    def every(self, flag: bool) -> bool:
        """Whether `flag` holds on every rank (so every rank takes the same branch around a collective)."""
        return bool(flag)

    def first_row(self, rows: int) -> int:
        """The batch row index of this rank's first row: the rows of the ranks before it (ranks hold
        contiguous blocks of the batch in rank order)."""
        return 0

    def before_step(self, policy) -> None:
        """Called before each optimizer step, once the step's gradients are accumulated."""
