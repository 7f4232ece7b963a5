"""The behaviour policy mu that samples the fresh rollouts (SPEC 9 "stale / diversified behaviour"; seed 002 sec. 3.2).

`behaviour=current` (default): the current policy at the training temperature, so mu = pi_theta
and every fresh weight is exactly 1 (SPEC 3). `behaviour=stale`: the weights from `lag` steps
back (seed 002's stale-policy sampling; until `lag` updates exist, the current weights, as
there). `behaviour=diverse`: the current weights at a higher sampling temperature (seed 002:
T = 1.2). Both make fresh rollouts off-policy; the trainer corrects them with truncated
importance sampling (`src.loss.variant_math.truncated_importance_weights`, seed 002 eq. 3) at the
sequence or token level, using log mu from a no-grad forward pass of the behaviour weights
at the behaviour temperature.
"""

from __future__ import annotations

from collections import deque

import torch

from src.loss.base import Truncation
from src.policy.model import frozen_copy
from src.variant import Variant, float_knob, int_knob


class CurrentBehaviour(Variant):
    """`behaviour=current`: the policy being trained samples at the training temperature (mu = pi_theta)."""

    @classmethod
    def plain(cls, node) -> bool:
        return True

    def __init__(self, policy: torch.nn.Module | None = None, training_temperature: float = 1.0,
                 name: str = "current") -> None:
        self.temperature = self.training_temperature = float(training_temperature)
        self.truncation = None  # nothing to correct

    def model_for_step(self, policy: torch.nn.Module) -> tuple[torch.nn.Module, int]:
        return policy, 0

    def is_off_policy(self, lag: int) -> bool:
        return False

    def metrics(self, collected, batch, update) -> dict[str, float]:
        return {}

    def state_dict(self) -> dict:
        return {}

    def load_state_dict(self, state: dict) -> None:
        pass


class BehaviourPolicy(Variant):
    """`behaviour=stale|diverse`: keeps the last `lag` + 1 weight snapshots and says which weights sample step t."""

    knobs = {"lag": int_knob(0, 100_000, "4 (seed 002: 1, 4, 16)", why="steps back of the sampling weights"),
             "temperature": float_knob(0, 100, "1.2 or null", low_open=True, nullable=True),
             "is_min": float_knob(0, 1, "0"), "is_max": float_knob(1, 1e6, "10"), "is_max_token": float_knob(1, 1e6, "2", id_omitted_at=(2.0,))}

    @classmethod
    def cell_label(cls, node, cfg) -> str:
        """e.g. -stale4, -T1.2-tokenIS."""
        return ((f"-stale{node.lag}" if node.lag else "")
                + (f"-T{node.temperature:g}" if node.temperature is not None else "")
                + ("-tokenIS" if node.is_level == "token" else ""))

    @classmethod
    def reader_label(cls, node, cfg) -> str:
        sampler = ([f"stale behaviour n={node.lag}"] if node.lag else ["behaviour"]) + \
                  ([f"T={node.temperature:g}"] if node.temperature is not None else [])
        return " ".join(sampler) + f" ({node.is_level} IS)"

    def __init__(self, policy: torch.nn.Module, lag: int, temperature: float | None = None,
                 training_temperature: float = 1.0, is_min: float = 0.0, is_max: float = 10.0,
                 is_level: str = "sequence", name: str = "stale", is_max_token: float = 2.0):
        self.lag = int(lag)
        temperature = training_temperature if temperature is None else temperature
        if self.lag == 0 and temperature == training_temperature:
            raise ValueError(f"behaviour={name} with lag=0 and temperature {temperature} = the training temperature "
                             "samples from the current policy: use behaviour=current, a lag >= 1 or another temperature")
        truncation = Truncation.checked("behaviour", is_min, is_max, is_level, is_max_token)
        self.temperature = float(temperature)
        self.training_temperature = float(training_temperature)
        self.truncation = truncation
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

    def is_off_policy(self, lag: int) -> bool:
        """Sampled by other weights or at another temperature than the policy trains at."""
        return lag > 0 or self.temperature != self.training_temperature

    def metrics(self, collected, batch, update) -> dict[str, float]:
        """Seed 002's view of an off-policy sampler: lag, temperature and how often truncation binds."""
        if not collected.off_policy:
            return {"behaviour/lag": 0.0}
        metrics = {"behaviour/lag": float(collected.lag), "behaviour/temperature": collected.temperature}
        off_policy = torch.tensor(batch.row_off_policy(), dtype=torch.bool)
        if update is not None and off_policy.any():
            raw, _ = update.weights_of(off_policy)  # per token at is_level=token: truncation acts per token
            truncated = (raw > self.truncation.is_max) | (raw < self.truncation.is_min)
            metrics["behaviour/truncated_fraction"] = truncated.float().mean().item()
            metrics["behaviour/log_ratio_mean"] = raw.log().mean().item()
        return metrics

    def state_dict(self) -> dict:
        return {"lag": self.lag, "history": list(self.history)}

    def load_state_dict(self, state: dict) -> None:
        if state["lag"] != self.lag:
            raise ValueError(f"checkpoint was written with behaviour.lag={state['lag']}, this run has "
                             f"behaviour.lag={self.lag}; resume with the same behaviour settings")
        self.history = deque(state["history"], maxlen=self.lag + 1)
