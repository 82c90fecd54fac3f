"""The DeepSeek-V3 and GLM-4.5 families: what their config.json becomes (and back), what is
refused and why, the dense/MoE split of their weight rules, and the multi-token-prediction layers
skipped on import. Logits, round trips and streams at every layout: tests/checkpoint."""

from __future__ import annotations

import json
from dataclasses import replace

import pytest
from safetensors.torch import load_file, save_file

from megatron_rl.models.build import transformer_config
from megatron_rl.models.config import MoEModelConfig
from megatron_rl.models.families import deepseek_v3, family_for, glm4_moe
from megatron_rl.models.families.base import bind_rules
from megatron_rl.models.hf_source import inspect_hf
from megatron_rl.parallel.dims import ParallelDims
from tests.checkpoint.tiny_hf import deepseek_v3_config, glm4_moe_config, save_tiny


def _hf(config) -> dict:
    return config.to_dict()


def test_deepseek_v3_config_maps_mla_yarn_and_the_router():
    config = deepseek_v3.config_from_hf(_hf(deepseek_v3_config()))
    assert config.multi_latent_attention and config.num_query_groups == config.num_attention_heads
    assert (config.q_lora_rank, config.kv_lora_rank) == (24, 16)
    assert (config.qk_nope_head_dim, config.qk_rope_head_dim, config.v_head_dim) == (16, 8, 12)
    assert (config.yarn_factor, config.yarn_original_max_position_embeddings) == (4.0, 64)
    assert (config.yarn_mscale, config.yarn_mscale_all_dim) == (1.0, 1.0)
    assert config.first_dense_layers == 1 and config.moe_layers == range(1, 4)
    assert config.router_score_function == "sigmoid" and config.router_expert_bias
    assert (config.router_num_groups, config.router_group_topk) == (4, 2)
    assert config.router_topk_scaling_factor == 2.5 and config.router_float32
    assert config.shared_expert_ffn_hidden_size == 16
    megatron = transformer_config(config, ParallelDims(world_size=1))
    assert megatron.multi_latent_attention and megatron.rope_type == "yarn"
    assert megatron.moe_layer_freq == [0, 1, 1, 1]
    assert megatron.moe_router_bias_update_rate == 0.0  # the bias stays as loaded
    assert megatron.moe_router_dtype == "fp32"
    updated = replace(config, router_bias_update_rate=1e-3, moe_aux_loss_coeff=0.01)
    megatron = transformer_config(updated, ParallelDims(world_size=1))
    assert megatron.moe_router_bias_update_rate == 1e-3 and megatron.moe_aux_loss_coeff == 0.01
    assert megatron.moe_router_load_balancing_type == "aux_loss"
    softmax = replace(config, router_score_function="softmax", router_expert_bias=False)
    with pytest.raises(ValueError, match="router_bias_update_rate: needs a sigmoid router"):
        replace(softmax, router_bias_update_rate=1e-3)


def test_glm4_moe_config_maps_bias_qk_norm_and_partial_rotary():
    config = glm4_moe.config_from_hf(_hf(glm4_moe_config()))
    assert config.qkv_bias and config.qk_layernorm and config.rotary_percent == 0.5
    assert (config.num_query_groups, config.kv_channels) == (2, 16)
    assert config.router_num_groups is None and config.router_topk_scaling_factor == 1.5
    without_factor = {k: v for k, v in _hf(glm4_moe_config()).items() if k != "rope_parameters"}
    del without_factor["partial_rotary_factor"]
    assert glm4_moe.config_from_hf(without_factor).rotary_percent == 0.5  # transformers' default


@pytest.mark.parametrize(
    ("family", "make_config"),
    [(deepseek_v3, deepseek_v3_config), (glm4_moe, glm4_moe_config)],
)
def test_config_json_round_trips(family, make_config):
    config = family.config_from_hf(_hf(make_config()))
    written = family.config_to_hf(config)
    assert family_for(written) is family.FAMILY
    assert family.config_from_hf(written) == config
    # transformers reads what is written, to the same shape
    assert type(make_config()).from_dict(written).num_hidden_layers == config.num_layers


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"norm_topk_prob": False}, "norm_topk_prob false is not supported"),
        ({"topk_group": 1}, "num_experts_per_tok / topk_group = 2"),
        ({"rope_interleave": False}, "rope_interleave false is not supported"),
        ({"attention_bias": True}, "attention_bias is not supported"),
        ({"scoring_func": "softmax"}, "scoring_func 'softmax'"),
        (
            {"rope_parameters": {"rope_type": "linear", "rope_theta": 1e4, "factor": 2.0}},
            "rope type 'linear' is not supported",
        ),
        (
            {
                "rope_parameters": {
                    "rope_type": "yarn",
                    "rope_theta": 1e4,
                    "factor": 4.0,
                    "original_max_position_embeddings": 64,
                    "mscale_all_dim": 1.0,
                }
            },
            "mscale_all_dim but no mscale",
        ),
        ({"first_k_dense_replace": 4}, "first_dense_layers: expected an int in"),
    ],
)
def test_deepseek_v3_configs_megatron_core_cannot_match_are_refused(change, message):
    with pytest.raises(ValueError, match=message):
        deepseek_v3.config_from_hf(_hf(deepseek_v3_config()) | change)


def test_rules_give_dense_layers_an_mlp_and_moe_layers_experts():
    config = deepseek_v3.config_from_hf(_hf(deepseek_v3_config()))
    names = set(bind_rules(deepseek_v3.FAMILY, config))
    assert "decoder.layers.0.mlp.linear_fc1.weight" in names
    assert not any(n.startswith("decoder.layers.0.mlp.router") for n in names)
    for layer in (1, 2, 3):
        assert f"decoder.layers.{layer}.mlp.linear_fc1.weight" not in names
        assert f"decoder.layers.{layer}.mlp.router.expert_bias" in names
        assert f"decoder.layers.{layer}.mlp.shared_experts.linear_fc2.weight" in names
        assert f"decoder.layers.{layer}.mlp.experts.local_experts.7.linear_fc1.weight" in names


def test_mla_widths_are_checked_against_the_tensor_parallel_size():
    config = deepseek_v3.config_from_hf(_hf(deepseek_v3_config(q_lora_rank=25)))
    with pytest.raises(ValueError, match=r"q_lora_rank: 25 is not divisible by tp\(2\)"):
        config.check_split(ParallelDims(world_size=2, tp=2, sequence_parallel=True))


def test_mla_fields_need_multi_latent_attention():
    with pytest.raises(ValueError, match="kv_lora_rank: a multi-latent attention field"):
        MoEModelConfig(
            num_layers=2,
            hidden_size=32,
            num_attention_heads=4,
            num_query_groups=4,
            ffn_hidden_size=8,
            moe_ffn_hidden_size=8,
            num_experts=2,
            router_topk=1,
            vocab_size=8,
            kv_lora_rank=8,
        )


def test_multi_token_prediction_layers_are_skipped_on_import_with_a_warning(tmp_path):
    hf_dir = save_tiny("deepseek_v3", tmp_path / "hf", num_nextn_predict_layers=1)
    weights = load_file(hf_dir / "model.safetensors")
    mtp = {
        name.replace("model.layers.3.", "model.layers.4."): tensor.clone()
        for name, tensor in weights.items()
        if name.startswith("model.layers.3.")
    } | {"model.layers.4.eh_proj.weight": weights["lm_head.weight"][:, :16].clone()}
    save_file(weights | mtp, hf_dir / "model.safetensors", metadata={"format": "pt"})
    with pytest.warns(UserWarning, match=rf"skipping the {len(mtp)} tensor\(s\) of the multi"):
        source = inspect_hf(hf_dir)
    assert source.config.num_layers == 4
    # one more such layer than the config counts is not skipped: it is a tensor no rule uses
    config = json.loads((hf_dir / "config.json").read_text())
    (hf_dir / "config.json").write_text(json.dumps(config | {"num_nextn_predict_layers": 0}))
    with pytest.raises(ValueError, match="tensor\\(s\\) the DeepseekV3ForCausalLM mapping"):
        inspect_hf(hf_dir)
