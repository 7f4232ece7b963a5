"""Training and evaluation prompts: the task's prompt text, wrapped in the tokenizer's chat template if asked."""

from __future__ import annotations

from src.task.base import Task


def apply_chat_template(tokenizer, prompt: str) -> str:
    """Wrap a prompt as one user turn; the text after 'Assistant:' (Countdown's '<think>') stays the model's to write.

    A prompt without an 'Assistant:' line (task=math) is the user turn whole.
    """
    question, _, assistant_start = prompt.partition("\nAssistant:")
    messages = [{"role": "user", "content": question}]
    prefix = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    return prefix + assistant_start.lstrip()


class PromptFormat:
    """How an instance becomes the prompt the policy sees (the task's prompt, policy.use_chat_template)."""

    def __init__(self, task: Task, tokenizer=None, use_chat_template: bool = False) -> None:
        self.task, self.tokenizer, self.use_chat_template = task, tokenizer, bool(use_chat_template)

    def format(self, instance) -> str:
        prompt = self.task.prompt(instance)
        return apply_chat_template(self.tokenizer, prompt) if self.use_chat_template else prompt
