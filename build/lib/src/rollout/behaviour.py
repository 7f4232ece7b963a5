"""The behaviour policy mu that samples the fresh rollouts (SPEC 9 "stale / diversified behaviour"; seed 002 sec. 3.2).

`behaviour=current` (default): the current policy at the training temperature, so mu = pi_theta
and every fresh weight is exactly 1 (SPEC 3). `behaviour=stale`: the weights from `lag` steps
back (seed 002's stale-policy sampling; until `lag` updates exist, the current weights, as
there). `behaviour=diverse`: the current weights at a higher sampling temperature (seed 002:
T = 1.2). Both make fresh rollouts off-policy; the trainer corrects them with truncated
importance sampling (`src.losses.truncated_importance_weights`, seed 002 eq. 3) at the
sequence or token level, using log mu from a no-grad forward pass of the behaviour weights
at the behaviour temperature.
"""

from __future__ import annotations

from collections import deque

import torch
from omegaconf import DictConfig

from src.policy.model import frozen_copy


class BehaviourPolicy:
    """Keeps the last `lag` + 1 weight snapshots and says which weights sample step t's rollouts."""

    def __init__(self, policy: torch.nn.Module, lag: int, temperature: float):
        if isinstance(lag, bool) or int(lag) != lag or lag < 0:
            raise ValueError(f"behaviour.lag={lag!r}: use an integer >= 0 (0 = current weights; seed 002: 1, 4, 16)")
        if not temperature > 0:
            raise ValueError(f"behaviour temperature {temperature!r} must be > 0 (seed 002 diversifies at 1.2)")
        self.lag = int(lag)
        self.temperature = float(temperature)
        # theta_{t-lag} .. theta_t on the CPU (lag + 1 copies of the weights; fine for the policies used here).
        self.history: deque[dict[str, torch.Tensor]] = deque(maxlen=self.lag + 1)
        self.stale_model = frozen_copy(policy) if self.lag > 0 else None

    def model_for_step(self, policy: torch.nn.Module) -> tuple[torch.nn.Module, int]:
        """Record the current weights theta_t; return (the model that samples this step, its lag in steps)."""
        if self.lag == 0:
            return policy, 0
        self.history.append({name: value.detach().to("cpu", copy=True) for name, value in policy.state_dict().items()})
        if len(self.history) <= self.lag:  # seed 002: no weights `lag` steps back yet -> the current ones
            return policy, 0
        self.stale_model.load_state_dict(self.history[0])
        return self.stale_model, self.lag

    def state_dict(self) -> dict:
        return {"lag": self.lag, "history": list(self.history)}

    def load_state_dict(self, state: dict) -> None:
        if state["lag"] != self.lag:
            raise ValueError(f"checkpoint was written with behaviour.lag={state['lag']}, this run has "
                             f"behaviour.lag={self.lag}; resume with the same behaviour settings")
        self.history = deque(state["history"], maxlen=self.lag + 1)


def build_behaviour(cfg: DictConfig, policy: torch.nn.Module) -> BehaviourPolicy | None:
    """The behaviour the `behaviour` group asks for; None when it is the current policy itself."""
    behaviour = cfg.behaviour
    if behaviour.name == "current":
        return None
    temperature = behaviour.temperature if behaviour.temperature is not None else cfg.trainer.rollout.temperature
    return BehaviourPolicy(policy, behaviour.lag, temperature)
