"""Training and evaluation prompts: the task's template, wrapped in the tokenizer's chat template if asked."""

from __future__ import annotations

from src.task import countdown


def apply_chat_template(tokenizer, prompt: str) -> str:
    """Wrap a prompt as one user turn; the text after '<think>' stays the model's to write."""
    question, _, assistant_start = prompt.partition("\nAssistant:")
    messages = [{"role": "user", "content": question}]
    prefix = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    return prefix + assistant_start.lstrip()


class PromptFormat:
    """How an instance becomes the prompt the policy sees (task.prompt_template, policy.use_chat_template)."""

    def __init__(self, template: str, tokenizer=None, use_chat_template: bool = False) -> None:
        self.template, self.tokenizer, self.use_chat_template = template, tokenizer, bool(use_chat_template)

    def format(self, instance: countdown.Instance) -> str:
        prompt = countdown.format_prompt(instance, self.template)
        return apply_chat_template(self.tokenizer, prompt) if self.use_chat_template else prompt
