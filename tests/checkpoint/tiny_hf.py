"""Tiny random Hugging Face MoE checkpoints, made in the test (no hub access)."""

from __future__ import annotations

from pathlib import Path

import torch
from transformers import MixtralConfig, MixtralForCausalLM, Qwen3MoeConfig, Qwen3MoeForCausalLM

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


FAMILIES = {
    "qwen3_moe": (qwen3_moe_config, Qwen3MoeForCausalLM),
    "mixtral": (mixtral_config, MixtralForCausalLM),
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
    model.save_pretrained(directory)
    (directory / "tokenizer_config.json").write_text('{"model_max_length": 128}\n')
    return directory
