"""`loss=rloo`: Replay-RLOO's objective, one optimizer step on eq. 3 (SPEC 4; paper eqs. 1-3)."""

from __future__ import annotations

from collections import defaultdict

import torch

from src.batch import Batch
from src.loss.base import Objective, UpdateResult, batch_sequences
from src.losses import truncated_importance_weights
from src.objective import importance_weights, leave_one_out_advantages, rloo_loss
from src.policy.forward import place_tokens, row_values


class RlooObjective(Objective):
    """L = -(1/B) sum_i w_i A_i log pi(y_i|x_i) + beta_KL KL - beta_H H over the batch's trained responses.

    A_i: leave-one-out advantages from the group's K rewards (eq. 1), also for a FIFO draw that
    trains only some of them. w_i: 1 for fresh rows (mu = pi_theta now), min(c, pi/mu) for
    replayed rows (eq. 2), and for fresh rows of a stale or tempered sampler seed 002's truncated
    exp(clip(log pi - log mu, log rho_min, log rho_max)), per response or per token. Weights are
    constants in the gradient. Micro-batch terms are normalised by the full batch (`rloo_loss`), so
    the accumulated gradient equals the one-batch gradient exactly; `autocast="bfloat16"` runs the
    forward passes in bf16 on fp32 weights (bf16 weights would round lr-1e-5 updates away).
    """

    def __init__(self, clip_ceiling: float, **settings) -> None:
        super().__init__(**settings)
        self.clip_ceiling = float(clip_ceiling)
        self.weight_ceiling = self.clip_ceiling

    def update(self, policy, reference, optimizer, batch: Batch) -> UpdateResult:
        groups, rows = batch.groups, batch.rows
        loo = leave_one_out_advantages(torch.tensor([g.rewards for g in groups], dtype=torch.float32))
        advantages = loo[[g for g, _ in rows], [j for _, j in rows]]
        sequences, cached_reference, token_counts = batch_sequences(batch)
        # Fresh groups have no behaviour log-probs yet: mu = pi_theta now, so their weight is exactly 1.
        behaviour = [groups[g].behaviour_logprobs[j] if groups[g].behaviour_logprobs is not None else None
                     for g, j in rows]
        off_policy_rows = torch.tensor(batch.row_off_policy(), dtype=torch.bool)
        token_level = bool(off_policy_rows.any()) and self.truncation.is_level == "token"
        behaviour_tokens = [groups[g].behaviour_token_logprobs[j] if token_level and off else None
                            for (g, j), off in zip(rows, off_policy_rows.tolist())]
        size, total_tokens = len(sequences), int(token_counts.sum())
        logprobs, raw_weights, weights = torch.zeros(size), torch.ones(size), torch.ones(size)
        kl_sums = torch.zeros(size)
        reference_tokens: list[tuple[float, ...]] = [()] * size
        totals = defaultdict(float)

        policy.train()
        optimizer.zero_grad(set_to_none=True)
        for index in self.forward.batches(sequences):
            chunk = [sequences[i] for i in index]
            token_logprobs, entropy, mask = self.forward.token_stats(policy, chunk, with_entropy=True)
            reference_logprobs = self.forward.reference_tokens(reference, chunk, [cached_reference[i] for i in index],
                                                               like=token_logprobs)
            mask = mask.float()
            current = (token_logprobs * mask).sum(-1).detach().cpu()                # log pi_theta(y|x)
            mu = torch.tensor([behaviour[i] if behaviour[i] is not None else current[n].item()
                               for n, i in enumerate(index)])
            clipped, raw = importance_weights(current, mu, self.clip_ceiling)     # eq. 2
            off_policy = off_policy_rows[index]
            if off_policy.any():  # seed 002 eq. 3
                truncated, truncated_raw = truncated_importance_weights(current, mu, self.truncation.is_min,
                                                                        self.truncation.is_max)
                clipped, raw = torch.where(off_policy, truncated, clipped), torch.where(off_policy, truncated_raw, raw)
            token_weights = clipped.to(mask.device)[:, None].expand_as(mask)  # a sequence weight on each token
            if off_policy.any() and token_level:
                mu_tokens = place_tokens(chunk, [behaviour_tokens[i] for i in index], torch.zeros_like(mask))
                per_token, _ = truncated_importance_weights(token_logprobs.detach().float(), mu_tokens,
                                                            self.truncation.is_min, self.truncation.is_max,
                                                            level="token", mask=mask)
                token_weights = torch.where(off_policy.to(mask.device)[:, None], per_token, token_weights)
                token_mean = (per_token * mask).sum(-1).cpu() / mask.sum(-1).clamp(min=1).cpu()
                clipped = torch.where(off_policy, token_mean, clipped)  # logged: the mean token weight
            terms = rloo_loss(token_logprobs, reference_logprobs, entropy, mask,
                              advantages[index].to(mask.device), token_weights, batch_size=size,
                              total_tokens=total_tokens, kl_coef=self.kl_coef, entropy_coef=self.entropy_coef,
                              kl_estimator=self.kl_tokens)
            terms.loss.backward()

            logprobs[index], raw_weights[index], weights[index] = current, raw, clipped
            for i, tokens in zip(index, row_values(reference_logprobs, mask)):
                reference_tokens[i] = tokens
            kl_sums[index] = terms.kl_tokens.sum(-1).detach().cpu()
            for key, value in (("loss", terms.loss), ("policy_loss", terms.policy), ("kl", terms.kl),
                               ("entropy", terms.entropy)):
                totals[key] += value.item()
        self.optimizer_step(policy, optimizer)
        return UpdateResult(logprobs=logprobs, raw_weights=raw_weights, weights=weights, kl_sums=kl_sums,
                            token_counts=token_counts, reference_tokens=reference_tokens, **totals)
