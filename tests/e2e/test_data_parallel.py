"""Data-parallel training (FSDP2, gloo on the CPU): two ranks reproduce one process's update."""

from __future__ import annotations

import pytest

from tests.conftest import wall_clock
import torch
import torch.multiprocessing as mp

from src.batch import Batch
from src.distributed.data_parallel import DataParallelTrainer, shard_batch, split_to
from src.loss.base import Objective
from src.loss.reducer import Reducer
from src.loss.trainer import Trainer
from src.policy.forward import Forward
from tests import data_parallel_ranks as ranks

FP32 = {"rtol": 1e-5, "atol": 1e-6}  # fp32 rounding: the ranks sum the same terms in other micro-batches
GRADIENTS = {"rtol": 1e-4, "atol": 1e-5}  # sums of ~100 terms of size ~1 each, in another order
# loss=grpo's 5 optimizer steps: each step's fp32 rounding (other micro-batches) moves the weights the next
# mini-batch's numbers are computed with; a row in the wrong mini-batch is off by far more (e.g. 1e-2)
STEPS = {"rtol": 1e-4, "atol": 1e-5}


def test_micro_batches_split_to_a_count_while_rows_last():
    assert split_to([[0, 1, 2], [3, 4]], 4) == [[0], [1], [2], [3, 4]]  # the first largest halves first
    assert split_to([[0, 1, 2]], 1) == [[0, 1, 2]]
    assert split_to([[0], [1]], 3) is None


def test_shards_keep_groups_whole_and_concatenate_back_in_row_order():
    batch = ranks.tiny_batch(ranks.tiny_policy()[0], pad_id=0)
    shards = [shard_batch(batch, rank, 3) for rank in range(3)]
    assert [len(shard) for shard in shards] == [3, 2, 2]
    assert [entry for shard in shards for entry in shard.entries] == batch.entries
    with pytest.raises(ValueError, match="trainer.groups_per_step to at least 8"):
        shard_batch(batch, 0, 8)


def test_any_loss_is_wrapped_with_rank_aware_micro_batches():
    class NewLoss(Objective):  # a researcher's loss: the shared trainer splits it over ranks as it is
        pass

    loss, reducer = NewLoss(), Reducer()
    wrapped = DataParallelTrainer(Trainer(loss, Forward(0, 4, fused=True)), reducer=reducer)
    assert wrapped.reducer is reducer and wrapped.forward.inner.micro_batch_size == 4
    assert vars(loss).keys() == vars(NewLoss()).keys()  # the trainer lends its reducer to `fix`, writes nothing
    assert wrapped.forward.fused  # the fused head runs through the sharded model's own forward


@pytest.mark.slow  # two spawned ranks load torch and transformers
def test_each_rank_samples_its_share_and_every_rank_holds_the_whole_call_in_order(tmp_path):
    """`RankShare`: rank r samples its block of the prompts with their places in the whole call, the blocks come
    back in prompt order on every rank, and a weight sync hands the engine whole tensors of the sharded policy."""
    from tests import data_parallel_ranks as ranks

    out = tmp_path / "shared.pt"
    mp.spawn(ranks.shared_generation, args=(2, str(tmp_path / "rendezvous"), str(out)), nprocs=2)
    got = torch.load(out, weights_only=False)  # this test's own file
    whole = ranks.CountingEngine().generate([f"prompt {i}" for i in range(7)], 2, None, seed=5)
    assert got["generation"] == whole  # sample for sample, as one process would have sampled them
    assert got["counts"] == [8, 6]  # prompts 0-3 and 4-6, two samples each: each rank its share
    policy, _ = ranks.tiny_policy()
    assert got["synced"].keys() == dict(policy.named_parameters()).keys()
    for name, tensor in policy.named_parameters():
        assert torch.equal(got["synced"][name], tensor.detach()), name  # gathered whole, not a shard


@pytest.mark.slow  # two spawned ranks load torch and transformers: ~20 s alone, ~50 s on a busy 2-core box
def test_two_ranks_give_one_process_loss_gradients_and_weights(tmp_path):
    """7 groups on 2 ranks (4 + 3 groups), replayed rows clipped and unclipped; FSDP streaming (micro-batches
    split to match across ranks) and gathered (they cannot be).

    The control run normalises each rank's loss by its own shard: its gradients are off, so the test
    would fail without the cross-rank totals."""
    plain = ranks.plain_update()
    out = tmp_path / "ranks.pt"
    mp.spawn(ranks.sharded_updates, args=(2, str(tmp_path / "rendezvous"), str(out)), nprocs=2)
    runs = torch.load(out, weights_only=False)  # written by this test's own ranks
    want = plain
    assert (want["result"].weights == ranks.CLIP).any() and (want["result"].weights < 1).any()
    assert not torch.equal(want["weights"]["model.norm.weight"], ranks.tiny_policy()[0].model.norm.weight)
    assert not runs["streaming"]["gathered"] and runs["gathered"]["gathered"]
    for got in (runs["streaming"], runs["gathered"]):
        for key in ("loss", "policy_loss", "kl", "entropy"):
            assert getattr(got["result"], key) == pytest.approx(getattr(want["result"], key), rel=1e-5), key
        for key in ("logprobs", "raw_weights", "weights", "kl_sums", "token_counts"):
            torch.testing.assert_close(getattr(got["result"], key), getattr(want["result"], key), **FP32)
        assert got["grads"].keys() == want["grads"].keys()
        for name in want["grads"]:
            torch.testing.assert_close(got["grads"][name], want["grads"][name], **GRADIENTS)
            torch.testing.assert_close(got["weights"][name], want["weights"][name], **FP32)

    control = runs["local_totals"]
    assert control["result"].loss != pytest.approx(want["result"].loss, rel=1e-3)
    off = max((control["grads"][n] - want["grads"][n]).abs().max().item() for n in want["grads"])
    assert off > 1e-2


@pytest.mark.slow  # two spawned ranks: ~20 s alone
def test_two_ranks_train_grpo_ipo_and_a_loss_outside_src_as_one_process(tmp_path):
    """loss=grpo (5 interleaved mini-batches, so each takes rows from both ranks' shards; streaming and
    gathered), loss=ipo (pairs within groups, the mean over the whole batch's pairs) and the outside RLOO
    copy on 2 ranks give one process's losses, diagnostics, per-row numbers and updated weights."""
    out = tmp_path / "ranks.pt"
    mp.spawn(ranks.other_losses, args=(2, str(tmp_path / "rendezvous"), str(out)), nprocs=2)
    runs = torch.load(out, weights_only=False)  # written by this test's own ranks
    assert "loss.updates_per_step=10: every data-parallel rank needs at least 10 responses" in runs["refused"]
    assert runs["grpo-gathered"]["gathered"] and not runs["grpo"]["gathered"]
    for name, loss in (("grpo", "grpo"), ("grpo-gathered", "grpo"), ("ipo", "ipo")):
        want, got = ranks.plain_update(loss), runs[name]
        assert want["result"].extras.keys() == got["result"].extras.keys() and want["result"].extras, name
        for key, value in want["result"].extras.items():
            assert got["result"].extras[key] == pytest.approx(value, rel=1e-4, abs=1e-6), (name, key)
        for key in ("loss", "policy_loss", "kl", "entropy"):
            assert getattr(got["result"], key) == pytest.approx(getattr(want["result"], key), rel=1e-4), (name, key)
        for key in ("logprobs", "raw_weights", "weights", "kl_sums", "token_counts"):
            torch.testing.assert_close(getattr(got["result"], key), getattr(want["result"], key), **STEPS,
                                       msg=lambda m, key=key, name=name: f"{name} {key}: {m}")
        assert got["result"].optimizer_steps == want["result"].optimizer_steps
        for parameter in want["weights"]:
            torch.testing.assert_close(got["weights"][parameter], want["weights"][parameter], **STEPS)
    assert ranks.plain_update("grpo")["result"].extras["grpo/behaviour_cap_frac"] > 0  # the cap acted
    assert ranks.plain_update("ipo")["result"].extras["ipo/pairs"] > 0
    # The outside RLOO copy, which no file in src/ names, on 2 ranks trains as the original in one process; so
    # does RLOO with the fused head (trainer.fused_logprobs), its gradients included.
    for name, want in (("rloocopy", ranks.plain_update("rloo")), ("rloo-fused", ranks.plain_update(fused=True))):
        got = runs[name]
        for key in ("loss", "policy_loss", "kl", "entropy"):
            assert getattr(got["result"], key) == pytest.approx(getattr(want["result"], key), rel=1e-5), (name, key)
        for key in ("logprobs", "raw_weights", "weights", "kl_sums", "token_counts"):
            torch.testing.assert_close(getattr(got["result"], key), getattr(want["result"], key), **FP32)
        for parameter in want["weights"]:
            torch.testing.assert_close(got["grads"][parameter], want["grads"][parameter], **GRADIENTS)
            torch.testing.assert_close(got["weights"][parameter], want["weights"][parameter], **FP32)
    fused, plain = ranks.plain_update(fused=True), ranks.plain_update()
    assert fused["result"].loss == pytest.approx(plain["result"].loss, rel=1e-5)  # the same loss, by another head


def assert_same_state(got: dict, want: dict) -> None:
    assert got["policy"].keys() == want["policy"].keys()
    for name, tensor in want["policy"].items():
        torch.testing.assert_close(got["policy"][name], tensor, rtol=0, atol=0)
    assert got["optimizer"].keys() == want["optimizer"].keys()
    for name, moments in want["optimizer"].items():
        for key in ("step", "exp_avg", "exp_avg_sq"):
            torch.testing.assert_close(got["optimizer"][name][key], moments[key], rtol=0, atol=0)


@pytest.mark.slow  # two spawned ranks, as above
def test_sharded_checkpoint_moves_between_two_ranks_and_one(tmp_path):
    """Saved by 2 ranks, loaded by one process; saved by one process (as DCP shards or as whole state dicts),
    loaded by 2 ranks: bit for bit."""
    from src.distributed.checkpoint import load_sharded, save_sharded

    policy, optimizer = ranks.trained(shard=False)
    save_sharded(tmp_path / "by-one", policy, optimizer)
    torch.save({"policy": policy.state_dict(), "optimizer": optimizer.state_dict()}, tmp_path / "whole.pt")
    one = ranks.full_state(policy, optimizer)
    mp.spawn(ranks.checkpoint_ranks, args=(2, str(tmp_path / "rendezvous"), str(tmp_path)), nprocs=2)
    two = torch.load(tmp_path / "ranks.pt", weights_only=True)

    assert_same_state(two["loaded"], one)          # one process -> 2 ranks
    assert_same_state(two["loaded_whole"], one)    # one process's whole tensors (its checkpoint.pt) -> 2 ranks
    policy, optimizer = ranks.fresh(shard=False)
    load_sharded(tmp_path / "by-ranks", policy, optimizer)
    assert_same_state(ranks.full_state(policy, optimizer), two["saved"])  # 2 ranks -> one process
    # Bit-for-bit matters: both runs trained on one batch and agree to fp32 rounding only, so a checkpoint
    # that did not load (or loaded the wrong folder) is told apart; training moved the weights off the start.
    assert not torch.equal(two["saved"]["policy"]["model.norm.weight"], ranks.fresh(False)[0].model.norm.weight)


def test_loading_a_folder_without_a_sharded_checkpoint_names_it(tmp_path):
    from src.distributed.checkpoint import load_sharded

    with pytest.raises(FileNotFoundError, match=f"{tmp_path} holds no sharded checkpoint"):
        load_sharded(tmp_path, *ranks.fresh(shard=False))


def test_no_rank_leaves_the_store_barrier_before_the_last_one_enters_it(tmp_path):
    """`store_barrier` (the second wait of `leave_group`, through the rendezvous store rather than gloo): rank 0,
    half a second early, leaves only after rank 1 has entered."""
    import json

    import torch.multiprocessing as mp

    mp.spawn(ranks.store_barrier_ranks, args=(2, str(tmp_path / "rendezvous"), str(tmp_path / "times")), nprocs=2)
    first, last = (json.loads((tmp_path / f"times.{rank}").read_text()) for rank in (0, 1))
    assert last["entered"] - first["entered"] > 0.4 and first["left"] >= last["entered"]


def launch_failure(stderr: str) -> str:
    """What a failed launch printed: the ranks' own last words (a Python traceback, or the stacks faulthandler prints
    for an abort) before torchrun's summary of which rank died, since the summary alone fills the last 2,000 chars."""
    ranks, _, summary = stderr.partition("Traceback (most recent call last):\n  File \"<frozen runpy>\"")
    return f"{ranks[-6000:]}\n--- torchrun's summary ---\n{summary[-1500:]}"


STEP_SETTINGS = ("trainer.groups_per_step=4", "trainer.group_size=4", "policy.max_new_tokens=24",
                 "trainer.micro_batch_size=3", "trainer.learning_rate=1e-3", "trainer.kl_coef=0.05",
                 "trainer.entropy_coef=0.01", "hardware.threads=1", "buffer=age1")


@pytest.mark.slow  # torchrun starts two ranks: ~20 s a loss
@pytest.mark.parametrize("loss, dtype, rel, extra", [
    pytest.param("rloo", "float32", 1e-5, (), marks=pytest.mark.long),
    pytest.param("ipo", "float32", 1e-5, (), marks=pytest.mark.long),
    # grpo's 4 optimizer steps a step carry fp32 rounding into the next (4e-5 by step 3): float64 shows the sums
    pytest.param("grpo", "float64", 1e-9, (), marks=pytest.mark.long),
    ("rloo", "float64", 1e-9, ("trainer.fused_logprobs=true",))])  # the fused head through the sharded forward
def test_torchrun_two_ranks_train_steps_with_the_one_process_numbers(tmp_path, loss, dtype, rel, extra):
    """Three steps of `train_step` (generate, score, replay at rho=1, update) under torchrun with 2 ranks give
    every metric of one process's run (the loss's own diagnostics included), timings aside."""
    import json
    import math
    import subprocess
    import sys

    from src.paths import PROJECT_ROOT

    script = str(PROJECT_ROOT / "tests" / "data_parallel_steps.py")
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2"]
    for name, launcher in (("one", [sys.executable]), ("two", torchrun)):
        done = subprocess.run([*launcher, script, str(tmp_path / f"{name}.json"), "3", *STEP_SETTINGS, f"loss={loss}",
                               f"hardware.dtype={dtype}", *extra],
                              cwd=PROJECT_ROOT, capture_output=True, text=True, timeout=300)
        assert done.returncode == 0, launch_failure(done.stderr)
    one, two = (json.loads((tmp_path / f"{name}.json").read_text()) for name in ("one", "two"))
    assert len(one) == len(two) == 3 and one[1]["batch/replay_groups"] == 2
    for want, got in zip(one, two):
        assert want.keys() == got.keys()
        for key, value in want.items():
            if wall_clock(key):
                continue
            if isinstance(value, float) and math.isnan(value):  # e.g. the replay ratio of a step with no replay
                assert math.isnan(got[key]), key
            else:
                assert got[key] == pytest.approx(value, rel=rel, abs=rel / 10), key
