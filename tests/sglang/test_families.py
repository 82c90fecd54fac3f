"""DeepSeek-V3 and GLM-4.5 (tiny random models) on a real SGLang 0.5.23 server on CPU: its
routed experts cover every layer, the dense first one with zeros, and R3 takes each MoE layer's
from the right column; weights the trainer streams (Megatron-Core, in small buckets) reach the
server, whose log-probs then equal the trainer's."""

from __future__ import annotations

import pytest
import torch

from megatron_rl.files.hf_checkpoint import HFCheckpoint
from megatron_rl.models.families import family_for
from megatron_rl.moe.engine_routing import engine_layer_columns
from megatron_rl.rollout.engine import SamplingParams
from megatron_rl.rollout.local import LocalEngine
from megatron_rl.rollout.sglang import SGLangEngine, make_weight_sync
from tests.checkpoint.tiny_hf import save_tiny
from tests.parallel.harness import run_on_ranks
from tests.sglang import families_worker
from tests.sglang.conftest import TEST_PORT, cpu_servers

PROMPTS = [[3, 4, 5, 6, 7, 8, 9], [10, 11, 12]]
PROBE = [3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13]


# GLM-4.5 (its dense first layers and routing as DeepSeek-V3's) is extended.
@pytest.fixture(
    scope="module",
    params=["deepseek_v3", pytest.param("glm4_moe", marks=pytest.mark.extended)],
)
def served(request, tmp_path_factory):
    """(tiny model directory, its model config, its server group)."""
    hf_dir = save_tiny(request.param, tmp_path_factory.mktemp(request.param) / "hf")
    checkpoint = HFCheckpoint(hf_dir)
    config = family_for(checkpoint.config).config_from_hf(checkpoint.config)
    group = cpu_servers(TEST_PORT + 20, tmp_path_factory.mktemp("logs"), model=str(hf_dir))
    with group:
        yield hf_dir, config, checkpoint, group
    checkpoint.close()


def _engine(served, tmp_path) -> SGLangEngine:
    hf_dir, config, checkpoint, group = served
    return SGLangEngine(
        group.urls,
        make_weight_sync("tensor", tp_sizes=[1], directory=tmp_path, hf_dir=str(hf_dir)),
        managed=group,
        routed_experts=(config.num_layers, config.router_topk),
        tensor_shapes={name: checkpoint.shape(name) for name in checkpoint.names()},
    )


def test_routed_experts_cover_every_layer_and_r3_finds_the_moe_ones(served, tmp_path):
    hf_dir, config, _, _ = served
    engine = _engine(served, tmp_path)
    reference = LocalEngine.from_pretrained(hf_dir)
    try:
        params = SamplingParams(temperature=0, max_new_tokens=6)
        groups = engine.generate(PROMPTS, params, return_routed_experts=True)
    finally:
        engine.close()
    columns = engine_layer_columns(config.num_layers, config.num_layers, config.moe_layers)
    for (sample,) in groups:
        record = sample.routed_experts  # [tokens - 1, every layer, topk]
        assert tuple(record.shape[1:]) == (config.num_layers, config.router_topk)
        assert not record[:, : config.first_dense_layers].any()  # dense rows: zeros
        # the model's own routing of the sample's tokens (transformers: MoE layers only)
        scored = sample.prompt_ids + sample.response_ids
        (own,) = reference.generate(
            [scored], SamplingParams(max_new_tokens=1), return_routed_experts=True
        )[0]
        own_routing = own.routed_experts[: len(scored) - 1]
        for index, layer in enumerate(config.moe_layers):
            served_sets = record[:, columns[layer]].sort(-1).values
            assert torch.equal(served_sets, own_routing[:, index].sort(-1).values), layer


def test_weights_streamed_from_the_trainer_give_the_trainers_log_probs(served, tmp_path):
    hf_dir, _, _, group = served
    # one tensor per bucket, but for DeepSeek-V3's q_a_proj / kv_a_proj_with_mqa pairs, which
    # SGLang fuses per update call and drops when they come apart
    (trainer,) = run_on_ranks(families_worker.perturbed_stream, str(hf_dir), PROBE, 1, world_size=1)
    buckets = [[(n, torch.from_numpy(t)) for n, t in bucket] for bucket in trainer["buckets"]]
    trainer_logp = torch.from_numpy(trainer["logp"])
    assert len(buckets) > 10
    engine = _engine(served, tmp_path)
    try:
        before = engine.score([PROBE])[0]
        assert (before - trainer_logp).abs().max() > 1e-3  # the noise moved the trainer
        engine.update_weights(buckets, version=1)
        after = engine.score([PROBE])[0]
    finally:
        engine.close()
        group.servers[0].connection.post(
            "/update_weights_from_disk", {"model_path": str(hf_dir), "weight_version": "base"}
        )
    assert (after - trainer_logp).abs().max() < 1e-4
