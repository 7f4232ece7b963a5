"""What each rank of the data-parallel tests runs (spawned processes import this module, not the test)."""

from __future__ import annotations

import dataclasses

import torch
import torch.distributed as dist

from src.batch import Batch, BatchGroup, Group
from src.distributed.data_parallel import DataParallelTrainer, RankReducer, leave_group
from src.distributed.fsdp import shard_policy
from src.loss.grpo import ClippedObjective
from src.loss.ipo import IpoObjective
from src.loss.rloo import RlooObjective
from src.loss.trainer import Trainer
from src.policy.forward import Forward
from src.policy.model import frozen_copy, load_policy
from tests.conftest import TINY_CHECKPOINT
from tests.outside_variants.variants import RlooCopy

LEARNING_RATE = 1e-3  # large enough that one step moves every weight visibly
# Adam's first step is lr * g / (|g| + eps): with eps 1e-8 a gradient near 0 turns fp32 noise into a +-lr
# step. eps 1e-4 bounds that gain at lr / eps = 10, so weights agree to fp32 tolerance too.
ADAM_EPS = 1e-4
CLIP = 1.5
WRAPPED = "_checkpoint_wrapped_module."


class LocalTotals(RankReducer):
    """The negative control: gradients are still summed over ranks, but each rank normalises its loss by
    its own shard's totals instead of the batch's."""

    def total(self, value):
        return value


def join(rank: int, world_size: int, rendezvous: str) -> None:
    """Join the gloo process group of `world_size` ranks through the file `rendezvous`."""
    import faulthandler

    faulthandler.enable()  # a rank that aborts (SIGABRT) prints where, into the test's captured output
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{rendezvous}", rank=rank, world_size=world_size)


def tiny_policy():
    policy, tokenizer = load_policy(str(TINY_CHECKPOINT), "cpu", "float32")
    return policy, tokenizer


def trainer(pad_id: int, micro_batch_size: int = 3, loss: str = "rloo", fused: bool = False) -> Trainer:
    """The trainer of loss=rloo (clip c = 1.5) or its outside copy, grpo with 5 mini-batches (so rank 1's first
    row, batch row 12, opens mini-batch 2) or ipo, with KL and entropy terms where the loss has them; `fused`:
    the output head on response positions only (trainer.fused_logprobs)."""
    forward = Forward(pad_id, micro_batch_size=micro_batch_size, fused=fused)
    if loss == "ipo":
        return Trainer(IpoObjective(0.1), forward)
    if loss == "grpo":
        chosen = ClippedObjective(0.2, 0.28, 2.0, 5)
    elif loss == "rloocopy":  # the outside copy of loss=rloo: a loss src/ does not know, split over ranks all the same
        chosen = RlooCopy(clip_ceiling=CLIP)
    else:
        chosen = RlooObjective(clip_ceiling=CLIP)
    return Trainer(chosen, forward, kl_coef=0.05, entropy_coef=0.01)


def tiny_batch(policy, pad_id: int, groups: int = 7, k: int = 3) -> Batch:
    """`groups` groups of K responses of varied lengths: the last two replayed (ages 1 and 2) with log mu
    off the policy's by +-0.7 nats, so some weights are clipped at c and some are not."""
    generator = torch.Generator().manual_seed(0)
    vocab = policy.config.vocab_size
    entries = []
    for g in range(groups):
        prompt = torch.randint(2, vocab, (5 + g % 3,), generator=generator).tolist()
        responses = [torch.randint(2, vocab, (2 + (g + j) % 6,), generator=generator).tolist() for j in range(k)]
        rewards = [[1.0, 0.1, 0.0][(g + j) % 3] for j in range(k)]
        group = Group(f"p{g}", prompt, {"numbers": [1, 2], "target": 3}, [f"r{j}" for j in range(k)], responses,
                      rewards, step=0)
        entries.append(BatchGroup(group))
    for age, entry in enumerate(entries[-2:], start=1):
        current = Forward(pad_id, 8).sampled_token_logprobs(policy, [(entry.group.prompt_ids, r)
                                                                     for r in entry.group.response_ids], 1.0)
        offsets = (-0.7, 0.7, 0.0)
        mu = [sum(tokens) + offset for tokens, offset in zip(current, offsets)]
        # the whole offset on the first token: pi/mu = e^0.7 > 2 there, so loss=grpo's behaviour cap (2) acts
        mu_tokens = [[tokens[0] + offset, *tokens[1:]] for tokens, offset in zip(current, offsets)]
        entries[-3 + age] = BatchGroup(entry.group.with_behaviour_logprobs(mu, tokens=mu_tokens), "replay", age)
    return Batch(entries)


def plain_update(loss: str = "rloo", fused: bool = False) -> dict:
    """One process, no FSDP: the numbers the ranks must reproduce."""
    policy, tokenizer = tiny_policy()
    batch = tiny_batch(policy, tokenizer.pad_token_id)
    optimizer = torch.optim.AdamW(policy.parameters(), lr=LEARNING_RATE, eps=ADAM_EPS)
    chosen = trainer(tokenizer.pad_token_id, loss=loss, fused=fused)
    result = chosen.update(policy, frozen_copy(policy), optimizer, batch)
    return {"result": result, "grads": {n: p.grad.clone() for n, p in policy.named_parameters()},
            "weights": {n: p.detach().clone() for n, p in policy.named_parameters()}}


def sharded_update(policy, tokenizer, reducer=None, activation_checkpointing: bool = False,
                   micro_batch_size: int = 3, loss: str = "rloo", fused: bool = False) -> dict:
    """One update of the sharded policy on this rank's shard: the whole-batch result, full gradients and weights."""
    batch = tiny_batch(policy, tokenizer.pad_token_id)
    reference = frozen_copy(policy)
    shard_policy(policy, activation_checkpointing=activation_checkpointing)
    optimizer = torch.optim.AdamW(policy.parameters(), lr=LEARNING_RATE, eps=ADAM_EPS)
    wrapped = DataParallelTrainer(trainer(tokenizer.pad_token_id, micro_batch_size, loss, fused), reducer=reducer)
    result = wrapped.update(policy, reference, optimizer, batch)
    gathered = wrapped.reducer.gathered
    grads = {n.replace(WRAPPED, ""): p.grad.full_tensor() for n, p in policy.named_parameters()}
    weights = {n.replace(WRAPPED, ""): p.detach().full_tensor() for n, p in policy.named_parameters()}
    return {"result": result, "grads": grads, "weights": weights, "gathered": gathered}


def sharded_updates(rank: int, world_size: int, rendezvous: str, out: str) -> None:
    """The update with the batch's totals reduced over ranks: streaming (4 + 3 micro-batches of 3 rows, split to
    4 + 4) with activation checkpointing, and gathered (12 + 9 one-row micro-batches cannot be matched);
    then the negative control with each rank's own totals. Rank 0 writes all three to `out`."""
    join(rank, world_size, rendezvous)
    streaming = sharded_update(*tiny_policy(), activation_checkpointing=True)
    gathered = sharded_update(*tiny_policy(), micro_batch_size=1)
    local = sharded_update(*tiny_policy(), reducer=LocalTotals())
    if rank == 0:
        torch.save({"streaming": streaming, "gathered": gathered, "local_totals": local}, out)
    leave_group()


def other_losses(rank: int, world_size: int, rendezvous: str, out: str) -> None:
    """loss=grpo streaming and gathered, loss=ipo, the outside RLOO copy and RLOO with the fused head (through
    the sharded model's own forward) streaming, and grpo with more mini-batches than rank 1 has rows (refused
    on every rank). Rank 0 writes them to `out`."""
    join(rank, world_size, rendezvous)
    runs = {"grpo": sharded_update(*tiny_policy(), loss="grpo"),
            "grpo-gathered": sharded_update(*tiny_policy(), micro_batch_size=1, loss="grpo"),
            "ipo": sharded_update(*tiny_policy(), loss="ipo"),
            "rloocopy": sharded_update(*tiny_policy(), loss="rloocopy"),
            "rloo-fused": sharded_update(*tiny_policy(), fused=True)}
    policy, tokenizer = tiny_policy()
    batch, reference = tiny_batch(policy, tokenizer.pad_token_id), frozen_copy(policy)
    too_many = trainer(tokenizer.pad_token_id, loss="grpo")
    too_many.objective.needs = dataclasses.replace(too_many.objective.needs, updates=10)  # rank 1: 3 groups of 3
    shard_policy(policy)
    try:
        DataParallelTrainer(too_many).update(policy, reference, torch.optim.AdamW(policy.parameters()), batch)
    except ValueError as refused:
        runs["refused"] = str(refused)
    if rank == 0:
        torch.save(runs, out)
    leave_group()


def full_state(policy, optimizer) -> dict:
    """Whole tensors of the policy and its optimizer state, keyed by parameter name (every rank calls it)."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict

    model_state, optimizer_state = get_state_dict(policy, optimizer, options=StateDictOptions(full_state_dict=True))
    return {"policy": {k: v.clone() for k, v in model_state.items()},
            "optimizer": {name: {k: v.clone() for k, v in moments.items()}
                          for name, moments in optimizer_state["state"].items()}}


def trained(shard: bool):
    """The tiny policy after one update (sharded over the process group when `shard`) and its optimizer."""
    policy, tokenizer = tiny_policy()
    batch = tiny_batch(policy, tokenizer.pad_token_id)
    reference = frozen_copy(policy)
    chosen = trainer(tokenizer.pad_token_id)
    if shard:
        shard_policy(policy)
        chosen = DataParallelTrainer(chosen)
    optimizer = torch.optim.AdamW(policy.parameters(), lr=LEARNING_RATE, eps=ADAM_EPS)
    chosen.update(policy, reference, optimizer, batch)
    return policy, optimizer


def fresh(shard: bool):
    """The untrained tiny policy (sharded when `shard`) with an AdamW that has taken no step."""
    policy, _ = tiny_policy()
    if shard:
        shard_policy(policy)
    return policy, torch.optim.AdamW(policy.parameters(), lr=LEARNING_RATE, eps=ADAM_EPS)


def checkpoint_ranks(rank: int, world_size: int, rendezvous: str, folder: str) -> None:
    """Save a trained sharded policy to folder/by-ranks; load folder/by-one (one process wrote it as DCP shards)
    and folder/whole.pt (one process's whole state dicts) into freshly sharded ones. Rank 0 writes the three
    as whole tensors to folder/ranks.pt."""
    from pathlib import Path

    from src.distributed.checkpoint import load_sharded, load_whole, save_sharded

    join(rank, world_size, rendezvous)
    policy, optimizer = trained(shard=True)
    save_sharded(Path(folder) / "by-ranks", policy, optimizer)
    saved = full_state(policy, optimizer)
    policy, optimizer = fresh(shard=True)
    load_sharded(Path(folder) / "by-one", policy, optimizer)
    loaded = full_state(policy, optimizer)
    policy, optimizer = fresh(shard=True)
    whole = torch.load(Path(folder) / "whole.pt", weights_only=True)  # this test's own file
    load_whole(policy, optimizer, whole["policy"], whole["optimizer"])
    loaded_whole = full_state(policy, optimizer)
    if rank == 0:
        torch.save({"saved": saved, "loaded": loaded, "loaded_whole": loaded_whole}, Path(folder) / "ranks.pt")
    leave_group()


class CountingEngine:
    """An engine with its own weights, as vLLM: each completion a function of (seed, the prompt's place in the
    whole call), and a count of the sequences it sampled; `sync_weights` keeps what it was handed."""

    own_weights = True

    def __init__(self) -> None:
        self.generated, self.synced = 0, None

    def generate(self, prompts, samples_per_prompt, sampling, seed, first_index=0):
        from src.rollout.interface import Completion, Generation

        self.generated += len(prompts) * samples_per_prompt
        return Generation(prompt_ids=[(len(prompt),) for prompt in prompts],
                          completions=[[Completion(token_ids=(seed, first_index + i, j), text=f"{prompt}/{j}")
                                        for j in range(samples_per_prompt)] for i, prompt in enumerate(prompts)])

    def sync_weights(self, model) -> None:
        from src.policy.model import trainer_weights

        self.synced = {name: tensor.clone() for name, tensor in trainer_weights(model)}

    def sleep(self) -> None:
        pass

    def close(self) -> None:
        self.closed = True


def shared_generation(rank: int, world_size: int, rendezvous: str, out: str) -> None:
    """7 prompts over the ranks with `RankShare`, and the sharded tiny policy synced into the engine. Rank 0
    writes the gathered generation, each rank's count and the synced weights to `out`."""
    from src.distributed.generation import RankShare

    join(rank, world_size, rendezvous)
    shared = RankShare(CountingEngine())
    generation = shared.generate([f"prompt {i}" for i in range(7)], 2, None, seed=5)
    policy, _ = tiny_policy()
    shard_policy(policy)
    shared.sync_weights(policy)
    counts = [None] * world_size
    dist.all_gather_object(counts, shared.generated)
    if rank == 0:
        torch.save({"generation": generation, "counts": counts, "synced": shared.synced}, out)
    leave_group()


def store_barrier_ranks(rank: int, world_size: int, rendezvous: str, out: str) -> None:
    """Rank 1 reaches the store barrier half a second after rank 0: each writes when it entered and left it."""
    import json
    import time

    from src.distributed.data_parallel import store_barrier

    join(rank, world_size, rendezvous)
    if rank == 1:
        time.sleep(0.5)
    entered = time.time()
    store_barrier("test/store-barrier")
    with open(f"{out}.{rank}", "w") as handle:
        json.dump({"entered": entered, "left": time.time()}, handle)
    leave_group()  # both barriers, then the group is gone
    assert not dist.is_initialized()
