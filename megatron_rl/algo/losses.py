"""Policy losses behind one registry: grpo, gspo, gspo_token, sspo, gmpo, cispo.

Each loss is a small pure kernel that turns validated inputs into a per-token objective `[B, T]`
(a sequence- or segment-level objective is carried by its tokens) plus where it clipped.
`megatron_rl.algo.policy_loss` owns everything shared: validation, aggregation into one scalar,
metrics.
Notation: d_t = logp_t - old_logp_t on response tokens, |y_i| = response length of row i.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, NamedTuple

import torch
from torch import Tensor

from megatron_rl.algo.inputs import PolicyLossBatch
from megatron_rl.algo.loss_options import DEFAULT_DUAL_CLIP, LossOptions
from megatron_rl.algo.ratios import (
    ClippedObjective,
    dual_clip_bound,
    ppo_clip,
    ratio_from_log,
    segment_mean,
    segments_to_tokens,
    sequence_mean,
    token_log_ratio,
    token_share,
)


class UnitRatios(NamedTuple):
    """Importance ratios at the loss's own unit (token, segment or sequence), for metrics."""

    values: Tensor  # any shape
    valid: Tensor  # bool, same shape: which entries are real units


class TokenObjective(NamedTuple):
    """What a loss kernel returns. All `[B, T]`, zero / False off the mask."""

    objective: Tensor  # surrogate to maximise, per token
    clipped_low: Tensor  # bool
    clipped_high: Tensor  # bool
    unit_ratios: UnitRatios
    extra_metrics: dict[str, Tensor]
    clipped_dual: Tensor | None = None  # bool; None for a loss without dual-clip


def _spread(per_sequence: Tensor, mask: Tensor) -> Tensor:
    """`[B]` -> `[B, T]`: the row's value on its response tokens, 0 (or False) elsewhere."""
    spread = per_sequence[:, None].expand(mask.shape)
    return torch.where(mask, spread, torch.zeros_like(spread))


def _detached_unit_exp(log_p: Tensor, mask: Tensor) -> Tensor:
    """exp(logp_t - sg[logp_t]) on response tokens: value 1, gradient d logp_t."""
    log_p = torch.where(mask, log_p, torch.zeros_like(log_p))
    return torch.exp(log_p - log_p.detach())


def grpo_objective(
    batch: PolicyLossBatch, clip_low: float, clip_high: float, options: LossOptions
) -> TokenObjective:
    """GRPO (DeepSeekMath, arXiv 2402.03300, Eq. 3 without the KL term): token ratio
    r_t = exp(d_t), obj_t = min(r_t A_t, clip(r_t, 1 - clip_low, 1 + clip_high) A_t), for
    A_t < 0 bounded below by dual_clip * A_t."""
    mask = batch.mask
    ratio = ratio_from_log(token_log_ratio(batch.logp, batch.old_logp, mask))
    clipped = ppo_clip(
        ratio, batch.token_advantages(), 1 - clip_low, 1 + clip_high, options.dual_clip
    )
    return TokenObjective(
        objective=torch.where(mask, clipped.objective, torch.zeros_like(ratio)),
        clipped_low=clipped.clipped_low & mask,
        clipped_high=clipped.clipped_high & mask,
        unit_ratios=UnitRatios(ratio, mask),
        extra_metrics={},
        clipped_dual=clipped.clipped_dual & mask,
    )


def _on_mask(clipped: ClippedObjective, mask: Tensor) -> ClippedObjective:
    """`clipped` with its objective 0 and its flags False off the mask."""
    return ClippedObjective(
        torch.where(mask, clipped.objective, torch.zeros_like(clipped.objective)),
        clipped.clipped_low & mask,
        clipped.clipped_high & mask,
        clipped.clipped_dual & mask,
    )


def _sequence_ratio_objective(
    batch: PolicyLossBatch,
    advantages: Tensor,
    clip_low: float,
    clip_high: float,
    dual_clip: float | None,
) -> tuple[ClippedObjective, Tensor]:
    """GSPO's clipped objective on every token `[B, T]`, its ratio s_it = sg[s_i] *
    exp(logp_t - sg[logp_t]) (`token_share`), `advantages` `[B, 1]` or `[B, T]`; and the
    sequence ratios s_i `[B]`."""
    mask = batch.mask
    log_ratio = token_log_ratio(batch.logp, batch.old_logp, mask)
    log_seq_ratio = sequence_mean(log_ratio.detach(), mask, batch.shard_sum)
    ratio = ratio_from_log(token_share(_spread(log_seq_ratio, mask), log_ratio))
    clipped = ppo_clip(ratio, advantages, 1 - clip_low, 1 + clip_high, dual_clip)
    return _on_mask(clipped, mask), ratio_from_log(log_seq_ratio)


def gspo_objective(
    batch: PolicyLossBatch, clip_low: float, clip_high: float, options: LossOptions
) -> TokenObjective:
    """GSPO (arXiv 2507.18071, Eq. 5 with s_i from Eq. 7): s_i = exp(sum_t d_t / |y_i|),
    obj_i = min(s_i A_i, clip(s_i, 1 - clip_low, 1 + clip_high) A_i); whole sequences clip (and,
    with dual_clip, bound at dual_clip * A_i for A_i < 0). Each token carries obj_i with the
    gradient of its own log-prob only (`token_share`): the gradient of obj_i spread over the
    row, and a per-token weight acts on its own token alone."""
    advantages = batch.sequence_advantages("gspo")[:, None]
    clipped, seq_ratio = _sequence_ratio_objective(
        batch, advantages, clip_low, clip_high, options.dual_clip
    )
    return TokenObjective(
        objective=clipped.objective,
        clipped_low=clipped.clipped_low,
        clipped_high=clipped.clipped_high,
        unit_ratios=UnitRatios(seq_ratio, batch.mask.any(dim=1)),
        extra_metrics={},
        clipped_dual=clipped.clipped_dual,
    )


def gspo_token_objective(
    batch: PolicyLossBatch, clip_low: float, clip_high: float, options: LossOptions
) -> TokenObjective:
    """GSPO-token (arXiv 2507.18071, Eq. 13 with s_it from Eq. 14): s_it = sg[s_i] *
    exp(logp_t - sg[logp_t]), per-token clip with per-token advantages. Its value is s_i and its
    gradient in logp_t is s_i, so with per-sequence advantages it equals GSPO exactly."""
    mask = batch.mask
    clipped, seq_ratio = _sequence_ratio_objective(
        batch, batch.token_advantages(), clip_low, clip_high, options.dual_clip
    )
    return TokenObjective(
        objective=clipped.objective,
        clipped_low=clipped.clipped_low,
        clipped_high=clipped.clipped_high,
        unit_ratios=UnitRatios(seq_ratio[:, None].expand(mask.shape), mask),
        extra_metrics={},
        clipped_dual=clipped.clipped_dual,
    )


def sspo_objective(
    batch: PolicyLossBatch, clip_low: float, clip_high: float, options: LossOptions
) -> TokenObjective:
    """SSPO (arXiv 2511.04256): segment ratio s_ij = exp(mean of d_t over segment j of row i),
    clipped to [lower_ij, upper_ij] with H_ij the mean old-policy entropy of the segment:
    upper_ij = 1 + clip_high + beta * H_ij (the paper's 1 + eps + H with beta = 1);
    lower_ij = max(1 - clip_low - beta * H_ij, 1e-3) ("entropy") or 1 - clip_low ("fixed").
    Every token carries its segment's objective, with the gradient of its own log-prob only
    (`token_share`), so seq-mean-token-mean gives -mean_i(sum_j |y_ij| obj_ij / |y_i|)."""
    mask, segment_ids = batch.mask, batch.segment_ids
    assert segment_ids is not None  # checked by policy_loss
    log_ratio = token_log_ratio(batch.logp, batch.old_logp, mask)
    segments = segment_mean(log_ratio.detach(), segment_ids, mask, batch.shard_sum)
    seg_ratio = ratio_from_log(segments.means)  # [B, S]
    if options.sspo_entropy_coef != 0.0:
        assert batch.old_entropy is not None  # checked by policy_loss
        entropy = segment_mean(batch.old_entropy, segment_ids, mask, batch.shard_sum).means
        spread = options.sspo_entropy_coef * entropy
    else:
        spread = torch.zeros_like(seg_ratio)
    upper = 1 + clip_high + spread
    if options.sspo_lower == "entropy":
        lower = (1 - clip_low - spread).clamp(min=1e-3)
    else:
        lower = torch.full_like(seg_ratio, 1 - clip_low)

    def on_tokens(per_segment: Tensor) -> Tensor:
        return segments_to_tokens(per_segment, segment_ids, mask)

    ratio = ratio_from_log(token_share(on_tokens(segments.means), log_ratio))
    advantages = batch.sequence_advantages("sspo")[:, None]
    dual_clip = options.dual_clip
    clipped = _on_mask(
        ppo_clip(ratio, advantages, on_tokens(lower), on_tokens(upper), dual_clip), mask
    )
    # The same decisions per segment, for the segment-level clip fraction.
    seg_clipped = ppo_clip(seg_ratio, advantages.expand_as(seg_ratio), lower, upper, dual_clip)
    valid_segments = segments.counts > 0
    clipped_segments = (seg_clipped.clipped_low | seg_clipped.clipped_high) & valid_segments
    return TokenObjective(
        objective=clipped.objective,
        clipped_low=clipped.clipped_low,
        clipped_high=clipped.clipped_high,
        unit_ratios=UnitRatios(seg_ratio, valid_segments),
        extra_metrics={
            "clip_frac/segment": clipped_segments.sum() / valid_segments.sum(),
            "segments/per_seq": valid_segments.sum() / mask.any(dim=1).sum(),
        },
        clipped_dual=clipped.clipped_dual,
    )


def gmpo_objective(
    batch: PolicyLossBatch, clip_low: float, clip_high: float, options: LossOptions
) -> TokenObjective:
    """GMPO (arXiv 2507.20673, Eq. 4): the geometric mean over tokens of the PPO-clipped token
    terms, J_i = A_i * exp(mean_t l_t), with the token log-ratio clipped one-sidedly in log space:
    l_t = min(d_t, clip_high) when A_i > 0 and max(d_t, -clip_low) when A_i < 0, i.e. the ratio is
    clipped to [e^-clip_low, e^clip_high] (paper: clip_low = clip_high = 0.4). For A_i < 0 the
    mean is unbounded above; dual_clip bounds J_i at dual_clip * A_i there. Each token carries
    J_i with the gradient of its own l_t only (`token_share`), the gradient of J_i spread over
    the row."""
    mask = batch.mask
    log_ratio = token_log_ratio(batch.logp, batch.old_logp, mask)
    advantages = batch.sequence_advantages("gmpo")
    token_adv = advantages[:, None].expand_as(log_ratio)
    clipped_high = (token_adv > 0) & (log_ratio > clip_high) & mask
    clipped_low = (token_adv < 0) & (log_ratio < -clip_low) & mask
    clipped_log_ratio = torch.where(
        clipped_high,
        torch.full_like(log_ratio, clip_high),
        torch.where(clipped_low, torch.full_like(log_ratio, -clip_low), log_ratio),
    )
    log_geometric = sequence_mean(clipped_log_ratio.detach(), mask, batch.shard_sum)
    ratio = ratio_from_log(token_share(_spread(log_geometric, mask), clipped_log_ratio))
    objective, bound = dual_clip_bound(token_adv * ratio, ratio, token_adv, options.dual_clip)
    return TokenObjective(
        objective=torch.where(mask, objective, torch.zeros_like(objective)),
        clipped_low=clipped_low,
        clipped_high=clipped_high,
        unit_ratios=UnitRatios(
            ratio_from_log(sequence_mean(log_ratio.detach(), mask, batch.shard_sum)),
            mask.any(dim=1),
        ),
        extra_metrics={},
        clipped_dual=bound & mask,
    )


def cispo_objective(
    batch: PolicyLossBatch, clip_low: float, clip_high: float, options: LossOptions
) -> TokenObjective:
    """CISPO (MiniMax-M1, arXiv 2506.13585, Eq. 4 with r-hat from Eq. 5): every token keeps its
    gradient, weighted by the stop-gradient clipped ratio r-hat_t = clip(r_t, 1 - clip_low,
    1 + clip_high): grad = sg(r-hat_t) A_t grad logp_t. The paper writes the surrogate as
    sg(r-hat) A log pi; we use sg(r-hat) A exp(logp - sg(logp)), which has the same gradient and
    whose value (r-hat A) is comparable with the other losses. The paper sets no lower bound
    (clip_low >= 1 does that) and divides by the token count (loss_agg='token-mean')."""
    mask = batch.mask
    ratio = ratio_from_log(token_log_ratio(batch.logp, batch.old_logp, mask))
    weight = ratio.clamp(min=1 - clip_low, max=1 + clip_high).detach()
    objective = weight * batch.token_advantages() * _detached_unit_exp(batch.logp, mask)
    return TokenObjective(
        objective=torch.where(mask, objective, torch.zeros_like(objective)),
        clipped_low=(ratio < 1 - clip_low) & mask,
        clipped_high=(ratio > 1 + clip_high) & mask,
        unit_ratios=UnitRatios(ratio, mask),
        extra_metrics={},
    )


@dataclass(frozen=True)
class PolicyLoss:
    """A registered loss: its kernel, its own options and where it comes from."""

    # (validated inputs, clip_low, clip_high, options) -> the per-token objective
    kernel: Callable[[PolicyLossBatch, float, float, LossOptions], TokenObjective]
    unit: str  # "token", "segment" or "sequence": where the importance ratio lives
    paper: str
    # (clip_low, clip_high) we suggest; docs/algorithms.md says which come from the paper.
    default_clip: tuple[float, float]
    # its own options (LossOptions fields beyond the common ones) -> their defaults
    options: dict[str, Any] = field(default_factory=dict)
    needs_segments: bool = False
    # The old policy's token entropy (SSPO's entropy-adaptive bounds at its default options),
    # which only a forward of the old policy gives; the engine returns log-probs alone.
    needs_old_entropy: bool = False


POLICY_LOSSES: dict[str, PolicyLoss] = {
    "grpo": PolicyLoss(
        grpo_objective,
        "token",
        "arXiv 2402.03300",
        (0.2, 0.27),
        options={"dual_clip": DEFAULT_DUAL_CLIP},
    ),
    "gspo": PolicyLoss(
        gspo_objective,
        "sequence",
        "arXiv 2507.18071",
        (3e-4, 4e-4),
        options={"dual_clip": DEFAULT_DUAL_CLIP},
    ),
    "gspo_token": PolicyLoss(
        gspo_token_objective,
        "token",
        "arXiv 2507.18071",
        (3e-4, 4e-4),
        options={"dual_clip": DEFAULT_DUAL_CLIP},
    ),
    "sspo": PolicyLoss(
        sspo_objective,
        "segment",
        "arXiv 2511.04256",
        (0.2, 0.2),
        options={
            "sspo_entropy_coef": 1.0,
            "sspo_lower": "entropy",
            "dual_clip": DEFAULT_DUAL_CLIP,
        },
        needs_segments=True,
        needs_old_entropy=True,
    ),
    "gmpo": PolicyLoss(
        gmpo_objective,
        "sequence",
        "arXiv 2507.20673",
        (0.4, 0.4),
        options={"dual_clip": DEFAULT_DUAL_CLIP},
    ),
    "cispo": PolicyLoss(cispo_objective, "token", "arXiv 2506.13585", (1.0, 0.28)),
}


def policy_loss_names() -> tuple[str, ...]:
    """The valid loss names, in registry order."""
    return tuple(POLICY_LOSSES)


def get_policy_loss(name: object) -> PolicyLoss:
    """The registry entry for `name`; an unknown name lists the valid ones."""
    if not isinstance(name, str) or name not in POLICY_LOSSES:
        raise ValueError(
            f"name: unknown policy loss {name!r}; valid names: {', '.join(POLICY_LOSSES)}"
        )
    return POLICY_LOSSES[name]
