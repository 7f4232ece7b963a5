"""Generation over data-parallel ranks: each rank's engine samples its share of a call, and every rank gets the
whole answer back.

An engine with its own copy of the weights (`own_weights`: vLLM) needs no other rank to sample. Each rank
takes a contiguous block of the call's prompts (`block`, as `shard_batch` splits a batch), samples it with the
prompts' seeds of the whole call (`first_index`), and the blocks are gathered in rank order: every rank then
holds the rollouts one process would have sampled, sample for sample, at 1/N of the work. A weight sync
gathers the sharded policy one parameter at a time into every rank's engine (`trainer_weights`).
"""

from __future__ import annotations

import torch.distributed as dist

from src.rollout.interface import Generation, SamplingParams

_ENGINES: list = []  # this process's engines shared over ranks, closed before it leaves the process group


def block(count: int, rank: int, world_size: int) -> tuple[int, int]:
    """[start, stop) of this rank's contiguous block of `count` items; blocks differ in size by at most one."""
    base, extra = divmod(count, world_size)
    start = rank * base + min(rank, extra)
    return start, start + base + (1 if rank < extra else 0)


def close_engines() -> None:
    """Shut down the shared engines while the process group they built theirs from still stands (vLLM's
    teardown, run again at exit, would otherwise destroy groups of a destroyed default group)."""
    while _ENGINES:
        _ENGINES.pop().close()


class RankShare:
    """`engine` over the ranks of `group`: same `generate` and `sync_weights`, each rank sampling its share."""

    def __init__(self, engine, group=None) -> None:
        self.engine, self.group = engine, group
        _ENGINES.append(engine)

    def __getattr__(self, name):  # generated, tokenizer, llm...: the wrapped engine's
        return getattr(self.engine, name)

    def generate(self, prompts: list[str], samples_per_prompt: int, sampling: SamplingParams, seed: int) -> Generation:
        # An engine split over `tp` consecutive ranks (tensor parallelism) is one engine: its ranks sample one block.
        rank, world = dist.get_rank(self.group), dist.get_world_size(self.group)
        tp = getattr(self.engine, "tensor_parallel_size", 1)
        start, end = block(len(prompts), rank // tp, world // tp)
        mine = self.engine.generate(prompts[start:end], samples_per_prompt, sampling, seed, first_index=start)
        blocks: list = [None] * world
        dist.all_gather_object(blocks, mine, group=self.group)  # ranks of one job: trusted peers
        engines = blocks[::tp]  # each engine's block once, in rank order
        return Generation(prompt_ids=[ids for block in engines for ids in block.prompt_ids],
                          completions=[done for block in engines for done in block.completions])

    def sync_weights(self, model) -> None:
        """The policy's weights into this rank's engine (every rank at once: sharded parameters are gathered)."""
        self.engine.sync_weights(model)
