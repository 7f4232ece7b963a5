"""ZIP-RC-Lite data: rollouts on disk (JSON lines), verifier labels, per-position joint-bin targets, hidden states.

Rollouts and labels are model output read back later, so they are stored as JSON (never pickled)
and every field is type-checked on the way in.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Iterable

import torch

from src.task.base import Task
from src.ziprc.head import SliceSpec, joint_index, length_bin, reward_state


@dataclass(frozen=True)
class Rollout:
    """One sampled response to one prompt, with the verifier's label once `label` has run."""

    split: str                    # "train" (head training) or "calibration" (held-out, K = 64)
    prompt_index: int
    truth: Any                    # the task's ground truth of the prompt (`Task.truth`), plain JSON
    prompt_ids: tuple[int, ...]
    response_ids: tuple[int, ...]
    text: str
    reward: float | None = None   # verifier reward (1.0 / 0.1 / 0.0), None before labelling
    reason: str | None = None     # the verifier's reason

    @classmethod
    def from_json(cls, line: str) -> "Rollout":
        raw = json.loads(line)
        if not isinstance(raw, dict):
            raise ValueError("a rollout line must be a JSON object")
        reward = raw.get("reward")
        return cls(split=str(raw["split"]), prompt_index=int(raw["prompt_index"]),
                   truth=raw["truth"],  # parsed JSON, so plain data; the task checks it as it reads it
                   prompt_ids=tuple(int(i) for i in raw["prompt_ids"]),
                   response_ids=tuple(int(i) for i in raw["response_ids"]), text=str(raw["text"]),
                   reward=None if reward is None else float(reward),
                   reason=None if raw.get("reason") is None else str(raw["reason"]))


def write_rollouts(path: Path, rollouts: Iterable[Rollout]) -> int:
    path.parent.mkdir(parents=True, exist_ok=True)
    count = 0
    with open(path, "w") as handle:
        for rollout in rollouts:
            handle.write(json.dumps(asdict(rollout)) + "\n")
            count += 1
    return count


def read_rollouts(path: Path) -> list[Rollout]:
    if not Path(path).is_file():
        raise FileNotFoundError(f"no rollouts at {path}: run the earlier ZIP-RC stage first "
                                "(python -m src.ziprc collect, then label)")
    with open(path) as handle:
        return [Rollout.from_json(line) for line in handle if line.strip()]


def label(rollout: Rollout, task: Task) -> Rollout:
    """The rollout with the task verifier's reward and reason (the only labeller: rule-based, no judge model)."""
    verdict = task.verify(rollout.text, task.instance_from_truth(rollout.truth))
    return Rollout(**{**asdict(rollout), "reward": verdict.reward, "reason": verdict.reason})


def position_targets(rollout: Rollout, spec: SliceSpec) -> torch.Tensor:
    """Joint-bin target for each position from the prompt's last token to the response's last token.

    Position t = 0..n (n response tokens) reads the prefix prompt + response[:t], which has n - t
    tokens left to generate; the reward state is the rollout's final outcome.
    """
    if rollout.reward is None:
        raise ValueError("rollout is not labelled: run `python -m src.ziprc label` first")
    state = reward_state(rollout.reward, spec.reward_values)
    n = len(rollout.response_ids)
    return torch.tensor([joint_index(state, length_bin(n - t, spec.length_edges), spec.L) for t in range(n + 1)])


@torch.no_grad()
def response_hidden_states(head, rollouts: list[Rollout], batch_size: int, pad_id: int) -> list[torch.Tensor]:
    """Per rollout, the backbone's last hidden state at positions len(prompt)-1 .. len(prompt)+n-1 (n+1 rows).

    The backbone is frozen, so these are computed once and the head trains on them directly
    (the paper's teacher-forced head loss over `output_hidden_states[-1]`).
    """
    device = next(head.parameters()).device
    out: list[torch.Tensor] = []
    for start in range(0, len(rollouts), batch_size):
        chunk = rollouts[start : start + batch_size]
        width = max(len(r.prompt_ids) + len(r.response_ids) for r in chunk)
        ids = torch.full((len(chunk), width), pad_id, dtype=torch.long)
        attention = torch.zeros((len(chunk), width), dtype=torch.long)
        for row, r in enumerate(chunk):  # right padding: positions 0..length-1 are the real tokens
            sequence = list(r.prompt_ids) + list(r.response_ids)
            ids[row, : len(sequence)] = torch.tensor(sequence)
            attention[row, : len(sequence)] = 1
        hidden = head.hidden_states(ids.to(device), attention.to(device)).float().cpu()
        for row, r in enumerate(chunk):
            first = len(r.prompt_ids) - 1
            out.append(hidden[row, first : first + len(r.response_ids) + 1].clone())
    return out
