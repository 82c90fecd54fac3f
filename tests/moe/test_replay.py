"""R2 routing replay on a real megatron-core MoE model (every layer MoE with a softmax router,
and DeepSeek-V3's shape: a dense first layer, a sigmoid router with a score-correction bias and
groups, a shared expert): forced routing is exactly the recorded one, the loss and gradients
(the dense layer's too) equal an independent forced-routing reference, the router still learns,
and activation recomputation replays the same routing."""

from __future__ import annotations

import math

import pytest

from tests.moe import replay_worker
from tests.parallel.harness import run_on_ranks

MODELS = ["qwen3_like", "deepseek_like"]


@pytest.mark.parametrize("model", MODELS)
def test_r2_replays_the_old_routing_exactly(model):
    (report,) = run_on_ranks(replay_worker.r2_matches_forced_routing, model, world_size=1)
    assert report["drift_free"] > 0.05  # the update moved routing ...
    assert report["drift_used"] == 0  # ... and replay forced the old routing, exactly
    assert report["replayed_loss"] == pytest.approx(report["forced_loss"], rel=1e-6)
    assert report["worst_grad_error"] <= 1e-5
    assert report["router_grad"] > 0  # gate weights stay differentiable: the router learns
    assert report["free_loss"] != pytest.approx(report["replayed_loss"], rel=1e-6)
    moe_layers = [0, 1] if model == "qwen3_like" else [1, 2, 3]  # layer 0 dense: no router
    assert report["replayed_layers"] == moe_layers
    assert report["routing_layers"] == len(moe_layers)


@pytest.mark.parametrize("model", MODELS)
def test_full_recompute_replays_the_same_routing(model):
    (report,) = run_on_ranks(replay_worker.recompute_gives_same_gradients, model, world_size=1)
    assert report["num_params"] > 20
    assert report["worst_grad_error"] <= 1e-5


@pytest.mark.parametrize(
    "layout", [{"tp": 2}, {"ep": 2}, {"pp": 2}], ids=["tp2_sequence_parallel", "ep2", "pp2_1f1b"]
)
def test_r2_on_two_ranks(layout):
    reports = run_on_ranks(replay_worker.replay_at_layout, layout)
    for report in reports:  # under PP each stage checks the routers of its own layers
        assert report["drift_free"] > 0.05
        assert report["drift_used"] == 0
    if "tp" in layout:  # each TP rank's routers see their sequence-parallel half of the tokens
        assert reports[0]["tokens_per_router"] == 2 * 24 // 2
    if "pp" in layout:  # the loss lives on the last stage
        assert math.isnan(reports[0]["loss"]) and math.isfinite(reports[1]["loss"])
    else:
        assert reports[0]["loss"] == pytest.approx(reports[1]["loss"])


def test_r2_with_a_dense_layer_on_the_first_stage():
    """PP=2 over the DeepSeek-like model: the first stage replays its one MoE layer (layer 1),
    the second its two (layers 2 and 3)."""
    reports = run_on_ranks(replay_worker.replay_at_layout, {"pp": 2}, "deepseek_like")
    assert [report["replayed_layers"] for report in reports] == [[1], [2, 3]]
    for report in reports:
        assert report["drift_free"] > 0.05
        assert report["drift_used"] == 0


def test_r3_engine_routing_round_trip():
    (report,) = run_on_ranks(replay_worker.r3_round_trip, world_size=1)
    assert report["drift_used"] == 0
    assert report["covered"] == report["tokens"] - 2  # each row's last token has no engine row


def test_bad_input_is_refused_clearly():
    (messages,) = run_on_ranks(replay_worker.bad_input_messages, world_size=1)
    assert "build the model with routing_replay=True" in messages["no_replay_built"]
    assert "1 layer(s) given, this rank's model has 2 MoE layer(s)" in messages["layers"]
    assert "needs integer indices [40, 2]" in messages["tokens"]
    assert "torch.float32" in messages["dtype"]
    assert "no routing was recorded" in messages["collect_without_record"]
    assert "carries no routing record" in messages["no_routing"]


@pytest.mark.timeout(300)
@pytest.mark.parametrize("model", MODELS)
def test_gate_weight_replay_forces_the_weights_and_keeps_the_gradient(model):
    (report,) = run_on_ranks(replay_worker.gate_weight_replay, model, world_size=1)
    for recompute in (False, True):
        case = report[f"recompute={recompute}"]
        # the trainer's own weights, or NaN (keep them): id-only replay's numbers, exactly
        assert case["own_loss_error"] == 0 and case["own_worst_grad_error"] == 0
        assert case["nan_loss_error"] == 0 and case["nan_worst_grad_error"] == 0
        # other weights: every forward (recomputed ones too) used them, and they mattered
        assert case["other_used_error"] <= 1e-6
        assert case["other_forwards"] == 2 * (1 + recompute)
        assert case["other_loss_change"] > 1e-4
        assert case["other_smallest_router_grad"] > 0  # every router still learns
    assert report["recompute_grad_error"] <= 1e-5
