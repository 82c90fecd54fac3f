"""Training-inference mismatch correction: a detached per-token weight on the policy loss.

The rollout engine samples with its own kernels and precision, so its probability of a token,
pi_engine, is not the trainer's pi_old for the same weights. The policy loss's importance ratio is
taken against pi_old; these corrections reweight each token (or whole sequences) by how far the
engine's sampling distribution was from pi_old, rho = pi_old / pi_engine:

| mode     | weight                               | levels                     | from            |
|----------|--------------------------------------|----------------------------|-----------------|
| `tis`    | min(rho, C)                          | token, sequence, geometric | Yao et al. 2025 |
| `mis`    | rho inside [lower, upper], 0 outside | token, sequence, geometric | Liu et al. 2025 |
| `icepop` | rho inside [alpha, beta], 0 outside  | token                      | Ring-1T         |

(Yao et al., "Your efficient RL framework secretly brings you off-policy RL training"; Liu et
al., "When speed kills stability: demystifying RL collapse from the training-inference
mismatch"; Ring-1T, arXiv 2510.18855, which calls it IcePop: token-level MIS with a two-sided
band, named here as its users know it.)

At the token level rho_t = exp(old_t - engine_t); at the sequence level every token of row i
carries rho_i = exp(sum_t (old_t - engine_t)), the ratio of the whole sequence's probabilities;
at the geometric level exp(mean_t (old_t - engine_t)), its length-normalised form (as GSPO's
ratio is). Ratios are formed in log space and compared there, so no product overflows. When the
engine and the trainer agree exactly every weight is 1.

TIS may carry an MIS band as a mask (`MismatchCorrection.masked_by`): each token's weight is
min(rho_t, C), zeroed where the band's ratio (at its own level) leaves [lower, upper]. Token TIS
with a geometric band is the recipe that kept the public Qwen3-30B-A3B runs of the mismatch
studies from collapsing.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import NamedTuple

import torch
from torch import Tensor

from megatron_rl.algo.ratios import (
    EXTREME_RATIO_TAUS,
    ShardSum,
    extreme_token_frac,
    sequence_mean,
    token_log_ratio,
    whole_sequences,
)
from megatron_rl.algo.reductions import MetricDeclarations, Reduction

MISMATCH_LEVELS = ("token", "sequence", "geometric")


@dataclass(frozen=True)
class CorrectionKind:
    """One correction mode: its weight's shape and the defaults of its bounds."""

    masks: bool  # True: rho inside [lower, upper], 0 outside; False: min(rho, upper)
    levels: tuple[str, ...]
    default_level: str
    default_lower: float | None  # None: the mode has no lower bound
    default_upper: float


MISMATCH_CORRECTIONS: dict[str, CorrectionKind] = {
    "tis": CorrectionKind(False, MISMATCH_LEVELS, "token", None, 2.0),
    "mis": CorrectionKind(True, MISMATCH_LEVELS, "sequence", 0.0, 2.0),
    "icepop": CorrectionKind(True, ("token",), "token", 0.5, 5.0),
}


@dataclass(frozen=True)
class MismatchCorrection:
    """A validated correction: `mode` one of MISMATCH_CORRECTIONS, `level` one of its levels,
    `upper` the TIS cap C (>= 1) or the band's upper end (> 1), `lower` the band's lower end
    (0 <= lower < 1; None for TIS)."""

    mode: str
    level: str
    lower: float | None
    upper: float
    mask: MismatchCorrection | None = None
    """tis only: an mis band whose outside zeroes the weight (`masked_by`); None: none."""

    @classmethod
    def of(
        cls,
        mode: str,
        *,
        level: str | None = None,
        lower: float | None = None,
        upper: float | None = None,
        key: str = "mismatch",
    ) -> MismatchCorrection:
        """`mode` with the given bounds (None: the mode's defaults), checked; errors name
        `key`'s fields (`mismatch_level`, `mismatch_lower`, `mismatch_upper`)."""
        if mode not in MISMATCH_CORRECTIONS:
            raise ValueError(
                f"{key}: unknown correction {mode!r}; valid: {', '.join(MISMATCH_CORRECTIONS)}"
            )
        kind = MISMATCH_CORRECTIONS[mode]
        level = kind.default_level if level is None else level
        if level not in kind.levels:
            raise ValueError(
                f"{key}_level: {mode} works at level {' or '.join(kind.levels)}, got {level!r}"
            )
        upper = kind.default_upper if upper is None else upper
        if not _finite_number(upper):
            raise ValueError(f"{key}_upper: expected a finite number, got {upper!r}")
        if kind.masks:
            lower = kind.default_lower if lower is None else lower
            if not _finite_number(lower) or not 0 <= lower < 1 < upper:
                raise ValueError(
                    f"{key}_lower, {key}_upper: {mode} keeps ratios inside [lower, upper] and "
                    f"needs 0 <= lower < 1 < upper, got [{lower}, {upper}]"
                )
        else:
            if lower is not None:
                raise ValueError(f"{key}_lower: {mode} has no lower bound (mis and icepop do)")
            if upper < 1:
                raise ValueError(f"{key}_upper: {mode}'s cap C must be >= 1, got {upper}")
        return cls(
            mode=mode,
            level=level,
            lower=None if lower is None else float(lower),
            upper=float(upper),
        )

    def masked_by(
        self,
        level: str,
        *,
        lower: float | None = None,
        upper: float | None = None,
        key: str = "mismatch_mask",
    ) -> MismatchCorrection:
        """This TIS correction with an mis band at `level` (None bounds: mis's defaults) as a
        mask; errors name `key`'s fields (`mismatch_mask_level`, `_lower`, `_upper`)."""
        if MISMATCH_CORRECTIONS[self.mode].masks:
            raise ValueError(
                f"{key}_level: only tis takes a mask ({self.mode} masks by itself already)"
            )
        band = MismatchCorrection.of("mis", level=level, lower=lower, upper=upper, key=key)
        return MismatchCorrection(self.mode, self.level, self.lower, self.upper, mask=band)


def _finite_number(value: object) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value)


class MismatchWeights(NamedTuple):
    """All `[B, T]`, 0 / False off the mask."""

    weights: Tensor  # detached weight of each token's objective
    truncated: Tensor  # bool: capped at C (tis)
    masked: Tensor  # bool: zeroed, outside the band (mis, icepop, tis's mask)


@torch.no_grad()
def mismatch_weights(
    old_logp: Tensor,
    engine_logp: Tensor,
    mask: Tensor,
    correction: MismatchCorrection,
    shard_sum: ShardSum = whole_sequences,
) -> MismatchWeights:
    """The correction's weight of every response token from `old_logp` (the trainer's) and
    `engine_logp` (the rollout engine's), `[B, T]` each; sequence sums cover all shards of a row
    under `shard_sum`."""
    log_rho = token_log_ratio(old_logp, engine_logp, mask)
    if correction.level == "sequence":
        masked = torch.where(mask, log_rho, torch.zeros_like(log_rho))
        log_rho = shard_sum(masked.sum(dim=1))[:, None].expand_as(log_rho)
    elif correction.level == "geometric":
        log_rho = sequence_mean(log_rho, mask, shard_sum)[:, None].expand_as(log_rho)
    log_upper = math.log(correction.upper)
    nothing = torch.zeros_like(mask)
    if MISMATCH_CORRECTIONS[correction.mode].masks:
        log_lower = -math.inf if correction.lower == 0 else math.log(correction.lower)
        truncated, masked = nothing, (log_rho < log_lower) | (log_rho > log_upper)
    else:
        truncated = log_rho > log_upper
        masked = nothing
        if correction.mask is not None:
            band = mismatch_weights(old_logp, engine_logp, mask, correction.mask, shard_sum)
            masked = band.masked
    weights = torch.where(
        masked, torch.zeros_like(log_rho), torch.exp(log_rho.clamp(max=log_upper))
    )
    return MismatchWeights(
        torch.where(mask, weights, torch.zeros_like(weights)), truncated & mask, masked & mask
    )


# What mismatch_metrics and engine_gap_metrics report (megatron_rl.algo.reductions).
MISMATCH_METRICS: MetricDeclarations = {
    "mismatch/weight_mean": Reduction.MEAN,
    "mismatch/weight_max": Reduction.MAX,
    "mismatch/truncated_token_frac": Reduction.MEAN,
    "mismatch/truncated_seq_frac": Reduction.MEAN,
    "mismatch/masked_token_frac": Reduction.MEAN,
    "mismatch/masked_seq_frac": Reduction.MEAN,
    "mismatch/k3": Reduction.MEAN,
    "mismatch/abs_max": Reduction.MAX,
    "mismatch/frac_tau*": Reduction.MEAN,
}


@torch.no_grad()
def mismatch_metrics(
    corrected: MismatchWeights, mask: Tensor, correction: MismatchCorrection
) -> dict[str, Tensor]:
    """The weights' mean and max over response tokens, and the share of tokens and of
    sequences (any token) that the correction truncated (tis) and masked (mis, icepop, tis's
    mask)."""
    masks = MISMATCH_CORRECTIONS[correction.mode].masks
    kinds = [] if masks else [("truncated", corrected.truncated)]
    if masks or correction.mask is not None:
        kinds.append(("masked", corrected.masked))
    has_tokens = mask.any(dim=1)
    num_tokens = mask.sum()
    weights = corrected.weights
    metrics = {
        "mismatch/weight_mean": weights.sum() / num_tokens,
        "mismatch/weight_max": torch.where(mask, weights, -math.inf).max(),
    }
    for what, changed in kinds:
        metrics[f"mismatch/{what}_token_frac"] = changed.sum() / num_tokens
        metrics[f"mismatch/{what}_seq_frac"] = (changed.any(dim=1) & has_tokens).sum() / (
            has_tokens.sum()
        )
    return metrics


@torch.no_grad()
def engine_gap_metrics(
    trainer_logp: Tensor, engine_logp: Tensor, mask: Tensor
) -> dict[str, Tensor]:
    """How far the engine's log-probs are from the trainer's for the same tokens, over response
    tokens (all `[B, T]`, or flat `[N]`), in float64: `mismatch/k3` (the k3 estimate of
    KL(engine || trainer)), `mismatch/abs_max` (the largest |log-ratio|) and
    `mismatch/frac_tau{tau}` (F(tau) of EXTREME_RATIO_TAUS)."""
    delta = (trainer_logp.double() - engine_logp.double())[mask]
    everywhere = torch.ones_like(delta, dtype=torch.bool)
    return {
        "mismatch/k3": (torch.expm1(delta) - delta).mean(),
        "mismatch/abs_max": delta.abs().max(),
    } | {
        f"mismatch/frac_tau{tau}": extreme_token_frac(delta, everywhere, tau)
        for tau in EXTREME_RATIO_TAUS
    }
