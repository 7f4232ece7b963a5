"""The transformers rollout engine: shapes, seeding, and stopping at the end of </answer>."""

from __future__ import annotations

import torch

from src.policy.model import load_policy
from src.rollout.interface import SamplingParams, closing_tokens, response_end
from src.rollout.engine import HFGenerateEngine, StopAfterAnswer
from src.task import countdown

SAMPLING = SamplingParams(temperature=1.0, top_p=1.0, top_k=None, max_new_tokens=10)


def prompts(n):
    return [countdown.format_prompt(i, countdown.DEFAULT_PROMPT_TEMPLATE) for i in countdown.generate_instances(n, seed=2)]


def test_generate_returns_k_completions_per_prompt_reproducibly(random_policy_dir):
    model, tokenizer = load_policy(str(random_policy_dir))
    engine = HFGenerateEngine(model, tokenizer, batch_size=6)  # forces several generate calls
    first = engine.generate(prompts(5), 3, SAMPLING, seed=11)
    assert [len(c) for c in first.completions] == [3] * 5
    assert all(1 <= len(c.token_ids) <= 10 for group in first.completions for c in group)
    assert first.prompt_ids[0] == tuple(tokenizer(prompts(5)[0])["input_ids"])
    again = engine.generate(prompts(5), 3, SAMPLING, seed=11)
    other = engine.generate(prompts(5), 3, SAMPLING, seed=12)
    assert again.completions == first.completions
    assert other.completions != first.completions
    for group in first.completions:
        for completion in group:
            assert completion.text == tokenizer.decode(completion.token_ids, skip_special_tokens=True)


def test_response_ends_after_the_closing_answer_tag_or_eos(random_policy_dir):
    _, tokenizer = load_policy(str(random_policy_dir))
    closing = closing_tokens(tokenizer)
    stop_ids = {tokenizer.eos_token_id}
    answer = tokenizer(" 1 </think>\n<answer> 1 + 2 </answer>", add_special_tokens=False)["input_ids"]
    tail = tokenizer(" 5 5 <answer> 3", add_special_tokens=False)["input_ids"]
    assert response_end(answer + tail, tokenizer, stop_ids, closing) == len(answer)
    assert response_end(tail + [tokenizer.eos_token_id] + answer, tokenizer, stop_ids, closing) == len(tail) + 1
    assert response_end(tail, tokenizer, stop_ids, closing) == len(tail)
    # '>' alone (e.g. in '<think>') must not stop a response.
    think = tokenizer(" <think> 4 >", add_special_tokens=False)["input_ids"]
    assert response_end(think, tokenizer, stop_ids, closing) == len(think)


def test_stopping_criterion_marks_only_rows_that_closed_their_answer(random_policy_dir):
    _, tokenizer = load_policy(str(random_policy_dir))
    prompt = tokenizer("[1, 2]", add_special_tokens=False)["input_ids"]
    done = tokenizer(" <answer> 1 + 2 </answer>", add_special_tokens=False)["input_ids"]
    open_ = tokenizer(" <answer> 1 + 2 + 3 + 4", add_special_tokens=False)["input_ids"]
    width = max(len(done), len(open_))
    rows = [prompt + [tokenizer.pad_token_id] * (width - len(r)) + r for r in (done, open_)]
    criterion = StopAfterAnswer(tokenizer, closing_tokens(tokenizer), prompt_length=len(prompt))
    assert criterion(torch.tensor(rows), None).tolist() == [True, False]


def test_stopping_criterion_keeps_a_finished_row_finished_without_decoding_it_again(random_policy_dir):
    _, tokenizer = load_policy(str(random_policy_dir))
    prompt = tokenizer("[1, 2]", add_special_tokens=False)["input_ids"]
    done = tokenizer(" <answer> 1 + 2 </answer>", add_special_tokens=False)["input_ids"]
    criterion = StopAfterAnswer(tokenizer, closing_tokens(tokenizer), prompt_length=len(prompt))
    assert criterion(torch.tensor([prompt + done]), None).tolist() == [True]
    decoded = []
    tokenizer_decode = tokenizer.decode
    tokenizer.decode = lambda ids, **kwargs: decoded.append(ids) or tokenizer_decode(ids, **kwargs)
    # generate pads a finished row; '<pad>' holds a '>' but the row is not looked at again.
    padded = torch.tensor([prompt + done + [tokenizer.pad_token_id] * 2])
    assert criterion(padded, None).tolist() == [True]
    assert decoded == []


def test_engine_log_mu_agrees_with_the_trainers_forward_pass_and_leaves_the_sample_alone(random_policy_dir):
    """`SamplingParams.logprobs`: each sampled token's log-prob from generate's own logits, at the sampling
    temperature, as the trainer's forward pass computes it (runtime.behaviour_logprobs=engine); left-padded prompts
    of different lengths, responses of different lengths, two temperatures. Asking for them draws the same tokens."""
    import dataclasses

    from src.policy.forward import Forward

    model, tokenizer = load_policy(str(random_policy_dir))
    engine, forward = HFGenerateEngine(model, tokenizer, batch_size=12), Forward(tokenizer.pad_token_id, 8)
    texts = [prompts(6)[i] + " extra words" * i for i in range(6)]  # prompts of six lengths: left padding
    for temperature in (1.0, 0.7):
        sampling = dataclasses.replace(SAMPLING, temperature=temperature)
        plain = engine.generate(texts, 4, sampling, seed=5)
        asked = engine.generate(texts, 4, dataclasses.replace(sampling, logprobs=True), seed=5)
        assert [[c.token_ids for c in g] for g in asked.completions] == [[c.token_ids for c in g] for g in plain.completions]
        assert all(c.logprobs is None for g in plain.completions for c in g)
        rows = [c for g in asked.completions for c in g]
        assert len({len(c.token_ids) for c in rows}) > 1  # responses of several lengths
        sequences = [(ids, c.token_ids) for ids, g in zip(asked.prompt_ids, asked.completions) for c in g]
        by_forward = forward.sampled_token_logprobs(model, sequences, temperature)
        for completion, expected in zip(rows, by_forward):
            assert len(completion.logprobs) == len(completion.token_ids) == len(expected)
            assert max(abs(a - b) for a, b in zip(completion.logprobs, expected)) < 1e-4
