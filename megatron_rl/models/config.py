"""The recipe's `model` section, and the shape of a Mixture-of-Experts decoder (rich enough for
Qwen3-MoE and Mixtral) that a Hugging Face config becomes."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Literal

import torch

if TYPE_CHECKING:
    from megatron_rl.parallel.dims import ParallelDims

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}

Dispatcher = Literal["alltoall", "allgather"]


@dataclass(frozen=True, kw_only=True)
class ModelConfig:
    """The policy: a Hugging Face MoE checkpoint, loaded into Megatron-Core."""

    hf_path: str = "examples/moe/tiny_qwen3_moe"
    """Directory of the Hugging Face checkpoint (config.json, safetensors, tokenizer files)."""
    dispatcher: Dispatcher = "alltoall"
    """Megatron-Core's MoE token dispatcher."""
    recompute: bool = False
    """Recompute activations in the backward pass (less memory, more time)."""


@dataclass(frozen=True, kw_only=True)
class MoEModelConfig:
    """A decoder-only MoE transformer (RMSNorm, RoPE, SwiGLU experts, no biases).

    Attributes:
        num_layers: transformer layers, every one an MoE layer.
        hidden_size: model width.
        num_attention_heads: query heads.
        num_query_groups: key/value heads (GQA); equal to num_attention_heads for MHA.
        head_dim: per-head width; None means hidden_size / num_attention_heads (Qwen3 sets it).
        ffn_hidden_size: width of a dense FFN (megatron-core requires it even when all layers are
            MoE; also the default width of a shared expert).
        moe_ffn_hidden_size: width of each routed expert's FFN.
        num_experts: routed experts per layer.
        router_topk: experts each token is routed to.
        shared_expert_ffn_hidden_size: width of the always-on shared expert; None for none.
        router_score_function: "softmax" (Qwen3-MoE, Mixtral) or "sigmoid" (DeepSeek-V3).
        router_pre_softmax: softmax over all experts, then top-k, weights not renormalised
            (Qwen3-MoE with norm_topk_prob=False); False: top-k, then softmax over the chosen
            (Mixtral; equal to Qwen3-MoE's default norm_topk_prob=True).
        qk_layernorm: RMSNorm on queries and keys per head (Qwen3).
        rope_theta: RoPE base.
        norm_eps: RMSNorm epsilon.
        vocab_size: vocabulary size (must be divisible by the tensor parallel size).
        tie_word_embeddings: share the input embedding and the output layer.
        max_position_embeddings: longest sequence the RoPE cache covers.
        dtype: parameter dtype, "float32" or "bfloat16".
        moe_aux_loss_coeff: load-balancing auxiliary loss weight; 0 turns it off.
        init_std: std of the random initialisation (when not loading a checkpoint).
    """

    num_layers: int
    hidden_size: int
    num_attention_heads: int
    num_query_groups: int
    head_dim: int | None = None
    ffn_hidden_size: int
    moe_ffn_hidden_size: int
    num_experts: int
    router_topk: int
    shared_expert_ffn_hidden_size: int | None = None
    router_score_function: Literal["softmax", "sigmoid"] = "softmax"
    router_pre_softmax: bool = False
    qk_layernorm: bool = False
    rope_theta: float = 10000.0
    norm_eps: float = 1e-6
    vocab_size: int
    tie_word_embeddings: bool = False
    max_position_embeddings: int = 4096
    dtype: Literal["float32", "bfloat16"] = "float32"
    moe_aux_loss_coeff: float = 0.0
    init_std: float = 0.02

    def __post_init__(self) -> None:
        positive = (
            "num_layers",
            "hidden_size",
            "num_attention_heads",
            "num_query_groups",
            "ffn_hidden_size",
            "moe_ffn_hidden_size",
            "num_experts",
            "router_topk",
            "vocab_size",
            "max_position_embeddings",
        )
        for name in positive:
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name}: expected a positive int, got {value!r}")
        if self.num_attention_heads % self.num_query_groups != 0:
            raise ValueError(
                f"num_query_groups: {self.num_query_groups} must divide num_attention_heads "
                f"({self.num_attention_heads})"
            )
        if self.head_dim is None and self.hidden_size % self.num_attention_heads != 0:
            raise ValueError(
                f"head_dim: not given and hidden_size ({self.hidden_size}) is not divisible by "
                f"num_attention_heads ({self.num_attention_heads})"
            )
        if self.router_topk > self.num_experts:
            raise ValueError(
                f"router_topk: {self.router_topk} exceeds num_experts ({self.num_experts})"
            )
        if self.router_score_function not in ("softmax", "sigmoid"):
            raise ValueError(
                f"router_score_function: expected 'softmax' or 'sigmoid', got "
                f"{self.router_score_function!r}"
            )
        if self.dtype not in DTYPES:
            raise ValueError(f"dtype: expected one of {', '.join(DTYPES)}, got {self.dtype!r}")

    def check_split(self, dims: ParallelDims) -> None:
        """Raise a ValueError, with the arithmetic, if `dims` cannot split this model."""
        dims.check_model(
            num_layers=self.num_layers,
            num_attention_heads=self.num_attention_heads,
            num_query_groups=self.num_query_groups,
            vocab_size=self.vocab_size,
            num_experts=self.num_experts,
            moe_ffn_hidden_size=self.moe_ffn_hidden_size,
            ffn_hidden_size=self.ffn_hidden_size,
        )

    @property
    def kv_channels(self) -> int:
        return self.head_dim or self.hidden_size // self.num_attention_heads

    @property
    def torch_dtype(self) -> torch.dtype:
        return DTYPES[self.dtype]
