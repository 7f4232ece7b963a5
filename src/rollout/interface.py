"""What every rollout engine shares: the sampling settings, the typed answer, the engine interface, and the
stop rule (`</answer>`) both engines apply the same way. Its own module, so the engines import it and not
each other."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch
from transformers import PreTrainedTokenizerBase

STOP_STRING = "</answer>"


@dataclass(frozen=True)
class SamplingParams:
    """How to sample: the training rollouts and the evaluation use different settings (SPEC 3, 7)."""

    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int | None = None
    max_new_tokens: int = 1024
    # Also return each sampled token's log-prob under the raw logits at `temperature`, the trainer's forward
    # convention (`Forward.sampled_token_logprobs`): an async worker's log mu without a forward pass of its own.
    logprobs: bool = False


@dataclass(frozen=True)
class Completion:
    """One sampled response: its token ids (as generated, never re-tokenised) and its text."""

    token_ids: tuple[int, ...]
    text: str
    logprobs: tuple[float, ...] | None = None  # per token, when `SamplingParams.logprobs` asked for them


@dataclass(frozen=True)
class Generation:
    """The engine's answer for a list of prompts: each prompt's token ids and its completions."""

    prompt_ids: list[tuple[int, ...]]
    completions: list[list[Completion]]


class RolloutEngine(Protocol):
    def generate(self, prompts: list[str], samples_per_prompt: int, sampling: SamplingParams, seed: int) -> Generation:
        """Sample `samples_per_prompt` responses for every prompt, reproducibly for a given seed."""

    def sync_weights(self, model: torch.nn.Module) -> None:
        """Make the engine sample from the trainer's current weights."""

    def sleep(self) -> None:
        """Release what generation holds on the device until the next `generate` or `sync_weights` (the step calls
        it once, before its update); nothing to do for an engine that holds nothing of its own."""


def closing_tokens(tokenizer: PreTrainedTokenizerBase) -> torch.Tensor:
    """Per vocabulary id: can this token complete the stop string (does its text hold the final '>')?"""
    return torch.tensor([STOP_STRING[-1] in tokenizer.decode([i]) for i in range(len(tokenizer))])


def response_end(token_ids: list[int], tokenizer: PreTrainedTokenizerBase, stop_ids: set[int],
                 closing: torch.Tensor) -> int:
    """Length of the response proper: up to and including the first EOS or the token that completes `</answer>`."""
    for index, token in enumerate(token_ids):
        if token in stop_ids:
            return index + 1
        # Only a token holding '>' can complete the stop string, so the prefix decode is rare.
        if closing[token] and STOP_STRING in tokenizer.decode(token_ids[: index + 1]):
            return index + 1
    return len(token_ids)
