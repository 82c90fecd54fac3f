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
from megatron.core.models.gpt.gpt_layer_specs import (
    get_gpt_layer_local_spec,
    get_gpt_layer_with_transformer_engine_spec,
)
from megatron.core.transformer.enums import AttnBackend
from megatron.core.transformer.moe.moe_layer import MoELayer
from megatron.core.transformer.spec_utils import ModuleSpec
from megatron.core.transformer.transformer_config import TransformerConfig

from megatron_rl.models.config import Dispatcher, MoEModelConfig
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


def _moe_options(
    model: MoEModelConfig, dispatcher: Dispatcher, routing_replay: bool
) -> dict[str, Any]:
    """TransformerConfig's MoE fields: experts, router, dispatcher, replay."""
    if dispatcher not in ("alltoall", "allgather"):
        raise ValueError(f"dispatcher: expected 'alltoall' or 'allgather', got {dispatcher!r}")
    return {
        "num_moe_experts": model.num_experts,
        "moe_ffn_hidden_size": model.moe_ffn_hidden_size,
        "moe_router_topk": model.router_topk,
        "moe_shared_expert_intermediate_size": model.shared_expert_ffn_hidden_size,
        "moe_router_score_function": model.router_score_function,
        "moe_router_pre_softmax": model.router_pre_softmax,
        "moe_router_load_balancing_type": "aux_loss" if model.moe_aux_loss_coeff > 0 else "none",
        "moe_aux_loss_coeff": model.moe_aux_loss_coeff,
        "moe_token_dispatcher_type": dispatcher,
        "moe_enable_routing_replay": routing_replay,
        "moe_grouped_gemm": False,
    }


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
    return TransformerConfig(
        num_layers=model.num_layers,
        hidden_size=model.hidden_size,
        num_attention_heads=model.num_attention_heads,
        num_query_groups=model.num_query_groups,
        kv_channels=model.kv_channels,
        ffn_hidden_size=model.ffn_hidden_size,
        qk_layernorm=model.qk_layernorm,
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
        **_moe_options(model, dispatcher, routing_replay),
        **_parallel_options(dims, recompute),
    )


def layer_spec(model: MoEModelConfig, *, use_te: bool) -> ModuleSpec:
    """Transformer-layer spec: TE modules on GPU when available, megatron-core's torch ones else."""
    if use_te:
        return get_gpt_layer_with_transformer_engine_spec(
            num_experts=model.num_experts, moe_grouped_gemm=False, qk_layernorm=model.qk_layernorm
        )
    return get_gpt_layer_local_spec(
        num_experts=model.num_experts,
        moe_grouped_gemm=False,
        qk_layernorm=model.qk_layernorm,
        normalization="RMSNorm",
    )


def build_gpt_moe(
    model: MoEModelConfig,
    dims: ParallelDims,
    *,
    dispatcher: Dispatcher = "alltoall",
    recompute: bool = False,
    use_te: bool | None = None,
    initialize: bool = True,
    routing_replay: bool = False,
) -> GPTModel:
    """This rank's part of the model (its pipeline stage, TP and EP shards). `initialize=False`
    skips the random initialisation, for models whose weights are loaded right after;
    `routing_replay=True` gives every router megatron-core's RouterReplay (see moe/replay.py)."""
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
        transformer_layer_spec=layer_spec(model, use_te=use_te),
        vocab_size=model.vocab_size,
        max_sequence_length=model.max_position_embeddings,
        pre_process=parallel_state.is_pipeline_first_stage(),
        post_process=parallel_state.is_pipeline_last_stage(),
        share_embeddings_and_output_weights=model.tie_word_embeddings,
        position_embedding_type="rope",
        rotary_base=int(model.rope_theta),
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
