"""The KL to the reference policy, estimated per response token (`trainer.kl_estimator`).

Schulman's estimators of KL[pi || ref] from tokens y ~ pi, with d = log ref(y) - log pi(y) (ratio r = e^d).
Their *values* and their *expected gradients as a per-token loss* (the token held fixed, the gradient
taken through log pi only, as autograd does on sampled rollouts) answer different questions:

  estimator          E_pi[value]                  E_pi[grad of the per-token loss] w.r.t. the logits
  k1 = -d            KL[pi || ref]  (unbiased)    0                  (E_pi[grad log pi] = 0: only noise)
  k2 = d^2 / 2       not KL (second-order close)  grad KL[pi || ref] (E_pi[-d grad log pi], exact)
  k3 = e^d - 1 - d   KL[pi || ref]  (unbiased)    grad KL[ref || pi] (E_pi[(1 - r) grad log pi] = -sum ref grad log pi)

so k3, the usual choice (TRL, GRPO), estimates the reverse KL's value but, as a loss, pulls pi
with the forward KL's gradient. tests/unit/test_losses.py checks all of this exactly over a 5-token vocabulary.
"""

from __future__ import annotations

from typing import Callable

import torch
from torch import Tensor

# Per-token KL estimate from (log pi, log pi_ref) tensors: kl_k1, kl_k2 or kl_k3.
KlEstimator = Callable[[Tensor, Tensor], Tensor]


def kl_k1(logprobs: Tensor, ref_logprobs: Tensor) -> Tensor:
    """Per-token k1 = log pi - log ref: unbiased for KL[pi || ref] in value, zero expected gradient as a loss."""
    return logprobs - ref_logprobs


def kl_k2(logprobs: Tensor, ref_logprobs: Tensor) -> Tensor:
    """Per-token k2 = (log pi - log ref)^2 / 2: biased in value; as a loss, the exact gradient of KL[pi || ref]."""
    return 0.5 * (logprobs - ref_logprobs) ** 2


def kl_k3(logprobs: Tensor, ref_logprobs: Tensor) -> Tensor:
    """Per-token k3 = r - 1 - log r with r = ref / pi: unbiased for KL[pi || ref]; as a loss, grad KL[ref || pi]."""
    log_ratio = ref_logprobs - logprobs
    return torch.expm1(log_ratio) - log_ratio  # expm1: no cancellation when pi is close to ref


KL_ESTIMATORS = {"k1": kl_k1, "k2": kl_k2, "k3": kl_k3}

