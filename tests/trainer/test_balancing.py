"""The recipe's load-balancing options in RL: megatron-core's switch aux loss
(`model.aux_loss_coeff`) weighs in as coeff x its mean over the update's non-padding tokens
whatever the loss denominator, padding left out;
the aux-loss-free expert-bias update (`model.router_bias_update_rate`) moves the bias after each
update, counts only the update's forwards, reaches the engine with the weights, and resumes
exactly from a checkpoint."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from megatron_rl.config import ConfigError
from megatron_rl.models.config import ModelConfig
from megatron_rl.parallel.dims import ParallelDims
from megatron_rl.trainer.policy import load_model_chunk
from tests.parallel.harness import run_on_ranks
from tests.trainer import balancing_worker
from tests.trainer.run_cli import (
    REPO,
    RESUMED_RUN,
    TINY_MODEL,
    check_repeats,
    finished_run_metrics,
    read_metrics,
    train_cli,
)

TINY_DEEPSEEK = str(REPO / "examples" / "moe" / "tiny_deepseek_v3")
DEEPSEEK_RECIPE = REPO / "examples" / "moe" / "tiny_deepseek_v3_gspo.yaml"


@pytest.mark.timeout(240)
@pytest.mark.parametrize(
    ("world_size", "loss_agg", "no_loss_tokens", "padded"),
    [
        (1, "token-mean", False, False),
        (1, "seq-mean-token-mean", False, False),
        (2, "seq-mean-token-sum", False, False),
        (1, "token-mean", True, False),
        (1, "seq-mean-token-mean", False, True),
        (2, "token-mean", False, True),
    ],
    ids=["token_mean", "seq_mean", "dp2_seq_sum", "no_loss_tokens", "padded", "dp2_padded"],
)
def test_the_aux_loss_adds_coeff_times_its_token_weighted_mean_over_micro_batches(
    world_size, loss_agg, no_loss_tokens, padded
):
    coeff = 0.5
    results = run_on_ranks(
        balancing_worker.aux_loss_gradient,
        loss_agg,
        coeff,
        no_loss_tokens,
        padded,
        world_size=world_size,
    )
    # each micro-batch's switch loss over its non-padding tokens, weighted by their count
    expected = coeff * sum(r["hand_sum"] for r in results) / sum(r["count"] for r in results)
    for result in results:  # the DP all-reduce leaves the same gradient on every rank
        assert (result["policy_grad"] == 0) == no_loss_tokens
        torch.testing.assert_close(result["difference"], expected, rtol=1e-4, atol=1e-7)
        if padded:  # padding follows every loss token and stays out of the switch loss
            assert result["pad_embedding_grad"] == 0.0
    assert expected.abs().max() > 1e-3


@pytest.mark.timeout(240)
def test_the_expert_bias_moves_after_each_update_and_reaches_the_engine():
    rate = 1e-2
    (result,) = run_on_ranks(balancing_worker.bias_update_sync, TINY_DEEPSEEK, rate, world_size=1)
    assert result["counted_without_grad"] == [0.0] * len(result["counted_without_grad"])
    step = result["updated"] - result["start"]
    # the sign rule: each expert's bias moved by the rate, up if under-loaded, down if over
    # (an expert loaded exactly at the mean would stay: sign 0)
    assert (((step.abs() - rate).abs() < 1e-6) | (step == 0)).all()
    assert (step > 0).any() and (step < 0).any()
    assert not torch.equal(result["engine_before"], result["updated"])
    assert torch.equal(result["engine_after"], result["updated"])


def test_a_bias_update_rate_needs_a_router_with_an_expert_bias():
    with pytest.raises(
        ConfigError, match=r"model\.router_bias_update_rate: needs a sigmoid router"
    ):
        load_model_chunk(
            ModelConfig(hf_path=str(TINY_MODEL), router_bias_update_rate=0.01),
            ParallelDims(world_size=1),
            routing_replay=False,
        )


@pytest.mark.extended  # a whole training run; the aux loss's gradient is checked above
@pytest.mark.timeout(300)
def test_a_short_run_with_the_aux_loss_trains(tmp_path):
    metrics = finished_run_metrics(train_cli(tmp_path, ["model.aux_loss_coeff=0.01"]), tmp_path)
    for step in (1, 2):
        assert math.isfinite(metrics[step]["loss/policy"]) and metrics[step]["steps/skipped"] == 0
        assert metrics[step]["mismatch/k3"] < 1e-8  # the engine was synced before the step


def _exported(run_dir: Path) -> dict[str, torch.Tensor]:
    tensors = {}
    for path in sorted((run_dir / "export").glob("*.safetensors")):
        tensors |= load_file(path)
    return tensors


@pytest.mark.extended  # three training runs (~70 s): `scripts/test.sh -m extended`
@pytest.mark.timeout(600)
def test_a_run_with_bias_updates_resumes_to_bit_identical_weights(tmp_path):
    rate = 1e-2
    overrides = [
        f"model.hf_path={TINY_DEEPSEEK}",
        f"model.router_bias_update_rate={rate}",
        "model.aux_loss_coeff=0.01",
        "checkpoint.export_hf=true",
        *RESUMED_RUN,
    ]
    whole_dir, resumed_dir = tmp_path / "whole", tmp_path / "resumed"
    whole = train_cli(whole_dir, overrides, recipe=DEEPSEEK_RECIPE)
    assert whole.returncode == 0, whole.stderr[-3000:]
    short = train_cli(resumed_dir, [*overrides, "run.steps=1"], recipe=DEEPSEEK_RECIPE)
    assert short.returncode == 0, short.stderr[-3000:]
    resumed = train_cli(resumed_dir, overrides, resume=True, recipe=DEEPSEEK_RECIPE)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    check_repeats(read_metrics(whole_dir), resumed_dir, (2, 3))
    expected, actual = _exported(whole_dir), _exported(resumed_dir)
    assert sorted(expected) == sorted(actual)
    for name, tensor in expected.items():
        assert torch.equal(tensor, actual[name]), name
    start = load_file(Path(TINY_DEEPSEEK) / "model.safetensors")
    biases = [name for name in expected if name.endswith("e_score_correction_bias")]
    assert biases
    for name in biases:
        moved = (expected[name].double() - start[name].double()) / rate
        # 3 steps x 2 updates, each moving every bias by +-rate (0 at an exactly even load)
        assert 1 - 1e-3 <= moved.abs().max() <= 6 + 1e-3, name
        assert torch.allclose(moved, moved.round(), atol=1e-3), name
