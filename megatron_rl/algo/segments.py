"""Subsentence segmentation of responses for SSPO: newline token ids -> segment ids."""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor


def subsentence_segment_ids(
    token_ids: Tensor, mask: Tensor, newline_token_ids: Sequence[int] | Tensor
) -> Tensor:
    """Segment id of every response token, counted from 0 within each row; -1 off the mask.

    A segment is a maximal run of response tokens that ends with one or more consecutive newline
    tokens: the newlines belong to the segment they end, and a run of newlines never forms a
    segment of its own (leading newlines join the first segment). Tokens after the last newline
    form the last segment; a response without newline is one segment. Response tokens need not
    be contiguous: "previous token" means the previous response token of the row.

    Args:
        token_ids: `[B, T]` integer token ids.
        mask: `[B, T]` bool, true on response tokens.
        newline_token_ids: every token id whose text ends a line (for BPE vocabularies this
            includes merged tokens such as ".\\n").

    Returns:
        `[B, T]` long segment ids.
    """
    if not isinstance(token_ids, Tensor) or token_ids.dim() != 2 or token_ids.is_floating_point():
        raise ValueError("token_ids: expected an integer tensor of shape [B, T]")
    if not isinstance(mask, Tensor) or mask.dtype != torch.bool or mask.shape != token_ids.shape:
        raise ValueError(f"mask: expected a bool tensor of shape {list(token_ids.shape)}")
    newlines = torch.as_tensor(newline_token_ids, dtype=token_ids.dtype, device=token_ids.device)
    if newlines.dim() != 1 or newlines.numel() == 0:
        raise ValueError("newline_token_ids: expected a non-empty 1-D list of token ids")

    is_newline = torch.isin(token_ids, newlines) & mask
    is_content = mask & ~is_newline
    positions = torch.arange(token_ids.shape[1], device=token_ids.device).expand_as(token_ids)
    # Position of the latest response token at or before t, then shifted to "strictly before t".
    last_response = torch.cummax(torch.where(mask, positions, -1), dim=1).values
    previous_response = torch.cat(
        [torch.full_like(last_response[:, :1], -1), last_response[:, :-1]], 1
    )
    previous_is_newline = is_newline.gather(1, previous_response.clamp(min=0)) & (
        previous_response >= 0
    )
    content_before = (torch.cumsum(is_content, dim=1) - is_content.long()) > 0
    starts_segment = is_content & previous_is_newline & content_before
    segment_ids = torch.cumsum(starts_segment, dim=1)
    return torch.where(mask, segment_ids, torch.full_like(segment_ids, -1))
