"""Rules and config fields the families share: the Llama-style attention and config of
Qwen3-MoE, Mixtral and GLM-4.5, and the DeepSeek-style MoE layers of DeepSeek-V3 and GLM-4.5
(dense leading layers, sigmoid router with a score-correction bias, shared experts)."""

from __future__ import annotations

from typing import Any

from megatron_rl.models.config import MoEModelConfig
from megatron_rl.models.families.base import FUSED_GATE_UP, FUSED_QKV, WeightRule

LAYER, HF_LAYER = "decoder.layers.{layer}", "model.layers.{layer}"


def embedding_and_head_rules() -> tuple[WeightRule, ...]:
    return (
        WeightRule("embedding.word_embeddings.weight", ("model.embed_tokens.weight",)),
        WeightRule("decoder.final_layernorm.weight", ("model.norm.weight",)),
        WeightRule(
            "output_layer.weight",
            ("lm_head.weight",),
            when=lambda config: not config.tie_word_embeddings,
        ),
    )


def layer_norm_rules() -> tuple[WeightRule, ...]:
    """The two norms of every layer: before attention and before the feed-forward part."""
    return (
        WeightRule(f"{LAYER}.input_layernorm.weight", (f"{HF_LAYER}.input_layernorm.weight",)),
        WeightRule(
            f"{LAYER}.pre_mlp_layernorm.weight", (f"{HF_LAYER}.post_attention_layernorm.weight",)
        ),
    )


def attention_rules() -> tuple[WeightRule, ...]:
    """GQA with a fused QKV projection, the layer norms around it; query/key norms and QKV
    biases where the config has them."""
    attention, hf = f"{LAYER}.self_attention", f"{HF_LAYER}.self_attn"
    return (
        *layer_norm_rules(),
        WeightRule(
            f"{attention}.linear_qkv.weight",
            tuple(f"{hf}.{p}_proj.weight" for p in "qkv"),
            FUSED_QKV,
        ),
        WeightRule(
            f"{attention}.linear_qkv.bias",
            tuple(f"{hf}.{p}_proj.bias" for p in "qkv"),
            FUSED_QKV,
            when=lambda config: config.qkv_bias,
        ),
        WeightRule(
            f"{attention}.q_layernorm.weight",
            (f"{hf}.q_norm.weight",),
            when=lambda config: config.qk_layernorm,
        ),
        WeightRule(
            f"{attention}.k_layernorm.weight",
            (f"{hf}.k_norm.weight",),
            when=lambda config: config.qk_layernorm,
        ),
        WeightRule(f"{attention}.linear_proj.weight", (f"{hf}.o_proj.weight",)),
    )


def swiglu_rules(megatron: str, hf: str, **kwargs: Any) -> tuple[WeightRule, ...]:
    """A SwiGLU feed-forward block: HF gate/up/down_proj <-> Megatron-Core's fused fc1 and fc2."""
    return (
        WeightRule(
            f"{megatron}.linear_fc1.weight",
            (f"{hf}.gate_proj.weight", f"{hf}.up_proj.weight"),
            FUSED_GATE_UP,
            **kwargs,
        ),
        WeightRule(f"{megatron}.linear_fc2.weight", (f"{hf}.down_proj.weight",), **kwargs),
    )


def deepseek_moe_rules() -> tuple[WeightRule, ...]:
    """The feed-forward part of DeepSeek-style layers: a dense SwiGLU in the first layers; in the
    others a sigmoid router with its score-correction bias, routed experts and shared experts."""
    mlp, hf = f"{LAYER}.mlp", f"{HF_LAYER}.mlp"
    return (
        *swiglu_rules(mlp, hf, layers="dense"),
        WeightRule(f"{mlp}.router.weight", (f"{hf}.gate.weight",), layers="moe"),
        WeightRule(
            f"{mlp}.router.expert_bias", (f"{hf}.gate.e_score_correction_bias",), layers="moe"
        ),
        *swiglu_rules(
            f"{mlp}.experts.local_experts.{{expert}}", f"{hf}.experts.{{expert}}", layers="moe"
        ),
        *swiglu_rules(
            f"{mlp}.shared_experts",
            f"{hf}.shared_experts",
            layers="moe",
            when=lambda config: config.shared_expert_ffn_hidden_size is not None,
        ),
    )


def require(hf: dict[str, Any], key: str) -> Any:
    if key not in hf:
        raise ValueError(f"config.json: missing field {key!r}")
    return hf[key]


def rope_parameters(hf: dict[str, Any]) -> dict[str, Any]:
    """RoPE's parameters in transformers 5's form: transformers 5 nests them (rope_theta too) in
    rope_parameters; 4.x configs have rope_theta at the top level and scaling in rope_scaling."""
    parameters = {"rope_theta": hf.get("rope_theta", 10000.0)} | dict(hf.get("rope_scaling") or {})
    parameters |= hf.get("rope_parameters") or {}
    parameters["rope_type"] = parameters.get("rope_type", parameters.get("type")) or "default"
    return parameters


def rope_theta(hf: dict[str, Any]) -> float:
    """The RoPE base of a config whose RoPE is not scaled."""
    parameters = rope_parameters(hf)
    if parameters["rope_type"] != "default":
        raise ValueError(
            f"config.json: rope scaling {parameters} is not supported for "
            f"{hf.get('model_type')!r}; only plain RoPE"
        )
    return float(parameters["rope_theta"])


def dtype(hf: dict[str, Any]) -> str:
    name = hf.get("dtype") or hf.get("torch_dtype") or "float32"
    if name not in ("float32", "bfloat16"):
        raise ValueError(f"config.json: dtype {name!r} is not supported; use float32 or bfloat16")
    return name


def llama_style_config(hf: dict[str, Any], *, default_norm_eps: float) -> dict[str, Any]:
    """The MoEModelConfig fields the Llama-style families read alike from config.json."""
    heads = require(hf, "num_attention_heads")
    return {
        "num_layers": require(hf, "num_hidden_layers"),
        "hidden_size": require(hf, "hidden_size"),
        "num_attention_heads": heads,
        "num_query_groups": hf.get("num_key_value_heads", heads),
        "head_dim": hf.get("head_dim"),
        "router_topk": require(hf, "num_experts_per_tok"),
        "rope_theta": rope_theta(hf),
        "norm_eps": hf.get("rms_norm_eps", default_norm_eps),
        "vocab_size": require(hf, "vocab_size"),
        "tie_word_embeddings": hf.get("tie_word_embeddings", False),
        "max_position_embeddings": hf.get("max_position_embeddings", 4096),
        "dtype": dtype(hf),
    }


def llama_style_fields(config: MoEModelConfig) -> dict[str, Any]:
    """The config.json fields the Llama-style families share."""
    return {
        "hidden_size": config.hidden_size,
        "num_hidden_layers": config.num_layers,
        "num_attention_heads": config.num_attention_heads,
        "num_key_value_heads": config.num_query_groups,
        "head_dim": config.kv_channels,
        "num_experts_per_tok": config.router_topk,
        "rms_norm_eps": config.norm_eps,
        "rope_parameters": {"rope_theta": config.rope_theta, "rope_type": "default"},
        "vocab_size": config.vocab_size,
        "tie_word_embeddings": config.tie_word_embeddings,
        "max_position_embeddings": config.max_position_embeddings,
        "hidden_act": "silu",
        "attention_bias": False,
        "dtype": config.dtype,
    }


def deepseek_moe_config(hf: dict[str, Any]) -> dict[str, Any]:
    """The MoEModelConfig fields of DeepSeek-style MoE layers (DeepSeek-V3, GLM-4.5), checked
    against what megatron-core's router computes."""
    topk = require(hf, "num_experts_per_tok")
    groups, group_topk = hf.get("n_group") or 1, hf.get("topk_group") or 1
    if hf.get("scoring_func", "sigmoid") != "sigmoid" or hf.get("topk_method", "noaux_tc") not in (
        "noaux_tc",
    ):
        raise ValueError(
            f"config.json: scoring_func {hf.get('scoring_func')!r} / topk_method "
            f"{hf.get('topk_method')!r} is not supported; only sigmoid scores with the "
            "score-correction bias (noaux_tc, DeepSeek-V3's)"
        )
    if groups > 1 and topk // group_topk != 2:
        # transformers scores a group by the sum of its best 2 experts; megatron-core by its best
        # topk / topk_group. They agree for DeepSeek-V3 (8 / 4).
        raise ValueError(
            f"config.json: n_group {groups} with num_experts_per_tok {topk} and topk_group "
            f"{group_topk}: groups are scored by their best 2 experts, which megatron-core "
            "matches only when num_experts_per_tok / topk_group = 2"
        )
    if not hf.get("norm_topk_prob", True) and topk > 1:
        raise ValueError(
            "config.json: norm_topk_prob false is not supported; megatron-core's sigmoid router "
            "always renormalises the top-k weights"
        )
    moe_ffn = require(hf, "moe_intermediate_size")
    shared = hf.get("n_shared_experts") or 0
    return {
        "ffn_hidden_size": require(hf, "intermediate_size"),
        "moe_ffn_hidden_size": moe_ffn,
        "num_experts": require(hf, "n_routed_experts"),
        "router_topk": topk,
        "first_dense_layers": hf.get("first_k_dense_replace") or 0,
        "shared_expert_ffn_hidden_size": moe_ffn * shared if shared else None,
        "router_score_function": "sigmoid",
        "router_expert_bias": True,
        "router_num_groups": groups if groups > 1 else None,
        "router_group_topk": group_topk if groups > 1 else None,
        "router_topk_scaling_factor": float(hf.get("routed_scaling_factor") or 1.0),
        "router_float32": True,
    }


def deepseek_moe_fields(config: MoEModelConfig) -> dict[str, Any]:
    """The config.json fields of DeepSeek-style MoE layers."""
    shared = config.shared_expert_ffn_hidden_size or 0
    if shared % config.moe_ffn_hidden_size != 0:
        raise ValueError(
            f"shared_expert_ffn_hidden_size: {shared} is not a whole number of experts of "
            f"moe_ffn_hidden_size {config.moe_ffn_hidden_size} (config.json's n_shared_experts)"
        )
    return {
        "intermediate_size": config.ffn_hidden_size,
        "moe_intermediate_size": config.moe_ffn_hidden_size,
        "n_routed_experts": config.num_experts,
        "num_experts_per_tok": config.router_topk,
        "first_k_dense_replace": config.first_dense_layers,
        "n_shared_experts": shared // config.moe_ffn_hidden_size,
        "n_group": config.router_num_groups or 1,
        "topk_group": config.router_group_topk or 1,
        "routed_scaling_factor": config.router_topk_scaling_factor or 1.0,
        "norm_topk_prob": True,
        "num_nextn_predict_layers": 0,
    }
