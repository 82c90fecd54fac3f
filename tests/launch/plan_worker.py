"""Worker for the planner's parameter counts: a rank's part of a model built by megatron-core,
counted by kind. Large shapes build on the meta device (no memory: Qwen3-30B-A3B's in seconds);
tied embeddings across pipeline stages need real tensors (megatron-core all-reduces the copy)."""

from __future__ import annotations

import torch
from megatron.core import parallel_state

from megatron_rl.models.build import build_gpt_moe
from megatron_rl.models.config import MoEModelConfig
from megatron_rl.parallel.dims import ParallelDims
from megatron_rl.parallel.distributed import LaunchEnv, init_distributed


def built_parameters(launch: LaunchEnv, model: MoEModelConfig, layout: dict, device: str) -> dict:
    """This rank's stage and its parameter counts: routed experts, and the rest."""
    dims = ParallelDims(world_size=launch.world_size, **layout)
    init_distributed(dims, launch)
    with torch.device(device):
        gpt = build_gpt_moe(model, dims, initialize=False)
    expert = sum(p.numel() for name, p in gpt.named_parameters() if ".mlp.experts." in name)
    total = sum(p.numel() for p in gpt.parameters())
    return {
        "stage": parallel_state.get_pipeline_model_parallel_rank(),
        "dense": total - expert,
        "expert": expert,
    }
