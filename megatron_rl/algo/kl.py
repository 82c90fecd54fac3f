"""KL divergence to a frozen reference policy, per token, by the usual sampled estimators.

With x = ref_logp_t - logp_t on a token sampled from the current policy (Schulman, "Approximating
KL divergence", 2020; k3 is DeepSeekMath's and verl's "low_var_kl"):

| estimator | per token      | its value as KL(pi || ref)   | its gradient as a loss term  |
|-----------|----------------|------------------------------|------------------------------|
| `k1`      | -x             | unbiased, can be negative    | grad logp: 0 in expectation  |
| `k2`      | x^2 / 2        | biased (little for small x)  | unbiased for grad KL         |
| `k3`      | exp(x) - 1 - x | unbiased, >= 0, low variance | biased                       |

(gradients on samples from the current policy.)
"""

from __future__ import annotations

import torch
from torch import Tensor

from megatron_rl.algo.ratios import LOG_RATIO_CLAMP

KL_ESTIMATORS = ("k1", "k2", "k3")


def check_kl_estimator(name: object) -> str:
    """`name` if it is one of KL_ESTIMATORS; else an error listing them."""
    if name not in KL_ESTIMATORS:
        raise ValueError(
            f"kl_estimator: unknown estimator {name!r}; valid: {', '.join(KL_ESTIMATORS)}"
        )
    return str(name)


def kl_to_reference(logp: Tensor, ref_logp: Tensor, mask: Tensor, estimator: str) -> Tensor:
    """`[B, T]` per-token estimate of KL(pi || ref) from the current log-probs `logp` (carrying
    the gradient) and the reference's `ref_logp`, 0 off `mask`. k3's exponent is clamped like
    the policy ratios (megatron_rl.algo.ratios.LOG_RATIO_CLAMP) so that it stays finite."""
    x = torch.where(mask, ref_logp - logp, torch.zeros_like(logp))
    if estimator == "k1":
        kl = -x
    elif estimator == "k2":
        kl = 0.5 * x.square()
    else:
        kl = torch.exp(x.clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)) - 1 - x
    return torch.where(mask, kl, torch.zeros_like(kl))
