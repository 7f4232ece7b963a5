"""The training state a step advances: counters and history, all of it saved in a checkpoint."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class TrainState:
    """Everything that changes during training; all of it goes into a checkpoint."""

    step: int = 0                         # next step to run
    fresh_evaluations: int = 0            # fresh verifier calls so far (SPEC 5), counted as they happen
    fresh_groups: int = 0
    replay_groups: float = 0.0            # whole groups' worth (a positive-bias FIFO draws single rollouts)
    gradient_steps: int = 0               # optimizer steps so far (grpo: updates_per_step per update; fifo extras)
    generated_tokens: int = 0             # response tokens generated so far (every fresh rollout, DAPO's rejected too)
    trained_tokens: int = 0               # response tokens in the loss so far, summed over every update batch
    groups_trained: int = 0               # groups in all update batches so far
    effective_groups_trained: int = 0     # ... of which had rewards not all equal (a non-zero advantage)
    history: list[dict] = field(default_factory=list)  # per-step headline numbers for the summary
