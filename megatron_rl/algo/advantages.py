"""Group-relative advantages (GRPO; Dr. GRPO without the std) and zero-variance groups."""

from __future__ import annotations

from typing import NamedTuple

import torch
from torch import Tensor


class GroupAdvantages(NamedTuple):
    advantages: Tensor  # [B] one advantage per sample
    num_zero_variance_groups: Tensor  # [] long: groups whose rewards are all equal
    zero_variance: Tensor  # [B] bool: the sample's group has all-equal rewards (drop or count)


def overlong_penalty(lengths: Tensor, max_new_tokens: int, buffer: int) -> Tensor:
    """DAPO's soft overlong punishment (arXiv 2503.14476, Eq. 13): `[B]` rewards added for
    responses of `lengths` `[B]` tokens: 0 up to max_new_tokens - buffer, then falling linearly
    to -1 at max_new_tokens ((max_new_tokens - buffer - length) / buffer), -1 beyond."""
    if isinstance(buffer, bool) or not isinstance(buffer, int) or not 0 < buffer < max_new_tokens:
        raise ValueError(
            f"buffer: expected an int in (0, max_new_tokens = {max_new_tokens}), got {buffer!r}"
        )
    free = max_new_tokens - buffer
    over = (lengths.to(torch.float32) - free).clamp(min=0)
    return -(over / buffer).clamp(max=1.0)


def zero_variance_groups(rewards: Tensor, group_size: int) -> Tensor:
    """`[B / group_size]` bool: the groups (consecutive rows) whose rewards `[B]` are all equal,
    which carry no gradient (`group_advantages` gives them advantage 0)."""
    grouped = rewards.view(-1, group_size)
    return grouped.amax(dim=1) == grouped.amin(dim=1)


def group_advantages(
    rewards: Tensor, group_size: int, *, std_normalize: bool = True, eps: float = 1e-6
) -> GroupAdvantages:
    """A_i = (r_i - mean_g) / (std_g + eps), or r_i - mean_g without `std_normalize` (Dr. GRPO).

    Samples of one prompt are consecutive: rows [g*group_size, (g+1)*group_size) form group g.
    std is the unbiased (Bessel-corrected) sample std of the group. A group whose rewards are
    all equal gets advantage exactly 0 (not a rounding residue of r - mean).

    Args:
        rewards: `[B]` float rewards, B a multiple of `group_size`.
        group_size: samples per prompt, at least 2.
    """
    if not isinstance(rewards, Tensor) or rewards.dim() != 1 or not rewards.is_floating_point():
        raise ValueError("rewards: expected a 1-D floating-point tensor [B]")
    if isinstance(group_size, bool) or not isinstance(group_size, int) or group_size < 2:
        raise ValueError(
            f"group_size: expected an int >= 2 (samples per prompt), got {group_size!r}"
        )
    if rewards.numel() % group_size != 0:
        raise ValueError(
            f"rewards: {rewards.numel()} samples do not split into groups of "
            f"group_size={group_size}"
        )
    if not bool(torch.isfinite(rewards).all()):
        raise ValueError("rewards: contains NaN or inf")
    if not eps >= 0:
        raise ValueError(f"eps: expected a non-negative number, got {eps!r}")

    grouped = rewards.to(torch.promote_types(rewards.dtype, torch.float32)).view(-1, group_size)
    centred = grouped - grouped.mean(dim=1, keepdim=True)
    if std_normalize:
        centred = centred / (grouped.std(dim=1, keepdim=True) + eps)
    zero_variance = zero_variance_groups(rewards, group_size)
    advantages = torch.where(zero_variance[:, None], torch.zeros_like(centred), centred)
    return GroupAdvantages(
        advantages=advantages.reshape(-1),
        num_zero_variance_groups=zero_variance.sum(),
        zero_variance=zero_variance.repeat_interleave(group_size),
    )
