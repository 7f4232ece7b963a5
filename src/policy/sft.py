"""Supervised warm start of the tiny CPU policy on the task's demonstrations (`make sft-tiny`).

The paper starts RL from an SFT checkpoint with low pass@1 but a working answer format.
This stage builds the same kind of start point for the ~1 M-parameter policy: a word-level
tokenizer for the task's prompts and demonstrations (Countdown's solver-written ones, or the
built-in math set's worked solutions), a randomly initialised small decoder, and a short next-token training run on
(prompt, demonstration) pairs whose loss covers the response tokens only. It is kept short
on purpose, so RL has room to improve: 300 steps for Countdown; the math task's multi-digit
arithmetic needs 1,000 steps on 20,000 demonstrations to reach that kind of start (`Task.warm_start`). The result is saved with `save_pretrained` and loaded
by the runner through `from_pretrained`, like any hub model.

    python -m src.policy.sft                    # writes checkpoints/tiny-countdown
    python -m src.policy.sft task=math          # writes checkpoints/tiny-math (20,000 demonstrations, 1,000 steps)
    python -m src.policy.sft --steps 50 --output /tmp/tiny   # a quick, weaker one
"""

from __future__ import annotations

import argparse
import json
import random
import time
from collections.abc import Mapping
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
from hydra import compose, initialize_config_dir

from src.paths import CONFIG_DIR, register_root_resolver, workspace_root
from src.policy.model import build_tiny_model
from src.policy.tokenizer import build_countdown_tokenizer, corpus_symbols, template_pieces
from src.task.base import build_task

register_root_resolver()  # the YAML's ${root:}


@dataclass
class SFTSettings:
    """Everything that determines the warm-start checkpoint (saved next to it)."""

    examples: int = 4000
    steps: int = 300
    batch_size: int = 64
    learning_rate: float = 2e-3
    hidden_size: int = 128
    layers: int = 4
    seed: int = 7  # demonstration prompts are drawn apart from the RL training seed
    output: str = ""  # default: checkpoints/tiny-<task>, e.g. checkpoints/tiny-countdown


def demonstrations(task_cfg, settings: SFTSettings) -> list[tuple[str, str]]:
    """(prompt, response) pairs for instances outside the held-out set (the task's `demonstrations`)."""
    return build_task(task_cfg).demonstrations(settings.examples, settings.seed)


def encode(pairs, tokenizer) -> list[tuple[list[int], int]]:
    """Token ids of prompt + response + EOS, with the prompt length (its tokens get no loss)."""
    encoded = []
    for prompt, response in pairs:
        prompt_ids = tokenizer(prompt, add_special_tokens=False)["input_ids"]
        response_ids = tokenizer(response, add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id]
        encoded.append((prompt_ids + response_ids, len(prompt_ids)))
    return encoded


def batch_loss(model, batch, pad_id: int) -> torch.Tensor:
    """Mean next-token cross-entropy over response tokens."""
    width = max(len(ids) for ids, _ in batch)
    input_ids = torch.full((len(batch), width), pad_id)
    labels = torch.full((len(batch), width), -100)
    attention = torch.zeros((len(batch), width), dtype=torch.long)
    for row, (ids, prompt_length) in enumerate(batch):
        input_ids[row, : len(ids)] = torch.tensor(ids)
        attention[row, : len(ids)] = 1
        labels[row, prompt_length : len(ids)] = torch.tensor(ids[prompt_length:])
    return model(input_ids=input_ids, attention_mask=attention, labels=labels).loss


def train_tiny_policy(settings: SFTSettings | Mapping | None = None, task_overrides: list[str] | None = None) -> Path:
    """Build, train and save the tiny policy; return the checkpoint folder. Settings left out of a mapping
    are the task's (`Task.warm_start`), then SFTSettings' defaults."""
    with initialize_config_dir(str(CONFIG_DIR), version_base="1.3"):
        task_cfg = compose("config", overrides=task_overrides or []).task
    task = build_task(task_cfg)
    if not isinstance(settings, SFTSettings):
        settings = SFTSettings(**{**task.warm_start, **dict(settings or {})})
    torch.manual_seed(settings.seed)
    rng = random.Random(settings.seed)
    pairs = task.demonstrations(settings.examples, settings.seed)
    # The template (its slot names too, as the committed Countdown tokenizer has them), the prompts (a math
    # prompt holds the problem's words) and the responses; symbols from what the prompts and responses use.
    texts = [text for pair in pairs for text in pair]
    tokenizer = build_countdown_tokenizer([task_cfg.prompt_template, *texts],
                                          phrases=template_pieces(task_cfg.prompt_template),
                                          symbols=corpus_symbols(texts))
    model = build_tiny_model(tokenizer, hidden_size=settings.hidden_size, layers=settings.layers, seed=settings.seed)
    examples = encode(pairs, tokenizer)
    optimizer = torch.optim.AdamW(model.parameters(), lr=settings.learning_rate, weight_decay=0.0)
    schedule = torch.optim.lr_scheduler.OneCycleLR(optimizer, max_lr=settings.learning_rate, total_steps=settings.steps)
    parameters = sum(p.numel() for p in model.parameters())
    print(f"tiny policy: {parameters / 1e6:.2f} M parameters, vocabulary {len(tokenizer)}, {len(examples)} demonstrations")
    started = time.perf_counter()
    model.train()
    for step in range(settings.steps):
        loss = batch_loss(model, rng.sample(examples, settings.batch_size), tokenizer.pad_token_id)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()
        schedule.step()
        if step % 50 == 0 or step == settings.steps - 1:
            print(f"  step {step:4d}  loss {loss.item():.3f}  ({time.perf_counter() - started:.0f}s)", flush=True)
    settings.output = settings.output or f"checkpoints/tiny-{task.name}"
    output = Path(settings.output)
    output = output if output.is_absolute() else workspace_root() / output
    model.eval()
    model.generation_config.pad_token_id = tokenizer.pad_token_id
    model.save_pretrained(output)
    tokenizer.save_pretrained(output)
    (output / "sft_settings.json").write_text(json.dumps(asdict(settings), indent=2) + "\n")
    print(f"saved to {output}")
    return output


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    for field, default in asdict(SFTSettings()).items():  # an option left out: the task's warm start, then this
        parser.add_argument("--" + field.replace("_", "-"), type=type(default), default=argparse.SUPPRESS,
                            help=f"default {default!r}, unless the task sets its own (Task.warm_start)")
    parser.add_argument("overrides", nargs="*", help="Hydra overrides for the task group, e.g. task.max_number=50")
    args = vars(parser.parse_intermixed_args())  # Hydra overrides before or after the options
    overrides = args.pop("overrides")
    train_tiny_policy(args, overrides)


if __name__ == "__main__":
    main()
