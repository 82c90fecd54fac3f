"""Pure tensor maths of RL post-training: advantages, segments, ratios and policy losses, and
how the metrics they report combine (reductions).

This package imports only torch, so every formula can be tested and reused without Megatron.
"""

from megatron_rl.algo.advantages import (
    GroupAdvantages,
    group_advantages,
    overlong_penalty,
    zero_variance_groups,
)
from megatron_rl.algo.aggregation import DEFAULT_LOSS_AGG, LOSS_AGG_MODES, policy_loss_denominator
from megatron_rl.algo.kl import KL_ESTIMATORS, kl_to_reference
from megatron_rl.algo.loss_options import DEFAULT_DUAL_CLIP, LossOptions
from megatron_rl.algo.losses import POLICY_LOSSES, PolicyLoss, get_policy_loss, policy_loss_names
from megatron_rl.algo.mismatch import (
    MISMATCH_CORRECTIONS,
    MISMATCH_LEVELS,
    MISMATCH_METRICS,
    MismatchCorrection,
    engine_gap_metrics,
)
from megatron_rl.algo.policy_loss import (
    LOSS_METRICS,
    PolicyLossSpec,
    compute_policy_loss,
    policy_loss,
)
from megatron_rl.algo.ratios import EXTREME_RATIO_TAUS, LOG_RATIO_CLAMP, extreme_token_frac
from megatron_rl.algo.reductions import MetricDeclarations, MetricReductions, Reduction
from megatron_rl.algo.segments import subsentence_segment_ids

__all__ = [
    "DEFAULT_DUAL_CLIP",
    "DEFAULT_LOSS_AGG",
    "EXTREME_RATIO_TAUS",
    "KL_ESTIMATORS",
    "LOG_RATIO_CLAMP",
    "LOSS_AGG_MODES",
    "LOSS_METRICS",
    "MISMATCH_CORRECTIONS",
    "MISMATCH_LEVELS",
    "MISMATCH_METRICS",
    "POLICY_LOSSES",
    "GroupAdvantages",
    "LossOptions",
    "MetricDeclarations",
    "MetricReductions",
    "MismatchCorrection",
    "PolicyLoss",
    "PolicyLossSpec",
    "Reduction",
    "compute_policy_loss",
    "engine_gap_metrics",
    "extreme_token_frac",
    "get_policy_loss",
    "group_advantages",
    "kl_to_reference",
    "overlong_penalty",
    "policy_loss",
    "policy_loss_denominator",
    "policy_loss_names",
    "subsentence_segment_ids",
    "zero_variance_groups",
]
