"""Log-ratio reductions at token, segment and sequence level, and the one-sided PPO clip.

All functions are vectorised over rows and tokens (scatter/segment sums, no Python loops) and use
O(B*T) memory. Padding may hold any value, NaN included: masked positions are selected away with
`torch.where`, which also keeps their gradient exactly zero.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import NamedTuple

import torch
from torch import Tensor

# Sums partial per-sequence statistics over the ranks that hold pieces of the same sequences
# (context parallelism). Must be differentiable; the identity when sequences are whole.
ShardSum = Callable[[Tensor], Tensor]


def whole_sequences(partial: Tensor) -> Tensor:
    """The ShardSum of unsharded sequences: every rank already holds the whole sum."""
    return partial


def token_log_ratio(logp: Tensor, old_logp: Tensor, mask: Tensor) -> Tensor:
    """d_t = logp_t - old_logp_t on response tokens, 0 elsewhere. All tensors `[B, T]`."""
    return torch.where(mask, logp - old_logp, torch.zeros_like(logp))


# |log r| beyond which a ratio is formed from the clamped log-ratio: exp(20) ~ 4.9e8 keeps
# exp() and its gradient finite in float32 (exp overflows at 88.7), and no ratio a clip range
# or a correction band admits lies anywhere near it.
LOG_RATIO_CLAMP = 20.0


def ratio_from_log(log_ratio: Tensor) -> Tensor:
    """exp(log_ratio), with the log-ratio clamped to [-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP]: equal
    to exp() inside the clamp; outside it the value stops growing and the gradient is 0."""
    return torch.exp(log_ratio.clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP))


def token_share(unit_log_ratio: Tensor, log_ratio: Tensor) -> Tensor:
    """sg[L_u] + d_t - sg[d_t], `[B, T]`: each token's value is its unit's log-ratio L_u
    (`unit_log_ratio`: a sequence's or segment's, already on its tokens) and its gradient is its
    own token's d_t alone (`log_ratio`): GSPO-token's form (arXiv 2507.18071, Eq. 14) in log
    space.

    Summed over a unit's n_u tokens with one weight w, the gradient in logp_t is w * f'(L_u) for
    any objective f of the unit's ratio, exactly what the unit's objective spread over its tokens
    gives: d(n_u * w * f(L_u)) / d logp_t = w * f'(L_u). Unlike that, a per-token weight (a
    token-level mismatch correction) then acts on its own token only: a token weighted 0 gets no
    gradient. No gradient crosses to other tokens, so none crosses context-parallel ranks either.
    """
    return unit_log_ratio.detach() + (log_ratio - log_ratio.detach())


# The F(tau) thresholds: the share of tokens whose probability differs by more than tau times.
# 1.25 is the share outside [0.8, 1.25], the routing-drift harness's tail measure.
EXTREME_RATIO_TAUS = (1.25, 2, 5)


def extreme_token_frac(log_ratio: Tensor, mask: Tensor, tau: float) -> Tensor:
    """F(tau): the share of response tokens with max(r, 1/r) > tau, r = exp(`log_ratio`) (e.g.
    p_train / p_engine). `log_ratio` and `mask` `[B, T]`; 0 when no token is masked in."""
    extreme = mask & (log_ratio.abs() > math.log(tau))
    return extreme.sum() / mask.sum().clamp(min=1)


def response_lengths(
    mask: Tensor, dtype: torch.dtype, shard_sum: ShardSum = whole_sequences
) -> Tensor:
    """|y_i|: `[B]` number of response tokens per row (over all shards), as `dtype`."""
    return shard_sum(mask.sum(dim=1).to(dtype))


def sequence_mean(values: Tensor, mask: Tensor, shard_sum: ShardSum = whole_sequences) -> Tensor:
    """`[B]` mean of `values` `[B, T]` over each row's response tokens (0 for an empty row)."""
    masked = torch.where(mask, values, torch.zeros_like(values))
    total, length = shard_sum(torch.stack([masked.sum(dim=1), mask.sum(dim=1).to(values.dtype)]))
    return total / length.clamp(min=1)


class SegmentMeans(NamedTuple):
    """Per-segment means, indexed `[B, S]` by segment id (S = T bounds the ids of a row)."""

    means: Tensor  # [B, S] mean over the segment's response tokens (0 where the segment is empty)
    counts: Tensor  # [B, S] number of response tokens in the segment


def segment_mean(
    values: Tensor, segment_ids: Tensor, mask: Tensor, shard_sum: ShardSum = whole_sequences
) -> SegmentMeans:
    """Mean of `values` `[B, T]` over each segment; `segment_ids` `[B, T]` in [0, T) on the mask.

    Segment ids index segments within their row. Off-mask tokens are scattered into slot 0 with
    weight 0, so they never touch a segment's sum or count.
    """
    slots = torch.where(mask, segment_ids, torch.zeros_like(segment_ids))
    masked_values = torch.where(mask, values, torch.zeros_like(values))
    sums = torch.zeros_like(values).scatter_add(1, slots, masked_values)
    counts = torch.zeros_like(values).scatter_add(1, slots, mask.to(values.dtype))
    sums, counts = shard_sum(torch.stack([sums, counts]))
    return SegmentMeans(means=sums / counts.clamp(min=1), counts=counts)


def segments_to_tokens(per_segment: Tensor, segment_ids: Tensor, mask: Tensor) -> Tensor:
    """Spread `[B, S]` per-segment values back onto tokens: `[B, T]`, 0 off the mask."""
    slots = torch.where(mask, segment_ids, torch.zeros_like(segment_ids))
    gathered = per_segment.gather(1, slots)
    return torch.where(mask, gathered, torch.zeros_like(gathered))


class ClippedObjective(NamedTuple):
    """One-sided PPO clip of a ratio; every field has the ratio's shape."""

    objective: Tensor  # min(r*A, clip(r, lower, upper)*A): the surrogate to maximise
    clipped_low: Tensor  # bool: A < 0 and r < lower (the clipped branch is taken, no gradient)
    clipped_high: Tensor  # bool: A > 0 and r > upper
    clipped_dual: Tensor  # bool: A < 0 and r > dual_clip (the objective is c*A, no gradient)


def dual_clip_bound(
    objective: Tensor, ratio: Tensor, advantages: Tensor, dual_clip: float | None
) -> tuple[Tensor, Tensor]:
    """PPO dual-clip (Ye et al. 2020, arXiv 1912.09729): for A < 0 the objective is bounded
    below by c*A, which binds where r > c; returns (objective, where it bound). Without it the
    gradient of a negative-advantage unit grows with its ratio. `dual_clip` None: no bound."""
    if dual_clip is None:
        return objective, torch.zeros_like(ratio, dtype=torch.bool)
    bound = (advantages < 0) & (ratio > dual_clip)
    return torch.where(bound, dual_clip * advantages, objective), bound


def ppo_clip(
    ratio: Tensor,
    advantages: Tensor,
    lower: Tensor | float,
    upper: Tensor | float,
    dual_clip: float | None = None,
) -> ClippedObjective:
    """PPO-clip, one-sided by the advantage's sign: min(r*A, clip(r, lower, upper)*A), and with
    `dual_clip` c, for A < 0, max of that and c*A (`dual_clip_bound`).

    Written with `torch.where` rather than `torch.minimum` so that the clipped branch carries
    exactly zero gradient and the unclipped one exactly A, with no tie-splitting at r == bound.
    `lower` and `upper` broadcast against `ratio` and are treated as constants.
    """
    lower_t = torch.as_tensor(lower, dtype=ratio.dtype, device=ratio.device)
    upper_t = torch.as_tensor(upper, dtype=ratio.dtype, device=ratio.device)
    clipped_high = (advantages > 0) & (ratio > upper_t)
    clipped_low = (advantages < 0) & (ratio < lower_t)
    bound = torch.where(clipped_high, upper_t, lower_t)
    objective = torch.where(clipped_high | clipped_low, bound * advantages, ratio * advantages)
    objective, clipped_dual = dual_clip_bound(objective, ratio, advantages, dual_clip)
    return ClippedObjective(objective, clipped_low, clipped_high, clipped_dual)
