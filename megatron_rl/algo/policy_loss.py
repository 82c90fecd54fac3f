"""The policy loss of a checked spec (`PolicyLossSpec.of`): what every loss shares around its
kernel (`megatron_rl.algo.losses`): input validation, the mismatch correction, the entropy bonus
and the KL penalty, aggregation into one scalar, metrics.

`compute_policy_loss(name, ..., clip_low=, clip_high=, **options)` is the one-call form;
`policy_loss(spec, ...)` takes a spec checked once (the trainer's, from its recipe).
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Any

import torch
from torch import Tensor

from megatron_rl.algo.aggregation import Aggregation, aggregation
from megatron_rl.algo.inputs import PolicyLossBatch, check_bound, validate_policy_loss_inputs
from megatron_rl.algo.kl import kl_to_reference
from megatron_rl.algo.loss_options import LossOptions
from megatron_rl.algo.losses import TokenObjective, get_policy_loss
from megatron_rl.algo.mismatch import mismatch_metrics, mismatch_weights
from megatron_rl.algo.ratios import (
    EXTREME_RATIO_TAUS,
    ShardSum,
    extreme_token_frac,
    token_log_ratio,
    whole_sequences,
)
from megatron_rl.algo.reductions import MetricDeclarations, Reduction

# The options every loss takes; the others are a loss's own (its registry entry lists them).
COMMON_OPTIONS = tuple(
    item.name
    for item in fields(LossOptions)
    if item.name not in ("dual_clip", "sspo_entropy_coef", "sspo_lower")
)


@dataclass(frozen=True)
class PolicyLossSpec:
    """Which policy loss, its clip range and its options, checked: build it with `of`."""

    name: str
    clip_low: float
    clip_high: float
    options: LossOptions

    @classmethod
    def of(cls, name: str, *, clip_low: float, clip_high: float, **options: Any) -> PolicyLossSpec:
        """Loss `name` with clip half-widths `clip_low` and `clip_high` (ratios are clipped to
        [1 - clip_low, 1 + clip_high]; GMPO: to [e^-clip_low, e^clip_high]) and `options`
        (fields of `LossOptions`; the loss's own defaults where not given). An unknown name or
        an option the loss does not take is refused, listing the valid ones."""
        loss = get_policy_loss(name)
        valid = (*COMMON_OPTIONS, *loss.options)
        unknown = sorted(set(options) - set(valid))
        if unknown:
            raise ValueError(
                f"unknown option(s) {', '.join(unknown)} for policy loss {name!r}; "
                f"valid options: {', '.join(valid)}"
            )
        return cls(
            name,
            check_bound("clip_low", clip_low),
            check_bound("clip_high", clip_high),
            LossOptions.checked(**(loss.options | options)),
        )


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
    loss_denominator: float | Tensor | None = None,
    shard_sum: ShardSum | None = None,
    **options: Any,
) -> tuple[Tensor, dict[str, Tensor]]:
    """The policy loss `name` and its metrics: `policy_loss` of
    `PolicyLossSpec.of(name, clip_low=clip_low, clip_high=clip_high, **options)`."""
    spec = PolicyLossSpec.of(name, clip_low=clip_low, clip_high=clip_high, **options)
    return policy_loss(
        spec,
        logp,
        old_logp,
        advantages,
        mask,
        segment_ids=segment_ids,
        old_entropy=old_entropy,
        engine_logp=engine_logp,
        entropy=entropy,
        ref_logp=ref_logp,
        loss_denominator=loss_denominator,
        shard_sum=shard_sum,
    )


def policy_loss(
    spec: PolicyLossSpec,
    logp: Tensor,
    old_logp: Tensor,
    advantages: Tensor,
    mask: Tensor,
    *,
    segment_ids: Tensor | None = None,
    old_entropy: Tensor | None = None,
    engine_logp: Tensor | None = None,
    entropy: Tensor | None = None,
    ref_logp: Tensor | None = None,
    loss_denominator: float | Tensor | None = None,
    shard_sum: ShardSum | None = None,
) -> tuple[Tensor, dict[str, Tensor]]:
    """The policy loss of `spec` and its metrics.

    Args:
        spec: the loss, its clip range and options (`PolicyLossSpec.of`).
        logp: `[B, T]` current-policy log-probs of the sampled response tokens.
        old_logp: `[B, T]` old-policy log-probs of the same tokens (no gradient).
        advantages: `[B]` per-sequence or `[B, T]` per-token advantages.
        mask: `[B, T]` bool, true on response tokens (padding and prompt are false).
        segment_ids: `[B, T]` long segment ids within each row (sspo; see
            `subsentence_segment_ids`).
        old_entropy: `[B, T]` old-policy token entropy (sspo with sspo_entropy_coef != 0).
        engine_logp: `[B, T]` the rollout engine's log-probs of the same tokens (no gradient;
            with the `mismatch` option).
        entropy: `[B, T]` current-policy token entropy, carrying its gradient (with
            `entropy_coef` > 0).
        ref_logp: `[B, T]` the frozen reference policy's log-probs (no gradient; with
            `kl_coef` > 0).
        loss_denominator: a global denominator from `policy_loss_denominator`, summed over
            micro-batches and DP ranks (default: this batch's own).
        shard_sum: context parallelism: each rank passes its shard of every row, positions it
            does not hold masked out, and a differentiable sum over the ranks sharing the rows
            (e.g. `megatron_rl.parallel.context.shard_sum`); per-row and per-segment sums then
            cover whole sequences, the default denominator is global, and the ranks' losses add
            up to the full loss; metrics stay per shard.

    Returns:
        The scalar loss to minimise,
        `-sum(w * (m * obj + entropy_coef * H - kl_coef * kl)) / denominator` (`w` the
        aggregation's token weights, `m` the mismatch weights, 1 without), and a dict of
        detached metric tensors (`LOSS_METRICS` and `mismatch.MISMATCH_METRICS` declare how each
        combines): `clip_frac/{token,seq,low,high}` (and `clip_frac/dual` where the loss has
        dual-clip), `ratio/{mean,max,min}` (at the loss's unit), `log_ratio/abs_max`,
        `log_ratio/std` (of the token log-ratios d), `kl/k3` (mean of exp(d) - 1 - d, an
        estimate of KL(old || new)), `log_ratio/frac_tau{1.25,2,5}` (share of tokens whose ratio
        exceeds tau or 1/tau), `loss/denominator`, with a correction `mismatch/weight_{mean,max}`
        and `mismatch/{truncated,masked}_{token,seq}_frac`, with an entropy bonus
        `loss/entropy_bonus`, with a KL penalty `kl/ref` (the aggregated estimate) and
        `loss/kl_penalty` (these two and the bonus over this batch's own denominator, not
        `loss_denominator`, so that they read alike however a batch is split), and
        loss-specific ones (sspo: `clip_frac/segment`, `segments/per_seq`).
    """
    batch = _checked_batch(
        spec,
        logp,
        old_logp,
        advantages,
        mask,
        segment_ids=segment_ids,
        old_entropy=old_entropy,
        engine_logp=engine_logp,
        entropy=entropy,
        ref_logp=ref_logp,
        shard_sum=shard_sum or whole_sequences,
    )
    options = spec.options
    agg = aggregation(
        batch.mask, batch.logp.dtype, options.loss_agg, options.max_response_len, batch.shard_sum
    )
    result = get_policy_loss(spec.name).kernel(batch, spec.clip_low, spec.clip_high, options)
    surrogate, metrics = _corrected_surrogate(batch, result, agg, options)
    surrogate, term_metrics = _with_entropy_and_kl(surrogate, batch, agg, options)
    denominator = agg.denominator
    if loss_denominator is not None:
        denominator = torch.as_tensor(
            _checked_denominator(loss_denominator), dtype=batch.logp.dtype, device=batch.logp.device
        )
    loss = -surrogate / denominator
    metrics |= term_metrics | _metrics(batch, result)
    metrics["loss/denominator"] = denominator.detach()
    return loss, metrics


def _corrected_surrogate(
    batch: PolicyLossBatch, result: TokenObjective, agg: Aggregation, options: LossOptions
) -> tuple[Tensor, dict[str, Tensor]]:
    """The kernel's objective summed over tokens, each weighted by the aggregation and, with a
    mismatch correction, by its correction weight; the correction's metrics."""
    weights = agg.token_weights
    if options.mismatch is None:
        return (weights * result.objective).sum(), {}
    assert batch.engine_logp is not None  # checked by _checked_batch
    corrected = mismatch_weights(
        batch.old_logp, batch.engine_logp, batch.mask, options.mismatch, batch.shard_sum
    )
    surrogate = (weights * corrected.weights * result.objective).sum()
    return surrogate, mismatch_metrics(corrected, batch.mask, options.mismatch)


def _with_entropy_and_kl(
    surrogate: Tensor, batch: PolicyLossBatch, agg: Aggregation, options: LossOptions
) -> tuple[Tensor, dict[str, Tensor]]:
    """`surrogate` plus the entropy bonus and less the KL penalty, each aggregated like the
    objective (not corrected) and reported over this batch's own denominator."""
    metrics: dict[str, Tensor] = {}
    if batch.entropy is not None:
        # padding may hold anything (NaN too): 0 * NaN would reach the sum
        entropy_on_mask = torch.where(batch.mask, batch.entropy, torch.zeros_like(batch.entropy))
        bonus = options.entropy_coef * (agg.token_weights * entropy_on_mask).sum()
        surrogate = surrogate + bonus
        metrics["loss/entropy_bonus"] = bonus.detach() / agg.denominator
    if batch.ref_logp is not None:
        kl = kl_to_reference(batch.logp, batch.ref_logp, batch.mask, options.kl_estimator)
        kl_sum = (agg.token_weights * kl).sum()
        surrogate = surrogate - options.kl_coef * kl_sum
        metrics["kl/ref"] = kl_sum.detach() / agg.denominator
        metrics["loss/kl_penalty"] = options.kl_coef * metrics["kl/ref"]
    return surrogate, metrics


def _checked_batch(
    spec: PolicyLossSpec,
    logp: Tensor,
    old_logp: Tensor,
    advantages: Tensor,
    mask: Tensor,
    *,
    segment_ids: Tensor | None,
    old_entropy: Tensor | None,
    engine_logp: Tensor | None,
    entropy: Tensor | None,
    ref_logp: Tensor | None,
    shard_sum: ShardSum,
) -> PolicyLossBatch:
    """The validated inputs, with the tensors the spec's options need and only those."""
    options, loss = spec.options, get_policy_loss(spec.name)
    if loss.needs_segments and segment_ids is None:
        raise ValueError(
            f"segment_ids: policy loss {spec.name!r} needs segment ids [B, T] "
            "(see megatron_rl.algo.subsentence_segment_ids)"
        )
    if loss.needs_old_entropy and options.sspo_entropy_coef != 0 and old_entropy is None:
        raise ValueError(
            "old_entropy: entropy-adaptive sspo (sspo_entropy_coef != 0) needs the old-policy "
            "token entropy [B, T]; pass it or set sspo_entropy_coef=0"
        )
    if options.mismatch is not None and engine_logp is None:
        raise ValueError(
            f"engine_logp: the mismatch correction {options.mismatch.mode!r} weighs tokens by "
            "old_logp - engine_logp and needs the engine's log-probs [B, T]"
        )
    if options.entropy_coef > 0 and entropy is None:
        raise ValueError(
            "entropy: entropy_coef > 0 adds an entropy bonus and needs the current policy's "
            "token entropy [B, T] (with its gradient)"
        )
    if options.kl_coef > 0 and ref_logp is None:
        raise ValueError(
            "ref_logp: kl_coef > 0 penalises the KL to the reference policy and needs its "
            "log-probs [B, T]"
        )
    return validate_policy_loss_inputs(
        logp,
        old_logp,
        advantages,
        mask,
        segment_ids,
        old_entropy,
        engine_logp=engine_logp if options.mismatch is not None else None,
        entropy=entropy if options.entropy_coef > 0 else None,
        ref_logp=ref_logp if options.kl_coef > 0 else None,
        check_finite=options.check_finite,
        shard_sum=shard_sum,
    )


def _checked_denominator(value: float | Tensor) -> float:
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
    return float(number)


# What policy_loss reports, and how each combines over micro-batches and updates
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
