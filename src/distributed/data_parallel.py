"""The update of a step over T ranks: each rank trains a shard of the batch (whole groups), the
objective's normalisers are summed over ranks, gradients are summed by FSDP, and every rank gets the
whole batch's `UpdateResult` back, so the rest of the step (store, bookkeeping, metrics) runs as in one
process and logs the same numbers.

FSDP's collectives (an all-gather per layer in each forward and backward, a reduce-scatter per layer in
each backward) must match across ranks, so every rank must run as many micro-batches. `RankForward`
splits micro-batches until each rank has the most any rank has; FSDP then runs as usual (streaming):
one layer's parameters gathered at a time, gradients reduce-scattered after each micro-batch. Where a
rank has too few rows to split that far, the update runs gathered instead: the parameters stay whole
after the first forward, gradients accumulate locally, and before the optimizer step every rank runs
one zero-weight forward and backward with synchronisation on, which reduce-scatters them
(`synchronise_gradients`). Either way the master weights, their gradients and the optimizer state stay
sharded.
"""
from __future__ import annotations

import torch
import torch.distributed as dist

from src.batch import Batch
from src.distributed.generation import block, close_engines
from src.loss.reducer import Reducer
from src.loss.trainer import Trainer, UpdateResult

SUMMED = ("loss", "policy_loss", "kl", "entropy")  # each rank's value is its share of the batch's value
PER_ROW = ("logprobs", "raw_weights", "weights", "kl_sums", "token_counts")


def leave_group(finished: bool = True) -> None:
    """Leave the process group. A run that finished waits for every rank first: a gloo rank that destroys its
    group while a peer is still inside its last collectives can abort the process ("terminate called without an
    active exception"). A failed run leaves at once, since the other ranks may never reach the barrier.

    The wait is two barriers. gloo's own lets a rank out while its last message to another rank may still be
    queued (pytorch/gloo#155, "Barrier followed by context destruction causes some participants to fail"): had
    that rank closed its connections then, the other would abort. The second barrier goes through the
    rendezvous store, not gloo, so no rank closes a connection before every rank is out of the first."""
    if finished:
        dist.barrier()
        store_barrier("replay-rloo/leave")
    close_engines()  # vLLM's own teardown destroys its groups, and the default one with them
    if dist.is_initialized():
        dist.destroy_process_group()


def store_barrier(key: str, timeout_s: float = 300.0) -> None:
    """Every rank of the default group waits here, through the group's rendezvous store (a TCP store beside
    gloo's connections), until all have arrived. torch keeps the store with the group
    (torch/distributed/distributed_c10d.py `_get_default_store`, which `init_process_group` fills), and torchelastic
    ships the barrier over it (torch/distributed/elastic/utils/store.py `barrier`)."""
    from torch.distributed.elastic.utils.store import barrier

    barrier(dist.distributed_c10d._get_default_store(), dist.get_world_size(), key_prefix=key,
            barrier_timeout=timeout_s)


def shard_batch(batch: Batch, rank: int, world_size: int) -> Batch:
    """This rank's contiguous block of the batch's groups (whole groups; sizes differ by at most one).

    Contiguous blocks in rank order concatenate back to the batch's row order (`gather_results`).
    """
    if len(batch) < world_size:
        raise ValueError(f"a batch of {len(batch)} groups cannot give each of {world_size} ranks a whole group; "
                         f"raise trainer.groups_per_step to at least {world_size}")
    start, stop = block(len(batch), rank, world_size)
    return Batch(entries=batch.entries[start:stop], dropped=batch.dropped)


def split_to(batches: list[list[int]], count: int) -> list[list[int]] | None:
    """`batches` split into `count` micro-batches by halving the largest ones; None if rows run out first."""
    batches = [list(batch) for batch in batches]
    while len(batches) < count:
        largest = max(range(len(batches)), key=lambda i: len(batches[i]))
        if len(batches[largest]) < 2:
            return None
        half = len(batches[largest]) // 2
        batches[largest:largest + 1] = [batches[largest][:half], batches[largest][half:]]
    return batches


class RankReducer(Reducer):
    """Totals are sums over the ranks of `group`; gradients are reduced per micro-batch by FSDP (streaming) or,
    in a gathered update, once before the optimizer step."""

    def __init__(self, group=None) -> None:
        self.group = group
        self.gathered = False  # set per update by `RankForward.batches`

    def agree(self, value: float, op) -> float:
        """`value` reduced with `op` (SUM, MAX, MIN) over the ranks."""
        reduced = torch.tensor(float(value), dtype=torch.float64)
        dist.all_reduce(reduced, op=op, group=self.group)
        return reduced.item()

    def total(self, value: float) -> float:
        summed = self.agree(value, dist.ReduceOp.SUM)
        return summed if isinstance(value, float) else int(summed)

    def maximum(self, value: float) -> float:
        return self.agree(value, dist.ReduceOp.MAX)

    def every(self, flag: bool) -> bool:
        return bool(self.agree(bool(flag), dist.ReduceOp.MIN))

    def first_row(self, rows: int) -> int:
        counts = [torch.zeros(1, dtype=torch.long) for _ in range(dist.get_world_size(self.group))]
        dist.all_gather(counts, torch.tensor([rows]), group=self.group)
        return int(sum(count.item() for count in counts[:dist.get_rank(self.group)]))

    def before_step(self, policy) -> None:
        if self.gathered:
            synchronise_gradients(policy)


class RankForward:
    """The objective's `Forward` with micro-batches every rank agrees on (see the module docstring)."""

    def __init__(self, forward, reducer: RankReducer) -> None:
        self.inner, self.reducer, self.policy = forward, reducer, None

    def __getattr__(self, name):  # token_stats, reference_tokens, fused...: the wrapped Forward's
        return getattr(self.inner, name)

    def batches(self, sequences) -> list[list[int]]:
        local = self.inner.batches(sequences)
        count = int(self.reducer.maximum(len(local)))
        split = split_to(local, count)
        # Once any call of an update (loss=grpo plans one per mini-batch) cannot match, the whole update is gathered.
        self.reducer.gathered = not self.reducer.every(split is not None) or self.reducer.gathered
        if self.reducer.gathered:
            hold_gradients(self.policy)
            return local
        return split


def synchronise_gradients(policy) -> None:
    """Reduce-scatter the gradients every rank accumulated without synchronisation: one zero-weight
    forward and backward with synchronisation on (its own gradient is exactly 0), then reshard."""
    policy.set_requires_gradient_sync(True)
    policy.set_reshard_after_backward(True)
    device = next(policy.parameters()).device
    (policy(input_ids=torch.zeros((1, 2), dtype=torch.long, device=device)).logits.sum() * 0.0).backward()
    hold_gradients(policy)


def hold_gradients(policy) -> None:
    """Accumulate gradients locally and keep parameters gathered until the next `synchronise_gradients`."""
    policy.set_requires_gradient_sync(False)
    policy.set_reshard_after_backward(False)
    policy.set_reshard_after_forward(False)


def release_parameters(policy) -> None:
    """FSDP's default (streaming): the layers' parameters sharded again after each forward and backward,
    gradients reduce-scattered after each backward."""
    policy.set_reshard_after_forward(True)
    policy.set_reshard_after_forward(False, recurse=False)  # FSDP keeps the root's gathered: the head runs last
    policy.set_requires_gradient_sync(True)
    policy.set_reshard_after_backward(True)


class DataParallelTrainer:
    """The trainer run over the ranks of `group`: same `update` signature, same whole-batch result.

    Any objective: the shared trainer (`src.loss.trainer.Trainer`) normalises every loss by totals from its
    `Reducer`, which this wrapper makes sum over the ranks, and takes as many optimizer steps and skipped
    micro-batches on every rank; each rank trains its share of the batch's groups.
    """

    def __init__(self, trainer: Trainer, group=None, reducer: Reducer | None = None) -> None:
        self.trainer, self.group = trainer, group
        trainer.use_reducer(reducer if reducer is not None else RankReducer(group))
        trainer.forward = RankForward(trainer.forward, trainer.reducer)

    def __getattr__(self, name):  # objective, forward, reducer...: the wrapped trainer's
        return getattr(self.trainer, name)

    def update(self, policy, reference, optimizer, batch: Batch) -> UpdateResult:
        rank, world = dist.get_rank(self.group), dist.get_world_size(self.group)
        self.trainer.forward.policy = policy
        self.trainer.reducer.gathered = False
        try:
            local = self.trainer.update(policy, reference, optimizer, shard_batch(batch, rank, world))
        finally:
            release_parameters(policy)
        results: list = [None] * world
        dist.all_gather_object(results, local, group=self.group)  # ranks of one job: trusted peers
        return gather_results(results)


def gather_results(results: list[UpdateResult]) -> UpdateResult:
    """One `UpdateResult` for the whole batch from the ranks' results, in rank (= row) order."""
    first = results[0]
    rows = {key: torch.cat([getattr(result, key) for result in results]) for key in PER_ROW}
    sums = {key: sum(getattr(result, key) for result in results) for key in SUMMED}
    behaviour = None if first.behaviour_tokens is None else [t for r in results for t in r.behaviour_tokens]
    token_level = any(result.token_weights is not None for result in results)
    return UpdateResult(
        **rows, **sums, reference_tokens=[tokens for result in results for tokens in result.reference_tokens],
        behaviour_tokens=behaviour, optimizer_steps=first.optimizer_steps,
        extras=first.extras,  # the objective reduced them over the ranks: every rank holds the batch's
        token_raw_weights=[w for r in results for w in token_weights(r, raw=True)] if token_level else None,
        token_weights=[w for r in results for w in token_weights(r, raw=False)] if token_level else None)


def token_weights(result: UpdateResult, raw: bool) -> list[torch.Tensor]:
    """Per-row token weights; a rank that weighted whole responses repeats each response's weight per token."""
    given = result.token_raw_weights if raw else result.token_weights
    if given is not None:
        return given
    weights = result.raw_weights if raw else result.weights
    return [weights[i].repeat(int(result.token_counts[i])) for i in range(len(weights))]
