"""The objective interface (`loss` config group): `update(policy, reference, optimizer, batch) -> UpdateResult`.

An objective is built from its YAML by `hydra.utils.instantiate`, with the run's `Forward` settings
and the trainer's regularisation (`kl_coef`, `entropy_coef`, `max_grad_norm`) added; the behaviour
group's truncation settings come along for objectives that correct off-policy fresh rows. A new
loss is a new subclass and a YAML file naming it; the subclass describes itself (`src.variant.Variant`):
its cell and reader labels, whether it is plain Replay-RLOO, and whether it reads clip.ceiling.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from src.batch import Batch, Group
from src.loss.kl import KL_ESTIMATORS
from src.loss.rloo_math import leave_one_out_advantages
from src.checks import check_choice
from src.loss.reducer import Reducer
from src.policy.forward import Forward
from src.variant import Variant

IS_LEVELS = ("sequence", "token")  # truncated importance weights per response or per token (seed 002 eq. 3)


@dataclass(frozen=True)
class Truncation:
    """Seed 002's truncated importance weight for fresh rows from a stale or tempered sampler (eq. 3)."""

    is_min: float = 0.0
    is_max: float = 2.0
    is_level: str = "sequence"  # "sequence": one weight per response; "token": one per token

    @classmethod
    def checked(cls, group: str, is_min: float, is_max: float, is_level: str,
                is_max_token: float | None = None) -> "Truncation":
        """The settings of config group `group` (behaviour or loss), refused with their keys unless valid.

        Seed 002 (l.121) truncates at rho_max = 10 per sequence and at 2 per token, so the group has a cap
        per level: `is_max` at is_level=sequence, `is_max_token` (when given) at is_level=token.
        """
        check_choice(f"{group}.is_level", is_level, IS_LEVELS)
        caps = {"is_max": is_max} if is_max_token is None else {"is_max": is_max, "is_max_token": is_max_token}
        for key, cap in caps.items():
            if not 0 <= is_min <= 1 <= cap:
                raise ValueError(f"{group}.is_min={is_min}, {group}.{key}={cap}: the truncation interval must hold 1 "
                                 f"(0 <= is_min <= 1 <= {key}; seed 002: 0 and 10, or 2 with token-level IS)")
        cap = is_max_token if is_level == "token" and is_max_token is not None else is_max
        return cls(float(is_min), float(cap), is_level)


@dataclass
class UpdateResult:
    """Per-response numbers from the update, in the batch's row order (detached, on the CPU)."""

    logprobs: torch.Tensor      # log pi_theta(y|x) before the update
    raw_weights: torch.Tensor
    weights: torch.Tensor       # clipped, as used in the gradient
    kl_sums: torch.Tensor       # per-response sum of token KL estimates
    token_counts: torch.Tensor
    # Per-response log pi_ref per token, stored with new groups; None where the update read no pi_ref (kl_coef = 0).
    reference_tokens: list[tuple[float, ...] | None]
    loss: float
    policy_loss: float
    kl: float
    entropy: float
    # Per-response log mu per token to store with fresh groups (loss=grpo: pi_prox's); None: not kept.
    behaviour_tokens: list[tuple[float, ...]] | None = None
    extras: dict[str, float] = field(default_factory=dict)  # loss-specific diagnostics (grpo/*, ipo/*)
    optimizer_steps: int = 1
    # Where the objective weights tokens (loss=grpo's capped pi_prox/mu, token-level truncated IS): per
    # row, the raw and the used weight of each response token. None: one weight per response.
    token_raw_weights: list[torch.Tensor] | None = None
    token_weights: list[torch.Tensor] | None = None

    def weights_of(self, rows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Raw and used importance weights of the selected rows (a bool mask over the batch's rows): one
        per response, or one per response token where the objective weights tokens, since that is where
        its cap or truncation acts (a clip fraction then counts capped tokens, not responses)."""
        if self.token_weights is None:
            return self.raw_weights[rows], self.weights[rows]
        picked = rows.nonzero().flatten().tolist()
        if not picked:
            return torch.empty(0), torch.empty(0)
        return (torch.cat([self.token_raw_weights[i] for i in picked]),
                torch.cat([self.token_weights[i] for i in picked]))

    def stored(self, group: Group, first_row: int) -> Group:
        """A trained fresh group as a store keeps it: with log mu and its per-token log pi_ref.

        A group sampled by a stale or tempered behaviour already carries that behaviour's mu.
        """
        rows = slice(first_row, first_row + group.size)
        reference = self.reference_tokens[rows]
        if any(tokens is None for tokens in reference):  # not read at kl_coef = 0: a later update computes it
            reference = None
        if group.behaviour_logprobs is not None:
            return group.with_behaviour_logprobs(group.behaviour_logprobs, reference, group.behaviour_token_logprobs)
        tokens = self.behaviour_tokens[rows] if self.behaviour_tokens else None
        return group.with_behaviour_logprobs(self.logprobs[rows].tolist(), reference, tokens)


class Objective(Variant):
    """Shared settings and bookkeeping of every objective; subclasses implement `update`."""

    # Whether the objective weighs replayed rows with clip.ceiling (eq. 2): then the ceiling names the cell
    # of a run that replays (`src.study.sweep.cell_name`), and enters its identity.
    reads_clip: bool = False

    def __init__(self, forward: Forward, kl_coef: float = 0.0, entropy_coef: float = 0.0,
                 max_grad_norm: float | None = None, truncation: Truncation | None = None,
                 kl_estimator: str = "k3", name: str = "") -> None:
        # `name` is the YAML's label for people (MLflow tags); the objective describes itself by its class.
        if kl_estimator not in KL_ESTIMATORS:
            raise ValueError(f"trainer.kl_estimator={kl_estimator!r}: choose one of {', '.join(KL_ESTIMATORS)} "
                             "(README: which KL each one's gradient gives; default k3)")
        self.forward = forward
        self.kl_coef = float(kl_coef)
        self.kl_estimator = kl_estimator
        self.kl_tokens = KL_ESTIMATORS[kl_estimator]  # per-token KL estimate, (log pi, log pi_ref) -> [rows, T]
        self.entropy_coef = float(entropy_coef)
        self.max_grad_norm = max_grad_norm
        self.truncation = truncation or Truncation()
        self.reducer = Reducer()  # batch-wide totals over the ranks that share the batch (one process: identity)
        # Whether the update reads log pi_ref: for its KL term only, so not at kl_coef = 0 (seeds 001 and 003),
        # where the reference forward is skipped and the KL is logged as nan (not measured). IPO always reads it.
        self.reads_reference = self.kl_coef != 0

    # The weight ceiling metrics compare raw weights against (clip fraction).
    weight_ceiling: float = float("inf")
    # True where the objective takes every batch-wide number (totals, maxima, its first row) from `reducer`
    # and takes as many optimizer steps and skipped micro-batches on every rank, so a batch split over
    # data-parallel ranks trains as one (src/distributed/data_parallel.py). A new loss opts in once it does.
    splits_over_ranks: bool = False

    def update(self, policy, reference, optimizer, batch: Batch) -> UpdateResult:
        raise NotImplementedError

    def advantages(self, rewards: torch.Tensor) -> torch.Tensor:
        """Each response's advantage from its group's K rewards ([G, K]): leave-one-out (eq. 1) by default.

        `update` computes them from the batch's groups; an asynchronous worker fixes them when it
        generates a group (SPEC 11), with the same function.
        """
        return leave_one_out_advantages(rewards)

    def reference_chunk(self, reference, chunk, cached, like: torch.Tensor) -> torch.Tensor | None:
        """Per-token log pi_ref of a micro-batch (`Forward.reference_tokens`), or None where the update reads none."""
        return self.forward.reference_tokens(reference, chunk, cached, like) if self.reads_reference else None

    def optimizer_step(self, policy, optimizer) -> None:
        self.reducer.before_step(policy)
        if self.max_grad_norm:
            torch.nn.utils.clip_grad_norm_(policy.parameters(), self.max_grad_norm)
        optimizer.step()


def batch_sequences(batch: Batch) -> tuple[list, list, torch.Tensor]:
    """The batch's trained rows as (prompt, response) id pairs, their stored log pi_ref (or None) and lengths."""
    groups = batch.groups
    sequences = [(groups[g].prompt_ids, groups[g].response_ids[j]) for g, j in batch.rows]
    cached = [groups[g].reference_logprobs[j] if groups[g].reference_logprobs is not None else None
              for g, j in batch.rows]
    token_counts = torch.tensor([float(len(response)) for _, response in sequences])
    return sequences, cached, token_counts
