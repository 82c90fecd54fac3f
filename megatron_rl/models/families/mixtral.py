"""Mixtral (MixtralForCausalLM): GQA, every layer MoE with top-k-then-softmax routing, experts
named w1 (gate), w3 (up), w2 (down) under block_sparse_moe."""

from __future__ import annotations

from typing import Any

from megatron_rl.models.config import MoEModelConfig
from megatron_rl.models.families import common
from megatron_rl.models.families.base import FUSED_GATE_UP, ModelFamily, WeightRule
from megatron_rl.models.families.common import HF_LAYER, LAYER

EXPERT = f"{LAYER}.mlp.experts.local_experts.{{expert}}"
HF_EXPERT = f"{HF_LAYER}.block_sparse_moe.experts.{{expert}}"

RULES = (
    *common.embedding_and_head_rules(),
    *common.attention_rules(),
    WeightRule(f"{LAYER}.mlp.router.weight", (f"{HF_LAYER}.block_sparse_moe.gate.weight",)),
    WeightRule(
        f"{EXPERT}.linear_fc1.weight",
        (f"{HF_EXPERT}.w1.weight", f"{HF_EXPERT}.w3.weight"),
        FUSED_GATE_UP,
    ),
    WeightRule(f"{EXPERT}.linear_fc2.weight", (f"{HF_EXPERT}.w2.weight",)),
)


def config_from_hf(hf: dict[str, Any]) -> MoEModelConfig:
    if hf.get("sliding_window") is not None:
        raise ValueError("config.json: sliding-window attention is not supported")
    expert_ffn = common.require(hf, "intermediate_size")
    return MoEModelConfig(
        **common.llama_style_config(hf, default_norm_eps=1e-5),
        ffn_hidden_size=expert_ffn,
        moe_ffn_hidden_size=expert_ffn,
        num_experts=common.require(hf, "num_local_experts"),
    )


def config_to_hf(config: MoEModelConfig) -> dict[str, Any]:
    return common.llama_style_fields(config) | {
        "architectures": ["MixtralForCausalLM"],
        "model_type": "mixtral",
        "intermediate_size": config.moe_ffn_hidden_size,
        "num_local_experts": config.num_experts,
        "sliding_window": None,
        "router_jitter_noise": 0.0,
    }


FAMILY = ModelFamily(
    architecture="MixtralForCausalLM",
    model_type="mixtral",
    rules=RULES,
    config_from_hf=config_from_hf,
    config_to_hf=config_to_hf,
)
