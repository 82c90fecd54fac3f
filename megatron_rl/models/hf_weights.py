"""Hugging Face weights into and out of a live, sharded Megatron-Core model.

Loading: every rank reads, for each of its own parameters, the Hugging Face tensors its rule
names, builds the full Megatron-Core tensor and keeps its own tensor-parallel slice. No
collectives; each rank reads only what it holds.

Streaming out (`stream_hf_weights`): the ranks walk the model's global tensors in one agreed
order. For each, the tensor-parallel group of its owner (lowest rank holding it) gathers the
slices, the owner sends the full tensor to the destination rank, and the destination converts
it to Hugging Face tensors and yields them in buckets. At any time the destination holds one
full tensor and one bucket; no rank ever holds the whole model.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import torch
import torch.distributed as dist
from megatron.core import parallel_state
from torch import Tensor

from megatron_rl.models.config import MoEModelConfig
from megatron_rl.models.families.base import (
    BoundRule,
    ModelFamily,
    bind_rules,
    canonical_megatron_name,
)

_LAYER = re.compile(r"^decoder\.layers\.(\d+)\.")
_EXPERT = re.compile(r"\.mlp\.experts\.local_experts\.(\d+)\.")
TIED_OUTPUT = "output_layer.weight"
EMBEDDING = "embedding.word_embeddings.weight"


def global_name(model: torch.nn.Module, local_name: str) -> str:
    """The single-process name of a parameter: global layer and expert indices, local spec."""
    name = canonical_megatron_name(local_name)
    layer_match = _LAYER.match(name)
    if layer_match is None:
        return name
    layer = model.decoder.layers[int(layer_match.group(1))]
    name = _LAYER.sub(f"decoder.layers.{layer.layer_number - 1}.", name, count=1)
    expert_match = _EXPERT.search(name)
    if expert_match is not None:
        expert = layer.mlp.local_expert_indices[int(expert_match.group(1))]
        name = _EXPERT.sub(f".mlp.experts.local_experts.{expert}.", name, count=1)
    return name


@dataclass(frozen=True)
class TPLayout:
    """How a parameter is split over its tensor-parallel group."""

    dim: int | None  # None: replicated
    glu: bool  # SwiGLU fc1: gate and up halves are split separately
    group: dist.ProcessGroup | None
    rank: int
    size: int


def tp_layout(local_name: str, param: Tensor) -> TPLayout:
    expert = ".mlp.experts." in local_name
    if expert:
        group = parallel_state.get_expert_tensor_parallel_group()
        rank = parallel_state.get_expert_tensor_parallel_rank()
        size = parallel_state.get_expert_tensor_parallel_world_size()
    else:
        group = parallel_state.get_tensor_model_parallel_group()
        rank = parallel_state.get_tensor_model_parallel_rank()
        size = parallel_state.get_tensor_model_parallel_world_size()
    split = getattr(param, "tensor_model_parallel", False) and size > 1
    return TPLayout(
        dim=param.partition_dim if split else None,
        glu=getattr(param, "partition_stride", 1) == 2,
        group=group,
        rank=rank,
        size=size,
    )


def tp_slice(full: Tensor, layout: TPLayout) -> Tensor:
    """This rank's slice of the full tensor."""
    if layout.dim is None:
        return full
    if layout.glu:
        halves = full.chunk(2, dim=layout.dim)
        return torch.cat(
            [h.chunk(layout.size, dim=layout.dim)[layout.rank] for h in halves], layout.dim
        )
    return full.chunk(layout.size, dim=layout.dim)[layout.rank]


def tp_gather(local: Tensor, layout: TPLayout) -> Tensor:
    """The full tensor from every rank's slice (a collective over the layout's group)."""
    if layout.dim is None:
        return local
    parts = [torch.empty_like(local) for _ in range(layout.size)]
    dist.all_gather(parts, local.contiguous(), group=layout.group)
    if layout.glu:
        halves = [part.chunk(2, dim=layout.dim) for part in parts]
        return torch.cat([h[0] for h in halves] + [h[1] for h in halves], dim=layout.dim)
    return torch.cat(parts, dim=layout.dim)


def _full_shape(param: Tensor, layout: TPLayout) -> tuple[int, ...]:
    shape = list(param.shape)
    if layout.dim is not None:
        shape[layout.dim] *= layout.size
    return tuple(shape)


def _rule_for(bound: dict[str, BoundRule], name: str, config: MoEModelConfig) -> BoundRule:
    if config.tie_word_embeddings and name == TIED_OUTPUT:
        name = EMBEDDING  # a pipeline's last stage keeps its own copy of the tied embedding
    if name not in bound:
        raise ValueError(f"model parameter {name!r} has no Hugging Face mapping in this family")
    return bound[name]


def expected_hf_shapes(
    rule: BoundRule, full_shape: tuple[int, ...], config: MoEModelConfig
) -> list[tuple[int, ...]]:
    """Shapes the Hugging Face tensors of `rule` must have, from the model's own shape."""
    meta = torch.empty(full_shape, device="meta")
    return [tuple(t.shape) for t in rule.transform.to_hf(meta, config)]


@dataclass(frozen=True)
class HFLoadPlan:
    """What `apply_hf_load` will copy: each local parameter with its rule and TP layout."""

    config: MoEModelConfig
    entries: list[tuple[Tensor, BoundRule, TPLayout]]


def plan_hf_load(
    model: torch.nn.Module,
    family: ModelFamily,
    config: MoEModelConfig,
    shape_of: Callable[[str], tuple[int, ...]],
) -> HFLoadPlan:
    """Match this rank's parameters to Hugging Face tensors and check every shape first
    (`shape_of(name)` reads a checkpoint header, not the tensor): a config that disagrees with
    the weights fails here, naming the tensor and both shapes, before anything is copied."""
    bound = bind_rules(family, config)
    entries = []
    for local_name, param in model.named_parameters():
        rule = _rule_for(bound, global_name(model, local_name), config)
        layout = tp_layout(local_name, param)
        expected = expected_hf_shapes(rule, _full_shape(param, layout), config)
        for hf_name, shape in zip(rule.hf, expected, strict=True):
            actual = shape_of(hf_name)
            if actual != shape:
                raise ValueError(
                    f"{hf_name}: checkpoint shape {list(actual)} disagrees with the shape "
                    f"{list(shape)} the config implies"
                )
        entries.append((param, rule, layout))
    return HFLoadPlan(config, entries)


def apply_hf_load(
    plan: HFLoadPlan,
    read: Callable[[str], Tensor],
    on_param: Callable[[int], None] | None = None,
) -> None:
    """Copy each planned parameter's slice from the Hugging Face tensors `read(name)` returns;
    `on_param(bytes)` is called after each (progress)."""
    with torch.no_grad():
        for param, rule, layout in plan.entries:
            full = rule.transform.to_megatron([read(name) for name in rule.hf], plan.config)
            param.copy_(tp_slice(full, layout))
            if on_param is not None:
                on_param(full.numel() * full.element_size())


def load_hf_weights(
    model: torch.nn.Module,
    family: ModelFamily,
    config: MoEModelConfig,
    read: Callable[[str], Tensor],
    shape_of: Callable[[str], tuple[int, ...]],
) -> None:
    """Fill this rank's parameters from Hugging Face tensors (plan, then copy)."""
    apply_hf_load(plan_hf_load(model, family, config, shape_of), read)


def unmapped_hf_names(
    family: ModelFamily, config: MoEModelConfig, available: set[str]
) -> list[str]:
    """Checkpoint tensors no rule uses (a tied model may carry a redundant lm_head)."""
    used = {name for rule in bind_rules(family, config).values() for name in rule.hf}
    ignorable = {"lm_head.weight"} if config.tie_word_embeddings else set()
    return sorted(name for name in available - used - ignorable if "rotary_emb" not in name)


def stream_hf_weights(
    model: torch.nn.Module,
    family: ModelFamily,
    config: MoEModelConfig,
    *,
    bucket_bytes: int = 512 * 2**20,
    dst: int = 0,
) -> Iterator[list[tuple[str, Tensor]]]:
    """`(hf_name, tensor)` buckets of at most `bucket_bytes` (one tensor larger than that comes
    alone), yielded on global rank `dst`. Every rank must iterate it to the end: the others take
    part in the gathers and yield nothing."""
    if isinstance(bucket_bytes, bool) or not isinstance(bucket_bytes, int) or bucket_bytes < 1:
        raise ValueError(f"bucket_bytes: expected a positive int, got {bucket_bytes!r}")
    bound = bind_rules(family, config)
    rank = dist.get_rank()
    mine: dict[str, tuple[Tensor, TPLayout]] = {}
    for local_name, param in model.named_parameters():
        name = global_name(model, local_name)
        if config.tie_word_embeddings and name == TIED_OUTPUT:
            continue
        mine[name] = (param, tp_layout(local_name, param))
    announced = {name: (_full_shape(p, layout), p.dtype) for name, (p, layout) in mine.items()}
    everyone: list[dict] = [{} for _ in range(dist.get_world_size())]
    dist.all_gather_object(everyone, announced)

    bucket: list[tuple[str, Tensor]] = []
    bucket_size = 0
    for name, rule in bound.items():
        holders = [r for r, held in enumerate(everyone) if name in held]
        if not holders:
            raise ValueError(f"{name}: no rank holds this tensor of the model")
        owner = holders[0]
        shape, dtype = everyone[owner][name]
        full = None
        if name in mine:
            param, layout = mine[name]
            group_ranks = dist.get_process_group_ranks(layout.group) if layout.group else [rank]
            if owner in group_ranks:
                full = tp_gather(param.detach(), layout)
        if owner != dst:
            if rank == owner:
                dist.send(full.contiguous(), dst)
            elif rank == dst:
                device = "cuda" if torch.cuda.is_available() else "cpu"
                full = torch.empty(shape, dtype=dtype, device=device)
                dist.recv(full, owner)
        if rank != dst:
            continue
        for hf_name, tensor in zip(rule.hf, rule.transform.to_hf(full, config), strict=True):
            size = tensor.numel() * tensor.element_size()
            if bucket and bucket_size + size > bucket_bytes:
                yield bucket
                bucket, bucket_size = [], 0
            bucket.append((hf_name, tensor.clone()))
            bucket_size += size
    if bucket:
        yield bucket
