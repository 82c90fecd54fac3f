"""The options of a policy loss, as one typed, checked object (`LossOptions.checked`).

Every loss takes the common options; a loss takes its own (dual-clip, SSPO's bounds) only where
the registry (`megatron_rl.algo.losses.POLICY_LOSSES`) lists them, and `PolicyLossSpec.of`
refuses the others by name. What a call brings with it (the tensors, a global denominator,
the context-parallel sum) is not an option: it is an argument of `policy_loss`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, fields
from typing import Any

from megatron_rl.algo.aggregation import DEFAULT_LOSS_AGG, check_aggregation
from megatron_rl.algo.inputs import check_bound
from megatron_rl.algo.kl import check_kl_estimator
from megatron_rl.algo.mismatch import MismatchCorrection

SSPO_LOWER_MODES = ("entropy", "fixed")

# PPO dual-clip's c, the default of every loss that takes the option (verl's clip_ratio_c): a
# unit with a negative advantage whose ratio grew past c contributes c * A and no gradient.
# Sequence- and segment-level ratios clip at ~1e-4 and rarely get there, but one that does
# (a sequence log-ratio of 20 has s = e^20) would otherwise get a gradient of that order.
DEFAULT_DUAL_CLIP = 3.0


@dataclass(frozen=True, kw_only=True)
class LossOptions:
    """A policy loss's options, checked (build them with `LossOptions.checked`)."""

    loss_agg: str = DEFAULT_LOSS_AGG
    """How token objectives become one scalar (`aggregation.LOSS_AGG_MODES`)."""
    max_response_len: int | None = None
    """Dr. GRPO's constant normaliser (loss_agg='seq-mean-token-sum-norm' only)."""
    check_finite: bool = True
    """Refuse NaN or inf on response tokens (one host sync)."""
    mismatch: MismatchCorrection | None = None
    """A training-inference mismatch correction: each token's objective weighted by it."""
    entropy_coef: float = 0.0
    """An entropy bonus: this times the aggregated current-policy entropy is added."""
    kl_coef: float = 0.0
    """A KL penalty: this times the aggregated estimate to the reference is subtracted."""
    kl_estimator: str = "k3"
    """k1, k2 or k3 (`megatron_rl.algo.kl`)."""
    dual_clip: float | None = None
    """PPO dual-clip's c (losses that take it; None: off)."""
    sspo_entropy_coef: float = 1.0
    """sspo: beta, how much the segment's old-policy entropy widens its clip bounds."""
    sspo_lower: str = "entropy"
    """sspo: the lower clip bound, `entropy` or `fixed` (docs/algorithms.md, sspo)."""

    @classmethod
    def checked(cls, **given: Any) -> LossOptions:
        """The options `given` (the rest at their defaults), each checked by name."""
        values = {item.name: item.default for item in fields(cls)} | given
        correction = values["mismatch"]
        if correction is not None and not isinstance(correction, MismatchCorrection):
            raise ValueError(
                f"mismatch: expected None or a MismatchCorrection (MismatchCorrection.of('tis')), "
                f"got {correction!r}"
            )
        check_aggregation(values["loss_agg"], values["max_response_len"])
        check_kl_estimator(values["kl_estimator"])
        if values["sspo_lower"] not in SSPO_LOWER_MODES:
            raise ValueError(
                f"sspo_lower: unknown mode {values['sspo_lower']!r}; valid modes: "
                f"{', '.join(SSPO_LOWER_MODES)}"
            )
        return cls(
            **values
            | {
                "check_finite": bool(values["check_finite"]),
                "entropy_coef": check_bound("entropy_coef", values["entropy_coef"]),
                "kl_coef": check_bound("kl_coef", values["kl_coef"]),
                "dual_clip": _check_dual_clip(values["dual_clip"]),
                "sspo_entropy_coef": check_bound("sspo_entropy_coef", values["sspo_entropy_coef"]),
            }
        )


def _check_dual_clip(value: object) -> float | None:
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int | float) or not 1 < value < math.inf:
        raise ValueError(
            f"dual_clip: expected None (off) or a finite number > 1 (PPO dual-clip's c, "
            f"commonly 3), got {value!r}"
        )
    return float(value)
