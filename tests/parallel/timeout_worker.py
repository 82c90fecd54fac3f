"""Worker for the collective-timeout test (run on gloo ranks by tests.parallel.harness)."""

from __future__ import annotations

import time
from datetime import timedelta

import torch
import torch.distributed as dist
from megatron.core import parallel_state

from megatron_rl.parallel.dims import ParallelDims
from megatron_rl.parallel.distributed import LaunchEnv, init_distributed


def collective_without_a_rank(launch: LaunchEnv, timeout_s: float) -> dict:
    """Rank 1 stops taking part (as on a dead node or behind a cut network) while rank 0 runs an
    all-reduce on megatron-core's data-parallel group and then on the default group: how long
    each took to fail, and the errors."""
    init_distributed(ParallelDims(world_size=2), launch, timeout=timedelta(seconds=timeout_s))
    if launch.rank == 1:
        time.sleep(3 * timeout_s)  # past both of rank 0's collectives
        return {}
    result = {}
    groups = {
        "data_parallel": parallel_state.get_data_parallel_group(),
        "default": dist.group.WORLD,
    }
    for name, group in groups.items():
        started = time.monotonic()
        try:
            dist.all_reduce(torch.ones(4), group=group)
            result[name] = {"seconds": time.monotonic() - started, "error": None}
        except RuntimeError as error:
            result[name] = {"seconds": time.monotonic() - started, "error": str(error)}
    return result
