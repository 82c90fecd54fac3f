"""GLM-4.5 and GLM-4.5-Air (Glm4MoeForCausalLM): GQA with biased query/key/value projections,
optional per-head query/key norms and RoPE on part of each head (partial_rotary_factor, 0.5 by
default); DeepSeek-V3's MoE layers: the first layers dense, then a sigmoid router with its
score-correction bias, a routed scaling factor and shared experts.

Its multi-token-prediction layers are skipped on import, as DeepSeek-V3's (see deepseek_v3.py).
"""

from __future__ import annotations

from typing import Any

from megatron_rl.models.config import MoEModelConfig
from megatron_rl.models.families import common
from megatron_rl.models.families.base import ModelFamily

RULES = (
    *common.embedding_and_head_rules(),
    *common.attention_rules(),
    *common.deepseek_moe_rules(),
)

# transformers' Glm4MoeConfig rotates half of each head when the config does not say
DEFAULT_PARTIAL_ROTARY_FACTOR = 0.5


def config_from_hf(hf: dict[str, Any]) -> MoEModelConfig:
    if hf.get("hidden_act", "silu") != "silu":
        raise ValueError(f"config.json: hidden_act {hf['hidden_act']!r}; only silu (SwiGLU)")
    partial_rotary = common.rope_parameters(hf).get(
        "partial_rotary_factor", hf.get("partial_rotary_factor", DEFAULT_PARTIAL_ROTARY_FACTOR)
    )
    return MoEModelConfig(
        **common.llama_style_config(hf, default_norm_eps=1e-5)
        | common.deepseek_moe_config(hf)
        | {
            "qk_layernorm": bool(hf.get("use_qk_norm", False)),
            "qkv_bias": bool(hf.get("attention_bias", False)),
            "rotary_percent": float(partial_rotary),
        }
    )


def config_to_hf(config: MoEModelConfig) -> dict[str, Any]:
    fields = common.llama_style_fields(config) | common.deepseek_moe_fields(config)
    fields["rope_parameters"] |= {"partial_rotary_factor": config.rotary_percent}
    return fields | {
        "architectures": ["Glm4MoeForCausalLM"],
        "model_type": "glm4_moe",
        "partial_rotary_factor": config.rotary_percent,
        "attention_bias": config.qkv_bias,
        "use_qk_norm": config.qk_layernorm,
    }


FAMILY = ModelFamily(
    architecture="Glm4MoeForCausalLM",
    model_type="glm4_moe",
    rules=RULES,
    config_from_hf=config_from_hf,
    config_to_hf=config_to_hf,
    mtp_layers_field="num_nextn_predict_layers",
)
