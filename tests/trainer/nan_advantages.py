"""`megatron-rl train` with every advantage replaced by NaN (fault injection for the tests): the
real loss turns non-finite, and the loop must skip, count and finally abort."""

from __future__ import annotations

import sys

import torch

from megatron_rl import cli
from megatron_rl.algo import GroupAdvantages, group_advantages
from megatron_rl.trainer import learner


def _nan_advantages(rewards: torch.Tensor, group_size: int, **kwargs) -> GroupAdvantages:
    result = group_advantages(rewards, group_size, **kwargs)
    nan = torch.full_like(result.advantages, float("nan"))
    return result._replace(advantages=nan)


if __name__ == "__main__":
    learner.group_advantages = _nan_advantages
    sys.exit(cli.main(sys.argv[1:]))
