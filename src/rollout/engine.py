"""Rollout engines: turn prompts into K sampled responses each.

The trainer talks to an engine only through `RolloutEngine.generate` and `sync_weights`, so a
faster engine (vLLM on the GPU path) plugs in without touching the training loop.
"""

from __future__ import annotations

import torch
from transformers import PreTrainedModel, PreTrainedTokenizerBase, StoppingCriteria, StoppingCriteriaList

from src.rollout.interface import (STOP_STRING, Completion, Generation, RolloutEngine, SamplingParams, closing_tokens,
                                   response_end)


class StopAfterAnswer(StoppingCriteria):
    """Marks a row finished once its generated text contains `</answer>` (works for any tokenizer)."""

    def __init__(self, tokenizer: PreTrainedTokenizerBase, closing: torch.Tensor, prompt_length: int):
        self.tokenizer, self.closing, self.prompt_length = tokenizer, closing, prompt_length
        self.done: torch.Tensor | None = None  # rows already finished: never decoded again

    def __call__(self, input_ids: torch.Tensor, scores, **kwargs) -> torch.Tensor:
        if self.done is None:
            self.done = torch.zeros(input_ids.shape[0], dtype=torch.bool)
        # Finished rows are padded with special tokens such as '<pad>', whose text holds a '>' too.
        candidates = self.closing[input_ids[:, -1].cpu()] & ~self.done
        for row in candidates.nonzero().flatten().tolist():
            self.done[row] = STOP_STRING in self.tokenizer.decode(input_ids[row, self.prompt_length :])
        return self.done.to(input_ids.device)


class HFGenerateEngine:
    """Batched sampling with transformers `generate`, sharing the trainer's model object (CPU default, GPU fallback)."""

    def __init__(self, model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase, batch_size: int = 256):
        self.model = model
        self.tokenizer = tokenizer
        self.batch_size = batch_size  # sequences per generate call, bounds memory
        self.generated = 0  # sequences this engine sampled: the generation work it did
        self.stop_ids = {tokenizer.eos_token_id}
        if tokenizer.pad_token_id is not None:
            self.stop_ids.add(tokenizer.pad_token_id)
        self.closing = closing_tokens(tokenizer)

    def sync_weights(self, model: torch.nn.Module) -> None:
        self.model = model  # same module object: nothing to copy

    def sleep(self) -> None:
        """Nothing to release: it samples with the trainer's own module."""

    @torch.no_grad()
    def generate(self, prompts: list[str], samples_per_prompt: int, sampling: SamplingParams, seed: int) -> Generation:
        prompt_ids = [tuple(self.tokenizer(prompt, add_special_tokens=False)["input_ids"]) for prompt in prompts]
        prompts_per_call = max(1, self.batch_size // samples_per_prompt)
        completions: list[list[Completion]] = []
        was_training = self.model.training
        self.model.eval()
        torch.manual_seed(seed)  # generate() draws from the global RNG
        # Layers compiled for the update (trainer.compile) run eagerly here: handed generate's KV cache they would
        # recompile at each write until torch's recompile limit, which then leaves the update's own shapes eager.
        try:
            with torch.compiler.set_stance("force_eager"):
                for start in range(0, len(prompts), prompts_per_call):
                    chunk = prompt_ids[start : start + prompts_per_call]
                    completions += self._generate_chunk(chunk, samples_per_prompt, sampling)
        finally:
            self.model.train(was_training)
        self.generated += len(prompts) * samples_per_prompt
        return Generation(prompt_ids=prompt_ids, completions=completions)

    def _generate_chunk(self, prompt_ids, samples_per_prompt, sampling) -> list[list[Completion]]:
        tokenizer = self.tokenizer
        tokenizer.padding_side = "left"  # so every prompt ends where generation starts
        encoded = tokenizer.pad({"input_ids": [list(ids) for ids in prompt_ids]}, return_tensors="pt")
        device = next(self.model.parameters()).device
        prompt_length = encoded["input_ids"].shape[1]
        output = self.model.generate(
            input_ids=encoded["input_ids"].to(device),
            attention_mask=encoded["attention_mask"].to(device),
            do_sample=True,
            temperature=sampling.temperature,
            top_p=sampling.top_p,
            top_k=sampling.top_k if sampling.top_k else None,
            max_new_tokens=sampling.max_new_tokens,
            num_return_sequences=samples_per_prompt,
            stopping_criteria=StoppingCriteriaList([StopAfterAnswer(tokenizer, self.closing, prompt_length)]),
            pad_token_id=tokenizer.pad_token_id,
            eos_token_id=tokenizer.eos_token_id,
            output_logits=sampling.logprobs,
            return_dict_in_generate=True,
        )
        new_tokens = output.sequences[:, prompt_length:]
        logprobs = sampled_logprobs(output.logits, new_tokens, sampling.temperature) if sampling.logprobs else None
        completions = []
        for index, token_ids in enumerate(new_tokens.tolist()):
            end = response_end(token_ids, tokenizer, self.stop_ids, self.closing)
            text = tokenizer.decode(token_ids[:end], skip_special_tokens=True)
            if index % samples_per_prompt == 0:
                completions.append([])
            completions[-1].append(Completion(token_ids=tuple(token_ids[:end]), text=text,
                                              logprobs=None if logprobs is None else tuple(logprobs[index][:end])))
        return completions


def sampled_logprobs(logits: tuple[torch.Tensor, ...], tokens: torch.Tensor, temperature: float) -> list[list[float]]:
    """Each sampled token's log-prob under generate's raw logits (before top-p/top-k) at `temperature`, as the
    trainer's forward pass computes it (`src.policy.forward`'s token stats): one row a sequence."""
    # One step at a time: never a [sequences, new tokens, vocabulary] copy, which a real vocabulary makes large.
    per_step = [torch.log_softmax(step.float() / temperature, dim=-1).gather(-1, tokens[:, [index]])
                for index, step in enumerate(logits)]
    return torch.cat(per_step, dim=1).tolist()


def build_engine(name: str, model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase, batch_size: int,
                 max_new_tokens: int | None = None, **vllm_options) -> RolloutEngine:
    """The engine named by `policy.engine`.

    `batch_size` bounds the HF engine's generate calls (vLLM schedules its own batches).
    `vllm_options` are `policy.vllm.*` and only apply to the vLLM engine: gpu_memory_utilization
    (0.3), enforce_eager (False), dtype ("bfloat16"), max_model_len and max_num_seqs (None: vLLM's
    defaults), seed (0), per_request_seeds (True), allow_untested_version (False); see
    `src.rollout.vllm_engine.VLLMEngine`. `max_new_tokens` (the run's response tokens) sizes vLLM's context
    when `max_model_len` is null.
    """
    if name == "hf":
        return HFGenerateEngine(model, tokenizer, batch_size=batch_size)
    if name == "vllm":
        # Imported here: the vLLM adapter (and vLLM itself) is only needed on GPU nodes.
        from src.rollout.vllm_engine import VLLMEngine

        return VLLMEngine(model, tokenizer, max_new_tokens=max_new_tokens, **vllm_options)
    raise ValueError(f"unknown policy.engine '{name}': choose 'hf' (or 'vllm' on a GPU node)")
