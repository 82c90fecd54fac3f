"""Values across pipeline stages.

Under pipeline parallelism only the last stage computes log-probs, the loss and its metrics, and
each stage routes only its own layers; rank 0, which logs the metrics, is on the first stage.
These collectives over the pipeline group give every stage the last stage's values, and join
per-layer records in layer order. Without PP they return their input.
"""

from __future__ import annotations

from typing import TypeVar

import torch
import torch.distributed as dist
from megatron.core import parallel_state
from torch import Tensor

T = TypeVar("T")


def from_last_stage(value: T) -> T:
    """`value` as the last pipeline stage computed it, on every stage (a collective over the
    pipeline group; `value` is any picklable object, e.g. a dict of floats)."""
    if parallel_state.get_pipeline_model_parallel_world_size() == 1:
        return value
    box = [value]
    dist.broadcast_object_list(
        box,
        src=parallel_state.get_pipeline_model_parallel_last_rank(),
        group=parallel_state.get_pipeline_model_parallel_group(),
    )
    return box[0]


def join_stages(per_stage: Tensor, dim: int) -> Tensor:
    """Every stage's `per_stage` concatenated along `dim` in stage order, on every stage: e.g.
    routing records `[tokens, stage_layers, topk]` joined along dim 1 into
    `[tokens, moe_layers, topk]`. Stages may differ in size along `dim` (a stage holding dense
    layers has fewer MoE layers); every other dimension must agree."""
    size = parallel_state.get_pipeline_model_parallel_world_size()
    if size == 1:
        return per_stage
    group = parallel_state.get_pipeline_model_parallel_group()
    sizes = [torch.zeros(1, dtype=torch.long, device=per_stage.device) for _ in range(size)]
    dist.all_gather(sizes, torch.tensor([per_stage.shape[dim]], device=per_stage.device), group)
    widest = max(int(s) for s in sizes)
    padding = list(per_stage.shape)
    padding[dim] = widest - per_stage.shape[dim]
    padded = torch.cat([per_stage, per_stage.new_zeros(padding)], dim=dim)
    parts = [torch.empty_like(padded) for _ in range(size)]
    dist.all_gather(parts, padded.contiguous(), group=group)
    return torch.cat([p.narrow(dim, 0, int(n)) for p, n in zip(parts, sizes, strict=True)], dim)
