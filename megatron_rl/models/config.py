"""The recipe's `model` section, and the shape of a Mixture-of-Experts decoder (rich enough for
Qwen3-MoE, Mixtral, DeepSeek-V3 and GLM-4.5) that a Hugging Face config becomes."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING, Literal

import torch

from megatron_rl.config import ConfigError

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
    """Megatron-Core's MoE token dispatcher where tokens cross ranks to their experts (ep or
    expert tp > 1); where none does, allgather whatever this says (the same results, without
    alltoall's identity re-sort: megatron_rl.models.build.dispatcher_for)."""
    recompute: bool = False
    """Recompute activations in the backward pass (less memory, more time)."""
    trust_remote_code: bool = False
    """Run the checkpoint's own tokenizer code (tokenizer_config.json's auto_map; Moonlight's
    tiktoken tokenizer). The tokenizer only: the model always runs megatron-core's layers, and
    the engines transformers' or SGLang's own implementation of its family."""
    aux_loss_coeff: float = 0.0
    """Megatron-Core's switch load-balancing loss in every MoE layer, this times its value
    averaged over the update's micro-batches added to the policy loss (0: off)."""
    router_bias_update_rate: float = 0.0
    """Megatron-Core's aux-loss-free balancing: after each update every expert's score-correction
    bias moves by this much towards an even load of the update's tokens (sign rule). Needs a
    sigmoid router with an expert bias (DeepSeek-V3's e_score_correction_bias); 0: the bias stays
    as loaded."""

    def validate(self) -> None:
        for name in ("aux_loss_coeff", "router_bias_update_rate"):
            value = getattr(self, name)
            if not math.isfinite(value) or value < 0:
                raise ConfigError(f"model.{name}: expected a finite number >= 0, got {value}")


@dataclass(frozen=True, kw_only=True)
class MoEModelConfig:
    """A decoder-only MoE transformer (RMSNorm, RoPE, SwiGLU feed-forward layers).

    Attributes:
        num_layers: transformer layers (dense leading layers included).
        hidden_size: model width.
        num_attention_heads: query heads.
        num_query_groups: key/value heads (GQA); equal to num_attention_heads for MHA and MLA.
        head_dim: per-head width; None means hidden_size / num_attention_heads (Qwen3 sets it).
            Unused by multi-latent attention, whose widths are the qk_*/v_head_dim fields.
        ffn_hidden_size: width of a dense layer's FFN (megatron-core requires it even when all
            layers are MoE).
        moe_ffn_hidden_size: width of each routed expert's FFN.
        num_experts: routed experts per MoE layer.
        router_topk: experts each token is routed to.
        first_dense_layers: the first this many layers have a dense FFN instead of experts
            (DeepSeek-V3's and GLM-4.5's first_k_dense_replace); the rest are MoE layers.
        shared_expert_ffn_hidden_size: width of the always-on shared expert of each MoE layer
            (all shared experts of a layer as one); None for none.
        router_score_function: "softmax" (Qwen3-MoE, Mixtral) or "sigmoid" (DeepSeek-V3).
        router_pre_softmax: softmax over all experts, then top-k, weights not renormalised
            (Qwen3-MoE with norm_topk_prob=False); False: top-k, then softmax over the chosen
            (Mixtral; equal to Qwen3-MoE's default norm_topk_prob=True). Softmax routers only.
        router_expert_bias: a per-expert score-correction bias added to the sigmoid scores when
            choosing experts, not when weighting them (DeepSeek-V3's e_score_correction_bias).
            It is a load-balancing device of pretraining: RL keeps it fixed unless
            router_bias_update_rate is set (the engine then receives it with the weights).
        router_num_groups: experts form this many equal groups; a token's experts come from its
            router_group_topk best groups, a group scored by the sum of its best
            router_topk / router_group_topk scores (DeepSeek-V3's n_group, topk_group). None:
            no groups.
        router_group_topk: groups each token may use (with router_num_groups).
        router_topk_scaling_factor: the gate weights are multiplied by it (DeepSeek-V3's
            routed_scaling_factor); None for 1.
        router_float32: the router's logits are computed in float32 whatever the model's dtype
            (DeepSeek-V3 and GLM-4.5 do so).
        qk_layernorm: RMSNorm on queries and keys per head (Qwen3, GLM-4.5 with use_qk_norm).
        qkv_bias: the query, key and value projections have biases (GLM-4.5's attention_bias).
        rotary_percent: the share of each head's dimensions that RoPE rotates, the first ones
            (GLM-4.5's partial_rotary_factor 0.5).
        multi_latent_attention: DeepSeek's multi-latent attention (MLA) instead of GQA: keys
            and values come up from a shared low-rank latent; a decoupled RoPE part of width
            qk_rope_head_dim is shared by all heads.
        q_lora_rank: MLA: rank of the queries' low-rank projection; None projects queries
            directly from the hidden state (DeepSeek-V2-Lite).
        kv_lora_rank: MLA: rank of the keys' and values' shared latent.
        qk_nope_head_dim: MLA: per-head query/key width without RoPE.
        qk_rope_head_dim: MLA: per-head query/key width with RoPE.
        v_head_dim: MLA: per-head value width.
        rope_theta: RoPE base.
        yarn_factor: YaRN RoPE scaling factor (MLA only); None for plain RoPE.
        yarn_original_max_position_embeddings: YaRN: the context length of pretraining.
        yarn_beta_fast: YaRN: rotations above which dimensions are not interpolated.
        yarn_beta_slow: YaRN: rotations below which dimensions are fully interpolated.
        yarn_mscale: YaRN: the cos/sin scale is mscale(factor, yarn_mscale) /
            mscale(factor, yarn_mscale_all_dim), with mscale(s, m) = 0.1 m ln(s) + 1.
        yarn_mscale_all_dim: YaRN: the softmax scale is multiplied by
            mscale(factor, yarn_mscale_all_dim) squared (0 leaves it).
        norm_eps: RMSNorm epsilon.
        vocab_size: vocabulary size (must be divisible by the tensor parallel size).
        tie_word_embeddings: share the input embedding and the output layer.
        max_position_embeddings: longest sequence the RoPE cache covers.
        dtype: parameter dtype, "float32" or "bfloat16".
        moe_aux_loss_coeff: weight of megatron-core's switch load-balancing loss in every MoE
            layer (averaged over an update's micro-batches by the trainer's schedule); 0 turns
            it off.
        router_bias_update_rate: megatron-core's aux-loss-free balancing: after each update the
            expert bias moves by this much towards an even load (needs router_expert_bias); 0
            keeps the bias as loaded.
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
    first_dense_layers: int = 0
    shared_expert_ffn_hidden_size: int | None = None
    router_score_function: Literal["softmax", "sigmoid"] = "softmax"
    router_pre_softmax: bool = False
    router_expert_bias: bool = False
    router_num_groups: int | None = None
    router_group_topk: int | None = None
    router_topk_scaling_factor: float | None = None
    router_float32: bool = False
    qk_layernorm: bool = False
    qkv_bias: bool = False
    rotary_percent: float = 1.0
    multi_latent_attention: bool = False
    q_lora_rank: int | None = None
    kv_lora_rank: int | None = None
    qk_nope_head_dim: int | None = None
    qk_rope_head_dim: int | None = None
    v_head_dim: int | None = None
    rope_theta: float = 10000.0
    yarn_factor: float | None = None
    yarn_original_max_position_embeddings: int | None = None
    yarn_beta_fast: float = 32.0
    yarn_beta_slow: float = 1.0
    yarn_mscale: float = 1.0
    yarn_mscale_all_dim: float = 0.0
    norm_eps: float = 1e-6
    vocab_size: int
    tie_word_embeddings: bool = False
    max_position_embeddings: int = 4096
    dtype: Literal["float32", "bfloat16"] = "float32"
    moe_aux_loss_coeff: float = 0.0
    router_bias_update_rate: float = 0.0
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
            _check_positive_int(self, name)
        if self.num_attention_heads % self.num_query_groups != 0:
            raise ValueError(
                f"num_query_groups: {self.num_query_groups} must divide num_attention_heads "
                f"({self.num_attention_heads})"
            )
        if (
            self.head_dim is None
            and not self.multi_latent_attention
            and self.hidden_size % self.num_attention_heads != 0
        ):
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
        if not isinstance(self.first_dense_layers, int) or not (
            0 <= self.first_dense_layers < self.num_layers
        ):
            raise ValueError(
                f"first_dense_layers: expected an int in [0, num_layers) = [0, {self.num_layers}) "
                f"(at least one MoE layer), got {self.first_dense_layers!r}"
            )
        if not 0 < self.rotary_percent <= 1:
            raise ValueError(
                f"rotary_percent: expected a value in (0, 1], got {self.rotary_percent}"
            )
        self._check_router()
        self._check_attention()

    def _check_router(self) -> None:
        for name in ("moe_aux_loss_coeff", "router_bias_update_rate"):
            value = getattr(self, name)
            if not math.isfinite(value) or value < 0:
                raise ValueError(f"{name}: expected a finite number >= 0, got {value}")
        if self.router_bias_update_rate > 0 and not self.router_expert_bias:
            raise ValueError(
                "router_bias_update_rate: needs a sigmoid router with an expert bias "
                "(router_expert_bias, DeepSeek-V3's e_score_correction_bias)"
            )
        if self.router_score_function == "softmax" and self.router_expert_bias:
            raise ValueError("router_expert_bias: needs router_score_function 'sigmoid'")
        if self.router_score_function == "sigmoid" and self.router_pre_softmax:
            raise ValueError("router_pre_softmax: applies to softmax routers only")
        if (self.router_num_groups is None) != (self.router_group_topk is None):
            raise ValueError("router_num_groups and router_group_topk: give both or neither")
        if self.router_num_groups is not None:
            _check_positive_int(self, "router_num_groups")
            _check_positive_int(self, "router_group_topk")
            if self.num_experts % self.router_num_groups != 0:
                raise ValueError(
                    f"router_num_groups: {self.router_num_groups} must divide num_experts "
                    f"({self.num_experts})"
                )
            if self.router_group_topk > self.router_num_groups:
                raise ValueError(
                    f"router_group_topk: {self.router_group_topk} exceeds router_num_groups "
                    f"({self.router_num_groups})"
                )
            if self.router_topk % self.router_group_topk != 0:
                raise ValueError(
                    f"router_group_topk: {self.router_group_topk} must divide router_topk "
                    f"({self.router_topk})"
                )

    def _check_attention(self) -> None:
        mla_fields = ("kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim")
        if self.multi_latent_attention:
            for name in (*mla_fields, *(("q_lora_rank",) if self.q_lora_rank is not None else ())):
                _check_positive_int(self, name)
            if self.num_query_groups != self.num_attention_heads:
                raise ValueError(
                    f"num_query_groups: multi-latent attention has one key/value head per query "
                    f"head; expected {self.num_attention_heads}, got {self.num_query_groups}"
                )
            if self.qkv_bias or self.qk_layernorm or self.rotary_percent != 1:
                raise ValueError(
                    "multi_latent_attention: qkv_bias, qk_layernorm and rotary_percent are GQA "
                    "options (MLA has its own latent norms and a RoPE part of its own width)"
                )
        else:
            given = [name for name in ("q_lora_rank", *mla_fields) if getattr(self, name)]
            if given:
                raise ValueError(
                    f"{given[0]}: a multi-latent attention field; set "
                    "multi_latent_attention to use it"
                )
            if self.yarn_factor is not None:
                raise ValueError(
                    "yarn_factor: YaRN RoPE scaling is supported with multi_latent_attention only"
                )
        if self.yarn_factor is not None:
            if not self.yarn_factor > 0:
                raise ValueError(f"yarn_factor: expected a positive number, got {self.yarn_factor}")
            _check_positive_int(self, "yarn_original_max_position_embeddings")

    @property
    def moe_layers(self) -> range:
        """Indices (from 0, over the whole model) of the MoE layers."""
        return range(self.first_dense_layers, self.num_layers)

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
            more_tp_splits=self._more_tp_splits(),
        )

    def _more_tp_splits(self) -> dict[str, int]:
        """Widths that tensor parallelism splits besides the standard ones: the shared expert
        (split like a dense layer) and MLA's down-projections (column-parallel in megatron-core,
        gathered again before use)."""
        splits = {}
        if self.shared_expert_ffn_hidden_size is not None:
            splits["shared_expert_ffn_hidden_size"] = self.shared_expert_ffn_hidden_size
        if self.multi_latent_attention:
            if self.q_lora_rank is not None:
                splits["q_lora_rank"] = self.q_lora_rank
            splits["kv_lora_rank + qk_rope_head_dim"] = self.kv_lora_rank + self.qk_rope_head_dim
        return splits

    @property
    def kv_channels(self) -> int:
        return self.head_dim or self.hidden_size // self.num_attention_heads

    @property
    def torch_dtype(self) -> torch.dtype:
        return DTYPES[self.dtype]


def _check_positive_int(config: MoEModelConfig, name: str) -> None:
    value = getattr(config, name)
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{name}: expected a positive int, got {value!r}")
