"""Build a Megatron-Core GPTModel with MoE layers from a MoEModelConfig and a ParallelDims.

Megatron's process groups must exist first (`megatron_rl.parallel.distributed`). The local
(torch) layer spec is used on CPU; the Transformer Engine spec when TE is importable and CUDA is
available.
"""

from __future__ import annotations

from typing import Any

import torch
from megatron.core import parallel_state
from megatron.core.models.gpt import GPTModel
from megatron.core.models.gpt.gpt_layer_specs import get_gpt_decoder_block_spec
from megatron.core.transformer.dot_product_attention import DotProductAttention
from megatron.core.transformer.enums import AttnBackend
from megatron.core.transformer.moe.experts import SequentialMLP
from megatron.core.transformer.moe.moe_layer import MoELayer
from megatron.core.transformer.moe.router import TopKRouter
from megatron.core.transformer.transformer_block import TransformerBlockSubmodules
from megatron.core.transformer.transformer_config import MLATransformerConfig, TransformerConfig

from megatron_rl.models.config import Dispatcher, MoEModelConfig
from megatron_rl.models.grouped_experts import GroupedSequentialMLP
from megatron_rl.models.packed_attention import PackedDotProductAttention
from megatron_rl.models.router import PaddingMaskedTopKRouter
from megatron_rl.parallel.dims import ParallelDims


def transformer_engine_available() -> bool:
    """True when the Transformer Engine layer spec can be used (TE importable, CUDA present)."""
    if not torch.cuda.is_available():
        return False
    try:
        import transformer_engine  # noqa: F401
    except ImportError:
        return False
    return True


def _moe_layer_pattern(model: MoEModelConfig) -> int | list[int]:
    """megatron-core's moe_layer_freq: 1 for every layer MoE, else one 0/1 per layer. The int
    keeps format-1 checkpoints' keys (a per-layer pattern makes megatron-core key every layer
    on its own, as format 2 does anyway)."""
    if model.first_dense_layers == 0:
        return 1
    return [int(layer in model.moe_layers) for layer in range(model.num_layers)]


def _moe_options(
    model: MoEModelConfig, dispatcher: Dispatcher, routing_replay: bool
) -> dict[str, Any]:
    """TransformerConfig's MoE fields: which layers have experts, the experts, the router, the
    dispatcher, replay."""
    return {
        "num_moe_experts": model.num_experts,
        "moe_layer_freq": _moe_layer_pattern(model),
        "moe_ffn_hidden_size": model.moe_ffn_hidden_size,
        "moe_router_topk": model.router_topk,
        "moe_shared_expert_intermediate_size": model.shared_expert_ffn_hidden_size,
        "moe_router_score_function": model.router_score_function,
        "moe_router_pre_softmax": model.router_pre_softmax,
        "moe_router_enable_expert_bias": model.router_expert_bias,
        # 0: the score-correction bias stays as loaded (MoEModelConfig.router_expert_bias); else
        # finalize_model_grads moves it after each update by the update's tokens per expert.
        "moe_router_bias_update_rate": model.router_bias_update_rate,
        "moe_router_num_groups": model.router_num_groups,
        "moe_router_group_topk": model.router_group_topk,
        "moe_router_topk_scaling_factor": model.router_topk_scaling_factor,
        "moe_router_dtype": "fp32" if model.router_float32 else None,
        "moe_router_load_balancing_type": "aux_loss" if model.moe_aux_loss_coeff > 0 else "none",
        "moe_aux_loss_coeff": model.moe_aux_loss_coeff,
        "moe_token_dispatcher_type": dispatcher,
        "moe_enable_routing_replay": routing_replay,
        "moe_grouped_gemm": False,
    }


def dispatcher_for(dims: ParallelDims, dispatcher: Dispatcher) -> Dispatcher:
    """The token dispatcher megatron-core runs: `dispatcher`, except on a layout where no token
    leaves its rank for an expert (etp x ep = 1: each rank runs every expert whole), where it is
    allgather. There the two compute the same thing bit for bit (tests/models/test_build.py),
    but alltoall still re-sorts the tokens by local expert after its exchange: an identity
    order, run as a split into one chunk per expert and a concatenation, forward and backward
    (`token_dispatcher.py:732, 767`); at 64 experts the training step on CPU took 16% less
    without it (docs/benchmarks/grouped_experts.md)."""
    if dispatcher not in ("alltoall", "allgather"):
        raise ValueError(f"dispatcher: expected 'alltoall' or 'allgather', got {dispatcher!r}")
    return dispatcher if dims.etp * dims.ep > 1 else "allgather"


def _parallel_options(dims: ParallelDims, recompute: bool) -> dict[str, Any]:
    """TransformerConfig's layout fields, and activation recomputation."""
    return {
        "tensor_model_parallel_size": dims.tp,
        "pipeline_model_parallel_size": dims.pp,
        "context_parallel_size": dims.cp,
        "expert_model_parallel_size": dims.ep,
        "expert_tensor_parallel_size": dims.etp,
        "sequence_parallel": bool(dims.sequence_parallel),
        "recompute_granularity": "full" if recompute else None,
        "recompute_method": "uniform" if recompute else None,
        "recompute_num_layers": 1 if recompute else None,
    }


def _attention_options(model: MoEModelConfig) -> dict[str, Any]:
    """The attention fields: GQA's, or multi-latent attention's (MLATransformerConfig's)."""
    if not model.multi_latent_attention:
        return {
            "num_query_groups": model.num_query_groups,
            "kv_channels": model.kv_channels,
            "qk_layernorm": model.qk_layernorm,
            "add_qkv_bias": model.qkv_bias,
        }
    options: dict[str, Any] = {
        "multi_latent_attention": True,
        "q_lora_rank": model.q_lora_rank,
        "kv_lora_rank": model.kv_lora_rank,
        "qk_head_dim": model.qk_nope_head_dim,
        "qk_pos_emb_head_dim": model.qk_rope_head_dim,
        "v_head_dim": model.v_head_dim,
        # MLA's latent norms are the spec's q/k layernorms.
        "qk_layernorm": True,
        "rotary_base": model.rope_theta,
        "rope_type": "rope" if model.yarn_factor is None else "yarn",
    }
    if model.yarn_factor is not None:
        options |= {
            "rotary_scaling_factor": model.yarn_factor,
            "original_max_position_embeddings": model.yarn_original_max_position_embeddings,
            "beta_fast": model.yarn_beta_fast,
            "beta_slow": model.yarn_beta_slow,
            "mscale": model.yarn_mscale,
            "mscale_all_dim": model.yarn_mscale_all_dim,
        }
    return options


def transformer_config(
    model: MoEModelConfig,
    dims: ParallelDims,
    *,
    dispatcher: Dispatcher = "alltoall",
    recompute: bool = False,
    use_te: bool = False,
    initialize: bool = True,
    routing_replay: bool = False,
) -> TransformerConfig:
    """The megatron-core TransformerConfig for `model` split as `dims`.

    `calculate_per_token_loss` is on: the loss function returns an unnormalised sum and its
    denominator, and megatron-core's `finalize_model_grads` divides the gradients by the
    denominator summed over micro-batches and data-parallel ranks (an exact global mean).
    """
    model.check_split(dims)
    dtype = model.torch_dtype
    config_class = MLATransformerConfig if model.multi_latent_attention else TransformerConfig
    return config_class(
        num_layers=model.num_layers,
        hidden_size=model.hidden_size,
        num_attention_heads=model.num_attention_heads,
        ffn_hidden_size=model.ffn_hidden_size,
        layernorm_epsilon=model.norm_eps,
        normalization="RMSNorm",
        gated_linear_unit=True,
        activation_func=torch.nn.functional.silu,
        add_bias_linear=False,
        hidden_dropout=0.0,
        attention_dropout=0.0,
        init_method_std=model.init_std,
        perform_initialization=initialize,
        params_dtype=dtype,
        pipeline_dtype=dtype,
        bf16=dtype == torch.bfloat16,
        use_cpu_initialization=not torch.cuda.is_available(),
        calculate_per_token_loss=True,
        # Fusions are CUDA kernels; off on CPU, on where TE provides them.
        bias_dropout_fusion=False,
        apply_rope_fusion=use_te,
        masked_softmax_fusion=use_te,
        gradient_accumulation_fusion=False,
        persist_layer_norm=False,
        attention_backend=AttnBackend.auto if use_te else AttnBackend.local,
        **_attention_options(model),
        **_moe_options(model, dispatcher_for(dims, dispatcher), routing_replay),
        **_parallel_options(dims, recompute),
    )


def block_spec(
    config: TransformerConfig, *, use_te: bool, grouped_experts: bool = True
) -> TransformerBlockSubmodules:
    """The layers of this pipeline stage, dense or MoE as `config.moe_layer_freq` says: TE modules
    on GPU when available, megatron-core's torch ones else, with the routed experts in grouped
    GEMMs instead of a loop (`megatron_rl.models.grouped_experts`; `grouped_experts=False`
    keeps megatron-core's loop, for benchmarks), routers that leave padding out of their
    expert-bias counts (`megatron_rl.models.router`) and, in place of the torch core attention,
    one that also takes packed sequences (`megatron_rl.models.packed_attention`)."""
    spec = get_gpt_decoder_block_spec(
        config, use_transformer_engine=use_te, normalization="RMSNorm"
    )
    for layer in spec.layer_specs:
        attention = layer.submodules.self_attention.submodules
        if attention.core_attention is DotProductAttention:
            attention.core_attention = PackedDotProductAttention
        moe = layer.submodules.mlp.submodules
        experts = getattr(moe, "experts", None)
        if grouped_experts and experts is not None and experts.module is SequentialMLP:
            experts.module = GroupedSequentialMLP
        if getattr(moe, "router", None) is TopKRouter:
            moe.router = PaddingMaskedTopKRouter
    return spec


def build_gpt_moe(
    model: MoEModelConfig,
    dims: ParallelDims,
    *,
    dispatcher: Dispatcher = "alltoall",
    recompute: bool = False,
    use_te: bool | None = None,
    initialize: bool = True,
    routing_replay: bool = False,
    grouped_experts: bool = True,
) -> GPTModel:
    """This rank's part of the model (its pipeline stage, TP and EP shards). `initialize=False`
    skips the random initialisation, for models whose weights are loaded right after;
    `routing_replay=True` gives every router megatron-core's RouterReplay (see moe/replay.py);
    `grouped_experts=False` runs the experts as megatron-core's loop (see `block_spec`)."""
    use_te = transformer_engine_available() if use_te is None else use_te
    config = transformer_config(
        model,
        dims,
        dispatcher=dispatcher,
        recompute=recompute,
        use_te=use_te,
        initialize=initialize,
        routing_replay=routing_replay,
    )
    gpt = GPTModel(
        config=config,
        transformer_layer_spec=block_spec(config, use_te=use_te, grouped_experts=grouped_experts),
        vocab_size=model.vocab_size,
        max_sequence_length=model.max_position_embeddings,
        pre_process=parallel_state.is_pipeline_first_stage(),
        post_process=parallel_state.is_pipeline_last_stage(),
        share_embeddings_and_output_weights=model.tie_word_embeddings,
        position_embedding_type="rope",
        rotary_base=int(model.rope_theta),
        rotary_percent=model.rotary_percent,
        parallel_output=True,
    )
    if dims.ep == 1 and dims.etp != dims.tp:
        _reduce_expert_grads_over_expert_data_parallel(gpt)
    return gpt


def _reduce_expert_grads_over_expert_data_parallel(model: GPTModel) -> None:
    """Mark the routed experts' weights as expert-parallel (`allreduce=False`), so that DDP
    reduces their gradients over the expert data-parallel group and the optimizer counts them
    in the expert group's gradient norm.

    megatron-core 0.16.1 marks them only when ep > 1 (`transformer/moe/experts.py:89, 203`,
    `tensor_parallel/layers.py:829, 886, 1149, 1209`, `extensions/transformer_engine.py:590,
    644, 1506, 1551`). With ep == 1 and etp != tp the expert data-parallel group is not the
    dense one: at tp=2, etp=1 each TP rank runs all experts on its half of the sequence, and
    unmarked, their gradients would keep only that half (measured: a relative error of 1.1).
    """
    for module in model.modules():
        if isinstance(module, MoELayer):
            for param in module.experts.parameters():
                param.allreduce = False
