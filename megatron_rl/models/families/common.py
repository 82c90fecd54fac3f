"""Rules and config fields shared by the Llama-style MoE families (Qwen3-MoE, Mixtral)."""

from __future__ import annotations

from typing import Any

from megatron_rl.models.config import MoEModelConfig
from megatron_rl.models.families.base import FUSED_QKV, WeightRule


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


def attention_rules() -> tuple[WeightRule, ...]:
    layer = "decoder.layers.{layer}"
    hf = "model.layers.{layer}"
    return (
        WeightRule(f"{layer}.input_layernorm.weight", (f"{hf}.input_layernorm.weight",)),
        WeightRule(
            f"{layer}.self_attention.linear_qkv.weight",
            tuple(f"{hf}.self_attn.{p}_proj.weight" for p in "qkv"),
            FUSED_QKV,
        ),
        WeightRule(
            f"{layer}.self_attention.linear_proj.weight", (f"{hf}.self_attn.o_proj.weight",)
        ),
        WeightRule(f"{layer}.pre_mlp_layernorm.weight", (f"{hf}.post_attention_layernorm.weight",)),
    )


def require(hf: dict[str, Any], key: str) -> Any:
    if key not in hf:
        raise ValueError(f"config.json: missing field {key!r}")
    return hf[key]


def rope_theta(hf: dict[str, Any]) -> float:
    """transformers 5 nests it in rope_parameters; 4.x configs have it at the top level."""
    parameters = hf.get("rope_parameters") or {}
    rope_type = parameters.get("rope_type", "default")
    scaling = hf.get("rope_scaling")
    if rope_type != "default" or (scaling and scaling.get("rope_type", scaling.get("type"))):
        raise ValueError(
            f"config.json: rope scaling {parameters or scaling} is not supported; only plain RoPE"
        )
    return float(parameters.get("rope_theta", hf.get("rope_theta", 10000.0)))


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
