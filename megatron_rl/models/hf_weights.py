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
from megatron.core.tensor_parallel import (
    ColumnParallelLinear,
    RowParallelLinear,
    VocabParallelEmbedding,
)
from torch import Tensor

from megatron_rl.models.config import MoEModelConfig
from megatron_rl.models.families.base import (
    BoundRule,
    ModelFamily,
    Transform,
    bind_rules,
    canonical_megatron_name,
)
from megatron_rl.models.module_weights import named_weights

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


def _split_dims(module: torch.nn.Module) -> dict[str, int]:
    """Which dimension of each of a module's tensors tensor parallelism splits (absent: not
    split): a column-parallel layer splits its outputs, weight and bias; a row-parallel layer
    its inputs (its bias is whole).

    Read from the module's kind, not from parameter attributes: megatron-core sets those only
    when it initialises the weights, which a model built to be loaded skips."""
    if isinstance(module, ColumnParallelLinear | VocabParallelEmbedding):
        return {"weight": 0, "bias": 0}
    if isinstance(module, RowParallelLinear):
        return {"weight": 1}
    mode = getattr(module, "parallel_mode", None)  # Transformer Engine's linear layers
    return {"column": {"weight": 0, "bias": 0}, "row": {"weight": 1}}.get(mode, {})


def tp_layouts(model: torch.nn.Module) -> dict[str, TPLayout]:
    """The tensor-parallel layout of every weight (`named_weights`), by its local name."""
    dense = (
        parallel_state.get_tensor_model_parallel_group(),
        parallel_state.get_tensor_model_parallel_rank(),
        parallel_state.get_tensor_model_parallel_world_size(),
    )
    expert = (
        parallel_state.get_expert_tensor_parallel_group(),
        parallel_state.get_expert_tensor_parallel_rank(),
        parallel_state.get_expert_tensor_parallel_world_size(),
    )
    split_weights = {}
    for module_name, module in model.named_modules():
        for tensor, dim in _split_dims(module).items():
            split_weights[f"{module_name}.{tensor}" if module_name else tensor] = dim
    glu = model.config.gated_linear_unit
    layouts = {}
    for name, _ in named_weights(model):
        group, rank, size = expert if ".mlp.experts." in name else dense
        dim = split_weights.get(name) if size > 1 else None
        layouts[name] = TPLayout(
            dim=dim,
            glu=glu and name.endswith(("linear_fc1.weight", "linear_fc1.bias")),
            group=group,
            rank=rank,
            size=size,
        )
    return layouts


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


def unchanged_ranges(
    model: torch.nn.Module, bound: dict[str, BoundRule], config: MoEModelConfig
) -> dict[str, list[tuple[str, int, int]]]:
    """This rank's whole (not tensor-parallel split) Megatron-Core tensors whose Hugging Face
    tensors are all byte ranges of them, as the rules (`bound`, `bind_rules`) `to_hf` makes
    them (a copy, the contiguous halves of a fused gate/up weight; not a regrouped QKV): by
    global Megatron-Core name, `(hf_name, start, end)` in bytes. Their values are needed only as
    bytes to copy."""
    layouts = tp_layouts(model)
    # (start, size) of each Hugging Face tensor, or None, by transform and tensor shape: the
    # same for every layer and expert
    found: dict[tuple[int, tuple[int, ...], torch.dtype], list[tuple[int, int]] | None] = {}
    ranges = {}
    for local_name, param in named_weights(model):
        name = global_name(model, local_name)
        if layouts[local_name].dim is not None or name not in bound:
            continue
        rule = bound[name]
        key = (id(rule.transform), tuple(param.shape), param.dtype)
        if key not in found:
            found[key] = _byte_ranges(rule.transform, param, config)
        if found[key] is not None:
            ranges[name] = [
                (hf_name, start, start + size)
                for hf_name, (start, size) in zip(rule.hf, found[key], strict=True)
            ]
    return ranges


def _byte_ranges(
    transform: Transform, param: Tensor, config: MoEModelConfig
) -> list[tuple[int, int]] | None:
    """(start, size) in bytes of each tensor `transform.to_hf` makes of a tensor like `param`,
    if each is a contiguous view of it; None if any is not."""
    full = torch.empty(param.shape, dtype=param.dtype, device="meta")
    ranges = []
    for tensor in transform.to_hf(full, config):
        if not ((tensor is full or tensor._base is full) and tensor.is_contiguous()):
            return None
        ranges.append((tensor.storage_offset() * tensor.element_size(), tensor.nbytes))
    return ranges


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
    layouts = tp_layouts(model)
    entries = []
    for local_name, param in named_weights(model):
        rule = _rule_for(bound, global_name(model, local_name), config)
        layout = layouts[local_name]
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


class HFWeightStream:
    """`(hf_name, tensor)` buckets of at most `bucket_bytes` (one tensor larger than that comes
    alone; two a rule binds together, `WeightRule.bucket_with_next`, may exceed it), yielded on
    global rank `dst` in the order of `manifest`.

    Creating it is a collective (the ranks share what they hold); every rank must then iterate
    it to the end: the others take part in the gathers and yield nothing. A yielded tensor may
    share memory with a live parameter; copy it to keep it past the next optimizer step.
    `before_tensor(name)`, if given, is called on every rank with each Megatron-Core tensor's
    global name just before the stream reads it (a conversion loads its checkpoint there, part by
    part).
    """

    def __init__(
        self,
        model: torch.nn.Module,
        family: ModelFamily,
        config: MoEModelConfig,
        *,
        bucket_bytes: int = 512 * 2**20,
        dst: int = 0,
        before_tensor: Callable[[str], None] | None = None,
    ) -> None:
        if isinstance(bucket_bytes, bool) or not isinstance(bucket_bytes, int) or bucket_bytes < 1:
            raise ValueError(f"bucket_bytes: expected a positive int, got {bucket_bytes!r}")
        self.config, self.bucket_bytes, self.dst = config, bucket_bytes, dst
        self.before_tensor = before_tensor
        self.rules = bind_rules(family, config)
        self.mine: dict[str, tuple[Tensor, TPLayout]] = {}
        layouts = tp_layouts(model)
        for local_name, param in named_weights(model):
            name = global_name(model, local_name)
            if not (config.tie_word_embeddings and name == TIED_OUTPUT):
                self.mine[name] = (param, layouts[local_name])
        announced = {n: (_full_shape(p, layout), p.dtype) for n, (p, layout) in self.mine.items()}
        self.held: list[dict] = [{} for _ in range(dist.get_world_size())]
        dist.all_gather_object(self.held, announced)
        self.owner = {}
        for name in self.rules:
            holders = [r for r, held in enumerate(self.held) if name in held]
            if not holders:
                raise ValueError(f"{name}: no rank holds this tensor of the model")
            self.owner[name] = holders[0]

    @property
    def manifest(self) -> list[tuple[str, tuple[int, ...], torch.dtype]]:
        """Every Hugging Face tensor the stream yields: (name, shape, dtype), in order."""
        entries = []
        for name, rule in self.rules.items():
            shape, dtype = self.held[self.owner[name]][name]
            for hf_name, hf_shape in zip(
                rule.hf, expected_hf_shapes(rule, shape, self.config), strict=True
            ):
                entries.append((hf_name, hf_shape, dtype))
        return entries

    def _full_tensor(self, name: str) -> Tensor | None:
        """The full Megatron-Core tensor on `dst` (None elsewhere); collectives as needed."""
        rank, owner = dist.get_rank(), self.owner[name]
        full = None
        if name in self.mine:
            param, layout = self.mine[name]
            group_ranks = dist.get_process_group_ranks(layout.group) if layout.group else [rank]
            if owner in group_ranks:
                full = tp_gather(param.detach(), layout)
        if owner != self.dst:
            if rank == owner:
                dist.send(full.contiguous(), self.dst)
            elif rank == self.dst:
                shape, dtype = self.held[owner][name]
                device = "cuda" if torch.cuda.is_available() else "cpu"
                full = torch.empty(shape, dtype=dtype, device=device)
                dist.recv(full, owner)
        return full if rank == self.dst else None

    def __iter__(self) -> Iterator[list[tuple[str, Tensor]]]:
        bucket: list[tuple[str, Tensor]] = []
        bucket_size = 0
        keep_with_last = False  # the last tensor's rule asks for this one in its bucket
        for name, rule in self.rules.items():
            if self.before_tensor is not None:
                self.before_tensor(name)
            full = self._full_tensor(name)
            if full is None:
                continue
            for hf_name, tensor in zip(
                rule.hf, rule.transform.to_hf(full, self.config), strict=True
            ):
                size = tensor.numel() * tensor.element_size()
                if bucket and bucket_size + size > self.bucket_bytes and not keep_with_last:
                    yield bucket
                    bucket, bucket_size = [], 0
                bucket.append((hf_name, tensor))
                bucket_size += size
                keep_with_last = False
            keep_with_last = rule.bucket_with_next
        if bucket:
            yield bucket


def stream_hf_weights(
    model: torch.nn.Module,
    family: ModelFamily,
    config: MoEModelConfig,
    *,
    bucket_bytes: int = 512 * 2**20,
    dst: int = 0,
    before_tensor: Callable[[str], None] | None = None,
) -> HFWeightStream:
    """The model's weights as Hugging Face tensors, in buckets; see `HFWeightStream`."""
    return HFWeightStream(
        model, family, config, bucket_bytes=bucket_bytes, dst=dst, before_tensor=before_tensor
    )
