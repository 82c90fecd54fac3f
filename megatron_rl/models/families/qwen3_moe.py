"""Qwen3-MoE (Qwen3MoeForCausalLM): GQA with per-head RMSNorm on queries and keys, every layer
MoE, softmax router (top-k renormalised by default), no shared expert."""

from __future__ import annotations

from typing import Any

from megatron_rl.models.config import MoEModelConfig
from megatron_rl.models.families import common
from megatron_rl.models.families.base import ModelFamily, WeightRule
from megatron_rl.models.families.common import HF_LAYER, LAYER

RULES = (
    *common.embedding_and_head_rules(),
    *common.attention_rules(),
    WeightRule(f"{LAYER}.mlp.router.weight", (f"{HF_LAYER}.mlp.gate.weight",)),
    *common.swiglu_rules(
        f"{LAYER}.mlp.experts.local_experts.{{expert}}", f"{HF_LAYER}.mlp.experts.{{expert}}"
    ),
)


def config_from_hf(hf: dict[str, Any]) -> MoEModelConfig:
    if hf.get("decoder_sparse_step", 1) != 1 or hf.get("mlp_only_layers"):
        raise ValueError(
            "config.json: dense layers (decoder_sparse_step != 1 or mlp_only_layers) are not "
            "supported; every layer must be MoE"
        )
    if hf.get("attention_bias") or hf.get("use_sliding_window"):
        raise ValueError("config.json: attention_bias and sliding windows are not supported")
    experts = hf.get("num_experts", hf.get("num_local_experts"))
    if experts is None:
        raise ValueError("config.json: missing field 'num_experts'")
    return MoEModelConfig(
        **common.llama_style_config(hf, default_norm_eps=1e-6),
        ffn_hidden_size=common.require(hf, "intermediate_size"),
        moe_ffn_hidden_size=common.require(hf, "moe_intermediate_size"),
        num_experts=experts,
        router_pre_softmax=not hf.get("norm_topk_prob", True),
        qk_layernorm=True,
    )


def config_to_hf(config: MoEModelConfig) -> dict[str, Any]:
    return common.llama_style_fields(config) | {
        "architectures": ["Qwen3MoeForCausalLM"],
        "model_type": "qwen3_moe",
        "intermediate_size": config.ffn_hidden_size,
        "moe_intermediate_size": config.moe_ffn_hidden_size,
        "num_experts": config.num_experts,
        "norm_topk_prob": not config.router_pre_softmax,
        "decoder_sparse_step": 1,
        "mlp_only_layers": [],
    }


FAMILY = ModelFamily(
    architecture="Qwen3MoeForCausalLM",
    model_type="qwen3_moe",
    rules=RULES,
    config_from_hf=config_from_hf,
    config_to_hf=config_to_hf,
)
