"""ZIP-RC-Lite (seed 004 3.2, B.5): the reserved slice, labels, offline metrics, meta-policies, live decoder, pipeline."""

from __future__ import annotations

import json
import math

import mlflow
import numpy as np
import pytest
import torch

from src.policy.model import load_policy
from src.task import countdown
from src.ziprc import metrics
from src.ziprc.data import Rollout, label, position_targets
from src.ziprc.decode import (ABANDONED, FINISHED, MetaPolicy, decode_all, decide, run_decode, stop_token_ids,
                              utility)
from src.ziprc.head import (PAPER_LENGTH_EDGES, QWEN25_RESERVED_START, ReservedSliceHead, SliceSpec, joint_index,
                            length_bin, make_spec, reward_state, value_and_length)
from tests.conftest import TINY_CHECKPOINT


# --------------------------------------------------------------------------- the slice
def test_bins_states_and_the_flattened_index():
    edges = PAPER_LENGTH_EDGES
    assert [length_bin(n, edges) for n in (0, 15, 16, 31, 32, 1023, 1024, 5000)] == [0, 0, 1, 1, 2, 6, 6, 6]
    assert [reward_state(r, (0.0, 1.0)) for r in (0.0, 0.1, 1.0)] == [0, 0, 1]
    assert [reward_state(r, (0.0, 0.1, 1.0)) for r in (0.0, 0.1, 1.0)] == [0, 1, 2]
    assert joint_index(1, 3, 7) == 10 and joint_index(2, 0, 7) == 14  # idx = length bin + state x L
    spec = make_spec(201, None, "structured", edges)
    assert (spec.R, spec.L, spec.size, spec.start) == (3, 7, 21, 201)
    assert make_spec(151_936, QWEN25_RESERVED_START, "binary", edges).ids == range(151_665, 151_679)


def test_value_and_expected_length_hand_worked():
    # R = 2, L = 2 (edges 0, 16, 32: midpoints 8, 24). Joint [[0.1, 0.2], [0.3, 0.4]] (row = reward state).
    spec = SliceSpec(0, (0.0, 1.0), (0, 16, 32))
    logits = torch.log(torch.tensor([0.1, 0.2, 0.3, 0.4]))
    value, length = value_and_length(logits, spec)
    assert value.item() == pytest.approx(0.7)  # P(state 1) = 0.3 + 0.4
    assert length.item() == pytest.approx(0.4 * 8 + 0.6 * 24)  # P(bin 0) = 0.1 + 0.3


@pytest.fixture(scope="module")
def tiny():
    return load_policy(str(TINY_CHECKPOINT))


def test_the_head_never_changes_the_backbones_next_token_distribution(tiny):
    policy, tokenizer = tiny
    vocab = len(tokenizer)
    embeddings = policy.get_input_embeddings().weight.detach().clone()
    head = ReservedSliceHead(policy, make_spec(vocab, None, "binary", PAPER_LENGTH_EDGES))
    assert head.spec.ids == range(vocab, vocab + 14)  # appended: no real token changes its id
    assert head.slice.weight.data_ptr() != policy.get_output_embeddings().weight.data_ptr()
    # Train the slice hard, so it is far from its initial zeros.
    optimizer = torch.optim.AdamW([p for p in head.parameters() if p.requires_grad], lr=0.1)
    ids = torch.tensor([tokenizer(countdown.format_prompt(countdown.Instance((1, 2, 3), 6)))["input_ids"]])
    for _ in range(5):
        _, slice_logits, _ = head(ids)
        loss = torch.nn.functional.cross_entropy(slice_logits[0], torch.full((ids.shape[1],), 3))
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    assert [n for n, p in head.named_parameters() if p.requires_grad] == ["slice.weight"]
    assert head.slice.weight.abs().sum() > 0
    torch.testing.assert_close(policy.get_input_embeddings().weight, embeddings, rtol=0, atol=0)
    with torch.no_grad():
        expected = policy(input_ids=ids).logits
        logits, slice_logits, _ = head(ids)
    assert expected.dtype == torch.float32 and logits.shape[-1] == vocab + 14
    assert torch.equal(logits[..., :vocab], expected)  # bit for bit
    assert torch.equal(torch.softmax(logits[..., :vocab], -1), torch.softmax(expected, -1))
    assert torch.equal(logits[..., vocab:], slice_logits)


def test_a_slice_inside_the_vocabulary_is_cloned_and_leaves_the_other_ids_alone(random_policy_dir):
    """The Qwen2.5 layout: unused rows inside the vocabulary, the slice cloned from them (untied)."""
    from src.policy.model import build_tiny_model
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(random_policy_dir)
    real = len(tokenizer)
    policy = build_tiny_model(tokenizer, hidden_size=32, layers=1, heads=2, kv_heads=1)
    policy.resize_token_embeddings(real + 20)  # 20 unused rows, as Qwen2.5 has 271
    head = ReservedSliceHead(policy, make_spec(real + 20, real + 2, "binary", (0, 16, 32, 64)))  # ids real+2..real+7
    ids = torch.tensor([[5, 9, 12, 7]])
    start, end = real + 2, real + 8
    with torch.no_grad():
        expected = policy(input_ids=ids).logits
        logits, _, _ = head(ids)
        # The clone starts where the rows were (its own, smaller matmul may round the last bit differently).
        torch.testing.assert_close(logits[..., start:end], expected[..., start:end])
        head.slice.weight.add_(1.0)
        logits, _, _ = head(ids)
    assert torch.equal(logits[..., :start], expected[..., :start])
    assert torch.equal(logits[..., end:], expected[..., end:])
    assert not torch.equal(logits[..., start:end], expected[..., start:end])
    assert policy.get_output_embeddings().weight.grad is None


def test_head_round_trips_through_safetensors_and_json(tiny, tmp_path):
    policy, tokenizer = tiny
    head = ReservedSliceHead(policy, make_spec(len(tokenizer), None, "structured", PAPER_LENGTH_EDGES))
    with torch.no_grad():
        head.slice.weight.normal_()
    head.save(tmp_path)
    again = ReservedSliceHead.load(policy, tmp_path)
    assert again.spec == head.spec and torch.equal(again.slice.weight, head.slice.weight)
    assert json.loads((tmp_path / "head.json").read_text())["reward_values"] == [0.0, 0.1, 1.0]


# --------------------------------------------------------------------------- labels and offline metrics
def test_labels_and_per_position_targets():
    task = countdown.CountdownTask()
    rollout = label(Rollout("train", 0, {"numbers": [1, 2, 3], "target": 6}, (7, 8), tuple(range(20)),
                            " </think> <answer> 1 + 2 + 3 </answer>"), task)
    assert (rollout.reward, rollout.reason) == (1.0, "correct")
    spec = SliceSpec(300, (0.0, 1.0), (0, 16, 32))
    targets = position_targets(rollout, spec).tolist()
    # 20 response tokens: 21 positions with 20, 19, ..., 0 tokens left; >= 16 left is bin 1, state 1 -> 1 + 2 = 3.
    assert len(targets) == 21 and targets[:5] == [3] * 5 and targets[5:] == [2] * 16
    wrong = label(Rollout("train", 0, {"numbers": [1, 2, 3], "target": 6}, (7,), (1, 2), "<answer> 1 + 2 </answer>"),
                  task)
    assert wrong.reward == 0.1 and position_targets(wrong, spec).tolist() == [0, 0, 0]
    with pytest.raises(ValueError, match="not labelled"):
        position_targets(Rollout("train", 0, {"numbers": [1], "target": 1}, (1,), (1,), ""), spec)


def test_offline_metrics_hand_worked():
    assert metrics.auc([0.9, 0.8, 0.3, 0.8], [True, True, False, False]) == pytest.approx((2 + 1.5) / 4)
    assert math.isnan(metrics.auc([0.1, 0.2], [True, True]))
    f1, accuracy = metrics.f1_and_accuracy([True, True, False, False], [True, False, True, False])
    assert f1 == pytest.approx(0.5) and accuracy == 0.5
    # predicted [0.5, 0.5, 0, 0]; observed cells [0, 2, 2, 2] -> empirical [0.25, 0, 0.75, 0]
    assert metrics.total_variation(np.array([0.5, 0.5, 0, 0]), [0, 2, 2, 2]) == pytest.approx(0.75)
    assert metrics.value_end([0.1] * 10 + [0.5] * 16) == pytest.approx(0.5)
    assert metrics.value_end([0.2, 0.4]) == pytest.approx(0.3)


def test_adaptive_k_gives_hard_prompts_more_samples_on_the_same_budget():
    values = [0.9, 0.1, 0.5, 0.3, 0.7]  # low V-hat(x) = predicted hard
    assert metrics.percentile_ranks(values).tolist() == [1.0, 0.0, 0.5, 0.25, 0.75]
    allocation = metrics.adaptive_k(values, mean_k=8, spread=0.5)
    assert sum(allocation) == 40
    assert allocation == [4, 12, 8, 10, 6]  # weights 1 + 0.5 (1 - 2r): 0.5, 1.5, 1, 1.25, 0.75 of 8
    assert metrics.adaptive_k(values, mean_k=8, spread=0.0) == [8] * 5
    assert metrics.percentile_ranks([2.0, 2.0, 1.0]).tolist() == [0.75, 0.75, 0.0]  # ties share a rank


# --------------------------------------------------------------------------- meta-policies on a hand-made trace
def trace_step(values, lengths):
    """A step function reading one prompt's hand-made value trace: values[j][t] after step t + 1."""
    def step(states):
        state = states[0]
        t = state.latency  # steps taken so far, this one included
        out = [values[j][min(t - 1, len(values[j]) - 1)] for j in range(state.k)]
        return [(out, [0.0] * state.k, [t >= lengths[j] for j in range(state.k)])]
    return step


# Three samples; their lengths (decode steps to finish) and V-hat after each step (prompt value 0.4).
VALUES = [[0.6, 0.7, 0.8, 0.9, 0.9, 0.9],   # a winner, 6 steps
          [0.3, 0.2, 0.1, 0.1],             # a loser, 4 steps
          [0.5, 0.4, 0.3, 0.3, 0.2, 0.2, 0.2, 0.2]]  # a slow loser, 8 steps
LENGTHS = [6, 4, 8]


def decode_trace(policy, values=VALUES, lengths=LENGTHS, rng=None):
    k = len(values)
    return run_decode(k, [([0.4] * k, [10.0] * k)], trace_step(values, lengths), policy, max_steps=100, rng=rng)[0]


def test_best_of_n_cost_and_latency_hand_worked():
    result = decode_trace(MetaPolicy("none"))
    # Active samples per step: 3, 3, 3, 3 (sample 1 finishes at step 4), 2, 2 (sample 0 at 6), 1, 1 -> 18,
    # plus the prompt encoding shared by all: cost 19. Latency: 8 steps (the slowest sample).
    assert (result.cost, result.latency) == (19, 8)
    assert result.status == (FINISHED,) * 3
    # value_end = mean of the whole (short) trace incl. the prompt value; sample 0 is selected.
    assert result.value_ends[0] == pytest.approx((0.4 + 0.6 + 0.7 + 0.8 + 0.9 * 3) / 7)
    assert result.selected == 0


def test_prune_abandons_predicted_losers_after_warmup_keeping_k_min():
    # warm-up 2, every 2 steps, window 1: at step 2 sample 1 (0.2) and sample 2 (0.4) are < 0.5;
    # k_min = 2 keeps the better one of them (sample 2) and abandons sample 1. At step 4 only 2 remain.
    result = decode_trace(MetaPolicy("prune", warmup=2, interval=2, k_min=2, window=1))
    assert result.status == (FINISHED, ABANDONED, FINISHED) and result.abandoned_at == (None, 2, None)
    # active: 3, 3, then 2 x 4 (steps 3-6), then 1 x 2 (steps 7-8) -> 16 + 1 = 17; latency unchanged at 8
    assert (result.cost, result.latency) == (17, 8)
    # k_min = 1: both losers go at step 2; the winner alone: 3 + 3 + 1 x 4 = 10 + 1, latency 6
    alone = decode_trace(MetaPolicy("prune", warmup=2, interval=2, k_min=1, window=1))
    assert alone.status == (FINISHED, ABANDONED, ABANDONED) and (alone.cost, alone.latency) == (11, 6)
    # before the warm-up nothing is pruned: warm-up 9 is beyond the longest sample
    assert decode_trace(MetaPolicy("prune", warmup=9, interval=1, k_min=1)).status == (FINISHED,) * 3


def test_early_stop_commits_when_the_smoothed_best_crosses_tau():
    # window 2: sample 0's smoothed value is (0.4+0.6)/2 = 0.5 after step 1, 0.65 after 2, 0.75 after 3, 0.85 after 4
    result = decode_trace(MetaPolicy("early_stop", tau=0.8, window=2))
    assert result.abandoned_at == (None, None, 4) and result.status == (FINISHED, FINISHED, ABANDONED)
    # sample 1 finished at step 4 before the decision (a finished sample stays a candidate): 3 x 4 + 1 x 2 + 1
    assert (result.cost, result.latency) == (15, 6) and result.selected == 0
    never = decode_trace(MetaPolicy("early_stop", tau=0.95, window=2))
    assert never.status == (FINISHED,) * 3 and never.cost == 19


def test_utility_rule_hand_worked():
    # U(S) = 1 - prod(1 - v) - beta sum l / l_max - gamma max l / l_max
    assert utility([0.5, 0.5], [10, 30], beta=0.01, gamma=0.1, max_length=100) == pytest.approx(
        0.75 - 0.01 * 0.4 - 0.1 * 0.3)
    from src.ziprc.decode import DecodeState
    state = DecodeState(3)
    state.values = [[0.9], [0.1], [0.5]]
    state.remaining = [50.0, 50.0, 50.0]
    # Dropping j changes U by -(v_j prod_{i != j}(1 - v_i)) + beta * 0.5: sample 1: -0.1 * 0.1 * 0.5 = -0.005,
    # sample 2: -0.5 * 0.1 * 0.9 = -0.045, sample 0: -0.9 * 0.45 = -0.405. beta = 0.02 saves 0.01 per sample:
    # only dropping sample 1 gains (+0.005); after it, dropping sample 2 would cost 0.05 - 0.01 > 0: stop.
    policy = MetaPolicy("utility", beta=0.02, warmup=0, interval=1, k_min=1, window=1, max_length=100)
    assert decide(policy, state, step=1) == [1]
    state.status[1] = ABANDONED
    assert decide(policy, state, step=2) == []
    # a tiny beta keeps everything; a huge one drops all but k_min, the least valuable first
    state = DecodeState(3)
    state.values, state.remaining = [[0.9], [0.1], [0.5]], [50.0] * 3
    assert decide(MetaPolicy("utility", beta=0.0001, warmup=0, interval=1, k_min=1, window=1), state, 1) == []
    assert decide(MetaPolicy("utility", beta=10, warmup=0, interval=1, k_min=1, window=1), state, 1) == [1, 2]


def test_always_prune_abandons_down_to_k_min_whatever_v_hat_says():
    # One decision, after step 1 (window 1): sample 0 at 0.6, sample 1 at 0.3, sample 2 at 0.5. The paper's rule
    # abandons the predicted loser only; the always-prune control (threshold None) goes down to k_min = 1.
    schedule = dict(warmup=1, interval=100, k_min=1, window=1)
    paper = decode_trace(MetaPolicy("prune", **schedule))
    assert paper.abandoned_at == (None, 1, None)
    always = decode_trace(MetaPolicy("prune", threshold=None, **schedule))
    assert always.abandoned_at == (None, 1, 1) and always.selected == 0
    assert decode_trace(MetaPolicy("prune", threshold=0.55, **schedule)).abandoned_at == (None, 1, 1)


def test_the_random_value_control_keeps_the_level_but_not_which_sample_is_which():
    """Same numbers, reassigned at random: always-prune still abandons two of three samples at step 1, but which
    two now varies with the seed, and the winner (sample 0) is sometimes among them; with the head, never."""
    import random

    from src.ziprc.decode import signal

    policy = MetaPolicy("prune", threshold=None, warmup=1, interval=100, k_min=1, window=1, values="random")
    shuffled = signal(policy, [0, 1, 2], lambda j: [0.6, 0.3, 0.5][j], random.Random(3))
    assert sorted(shuffled.values()) == [0.3, 0.5, 0.6]
    results = [decode_trace(policy, rng=random.Random(seed)) for seed in range(20)]
    assert all(sum(step is not None for step in r.abandoned_at) == 2 for r in results)
    assert {r.abandoned_at.index(None) for r in results} == {0, 1, 2}  # each sample survives in some seed
    head = MetaPolicy("prune", threshold=None, warmup=1, interval=100, k_min=1, window=1)
    assert {decode_trace(head, rng=random.Random(seed)).abandoned_at for seed in range(5)} == {(None, 1, 1)}


def test_early_stop_answers_with_the_committed_sample_or_the_best_finished_one():
    # Sample 0 finishes at step 1 (value_end 0.65); sample 1's value reaches tau = 0.6 at step 2, so early stop
    # commits to it (value_end 0.6) and abandons sample 2. l.116 ("commit to it"): sample 1 answers. l.123 (the
    # best finished value_end): sample 0, which finished before the commit.
    values = [[0.9], [0.5, 0.7, 0.7, 0.7], [0.1] * 9]
    lengths = [1, 4, 9]
    committed = decode_trace(MetaPolicy("early_stop", tau=0.6, window=1), values, lengths)
    assert committed.abandoned_at == (None, None, 2) and committed.selected == 1
    best = decode_trace(MetaPolicy("early_stop", tau=0.6, window=1, answer="best_finished"), values, lengths)
    assert best.status == committed.status and best.cost == committed.cost and best.selected == 0
    assert best.value_ends[0] > best.value_ends[1]


def test_unknown_meta_policy_is_refused():
    with pytest.raises(ValueError, match="choose one of none, prune, early_stop, utility"):
        MetaPolicy("greedy")


def test_best_of_n_is_the_exact_mean_over_every_subset():
    from itertools import combinations

    ends, correct, lengths = [0.3, 0.9, 0.3, 0.1, 0.7], [True, False, False, True, True], [10, 30, 20, 40, 25]
    for n in range(1, 6):
        subsets = list(combinations(range(5), n))
        answers = [max(subset, key=lambda j: ends[j]) for subset in subsets]  # ties: the lower index, as max
        expected = (np.mean([correct[j] for j in answers]), np.mean([1 + sum(lengths[j] for j in s) for s in subsets]),
                    np.mean([max(lengths[j] for j in s) for s in subsets]))
        assert metrics.best_of_n(ends, correct, lengths, n) == pytest.approx(expected)
    assert metrics.best_of_n(ends, correct, lengths, 1)[0] == pytest.approx(0.6)  # n = 1: the mean outcome
    with pytest.raises(ValueError, match="1 <= n <= K"):
        metrics.best_of_n(ends, correct, lengths, 6)


def test_matched_cost_reads_the_best_of_n_frontier():
    curve = [(10.0, 0.2), (20.0, 0.4), (30.0, 0.35), (40.0, 0.5)]  # n = 3 is dominated by n = 2
    assert metrics.matched_cost(curve, 0.3) == pytest.approx(15.0)  # halfway from n = 1 to n = 2
    assert metrics.matched_cost(curve, 0.45) == pytest.approx(30.0)  # halfway from n = 2 to n = 4
    assert metrics.matched_cost(curve, 0.1) == 10.0  # no fewer than one sample
    assert math.isnan(metrics.matched_cost(curve, 0.6))  # more accurate than every n


# --------------------------------------------------------------------------- the live decoder
def test_the_live_decoder_never_emits_a_reserved_token(tiny):
    policy, tokenizer = tiny
    head = ReservedSliceHead(policy, make_spec(len(tokenizer), None, "binary", PAPER_LENGTH_EDGES))
    with torch.no_grad():  # reserved logits far above every real one: unmasked sampling would pick them
        head.slice.weight.copy_(policy.get_output_embeddings().weight[:14] * 50)
    prompts = [tokenizer(countdown.format_prompt(inst))["input_ids"] for inst in countdown.generate_instances(3, 5)]
    with torch.no_grad():
        logits, _, _ = head(torch.tensor([prompts[0]]))
    assert logits[0, -1].argmax().item() in head.spec.ids
    decoded = decode_all(head, tokenizer, prompts, 4, MetaPolicy("none"), seed=0, temperature=1.0, top_p=1.0,
                         top_k=None, max_new_tokens=12)
    emitted = [token for item in decoded for ids in item.response_ids for token in ids]
    assert emitted and not set(emitted) & set(head.spec.ids)
    assert all(len(ids) <= 12 for item in decoded for ids in item.response_ids)


def test_live_pruning_keeps_the_surviving_samples_and_counts_only_active_passes(tiny):
    """Abandoned samples ride in the batch but change nothing for the others, and stop costing."""
    policy, tokenizer = tiny
    head = ReservedSliceHead(policy, make_spec(len(tokenizer), None, "binary", PAPER_LENGTH_EDGES))
    prompts = [tokenizer(countdown.format_prompt(inst))["input_ids"] for inst in countdown.generate_instances(2, 9)]
    run = lambda policy: decode_all(head, tokenizer, prompts, 4, policy, seed=3, temperature=1.0, top_p=1.0,
                                    top_k=None, max_new_tokens=30)
    full = run(MetaPolicy("none"))
    # An untrained head predicts V = 0.5 everywhere (zero logits): tau = 0.5 commits at the first step.
    committed = run(MetaPolicy("early_stop", tau=0.5, window=1))
    for a, b in zip(full, committed):
        keep = b.result.selected
        assert b.result.status.count(ABANDONED) == 3 and a.response_ids[keep] == b.response_ids[keep]
        assert b.result.cost == 1 + 4 + (len(b.response_ids[keep]) - 1)
        assert a.result.cost == 1 + sum(len(ids) for ids in a.response_ids)
        assert a.result.latency == max(len(ids) for ids in a.response_ids)


def test_stop_tokens_include_the_chat_turn_end(tiny):
    _, tokenizer = tiny
    assert stop_token_ids(tokenizer) == {tokenizer.eos_token_id}


# --------------------------------------------------------------------------- the pipeline
@pytest.mark.slow
@pytest.mark.long  # make test-long (docs/testing.md): the suite runs make ziprc
def test_every_stage_runs_end_to_end_on_the_tiny_policy_and_logs_to_mlflow(tmp_path):
    from src.ziprc.pipeline import main

    uri = f"sqlite:///{tmp_path}/mlruns.db"
    common = [f"ziprc.workdir={tmp_path}/work", f"ziprc.report_dir={tmp_path}/report", f"tracking.uri={uri}", f"tracking.artifact_location={tmp_path}/art",
              "ziprc.collect.train_prompts=12", "ziprc.collect.calibration_prompts=3",
              "ziprc.collect.calibration_samples=16", "ziprc.decode.prompts=4", "ziprc.decode.tune_prompts=3",
              "ziprc.decode.seeds=[0,1]",
              "ziprc.decode.policies=[{kind:none},{kind:prune},{kind:early_stop,tau:0.5},{kind:utility,beta:0.05}]",
              "policy.max_new_tokens=24", "hardware.threads=1"]
    assert main(["all", *common]) == 0
    runs = mlflow.search_runs(experiment_names=["ziprc"])
    stages = runs["tags.ziprc.stage"].tolist()
    assert {"collect", "label", "train", "score", "decode", "report"} <= set(stages)
    assert stages.count("decode") == 1 + 4 * 2 * 2  # the stage and one run per meta-policy, split and seed
    decode = runs[runs["tags.ziprc.policy"].notna()]
    assert (decode["metrics.reserved_emitted"] == 0).all()
    none = decode[decode["tags.ziprc.policy"] == "none"]["metrics.cost"].mean()
    assert decode[decode["tags.ziprc.policy"] == "prune"]["metrics.cost"].mean() <= none
    score = json.loads((tmp_path / "work" / "score.json").read_text())
    assert 0 <= score["mean_total_variation"] <= 1 and score["prompts"] == 3
    lines = (tmp_path / "work" / "labelled.jsonl").read_text().splitlines()
    assert len(lines) == 12 * 4 + 3 * 16
    assert main(["decode", *common, "ziprc.decode.k_min=9"]) == 2  # refused before loading anything
    none = decode[decode["tags.ziprc.policy"] == "none"]
    assert set(none["tags.ziprc.split"]) == {"tune", "report"}
    # best-of-8 of the decode's 8 samples is the decode itself
    np.testing.assert_allclose(none["metrics.bon_cost_n8"], none["metrics.cost"])
    np.testing.assert_allclose(none["metrics.bon_latency_n8"], none["metrics.latency"])
    np.testing.assert_allclose(none["metrics.bon_accuracy_n8"], none["metrics.accuracy"])


def test_pareto_front_and_operating_points_relative_to_best_of_n():
    import pandas as pd

    from src.ziprc.report import operating_points, pareto_front

    # (cost, accuracy): B (40, 0.5) beats D (50, 0.4); A, B, C trade off.
    x, y = np.array([100.0, 40.0, 20.0, 50.0]), np.array([0.7, 0.5, 0.3, 0.4])
    assert pareto_front(x, y) == [2, 1, 0]
    runs = pd.DataFrame({"tags.ziprc.policy": ["none", "none", "prune", "prune"],
                         "tags.ziprc.kind": ["none", "none", "prune", "prune"],
                         "tags.ziprc.seed": ["0", "1", "0", "1"],
                         "metrics.accuracy": [0.6, 0.8, 0.5, 0.7], "metrics.cost": [100.0, 100.0, 30.0, 50.0],
                         "metrics.latency": [40.0, 60.0, 40.0, 40.0]})
    table = operating_points(runs).set_index("policy")
    assert table.loc["none", "accuracy"] == pytest.approx(0.7) and table.loc["none", "seeds"] == 2
    assert table.loc["prune", "cost_change"] == pytest.approx(40 / 100 - 1)  # -60 %
    assert table.loc["prune", "latency_change"] == pytest.approx(40 / 50 - 1)
    assert table.loc["prune", "accuracy_change"] == pytest.approx(-0.1)
    assert table.loc["prune", "cost_std"] == pytest.approx(np.std([30, 50], ddof=1))


def _run(policy, kind, split, seed, accuracy, cost, values="head", **extra):
    return {"tags.ziprc.policy": policy, "tags.ziprc.kind": kind, "tags.ziprc.split": split,
            "tags.ziprc.values": values, "tags.ziprc.seed": str(seed), "metrics.accuracy": accuracy,
            "metrics.cost": cost, "metrics.latency": 30.0, **extra}


def test_settings_are_chosen_on_the_tuning_prompts_and_reported_on_the_others():
    """The tune split picks prune V<0.2 (it saves most there); the report split's numbers are then read at that
    setting, against the report split's own best-of-n curve, with the random control beside it."""
    import pandas as pd

    from src.ziprc.report import best_of_n_curve, choose_on_tune, operating_points, with_matched_savings

    bon = {f"metrics.bon_{name}_n{n}": value for n, (a, c) in enumerate([(0.2, 10.0), (0.4, 20.0)], start=1)
           for name, value in (("accuracy", a), ("cost", c), ("latency", 5.0))}
    rows = [_run("none", "none", split, 0, 0.4, 20.0, **bon) for split in ("tune", "report")]
    rows += [_run("prune", "prune", "tune", 0, 0.2, 15.0), _run("prune V<0.2", "prune", "tune", 0, 0.3, 12.0),
             _run("prune", "prune", "report", 0, 0.4, 25.0), _run("prune V<0.2", "prune", "report", 0, 0.2, 12.0),
             _run("prune V<0.2 (random V-hat)", "prune", "report", 0, 0.1, 12.0, values="random"),
             _run("always-prune", "prune", "tune", 0, 0.5, 5.0)]
    runs = pd.DataFrame(rows)
    curve = best_of_n_curve(runs)
    assert curve[curve["split"] == "report"][["n", "accuracy", "cost"]].values.tolist() == [[1, 0.2, 10.0],
                                                                                            [2, 0.4, 20.0]]
    table = with_matched_savings(operating_points(runs), curve).set_index(["split", "policy"])
    # tune: prune V<0.2 at 0.3 needs 15 passes of best-of-n (halfway), it spends 12: saves 20 %; prune saves -50 %
    assert table.loc[("tune", "prune V<0.2"), "saving"] == pytest.approx(1 - 12 / 15)
    assert table.loc[("tune", "prune"), "saving"] == pytest.approx(1 - 15 / 10)
    assert math.isnan(table.loc[("tune", "always-prune"), "saving"])  # above every n, but a control: not chosen
    assert choose_on_tune(table.reset_index()) == {"prune": "prune V<0.2"}
    assert table.loc[("report", "prune V<0.2"), "saving"] == pytest.approx(1 - 12 / 10)  # reported as it is


def test_tuning_prompts_are_apart_from_the_reported_and_the_head_training_ones(compose_ziprc):
    from src.task.base import build_task
    from src.ziprc.pipeline import decode_splits

    cfg = compose_ziprc("ziprc.collect.train_prompts=20", "ziprc.decode.prompts=10", "ziprc.decode.tune_prompts=15")
    splits = decode_splits(cfg, lambda text: {"input_ids": [len(text)]}, build_task(cfg.task))
    train, heldout = countdown.train_and_heldout(cfg.task, train_size=20)
    tune = {inst.key for inst in splits["tune"][0]}
    assert len(tune) == 15 and len(splits["report"][0]) == 10
    assert not tune & {inst.key for inst in heldout} and not tune & {inst.key for inst in train}
    assert splits["report"][0] == heldout[:10]


@pytest.mark.parametrize("override, words", [
    ("ziprc.decode.policies=[{kind:prune,treshold:0.2}]", ["unknown key(s) treshold"]),
    ("ziprc.decode.policies=[{kind:prune,threshold:1.5}]", ["threshold", "null to always prune"]),
    ("ziprc.decode.policies=[{kind:prune,values:shuffled}]", ["values must be one of head, random"]),
    ("ziprc.decode.policies=[{kind:early_stop,tau:0.5,answer:last}]", ["answer must be one of committed"]),
    ("ziprc.decode.early_stop_answer=first", ["early_stop_answer=first", "best_finished"]),
    ("ziprc.decode.tune_prompts=-1", ["tune_prompts=-1"]),
    ("out=o", ["out=o: give an absolute folder"]),
])
def test_bad_decode_settings_are_refused_with_the_fix(compose_ziprc, override, words):
    from src.ziprc.pipeline import ZipRCConfigError, validate

    with pytest.raises(ZipRCConfigError) as error:
        validate(compose_ziprc(override))
    assert all(word in str(error.value) for word in words), str(error.value)


@pytest.fixture
def compose_ziprc():
    from hydra import compose, initialize_config_dir

    from src.paths import CONFIG_DIR

    def _compose(*overrides):
        with initialize_config_dir(str(CONFIG_DIR), version_base="1.3"):
            return compose("ziprc_main", overrides=list(overrides))
    return _compose
