"""The declarative mapping between Megatron-Core and Hugging Face weights.

A model family is a list of `WeightRule`s, each tying one Megatron-Core tensor to one or more
Hugging Face tensors through a `Transform`, plus the two config conversions. Names are written as
templates with `{layer}` and `{expert}`; Megatron-Core names are *global* (layer index over the
whole model, expert index over all experts), as if the model were on one process. Sharding (TP
slices, EP-local expert indices, PP layer offsets) is handled apart, in `models/hf_weights.py`,
so a family never sees it. A rule with `{layer}` applies to every layer, or only to the dense or
only to the MoE layers (models whose first layers are dense). A new family is one new file of
rules and config conversions, plus a Transform where a tensor needs a new kind of rearrangement.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Literal, Protocol

import torch
from torch import Tensor

from megatron_rl.models.config import MoEModelConfig


class Transform(Protocol):
    """How Hugging Face tensors become one Megatron-Core tensor, and back (exact inverses)."""

    def to_megatron(self, hf: list[Tensor], config: MoEModelConfig) -> Tensor: ...

    def to_hf(self, megatron: Tensor, config: MoEModelConfig) -> list[Tensor]: ...


class Copy:
    """Same tensor under another name."""

    def to_megatron(self, hf: list[Tensor], config: MoEModelConfig) -> Tensor:
        return hf[0]

    def to_hf(self, megatron: Tensor, config: MoEModelConfig) -> list[Tensor]:
        return [megatron]


class FusedQKV:
    """HF q [heads*d, H], k [groups*d, H], v [groups*d, H] <-> Megatron-Core's fused QKV, grouped
    by key/value head: for each group, its query heads, then its key, then its value. That
    grouping is what lets tensor parallelism split the fused weight contiguously by groups.
    Biases ([heads*d], [groups*d], [groups*d]) are fused the same way."""

    def to_megatron(self, hf: list[Tensor], config: MoEModelConfig) -> Tensor:
        q, k, v = hf
        groups, dim = config.num_query_groups, config.kv_channels
        rest = q.shape[1:]  # (H,) for weights, () for biases
        per_group = [
            q.reshape(groups, -1, dim, *rest),
            k.reshape(groups, 1, dim, *rest),
            v.reshape(groups, 1, dim, *rest),
        ]
        return torch.cat(per_group, dim=1).reshape(-1, *rest)

    def to_hf(self, megatron: Tensor, config: MoEModelConfig) -> list[Tensor]:
        groups, dim = config.num_query_groups, config.kv_channels
        heads_per_group = config.num_attention_heads // groups
        rest = megatron.shape[1:]
        grouped = megatron.reshape(groups, heads_per_group + 2, dim, *rest)
        q, k, v = grouped.split([heads_per_group, 1, 1], dim=1)
        return [t.reshape(-1, *rest).contiguous() for t in (q, k, v)]


class FusedGateUp:
    """HF gate [F, H] and up [F, H] <-> Megatron-Core's SwiGLU fc1 [2F, H] = [gate; up]."""

    def to_megatron(self, hf: list[Tensor], config: MoEModelConfig) -> Tensor:
        return torch.cat(hf, dim=0)

    def to_hf(self, megatron: Tensor, config: MoEModelConfig) -> list[Tensor]:
        return [t.contiguous() for t in megatron.chunk(2, dim=0)]


COPY, FUSED_QKV, FUSED_GATE_UP = Copy(), FusedQKV(), FusedGateUp()


LayerKind = Literal["all", "dense", "moe"]


@dataclass(frozen=True)
class WeightRule:
    """One Megatron-Core tensor and the Hugging Face tensors it is made of."""

    megatron: str  # template, global indices: "decoder.layers.{layer}.mlp.router.weight"
    hf: tuple[str, ...]  # templates: ("model.layers.{layer}.mlp.gate.weight",)
    transform: Transform = COPY
    when: Callable[[MoEModelConfig], bool] = lambda config: True  # e.g. untied embeddings only
    layers: LayerKind = "all"  # with {layer}: which layers have this tensor
    # The weight stream puts this rule's last Hugging Face tensor and the next rule's first (of
    # the same layer) in one bucket: an engine that fuses them per update call needs both.
    bucket_with_next: bool = False


@dataclass(frozen=True)
class ModelFamily:
    """A Hugging Face architecture: its weight rules and its config conversions."""

    architecture: str  # config.json "architectures"[0], e.g. "Qwen3MoeForCausalLM"
    model_type: str  # config.json "model_type"
    rules: tuple[WeightRule, ...]
    config_from_hf: Callable[[dict[str, Any]], MoEModelConfig]
    config_to_hf: Callable[[MoEModelConfig], dict[str, Any]]
    # config.json's count of multi-token-prediction layers, stored after the last decoder layer
    # as model.layers.{num_hidden_layers + i}: RL does not use them (they are skipped on import).
    mtp_layers_field: str | None = None


@dataclass(frozen=True)
class BoundRule:
    """A rule with its indices filled in: concrete names of one Megatron-Core tensor."""

    megatron: str
    hf: tuple[str, ...]
    transform: Transform
    bucket_with_next: bool = False


def _fill(template: str, layer: int | None, expert: int | None) -> str:
    return template.format(layer=layer, expert=expert)


def _layers(kind: LayerKind, config: MoEModelConfig) -> range:
    if kind == "moe":
        return config.moe_layers
    if kind == "dense":
        return range(config.first_dense_layers)
    return range(config.num_layers)


def bind_rules(family: ModelFamily, config: MoEModelConfig) -> dict[str, BoundRule]:
    """Every Megatron-Core tensor of the model (global names) -> its concrete rule, the tensors
    outside the layers first, then layer by layer (in the family's rule order within a layer)."""
    ordered: list[tuple[tuple[int, int], str, BoundRule]] = []
    for index, rule in enumerate(family.rules):
        if not rule.when(config):
            continue
        layers = _layers(rule.layers, config) if "{layer}" in rule.megatron else [None]
        experts = range(config.num_experts) if "{expert}" in rule.megatron else [None]
        for layer in layers:
            for expert in experts:
                name = _fill(rule.megatron, layer, expert)
                hf = tuple(_fill(t, layer, expert) for t in rule.hf)
                bound = BoundRule(name, hf, rule.transform, rule.bucket_with_next)
                ordered.append(((-1 if layer is None else layer, index), name, bound))
    ordered.sort(key=lambda entry: entry[0])  # stable: experts keep their order
    return {name: bound for _, name, bound in ordered}


# Megatron-Core's Transformer Engine spec fuses the input norm into the QKV projection; the
# mapping is written for the local spec's names.
TE_ALIASES = (
    (re.compile(r"self_attention\.linear_qkv\.layer_norm_weight$"), "input_layernorm.weight"),
)


def canonical_megatron_name(name: str) -> str:
    """The local-spec name of a parameter (Transformer Engine spec names mapped back)."""
    for pattern, replacement in TE_ALIASES:
        if pattern.search(name):
            return pattern.sub(replacement, name)
    return name
