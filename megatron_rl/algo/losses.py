"""Policy losses behind one registry: grpo, gspo, gspo_token, sspo, gmpo, cispo.

Each loss is a small pure kernel that turns validated inputs into a per-token objective `[B, T]`
(a sequence- or segment-level objective is spread over its tokens) plus where it clipped.
`compute_policy_loss` owns everything shared: validation, aggregation into one scalar, metrics.
Notation: d_t = logp_t - old_logp_t on response tokens, |y_i| = response length of row i.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, NamedTuple

import torch
from torch import Tensor

from megatron_rl.algo.aggregation import DEFAULT_LOSS_AGG, aggregation
from megatron_rl.algo.inputs import PolicyLossBatch, check_bound, validate_policy_loss_inputs
from megatron_rl.algo.kl import check_kl_estimator, kl_to_reference
from megatron_rl.algo.mismatch import MismatchCorrection, mismatch_metrics, mismatch_weights
from megatron_rl.algo.ratios import (
    EXTREME_RATIO_TAUS,
    ClippedObjective,
    dual_clip_bound,
    extreme_token_frac,
    ppo_clip,
    ratio_from_log,
    segment_mean,
    segments_to_tokens,
    sequence_mean,
    token_log_ratio,
    token_share,
    whole_sequences,
)
from megatron_rl.algo.reductions import MetricDeclarations, Reduction


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
    batch: PolicyLossBatch, clip_low: float, clip_high: float, *, dual_clip: float | None
) -> TokenObjective:
    """GRPO (DeepSeekMath, arXiv 2402.03300, Eq. 3 without the KL term): token ratio
    r_t = exp(d_t), obj_t = min(r_t A_t, clip(r_t, 1 - clip_low, 1 + clip_high) A_t), for
    A_t < 0 bounded below by dual_clip * A_t."""
    mask = batch.mask
    ratio = ratio_from_log(token_log_ratio(batch.logp, batch.old_logp, mask))
    clipped = ppo_clip(ratio, batch.token_advantages(), 1 - clip_low, 1 + clip_high, dual_clip)
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
    batch: PolicyLossBatch, clip_low: float, clip_high: float, *, dual_clip: float | None
) -> TokenObjective:
    """GSPO (arXiv 2507.18071, Eq. 5 with s_i from Eq. 7): s_i = exp(sum_t d_t / |y_i|),
    obj_i = min(s_i A_i, clip(s_i, 1 - clip_low, 1 + clip_high) A_i); whole sequences clip (and,
    with dual_clip, bound at dual_clip * A_i for A_i < 0). Each token carries obj_i with the
    gradient of its own log-prob only (`token_share`): the gradient of obj_i spread over the
    row, and a per-token weight acts on its own token alone."""
    advantages = batch.sequence_advantages("gspo")[:, None]
    clipped, seq_ratio = _sequence_ratio_objective(
        batch, advantages, clip_low, clip_high, dual_clip
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
    batch: PolicyLossBatch, clip_low: float, clip_high: float, *, dual_clip: float | None
) -> TokenObjective:
    """GSPO-token (arXiv 2507.18071, Eq. 13 with s_it from Eq. 14): s_it = sg[s_i] *
    exp(logp_t - sg[logp_t]), per-token clip with per-token advantages. Its value is s_i and its
    gradient in logp_t is s_i, so with per-sequence advantages it equals GSPO exactly."""
    mask = batch.mask
    clipped, seq_ratio = _sequence_ratio_objective(
        batch, batch.token_advantages(), clip_low, clip_high, dual_clip
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
    batch: PolicyLossBatch,
    clip_low: float,
    clip_high: float,
    *,
    sspo_entropy_coef: float,
    sspo_lower: str,
    dual_clip: float | None,
) -> TokenObjective:
    """SSPO (arXiv 2511.04256): segment ratio s_ij = exp(mean of d_t over segment j of row i),
    clipped to [lower_ij, upper_ij] with H_ij the mean old-policy entropy of the segment:
    upper_ij = 1 + clip_high + beta * H_ij (the paper's 1 + eps + H with beta = 1);
    lower_ij = max(1 - clip_low - beta * H_ij, 1e-3) ("entropy") or 1 - clip_low ("fixed").
    Every token carries its segment's objective, with the gradient of its own log-prob only
    (`token_share`), so seq-mean-token-mean gives -mean_i(sum_j |y_ij| obj_ij / |y_i|)."""
    mask, segment_ids = batch.mask, batch.segment_ids
    assert segment_ids is not None  # checked by compute_policy_loss
    log_ratio = token_log_ratio(batch.logp, batch.old_logp, mask)
    segments = segment_mean(log_ratio.detach(), segment_ids, mask, batch.shard_sum)
    seg_ratio = ratio_from_log(segments.means)  # [B, S]
    if sspo_entropy_coef != 0.0:
        assert batch.old_entropy is not None  # checked by compute_policy_loss
        entropy = segment_mean(batch.old_entropy, segment_ids, mask, batch.shard_sum).means
        spread = sspo_entropy_coef * entropy
    else:
        spread = torch.zeros_like(seg_ratio)
    upper = 1 + clip_high + spread
    if sspo_lower == "entropy":
        lower = (1 - clip_low - spread).clamp(min=1e-3)
    else:
        lower = torch.full_like(seg_ratio, 1 - clip_low)

    def on_tokens(per_segment: Tensor) -> Tensor:
        return segments_to_tokens(per_segment, segment_ids, mask)

    ratio = ratio_from_log(token_share(on_tokens(segments.means), log_ratio))
    advantages = batch.sequence_advantages("sspo")[:, None]
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
    batch: PolicyLossBatch, clip_low: float, clip_high: float, *, dual_clip: float | None
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
    objective, bound = dual_clip_bound(token_adv * ratio, ratio, token_adv, dual_clip)
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


def cispo_objective(batch: PolicyLossBatch, clip_low: float, clip_high: float) -> TokenObjective:
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


SSPO_LOWER_MODES = ("entropy", "fixed")


def _check_sspo_options(options: dict[str, Any], old_entropy: Tensor | None) -> dict[str, Any]:
    coef = check_bound("sspo_entropy_coef", options["sspo_entropy_coef"])
    if options["sspo_lower"] not in SSPO_LOWER_MODES:
        raise ValueError(
            f"sspo_lower: unknown mode {options['sspo_lower']!r}; valid modes: "
            f"{', '.join(SSPO_LOWER_MODES)}"
        )
    if coef != 0.0 and old_entropy is None:
        raise ValueError(
            "old_entropy: entropy-adaptive sspo (sspo_entropy_coef != 0) needs the old-policy "
            "token entropy [B, T]; pass it or set sspo_entropy_coef=0"
        )
    return options | {"sspo_entropy_coef": coef}


def _check_dual_clip(value: object) -> float | None:
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int | float) or not 1 < value < math.inf:
        raise ValueError(
            f"dual_clip: expected None (off) or a finite number > 1 (PPO dual-clip's c, "
            f"commonly 3), got {value!r}"
        )
    return float(value)


@dataclass(frozen=True)
class PolicyLoss:
    """A registered loss: its kernel, its own options and where it comes from."""

    kernel: Callable[..., TokenObjective]
    unit: str  # "token", "segment" or "sequence": where the importance ratio lives
    paper: str
    # (clip_low, clip_high) we suggest; docs/algorithms.md says which come from the paper.
    default_clip: tuple[float, float]
    options: dict[str, Any] = field(default_factory=dict)  # option name -> default
    needs_segments: bool = False
    # The old policy's token entropy (SSPO's entropy-adaptive bounds at its default options),
    # which only a forward of the old policy gives; the engine returns log-probs alone.
    needs_old_entropy: bool = False
    # Validates the loss's own options (and what they require); returns them normalised.
    check_options: Callable[[dict[str, Any], Tensor | None], dict[str, Any]] | None = None


# PPO dual-clip's c, the default of every loss that takes the option (verl's clip_ratio_c): a
# unit with a negative advantage whose ratio grew past c contributes c * A and no gradient.
# Sequence- and segment-level ratios clip at ~1e-4 and rarely get there, but one that does
# (a sequence log-ratio of 20 has s = e^20) would otherwise get a gradient of that order.
DEFAULT_DUAL_CLIP = 3.0

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
        check_options=_check_sspo_options,
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

# Options every loss accepts (see compute_policy_loss).
COMMON_OPTIONS: dict[str, Any] = {
    "loss_agg": DEFAULT_LOSS_AGG,
    "max_response_len": None,
    "loss_denominator": None,
    "check_finite": True,
    "shard_sum": None,
    "mismatch": None,
    "entropy_coef": 0.0,
    "kl_coef": 0.0,
    "kl_estimator": "k3",
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


def _resolve_options(name: str, spec: PolicyLoss, given: dict[str, Any]) -> dict[str, Any]:
    valid = COMMON_OPTIONS | spec.options
    unknown = sorted(set(given) - set(valid))
    if unknown:
        raise ValueError(
            f"unknown option(s) {', '.join(unknown)} for policy loss {name!r}; "
            f"valid options: {', '.join(valid)}"
        )
    return valid | given


def _check_denominator(value: object) -> None:
    if value is None:
        return
    number = value.detach() if isinstance(value, Tensor) else value
    if isinstance(number, Tensor):
        if number.numel() != 1:
            raise ValueError(
                f"loss_denominator: expected a number or 1-element tensor, got shape "
                f"{list(number.shape)}"
            )
        number = number.item()
    if isinstance(number, bool) or not isinstance(number, int | float) or not number > 0:
        raise ValueError(f"loss_denominator: expected a positive number, got {value!r}")


@dataclass(frozen=True)
class PolicyLossSpec:
    """Which policy loss, its clip range and its options (see `compute_policy_loss`)."""

    name: str
    clip_low: float
    clip_high: float
    options: dict[str, Any] = field(default_factory=dict)


def compute_policy_loss(
    name: str,
    logp: Tensor,
    old_logp: Tensor,
    advantages: Tensor,
    mask: Tensor,
    *,
    clip_low: float,
    clip_high: float,
    segment_ids: Tensor | None = None,
    old_entropy: Tensor | None = None,
    engine_logp: Tensor | None = None,
    entropy: Tensor | None = None,
    ref_logp: Tensor | None = None,
    **options: Any,
) -> tuple[Tensor, dict[str, Tensor]]:
    """The policy loss `name` and its metrics.

    Args:
        name: one of `policy_loss_names()`.
        logp: `[B, T]` current-policy log-probs of the sampled response tokens.
        old_logp: `[B, T]` old-policy log-probs of the same tokens (no gradient).
        advantages: `[B]` per-sequence or `[B, T]` per-token advantages.
        mask: `[B, T]` bool, true on response tokens (padding and prompt are false).
        clip_low, clip_high: clip half-widths: ratios are clipped to [1 - clip_low, 1 + clip_high]
            (GMPO: to [e^-clip_low, e^clip_high]).
        segment_ids: `[B, T]` long segment ids within each row (sspo; see
            `subsentence_segment_ids`).
        old_entropy: `[B, T]` old-policy token entropy (sspo with sspo_entropy_coef != 0).
        engine_logp: `[B, T]` the rollout engine's log-probs of the same tokens (no gradient;
            with the `mismatch` option).
        entropy: `[B, T]` current-policy token entropy, carrying its gradient (with
            `entropy_coef` > 0).
        ref_logp: `[B, T]` the frozen reference policy's log-probs (no gradient; with
            `kl_coef` > 0).
        **options: `loss_agg` (see `aggregation.LOSS_AGG_MODES`), `max_response_len` (Dr. GRPO's
            constant), `loss_denominator` (a global denominator from `policy_loss_denominator`,
            summed over micro-batches and DP ranks), `check_finite` (default True; costs one
            host sync), `shard_sum` (context parallelism: each rank passes its shard of every
            row, positions it does not hold masked out, and a differentiable sum over the
            ranks sharing the rows, e.g. `megatron_rl.parallel.context.shard_sum`; per-row and
            per-segment sums then cover whole sequences, the default denominator is global, and
            the ranks' losses add up to the full loss; metrics stay per shard), `mismatch` (a
            `MismatchCorrection`: each token's objective is weighted by its detached weight),
            `entropy_coef` (an entropy bonus: entropy_coef times the aggregated current-policy
            entropy is added to the objective), `kl_coef` and `kl_estimator` (k1, k2, k3: a KL
            penalty to the reference, kl_coef times the aggregated estimate, is subtracted from
            the objective; `megatron_rl.algo.kl`), and the loss's own options (grpo, gspo,
            gspo_token, sspo, gmpo: `dual_clip`; sspo: `sspo_entropy_coef`, `sspo_lower`).

    Returns:
        The scalar loss to minimise,
        `-sum(w * (m * obj + entropy_coef * H - kl_coef * kl)) / denominator` (`m` the mismatch
        weights, 1 without), and a dict of detached metric tensors:
        `clip_frac/{token,seq,low,high}` (and `clip_frac/dual` where the loss has dual-clip),
        `ratio/{mean,max,min}` (at the loss's unit), `log_ratio/abs_max`, `log_ratio/std` (of
        the token log-ratios d), `kl/k3` (mean of exp(d) - 1 - d, an estimate of
        KL(old || new)), `log_ratio/frac_tau{1.25,2,5}` (share of tokens whose ratio exceeds tau
        or 1/tau), `loss/denominator`, with a correction `mismatch/weight_{mean,max}` and
        `mismatch/{truncated,masked}_{token,seq}_frac`, with an entropy bonus
        `loss/entropy_bonus`, with a KL penalty `kl/ref` (the aggregated estimate) and
        `loss/kl_penalty` (these two and the bonus over this batch's own denominator, not
        `loss_denominator`, so that they read alike however a batch is split), and
        loss-specific ones (sspo: `clip_frac/segment`,
        `segments/per_seq`).
    """
    spec = get_policy_loss(name)
    opts = _resolve_options(name, spec, options)
    clip_low = check_bound("clip_low", clip_low)
    clip_high = check_bound("clip_high", clip_high)
    _check_denominator(opts["loss_denominator"])
    kernel_options = {key: opts[key] for key in spec.options}
    if spec.needs_segments and segment_ids is None:
        raise ValueError(
            f"segment_ids: policy loss {name!r} needs segment ids [B, T] "
            "(see megatron_rl.algo.subsentence_segment_ids)"
        )
    if spec.check_options is not None:
        kernel_options = spec.check_options(kernel_options, old_entropy)
    if "dual_clip" in kernel_options:
        kernel_options["dual_clip"] = _check_dual_clip(kernel_options["dual_clip"])
    correction, entropy_coef, kl_coef = _check_extra_terms(opts, engine_logp, entropy, ref_logp)
    batch = validate_policy_loss_inputs(
        logp,
        old_logp,
        advantages,
        mask,
        segment_ids,
        old_entropy,
        engine_logp=engine_logp if correction is not None else None,
        entropy=entropy if entropy_coef > 0 else None,
        ref_logp=ref_logp if kl_coef > 0 else None,
        check_finite=opts["check_finite"],
        shard_sum=opts["shard_sum"] or whole_sequences,
    )
    agg = aggregation(
        batch.mask, batch.logp.dtype, opts["loss_agg"], opts["max_response_len"], batch.shard_sum
    )
    denominator = agg.denominator
    if opts["loss_denominator"] is not None:
        denominator = torch.as_tensor(
            opts["loss_denominator"], dtype=batch.logp.dtype, device=batch.logp.device
        )

    result = spec.kernel(batch, clip_low, clip_high, **kernel_options)
    objective_weights = agg.token_weights
    metrics: dict[str, Tensor] = {}
    if correction is not None:
        assert batch.engine_logp is not None  # checked by _check_extra_terms
        corrected = mismatch_weights(
            batch.old_logp, batch.engine_logp, batch.mask, correction, batch.shard_sum
        )
        objective_weights = objective_weights * corrected.weights
        metrics |= mismatch_metrics(corrected, batch.mask, correction.mode)
    surrogate = (objective_weights * result.objective).sum()
    if batch.entropy is not None:
        # padding may hold anything (NaN too): 0 * NaN would reach the sum
        entropy_on_mask = torch.where(batch.mask, batch.entropy, torch.zeros_like(batch.entropy))
        bonus = entropy_coef * (agg.token_weights * entropy_on_mask).sum()
        surrogate = surrogate + bonus
        metrics["loss/entropy_bonus"] = bonus.detach() / agg.denominator
    if batch.ref_logp is not None:
        kl = kl_to_reference(batch.logp, batch.ref_logp, batch.mask, opts["kl_estimator"])
        kl_sum = (agg.token_weights * kl).sum()
        surrogate = surrogate - kl_coef * kl_sum
        metrics["kl/ref"] = kl_sum.detach() / agg.denominator
        metrics["loss/kl_penalty"] = kl_coef * metrics["kl/ref"]
    loss = -surrogate / denominator
    metrics |= _metrics(batch, result)
    metrics["loss/denominator"] = denominator.detach()
    return loss, metrics


def _check_extra_terms(
    opts: dict[str, Any],
    engine_logp: Tensor | None,
    entropy: Tensor | None,
    ref_logp: Tensor | None,
) -> tuple[MismatchCorrection | None, float, float]:
    """The mismatch correction and the entropy and KL coefficients, with the inputs they
    need."""
    correction = opts["mismatch"]
    if correction is not None and not isinstance(correction, MismatchCorrection):
        raise ValueError(
            f"mismatch: expected None or a MismatchCorrection (MismatchCorrection.of('tis')), "
            f"got {correction!r}"
        )
    if correction is not None and engine_logp is None:
        raise ValueError(
            f"engine_logp: the mismatch correction {correction.mode!r} weighs tokens by "
            "old_logp - engine_logp and needs the engine's log-probs [B, T]"
        )
    entropy_coef = check_bound("entropy_coef", opts["entropy_coef"])
    if entropy_coef > 0 and entropy is None:
        raise ValueError(
            "entropy: entropy_coef > 0 adds an entropy bonus and needs the current policy's "
            "token entropy [B, T] (with its gradient)"
        )
    kl_coef = check_bound("kl_coef", opts["kl_coef"])
    check_kl_estimator(opts["kl_estimator"])
    if kl_coef > 0 and ref_logp is None:
        raise ValueError(
            "ref_logp: kl_coef > 0 penalises the KL to the reference policy and needs its "
            "log-probs [B, T]"
        )
    return correction, entropy_coef, kl_coef


# What compute_policy_loss reports, and how each combines over micro-batches and updates
# (megatron_rl.algo.reductions); the mismatch correction's are in mismatch.MISMATCH_METRICS.
LOSS_METRICS: MetricDeclarations = {
    "clip_frac/token": Reduction.MEAN,
    "clip_frac/low": Reduction.MEAN,
    "clip_frac/high": Reduction.MEAN,
    "clip_frac/seq": Reduction.MEAN,
    "clip_frac/dual": Reduction.MEAN,
    "clip_frac/segment": Reduction.MEAN,
    "segments/per_seq": Reduction.MEAN,
    "ratio/mean": Reduction.MEAN,
    "ratio/max": Reduction.MAX,
    "ratio/min": Reduction.MIN,
    "log_ratio/abs_max": Reduction.MAX,
    "log_ratio/std": Reduction.MEAN,
    "log_ratio/frac_tau*": Reduction.MEAN,
    "kl/k3": Reduction.MEAN,
    "kl/ref": Reduction.MEAN,
    "loss/kl_penalty": Reduction.MEAN,
    "loss/entropy_bonus": Reduction.MEAN,
    "loss/denominator": Reduction.SUM,
}


@torch.no_grad()
def _metrics(batch: PolicyLossBatch, result: TokenObjective) -> dict[str, Tensor]:
    mask = batch.mask
    num_tokens = mask.sum()
    clipped = result.clipped_low | result.clipped_high
    dual: dict[str, Tensor] = {}
    if result.clipped_dual is not None:
        clipped = clipped | result.clipped_dual
        dual["clip_frac/dual"] = result.clipped_dual.sum() / num_tokens
    has_tokens = mask.any(dim=1)
    log_ratio = token_log_ratio(batch.logp, batch.old_logp, mask)
    k3 = torch.where(mask, torch.expm1(log_ratio) - log_ratio, torch.zeros_like(log_ratio))
    values, valid = result.unit_ratios
    values = values.detach()
    inf = torch.full_like(values, float("inf"))
    return {
        "clip_frac/token": clipped.sum() / num_tokens,
        "clip_frac/low": result.clipped_low.sum() / num_tokens,
        "clip_frac/high": result.clipped_high.sum() / num_tokens,
        "clip_frac/seq": (clipped.any(dim=1) & has_tokens).sum() / has_tokens.sum(),
        "ratio/mean": torch.where(valid, values, 0).sum() / valid.sum(),
        "ratio/max": torch.where(valid, values, -inf).max(),
        "ratio/min": torch.where(valid, values, inf).min(),
        "log_ratio/abs_max": log_ratio.abs().max(),
        "log_ratio/std": _masked_std(log_ratio, mask, num_tokens),
        "kl/k3": k3.sum() / num_tokens,
        **{
            f"log_ratio/frac_tau{tau}": extreme_token_frac(log_ratio, mask, tau)
            for tau in EXTREME_RATIO_TAUS
        },
        **dual,
        **{key: value.detach() for key, value in result.extra_metrics.items()},
    }


def _masked_std(values: Tensor, mask: Tensor, count: Tensor) -> Tensor:
    """Population std of `values` `[B, T]` over the tokens of `mask` (0 with none)."""
    count = count.clamp(min=1)
    mean = torch.where(mask, values, 0).sum() / count
    return (torch.where(mask, (values - mean) ** 2, 0).sum() / count).sqrt()
