"""How per-token objectives become one scalar loss, with a denominator that can be made global.

Every mode is `loss = -sum_{i,t} w_it * obj_it / D`, where the token weights `w` depend only on the
token's own row and the denominator `D` is a plain count. A batch split over micro-batches and
data-parallel ranks therefore gives the full-batch loss and gradient exactly when each part uses
the same global `D` (the sum of the parts' `policy_loss_denominator`) and the parts' losses are
summed.

| mode                        | w_it        | D                              | used by          |
|-----------------------------|-------------|--------------------------------|------------------|
| seq-mean-token-mean         | 1 / |y_i|   | number of non-empty sequences  | GRPO, GSPO paper |
| token-mean                  | 1           | number of response tokens      | DAPO, CISPO      |
| seq-mean-token-sum          | 1           | number of non-empty sequences  | verl's option    |
| seq-mean-token-sum-norm     | 1           | sequences * max_response_len   | Dr. GRPO         |
"""

from __future__ import annotations

from typing import NamedTuple

import torch
from torch import Tensor

from megatron_rl.algo.ratios import ShardSum, response_lengths, whole_sequences

LOSS_AGG_MODES = (
    "seq-mean-token-mean",
    "token-mean",
    "seq-mean-token-sum",
    "seq-mean-token-sum-norm",
)
DEFAULT_LOSS_AGG = "seq-mean-token-mean"


class Aggregation(NamedTuple):
    token_weights: Tensor  # [B, T], 0 off the mask
    denominator: Tensor  # [] local denominator D of this batch


def check_aggregation(loss_agg: object, max_response_len: object) -> None:
    """`loss_agg` is a mode of LOSS_AGG_MODES, with `max_response_len` where it needs one."""
    if loss_agg not in LOSS_AGG_MODES:
        raise ValueError(
            f"loss_agg: unknown mode {loss_agg!r}; valid modes: {', '.join(LOSS_AGG_MODES)}"
        )
    if loss_agg == "seq-mean-token-sum-norm":
        if isinstance(max_response_len, bool) or not isinstance(max_response_len, int):
            raise ValueError(
                "max_response_len: loss_agg='seq-mean-token-sum-norm' (Dr. GRPO) divides every "
                "sequence's token sum by one constant, the generation budget; pass it as a "
                f"positive int, got {max_response_len!r}"
            )
        if max_response_len <= 0:
            raise ValueError(f"max_response_len: expected a positive int, got {max_response_len}")
    elif max_response_len is not None:
        raise ValueError(
            f"max_response_len: only used by loss_agg='seq-mean-token-sum-norm', not {loss_agg!r}"
        )


def aggregation(
    mask: Tensor,
    dtype: torch.dtype,
    loss_agg: str,
    max_response_len: int | None,
    shard_sum: ShardSum = whole_sequences,
) -> Aggregation:
    """Token weights `[B, T]` and the denominator for `mask` `[B, T]` under `loss_agg` (local to
    this batch, or over all shards of its rows under `shard_sum`)."""
    check_aggregation(loss_agg, max_response_len)
    lengths = response_lengths(mask, dtype, shard_sum)
    num_sequences = (lengths > 0).sum().to(dtype)
    ones = mask.to(dtype)
    if loss_agg == "seq-mean-token-mean":
        return Aggregation(ones / lengths.clamp(min=1)[:, None], num_sequences)
    if loss_agg == "token-mean":
        return Aggregation(ones, lengths.sum())
    if loss_agg == "seq-mean-token-sum":
        return Aggregation(ones, num_sequences)
    longest = int(lengths.max())
    if longest > max_response_len:
        raise ValueError(
            f"max_response_len: {max_response_len} is shorter than the longest response in the "
            f"batch ({longest} tokens)"
        )
    return Aggregation(ones, num_sequences * max_response_len)


def policy_loss_denominator(
    mask: Tensor,
    *,
    loss_agg: str = DEFAULT_LOSS_AGG,
    max_response_len: int | None = None,
) -> Tensor:
    """The local loss denominator of `mask` `[B, T]`: sum it over micro-batches and DP ranks and
    pass the total to `compute_policy_loss(..., loss_denominator=...)` for an exact global loss."""
    if not isinstance(mask, Tensor) or mask.dtype != torch.bool or mask.dim() != 2:
        raise ValueError("mask: expected a bool tensor of shape [B, T]")
    return aggregation(mask, torch.float32, loss_agg, max_response_len).denominator
