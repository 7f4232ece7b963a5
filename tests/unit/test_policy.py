"""The tiny policy's tokenizer and the `from_pretrained` loading path, on local folders."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from src.policy.model import load_policy
from src.policy.tokenizer import build_countdown_tokenizer, template_pieces
from src.task import countdown
from tests.conftest import TINY_CHECKPOINT

TEMPLATE = countdown.DEFAULT_PROMPT_TEMPLATE


def test_tokenizer_round_trips_prompts_and_demonstrations_exactly():
    instances = countdown.generate_instances(30, seed=5)
    texts = [countdown.demonstration(i) for i in instances]
    tokenizer = build_countdown_tokenizer([TEMPLATE, *texts], template_pieces(TEMPLATE))
    for instance, demo in zip(instances, texts):
        prompt = countdown.format_prompt(instance, TEMPLATE)
        for text in (prompt, demo):
            ids = tokenizer(text, add_special_tokens=False)["input_ids"]
            assert tokenizer.unk_token_id not in ids
            assert tokenizer.decode(ids) == text
        # The template's fixed text is three tokens; the rest is digits and punctuation.
        assert len(tokenizer(prompt)["input_ids"]) < 25


def test_saved_policy_loads_through_from_pretrained_with_the_same_tokenizer(random_policy_dir):
    """A folder holding model config + tokenizer must give back the project's own tokenizer, not a hub class."""
    model, tokenizer = load_policy(str(random_policy_dir))
    reference = AutoModelForCausalLM.from_pretrained(random_policy_dir)
    for name, tensor in reference.state_dict().items():
        torch.testing.assert_close(model.state_dict()[name], tensor)
    prompt = countdown.format_prompt(countdown.Instance((44, 19, 35), 98), TEMPLATE)
    ids = AutoTokenizer.from_pretrained(random_policy_dir)(prompt)["input_ids"]
    assert tokenizer(prompt)["input_ids"] == ids
    assert tokenizer.decode(ids) == prompt and tokenizer.unk_token_id not in ids


def test_missing_policy_names_the_fix(tmp_path):
    with pytest.raises(FileNotFoundError) as error:
        load_policy(str(tmp_path / "nowhere"))
    assert "policy.name_or_path" in str(error.value) and "sft-tiny" in str(error.value)


@pytest.mark.skipif(not TINY_CHECKPOINT.exists(), reason="run `make sft-tiny` to build the warm start")
def test_committed_warm_start_loads_and_knows_the_answer_format():
    model, tokenizer = load_policy(str(TINY_CHECKPOINT))
    assert 0.5e6 < sum(p.numel() for p in model.parameters()) < 10e6
    instance = countdown.Instance((44, 19, 35), 98)
    prompt_ids = tokenizer(countdown.format_prompt(instance, TEMPLATE))["input_ids"]
    response_ids = tokenizer(countdown.demonstration(instance))["input_ids"]
    ids = torch.tensor([prompt_ids + response_ids])
    with torch.no_grad():
        logits = model(ids).logits[0, len(prompt_ids) - 1 : -1]
    loss = torch.nn.functional.cross_entropy(logits, ids[0, len(prompt_ids):])
    assert loss.item() < 1.0  # a trained model, read with the tokenizer it was trained with
