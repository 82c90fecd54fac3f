"""DeepSeek-V3 (DeepseekV3ForCausalLM; also Moonlight and Kimi-K2, which share its architecture):
multi-latent attention (MLA) with low-rank query and key/value projections and a decoupled RoPE
part, optionally YaRN-scaled; the first layers dense, the rest MoE with a sigmoid router, its
score-correction bias, group-limited top-k and a routed scaling factor, plus shared experts.

The multi-token-prediction layers (num_nextn_predict_layers, stored as the layers after the
last decoder layer) serve speculative decoding, not RL: they are skipped on import, and an
export has none (config.json is kept as it was, as transformers itself writes it).
"""

from __future__ import annotations

from typing import Any

from megatron_rl.models.config import MoEModelConfig
from megatron_rl.models.families import common
from megatron_rl.models.families.base import ModelFamily, WeightRule
from megatron_rl.models.families.common import HF_LAYER, LAYER

ATTENTION, HF_ATTENTION = f"{LAYER}.self_attention", f"{HF_LAYER}.self_attn"


def _with_q_lora(config: MoEModelConfig) -> bool:
    return config.q_lora_rank is not None


# MLA's projections keep their layouts in both: megatron-core's up-projections are laid out per
# head as [no-RoPE part, RoPE part] (queries) and [key, value] like transformers', and its RoPE
# takes the interleaved dimensions that transformers' rope_interleave=True implies.
# SGLang fuses q_a_proj and kv_a_proj_with_mqa within one weight-update call and silently drops
# one that comes without the other: the stream keeps them in one bucket.
MLA_RULES = (
    WeightRule(
        f"{ATTENTION}.linear_q_proj.weight",
        (f"{HF_ATTENTION}.q_proj.weight",),
        when=lambda config: not _with_q_lora(config),
    ),
    WeightRule(
        f"{ATTENTION}.linear_q_down_proj.weight",
        (f"{HF_ATTENTION}.q_a_proj.weight",),
        when=_with_q_lora,
        bucket_with_next=True,
    ),
    WeightRule(
        f"{ATTENTION}.linear_kv_down_proj.weight", (f"{HF_ATTENTION}.kv_a_proj_with_mqa.weight",)
    ),
    WeightRule(
        f"{ATTENTION}.q_layernorm.weight",
        (f"{HF_ATTENTION}.q_a_layernorm.weight",),
        when=_with_q_lora,
    ),
    WeightRule(
        f"{ATTENTION}.linear_q_up_proj.weight",
        (f"{HF_ATTENTION}.q_b_proj.weight",),
        when=_with_q_lora,
    ),
    WeightRule(f"{ATTENTION}.kv_layernorm.weight", (f"{HF_ATTENTION}.kv_a_layernorm.weight",)),
    WeightRule(f"{ATTENTION}.linear_kv_up_proj.weight", (f"{HF_ATTENTION}.kv_b_proj.weight",)),
    WeightRule(f"{ATTENTION}.linear_proj.weight", (f"{HF_ATTENTION}.o_proj.weight",)),
)

RULES = (
    WeightRule(
        f"{ATTENTION}.linear_q_proj.weight",
        (f"{HF_ATTENTION}.q_proj.weight",),
        when=lambda config: not _with_q_lora(config),
    ),
    WeightRule(
        f"{ATTENTION}.linear_q_down_proj.weight",
        (f"{HF_ATTENTION}.q_a_proj.weight",),
        when=_with_q_lora,
    ),
    WeightRule(
        f"{ATTENTION}.q_layernorm.weight",
        (f"{HF_ATTENTION}.q_a_layernorm.weight",),
        when=_with_q_lora,
    ),
    WeightRule(
        f"{ATTENTION}.linear_q_up_proj.weight",
        (f"{HF_ATTENTION}.q_b_proj.weight",),
        when=_with_q_lora,
    ),
    WeightRule(
        f"{ATTENTION}.linear_kv_down_proj.weight", (f"{HF_ATTENTION}.kv_a_proj_with_mqa.weight",)
    ),
    WeightRule(f"{ATTENTION}.kv_layernorm.weight", (f"{HF_ATTENTION}.kv_a_layernorm.weight",)),
    WeightRule(f"{ATTENTION}.linear_kv_up_proj.weight", (f"{HF_ATTENTION}.kv_b_proj.weight",)),
    WeightRule(f"{ATTENTION}.linear_proj.weight", (f"{HF_ATTENTION}.o_proj.weight",)),
)

RULES = (
    *common.embedding_and_head_rules(),
    *common.layer_norm_rules(),
    *MLA_RULES,
    *common.deepseek_moe_rules(),
)


def _rope_fields(hf: dict[str, Any]) -> dict[str, Any]:
    """Plain RoPE or YaRN, as megatron-core's MLA computes them (transformers' mscale rules:
    the cos/sin scale is mscale(factor, mscale) / mscale(factor, mscale_all_dim) when both are
    set, mscale(factor, 1) otherwise)."""
    parameters = common.rope_parameters(hf)
    fields: dict[str, Any] = {"rope_theta": float(parameters["rope_theta"])}
    if parameters["rope_type"] == "default":
        return fields
    if parameters["rope_type"] != "yarn":
        raise ValueError(
            f"config.json: rope type {parameters['rope_type']!r} is not supported for "
            "DeepSeek-V3; plain RoPE or yarn"
        )
    unsupported = [key for key in ("attention_factor",) if parameters.get(key) is not None]
    if unsupported or parameters.get("truncate", True) is not True:
        raise ValueError(
            f"config.json: yarn with {unsupported or 'truncate false'} is not supported "
            "(megatron-core derives the attention factor and rounds the correction range)"
        )
    factor = parameters.get("factor")
    if factor is None:
        raise ValueError("config.json: rope_parameters: yarn needs a 'factor'")
    mscale, mscale_all_dim = parameters.get("mscale"), parameters.get("mscale_all_dim")
    if mscale_all_dim and not mscale:
        raise ValueError(
            "config.json: yarn with mscale_all_dim but no mscale is not supported (transformers "
            "then scales cos/sin and the softmax by different rules than megatron-core)"
        )
    both = bool(mscale and mscale_all_dim)
    return fields | {
        "yarn_factor": float(factor),
        "yarn_original_max_position_embeddings": common.require(
            parameters, "original_max_position_embeddings"
        ),
        "yarn_beta_fast": float(parameters.get("beta_fast") or 32.0),
        "yarn_beta_slow": float(parameters.get("beta_slow") or 1.0),
        "yarn_mscale": float(mscale) if both else 1.0,
        "yarn_mscale_all_dim": float(mscale_all_dim) if both else 0.0,
    }


def config_from_hf(hf: dict[str, Any]) -> MoEModelConfig:
    if hf.get("attention_bias"):
        raise ValueError("config.json: attention_bias is not supported for DeepSeek-V3")
    if hf.get("rope_interleave", True) is not True:
        raise ValueError(
            "config.json: rope_interleave false is not supported; megatron-core's MLA rotates "
            "interleaved dimension pairs"
        )
    if hf.get("hidden_act", "silu") != "silu":
        raise ValueError(f"config.json: hidden_act {hf['hidden_act']!r}; only silu (SwiGLU)")
    heads = common.require(hf, "num_attention_heads")
    return MoEModelConfig(
        num_layers=common.require(hf, "num_hidden_layers"),
        hidden_size=common.require(hf, "hidden_size"),
        num_attention_heads=heads,
        num_query_groups=heads,
        multi_latent_attention=True,
        q_lora_rank=hf.get("q_lora_rank"),
        kv_lora_rank=common.require(hf, "kv_lora_rank"),
        qk_nope_head_dim=common.require(hf, "qk_nope_head_dim"),
        qk_rope_head_dim=common.require(hf, "qk_rope_head_dim"),
        v_head_dim=common.require(hf, "v_head_dim"),
        **_rope_fields(hf),
        **common.deepseek_moe_config(hf),
        norm_eps=hf.get("rms_norm_eps", 1e-6),
        vocab_size=common.require(hf, "vocab_size"),
        tie_word_embeddings=hf.get("tie_word_embeddings", False),
        max_position_embeddings=hf.get("max_position_embeddings", 4096),
        dtype=common.dtype(hf),
    )


def _rope_parameters(config: MoEModelConfig) -> dict[str, Any]:
    if config.yarn_factor is None:
        return {"rope_theta": config.rope_theta, "rope_type": "default"}
    return {
        "rope_theta": config.rope_theta,
        "rope_type": "yarn",
        "factor": config.yarn_factor,
        "original_max_position_embeddings": config.yarn_original_max_position_embeddings,
        "beta_fast": config.yarn_beta_fast,
        "beta_slow": config.yarn_beta_slow,
        "mscale": config.yarn_mscale,
        "mscale_all_dim": config.yarn_mscale_all_dim,
    }


def config_to_hf(config: MoEModelConfig) -> dict[str, Any]:
    return common.deepseek_moe_fields(config) | {
        "architectures": ["DeepseekV3ForCausalLM"],
        "model_type": "deepseek_v3",
        "hidden_size": config.hidden_size,
        "num_hidden_layers": config.num_layers,
        "num_attention_heads": config.num_attention_heads,
        "num_key_value_heads": config.num_attention_heads,
        "q_lora_rank": config.q_lora_rank,
        "kv_lora_rank": config.kv_lora_rank,
        "qk_nope_head_dim": config.qk_nope_head_dim,
        "qk_rope_head_dim": config.qk_rope_head_dim,
        "v_head_dim": config.v_head_dim,
        "rope_interleave": True,
        "rope_parameters": _rope_parameters(config),
        "rms_norm_eps": config.norm_eps,
        "vocab_size": config.vocab_size,
        "tie_word_embeddings": config.tie_word_embeddings,
        "max_position_embeddings": config.max_position_embeddings,
        "hidden_act": "silu",
        "attention_bias": False,
        "dtype": config.dtype,
        # in DeepSeek-V3's own config.json, not in transformers' class; SGLang needs them
        "moe_layer_freq": 1,
        "topk_method": "noaux_tc",
        "scoring_func": "sigmoid",
    }


FAMILY = ModelFamily(
    architecture="DeepseekV3ForCausalLM",
    model_type="deepseek_v3",
    rules=RULES,
    config_from_hf=config_from_hf,
    config_to_hf=config_to_hf,
    mtp_layers_field="num_nextn_predict_layers",
)
