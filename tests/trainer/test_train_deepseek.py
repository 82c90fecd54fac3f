"""`megatron-rl train` end to end on the shipped tiny DeepSeek-V3-shaped model (MLA with YaRN, a
dense first layer, sigmoid routing with a score-correction bias in groups, a shared expert):
GSPO with weight syncs and an export whose greedy outputs, reloaded by transformers, are the
trainer's own; GRPO with R2 replay under full recompute; GRPO with R3 at PP=2, where the first
stage holds the dense layer and one MoE layer."""

from __future__ import annotations

import math

from megatron_rl.rewards import ArithmeticTask
from megatron_rl.rollout.codec import PromptCodec
from megatron_rl.rollout.engine import SamplingParams
from megatron_rl.rollout.local import LocalEngine
from tests.parallel.harness import run_on_ranks
from tests.trainer import greedy_worker
from tests.trainer.run_cli import REPO, finished_run_metrics, train_cli

TINY_DEEPSEEK = REPO / "examples" / "moe" / "tiny_deepseek_v3"
RECIPE = REPO / "examples" / "moe" / "tiny_deepseek_v3_gspo.yaml"
MOE_LAYERS = (1, 2, 3)  # layer 0 is dense


def _train(tmp_path, overrides, nproc=1):
    result = train_cli(
        tmp_path, [f"model.hf_path={TINY_DEEPSEEK}", *overrides], nproc=nproc, recipe=RECIPE
    )
    metrics = finished_run_metrics(result, tmp_path)
    for step in (1, 2):
        assert math.isfinite(metrics[step]["loss/policy"]) and metrics[step]["steps/skipped"] == 0
        # the engine was synced before the step: its log-probs are the trainer's
        assert metrics[step]["mismatch/k3"] < 1e-8
    assert any(metrics[step]["grad_norm"] > 0 for step in (1, 2))
    return metrics


def test_gspo_syncs_exports_and_the_export_greedily_answers_as_the_trainer(tmp_path):
    _train(tmp_path, ["checkpoint.export_hf=true"])
    codec = PromptCodec(TINY_DEEPSEEK, max_prompt_tokens=80)
    problems = ArithmeticTask().problems("eval", 4, seed=5)
    prompts = [codec.encode_prompt(p.prompt) for p in problems]
    (trainer,) = run_on_ranks(
        greedy_worker.greedy_from_checkpoint,
        str(tmp_path / "checkpoints" / "step_000002"),
        prompts,
        48,
        list(codec.stop_token_ids),
        world_size=1,
    )
    reloaded = LocalEngine.from_pretrained(tmp_path / "export")  # transformers' DeepSeek-V3
    params = SamplingParams(temperature=0, max_new_tokens=48, stop_token_ids=codec.stop_token_ids)
    exported = [group[0].response_ids for group in reloaded.generate(prompts, params)]
    assert [list(r) for r in exported] == trainer
    assert any(len(response) > 8 for response in trainer)


def _routing_metrics(record):
    layers = sorted(
        int(key.rsplit("_", 1)[1]) for key in record if key.startswith("routing/drift_layer_")
    )
    assert layers == list(MOE_LAYERS)  # named by model layer; the dense layer has none
    assert record["routing/replay_miss_token_layer"] == 0.0  # replay forced every MoE layer


def test_grpo_with_r2_under_full_recompute(tmp_path):
    metrics = _train(tmp_path, ["algo.loss=grpo", "algo.routing_replay=r2", "model.recompute=true"])
    _routing_metrics(metrics[2])


def test_grpo_with_r3_at_pp2_takes_each_stages_moe_layers_from_the_engine(tmp_path):
    metrics = _train(
        tmp_path, ["algo.loss=grpo", "algo.routing_replay=r3", "parallel.pp=2"], nproc=2
    )
    _routing_metrics(metrics[2])
    # before the first update the trainer routes as the engine did: a shifted mapping (stage 1
    # taking layers 1-2's routing for its layers 2-3) would disagree on most tokens
    for step in (1, 2):
        assert metrics[step]["routing/engine_mismatch_token_layer"] < 0.05
