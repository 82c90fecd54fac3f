"""Packed (THD) sequences for the loss path: several sequences back to back in one row,
delimited by `cu_seqlens`, turned into the padded `[N, L]` rows the losses take."""

from __future__ import annotations

import torch
from torch import Tensor


def _check_cu_seqlens(cu_seqlens: Tensor, total: int) -> Tensor:
    if cu_seqlens.dim() != 1 or cu_seqlens.numel() < 2 or cu_seqlens.is_floating_point():
        raise ValueError("cu_seqlens: expected a 1-D integer tensor [N + 1] of sequence offsets")
    lengths = cu_seqlens[1:] - cu_seqlens[:-1]
    if int(cu_seqlens[0]) != 0 or int(cu_seqlens[-1]) != total or bool((lengths <= 0).any()):
        raise ValueError(
            f"cu_seqlens: expected strictly increasing offsets from 0 to the packed length "
            f"{total}, got {cu_seqlens.tolist()}"
        )
    return lengths


def packed_positions(cu_seqlens: Tensor) -> tuple[Tensor, Tensor]:
    """For each packed token: its sequence index and its position in that sequence, `[total]`."""
    total = int(cu_seqlens[-1])
    lengths = _check_cu_seqlens(cu_seqlens, total)
    sequence = torch.repeat_interleave(
        torch.arange(len(lengths), device=cu_seqlens.device), lengths
    )
    position = torch.arange(total, device=cu_seqlens.device) - cu_seqlens[:-1][sequence]
    return sequence, position


def unpack(packed: Tensor, cu_seqlens: Tensor, fill: float | bool = 0) -> Tensor:
    """`[total, ...]` packed values -> `[N, max_len, ...]` padded rows (differentiable).

    Padding takes `fill`; gradients flow back to the packed values only.
    """
    if packed.shape[0] != int(cu_seqlens[-1]):
        raise ValueError(
            f"packed: {packed.shape[0]} tokens, but cu_seqlens ends at {int(cu_seqlens[-1])}"
        )
    sequence, position = packed_positions(cu_seqlens)
    max_len = int((cu_seqlens[1:] - cu_seqlens[:-1]).max())
    shape = (len(cu_seqlens) - 1, max_len, *packed.shape[1:])
    padded = torch.full(shape, fill, dtype=packed.dtype, device=packed.device)
    return padded.index_put((sequence, position), packed)


def packed_targets(tokens: Tensor, cu_seqlens: Tensor) -> Tensor:
    """`[total]` the next token within each sequence (a sequence's last token repeats itself;
    it has no next token and must be outside the loss mask)."""
    following = torch.cat([tokens[1:], tokens[-1:]])
    is_last = torch.zeros_like(tokens, dtype=torch.bool)
    is_last[cu_seqlens[1:] - 1] = True
    return torch.where(is_last, tokens, following)
