"""Validation of policy-loss inputs: every bad argument fails here, by name, before any maths.

Nothing broadcasts silently: the only shape change made is the documented one, per-sequence
advantages `[B]` spread over the response tokens of their row. Loss maths runs in float32 or wider
(float64 stays float64): GSPO's clip range is ~3e-4 around 1, far below bfloat16's resolution.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import Tensor

from megatron_rl.algo.ratios import ShardSum


@dataclass(frozen=True)
class PolicyLossBatch:
    """Validated, upcast inputs of one policy-loss call. B = rows, T = token positions.

    Attributes:
        logp: `[B, T]` current-policy log-probs of the sampled tokens (carries the gradient).
        old_logp: `[B, T]` old-policy log-probs (no gradient is taken through it).
        advantages: `[B]` or `[B, T]`, as given by the caller.
        mask: `[B, T]` bool, true on response tokens.
        segment_ids: `[B, T]` long segment index of each token within its row, or None.
        old_entropy: `[B, T]` old-policy token entropy, or None.
        engine_logp: `[B, T]` the rollout engine's log-probs (no gradient), or None.
        entropy: `[B, T]` current-policy token entropy (carries its gradient), or None.
        ref_logp: `[B, T]` the reference policy's log-probs (no gradient), or None.
        shard_sum: sums per-row partial statistics over the shards of the rows (identity when
            rows are whole).
    """

    logp: Tensor
    old_logp: Tensor
    advantages: Tensor
    mask: Tensor
    segment_ids: Tensor | None
    old_entropy: Tensor | None
    shard_sum: ShardSum
    engine_logp: Tensor | None = None
    entropy: Tensor | None = None
    ref_logp: Tensor | None = None

    def token_advantages(self) -> Tensor:
        """`[B, T]` advantage of every token (a per-sequence advantage repeats along its row)."""
        if self.advantages.dim() == 1:
            return self.advantages[:, None].expand_as(self.logp)
        return self.advantages

    def sequence_advantages(self, loss_name: str) -> Tensor:
        """`[B]` advantage per row; `[B, T]` input must be constant over each row's response."""
        if self.advantages.dim() == 1:
            return self.advantages
        masked_max = torch.where(self.mask, self.advantages, -math.inf).amax(dim=1)
        masked_min = torch.where(self.mask, self.advantages, math.inf).amin(dim=1)
        has_tokens = self.mask.any(dim=1)
        if bool((has_tokens & (masked_max != masked_min)).any()):
            raise ValueError(
                f"advantages: loss {loss_name!r} works at sequence or segment level and needs one "
                "advantage per sequence, shape [B] (or [B, T] constant along each row's response "
                "tokens); got per-token values that differ within a row. Use 'gspo_token' or "
                "'grpo' for per-token advantages."
            )
        return torch.where(has_tokens, masked_max, torch.zeros_like(masked_max))


def _describe(tensor: object) -> str:
    if isinstance(tensor, Tensor):
        return f"tensor of shape {list(tensor.shape)} and dtype {tensor.dtype}"
    return f"{type(tensor).__name__}"


def _require_tensor(name: str, value: object, expected: str) -> Tensor:
    if not isinstance(value, Tensor):
        raise ValueError(f"{name}: expected {expected}, got {_describe(value)}")
    return value


def _require_float(name: str, value: object, shape: tuple[int, ...], shape_text: str) -> Tensor:
    tensor = _require_tensor(name, value, f"a floating-point tensor of shape {shape_text}")
    if not tensor.is_floating_point():
        raise ValueError(
            f"{name}: expected a floating-point tensor of shape {shape_text}, "
            f"got {_describe(tensor)}"
        )
    if tuple(tensor.shape) != shape:
        raise ValueError(
            f"{name}: expected shape {shape_text} = {list(shape)}, got {list(tensor.shape)}"
        )
    return tensor


def _require_finite_on(name: str, tensor: Tensor, mask: Tensor) -> None:
    """Raise if `tensor` holds NaN or inf on a response token (padding may hold anything)."""
    bad = ~torch.isfinite(tensor.detach()) & mask
    if bool(bad.any()):
        first = tuple(int(i) for i in bad.nonzero()[0])
        raise ValueError(
            f"{name}: {int(bad.sum())} non-finite value(s) on response tokens "
            f"(first at index {list(first)}: {tensor[first].item()})"
        )


def check_bound(name: str, value: object) -> float:
    """A clip half-width or coefficient: a finite, non-negative real number."""
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise ValueError(f"{name}: expected a non-negative number, got {value!r}")
    if not math.isfinite(value) or value < 0:
        raise ValueError(f"{name}: expected a finite, non-negative number, got {value!r}")
    return float(value)


def _check_mask(mask: object, shape: tuple[int, ...], shard_sum: ShardSum) -> Tensor:
    mask_t = _require_tensor("mask", mask, "a bool tensor of shape [B, T]")
    if mask_t.dtype != torch.bool:
        raise ValueError(f"mask: expected a bool tensor of shape [B, T], got {_describe(mask_t)}")
    if tuple(mask_t.shape) != shape:
        raise ValueError(f"mask: expected shape [B, T] = {list(shape)}, got {list(mask_t.shape)}")
    if not bool(shard_sum(mask_t.sum().to(torch.float32)) > 0):
        raise ValueError("mask: has no true entry; a policy loss needs at least one response token")
    return mask_t


def _check_segment_ids(segment_ids: object, shape: tuple[int, ...], mask: Tensor) -> Tensor:
    seg_t = _require_tensor("segment_ids", segment_ids, "a long tensor of shape [B, T]")
    if seg_t.dtype not in (torch.int64, torch.int32):
        raise ValueError(
            f"segment_ids: expected an integer (long) tensor of shape [B, T], "
            f"got {_describe(seg_t)}"
        )
    if tuple(seg_t.shape) != shape:
        raise ValueError(
            f"segment_ids: expected shape [B, T] = {list(shape)}, got {list(seg_t.shape)}"
        )
    on_mask, seq = seg_t[mask], shape[1]
    if bool(((on_mask < 0) | (on_mask >= seq)).any()):
        raise ValueError(
            f"segment_ids: on response tokens ids must lie in [0, T) = [0, {seq}); got values "
            f"from {int(on_mask.min())} to {int(on_mask.max())}"
        )
    return seg_t.long()


def _check_one_device(tensors: dict[str, Tensor | None]) -> None:
    device = tensors["logp"].device
    for name, tensor in tensors.items():
        if tensor is not None and tensor.device != device:
            raise ValueError(
                f"{name}: on device {tensor.device}, but logp is on {device}; "
                "all inputs must share one device"
            )


def _check_finite_values(tensors: dict[str, Tensor | None]) -> None:
    """Finite log-probs and advantages on response tokens (advantages per sequence: of rows
    with one), and finite, non-negative entropy."""
    mask, advantages = tensors["mask"], tensors["advantages"]
    adv_mask = mask.any(dim=1) if advantages.dim() == 1 else mask
    for name, where in (("logp", mask), ("old_logp", mask), ("advantages", adv_mask)):
        _require_finite_on(name, tensors[name], where)
    for name in ("engine_logp", "ref_logp"):
        if tensors[name] is not None:
            _require_finite_on(name, tensors[name], mask)
    for name in ("old_entropy", "entropy"):
        entropy = tensors[name]
        if entropy is not None:
            _require_finite_on(name, entropy, mask)
            if bool(((entropy.detach() < 0) & mask).any()):
                raise ValueError(f"{name}: token entropy must be >= 0 on response tokens")


def validate_policy_loss_inputs(
    logp: object,
    old_logp: object,
    advantages: object,
    mask: object,
    segment_ids: object,
    old_entropy: object,
    *,
    engine_logp: object = None,
    entropy: object = None,
    ref_logp: object = None,
    check_finite: bool,
    shard_sum: ShardSum,
) -> PolicyLossBatch:
    """Check shapes, dtypes, devices and values; return the inputs upcast to the working dtype."""
    logp_t = _require_tensor("logp", logp, "a floating-point tensor of shape [B, T]")
    if logp_t.dim() != 2:
        raise ValueError(f"logp: expected shape [B, T] (2 dims), got {list(logp_t.shape)}")
    shape = tuple(logp_t.shape)
    logp_t = _require_float("logp", logp_t, shape, "[B, T]")
    old_logp_t = _require_float("old_logp", old_logp, shape, "[B, T] like logp")
    mask_t = _check_mask(mask, shape, shard_sum)
    adv_t = _require_tensor("advantages", advantages, "a floating-point tensor of shape [B]")
    adv_shape = "[B]" if adv_t.dim() == 1 else "[B, T]"
    adv_t = _require_float(
        "advantages", adv_t, shape[:1] if adv_t.dim() == 1 else shape, f"{adv_shape} (or [B, T])"
    )
    seg_t = None if segment_ids is None else _check_segment_ids(segment_ids, shape, mask_t)
    optional = {
        "old_entropy": old_entropy,
        "engine_logp": engine_logp,
        "entropy": entropy,
        "ref_logp": ref_logp,
    }
    given = {
        name: None if value is None else _require_float(name, value, shape, "[B, T] like logp")
        for name, value in optional.items()
    }
    tensors = {"logp": logp_t, "old_logp": old_logp_t, "advantages": adv_t, "mask": mask_t}
    tensors |= {"segment_ids": seg_t, **given}
    _check_one_device(tensors)
    if check_finite:
        _check_finite_values(tensors)

    work_dtype = torch.promote_types(logp_t.dtype, torch.float32)

    def detached(name: str) -> Tensor | None:
        value = given[name]
        return None if value is None else value.detach().to(work_dtype)

    return PolicyLossBatch(
        logp=logp_t.to(work_dtype),
        old_logp=old_logp_t.detach().to(work_dtype),
        advantages=adv_t.detach().to(work_dtype),
        mask=mask_t,
        segment_ids=seg_t,
        old_entropy=detached("old_entropy"),
        shard_sum=shard_sum,
        engine_logp=detached("engine_logp"),
        entropy=None if given["entropy"] is None else given["entropy"].to(work_dtype),
        ref_logp=detached("ref_logp"),
    )
