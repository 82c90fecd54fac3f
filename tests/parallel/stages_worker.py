"""Worker for the pipeline-stage collectives test: 2 ranks, one per stage."""

from __future__ import annotations

import torch
from megatron.core import parallel_state

from megatron_rl.parallel.dims import ParallelDims
from megatron_rl.parallel.distributed import LaunchEnv, init_distributed
from megatron_rl.parallel.stages import from_last_stage, join_stages


def across_stages(launch: LaunchEnv, pp: int) -> dict:
    init_distributed(ParallelDims(world_size=launch.world_size, pp=pp), launch)
    stage = parallel_state.get_pipeline_model_parallel_rank()
    last = parallel_state.is_pipeline_last_stage()
    # routing records of this stage's 2 layers, [tokens=3, layers=2, topk=2], tagged by stage
    records = torch.arange(12).reshape(3, 2, 2) + 100 * stage
    return {
        "stage": stage,
        "from_last": from_last_stage({"loss": 0.25, "clip_frac/seq": 0.5} if last else {}),
        "joined": join_stages(records, dim=1).tolist(),
        # the first stage holding a dense layer: one MoE layer there, two on the next
        "joined_uneven": join_stages(records[:, :1] if stage == 0 else records, dim=1).tolist(),
    }
