"""Context parallelism at the loss: sequences sharded across ranks, sums that cross them.

Megatron-Core's CP splits every sequence into 2 * cp chunks and gives rank r chunks r and
2 * cp - 1 - r, which balances causal attention work. For the loss each rank keeps its
`[B, T]` per-token tensors at full width with the positions it does not hold masked out, and
per-row and per-segment sums go through a differentiable all-reduce (`shard_sum`), so the
sequence ratios of GSPO and the segment ratios of SSPO see whole sequences.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.distributed.nn.functional as dist_fn
from torch import Tensor

from megatron_rl.algo.ratios import ShardSum


def shard_sum(group: dist.ProcessGroup) -> ShardSum:
    """A differentiable sum over `group`: forward all-reduces the partial sums; backward
    all-reduces their gradients (every rank's loss depends on every rank's shard)."""

    def reduce(partial: Tensor) -> Tensor:
        return dist_fn.all_reduce(partial, op=dist.ReduceOp.SUM, group=group)

    return reduce


def load_balanced_positions(seq_len: int, cp_size: int, cp_rank: int) -> Tensor:
    """Positions of a length-`seq_len` sequence held by `cp_rank`: chunks r and 2*cp - 1 - r."""
    if seq_len % (2 * cp_size) != 0:
        raise ValueError(
            f"seq_len: context parallelism splits sequences into 2*cp = {2 * cp_size} chunks; "
            f"{seq_len} is not divisible by {2 * cp_size}"
        )
    chunk = seq_len // (2 * cp_size)
    first = torch.arange(cp_rank * chunk, (cp_rank + 1) * chunk)
    mirror = 2 * cp_size - 1 - cp_rank
    return torch.cat([first, torch.arange(mirror * chunk, (mirror + 1) * chunk)])


def shard_mask(mask: Tensor, cp_size: int, cp_rank: int) -> Tensor:
    """`mask` `[B, T]` restricted to the positions `cp_rank` holds."""
    held = torch.zeros(mask.shape[1], dtype=torch.bool, device=mask.device)
    held[load_balanced_positions(mask.shape[1], cp_size, cp_rank).to(mask.device)] = True
    return mask & held
