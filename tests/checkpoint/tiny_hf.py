"""Tiny random Hugging Face MoE checkpoints, made in the test (no hub access)."""

from __future__ import annotations

from pathlib import Path

import torch
from transformers import (
    DeepseekV3Config,
    DeepseekV3ForCausalLM,
    Glm4MoeConfig,
    Glm4MoeForCausalLM,
    MixtralConfig,
    MixtralForCausalLM,
    Qwen3MoeConfig,
    Qwen3MoeForCausalLM,
)

VOCAB = 96


def qwen3_moe_config(**overrides) -> Qwen3MoeConfig:
    fields = {
        "vocab_size": VOCAB,
        "hidden_size": 32,
        "intermediate_size": 64,
        "moe_intermediate_size": 16,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 16,
        "num_experts": 4,
        "num_experts_per_tok": 2,
        "norm_topk_prob": True,
        "max_position_embeddings": 128,
        "tie_word_embeddings": False,
        "rope_theta": 10000.0,
    }
    return Qwen3MoeConfig(**(fields | overrides))


def mixtral_config(**overrides) -> MixtralConfig:
    fields = {
        "vocab_size": VOCAB,
        "hidden_size": 32,
        "intermediate_size": 24,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "num_local_experts": 4,
        "num_experts_per_tok": 2,
        "max_position_embeddings": 128,
        "sliding_window": None,
        "rope_theta": 10000.0,
    }
    return MixtralConfig(**(fields | overrides))


def deepseek_v3_config(**overrides) -> DeepseekV3Config:
    """MLA with YaRN, one dense layer then three MoE layers (so that PP=2 puts the dense and an
    MoE layer on one stage, two MoE layers on the other), group-limited sigmoid routing with
    the score-correction bias, a routed scaling factor and a shared expert."""
    fields = {
        "vocab_size": VOCAB,
        "hidden_size": 32,
        "intermediate_size": 48,
        "moe_intermediate_size": 16,
        "num_hidden_layers": 4,
        "first_k_dense_replace": 1,
        "num_attention_heads": 4,
        "q_lora_rank": 24,
        "kv_lora_rank": 16,
        "qk_nope_head_dim": 16,
        "qk_rope_head_dim": 8,
        "v_head_dim": 12,
        "n_routed_experts": 8,
        "num_experts_per_tok": 4,
        "n_group": 4,
        "topk_group": 2,
        "n_shared_experts": 1,
        "routed_scaling_factor": 2.5,
        "max_position_embeddings": 256,
        "rope_parameters": {
            "rope_type": "yarn",
            "rope_theta": 10000.0,
            "factor": 4.0,
            "original_max_position_embeddings": 64,
            "beta_fast": 32,
            "beta_slow": 1,
            "mscale": 1.0,
            "mscale_all_dim": 1.0,
        },
        "tie_word_embeddings": False,
        # in DeepSeek-V3's own config.json, not in transformers' class; SGLang needs them
        "moe_layer_freq": 1,
        "topk_method": "noaux_tc",
        "scoring_func": "sigmoid",
    }
    return DeepseekV3Config(**(fields | overrides))


def glm4_moe_config(**overrides) -> Glm4MoeConfig:
    """GLM-4.5's shape: biased QKV, query/key norms, RoPE on half of each head, one dense layer,
    sigmoid routing with the score-correction bias and a shared expert."""
    fields = {
        "vocab_size": VOCAB,
        "hidden_size": 32,
        "intermediate_size": 48,
        "moe_intermediate_size": 16,
        "num_hidden_layers": 4,
        "first_k_dense_replace": 1,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 16,
        "attention_bias": True,
        "use_qk_norm": True,
        "partial_rotary_factor": 0.5,
        "n_routed_experts": 8,
        "num_experts_per_tok": 2,
        "n_shared_experts": 1,
        "routed_scaling_factor": 1.5,
        "max_position_embeddings": 256,
        "tie_word_embeddings": False,
    }
    return Glm4MoeConfig(**(fields | overrides))


FAMILIES = {
    "qwen3_moe": (qwen3_moe_config, Qwen3MoeForCausalLM),
    "mixtral": (mixtral_config, MixtralForCausalLM),
    "deepseek_v3": (deepseek_v3_config, DeepseekV3ForCausalLM),
    "glm4_moe": (glm4_moe_config, Glm4MoeForCausalLM),
}


def save_tiny(family: str, directory: Path, seed: int = 0, **overrides) -> Path:
    """A randomly initialised model of `family`, saved with its (tiny) tokenizer files."""
    make_config, model_class = FAMILIES[family]
    torch.manual_seed(seed)
    model = model_class(make_config(**overrides))
    with torch.no_grad():  # spread the norms away from 1 so that a swapped norm shows up
        for name, param in model.named_parameters():
            if "norm" in name:
                param.add_(0.1 * torch.randn_like(param))
            if name.endswith("proj.bias"):
                param.normal_(0, 0.1)
        for name, buffer in model.named_buffers():  # a bias that changes some experts' choice
            if name.endswith("e_score_correction_bias"):
                buffer.normal_(0, 0.01)
    model.save_pretrained(directory)
    (directory / "tokenizer_config.json").write_text('{"model_max_length": 128}\n')
    return directory
