"""The Megatron-Core policy and the in-process engine stay in step through weight syncs;
training checkpoints restore the policy and its optimizer exactly."""

from __future__ import annotations

import math
from pathlib import Path

import pytest

from megatron_rl.moe.margins import bucket_names
from tests.parallel.harness import run_on_ranks
from tests.trainer import policy_worker
from tests.trainer.policy_worker import bfloat16_copy

TINY_MODEL = str(Path(__file__).resolve().parents[2] / "examples" / "moe" / "tiny_qwen3_moe")


@pytest.mark.parametrize(
    ("world_size", "layout"),
    [(1, {}), (2, {"ep": 2}), (2, {"tp": 2, "etp": 1}), (2, {"pp": 2})],
    ids=["one_rank", "ep2", "tp2_etp1", "pp2"],
)
def test_engine_log_probs_equal_the_trainers_after_each_sync(world_size, layout):
    result = run_on_ranks(policy_worker.weight_sync, TINY_MODEL, layout, world_size=world_size)[0]
    assert result["start"] < 1e-4
    assert result["grad_norm"] > 0
    assert result["before_sync"] > 1e-3  # the update moved the trainer away from the engine
    assert result["after_sync"] < 1e-4
    assert result["version"] == 1


@pytest.mark.parametrize("world_size", [1, 2], ids=["one_rank", "ep2"])
def test_the_sync_probe_passes_after_each_sync_and_stops_every_rank_on_lost_updates(world_size):
    results = run_on_ranks(policy_worker.probe_check, TINY_MODEL, world_size=world_size)
    rank0 = results[0]
    for checked in (rank0["start"], rank0["synced"]):
        assert checked["sync/probe_mean_abs_diff"] < 1e-5
        assert checked["sync/probe_max_abs_diff"] < 1e-4
    for result in results:
        assert "the engine is not serving the trainer's weights" in result["error"]
        assert "weight sync 2" in result["error"]


@pytest.mark.parametrize(
    ("world_size", "layout"), [(1, {}), (2, {"pp": 2})], ids=["one_rank", "pp2"]
)
def test_one_update_needs_no_old_policy_forward(world_size, layout):
    # With one update per batch the old policy's weights are the current ones: the update's
    # own forward, detached, gives the same step as the old log-probs of a separate forward.
    result = run_on_ranks(
        policy_worker.old_policy_is_current, TINY_MODEL, layout, world_size=world_size
    )[0]
    losses, grad_norms = result["loss"], result["grad_norm"]
    assert losses[1] == pytest.approx(losses[0], rel=1e-5, abs=1e-7)
    assert grad_norms[1] == pytest.approx(grad_norms[0], rel=1e-4)
    assert grad_norms[0] > 0 and result["moved"] > 1e-4
    assert result["weight_diff"] < 1e-6
    metrics = result["metrics"]
    assert metrics["clip_frac/seq"] == 0 and metrics["ratio/max"] == 1.0
    # what the old-policy pass would have reported: the engine against the trainer
    for key, value in result["gap"].items():
        assert metrics[key] == pytest.approx(value, rel=1e-3, abs=1e-9), key
    assert metrics["mismatch/weight_mean"] == pytest.approx(1, abs=1e-3)
    assert 0 < metrics["entropy/mean"] < 5


@pytest.mark.parametrize(
    ("format_version", "distributed", "dtype"),
    # the plain optimizer with the old format, the distributed one with the current format
    [(1, False, "float32"), (2, True, "float32"), (2, True, "bfloat16")],
    ids=["format1_plain", "format2_distributed", "format2_distributed_bf16"],
)
def test_a_training_checkpoint_restores_weights_and_optimizer(
    format_version, distributed, dtype, tmp_path
):
    model = TINY_MODEL if dtype == "float32" else bfloat16_copy(TINY_MODEL, tmp_path / "bf16")
    results = run_on_ranks(
        policy_worker.checkpoint_round_trip,
        model,
        str(tmp_path / "checkpoints"),
        format_version,
        distributed,
        world_size=2,
    )
    for result in results:
        assert result["format"] == format_version
        assert f"torch.{dtype}" in result["dtypes"]  # (megatron-core may keep a few in fp32)
        assert result["optimizers"] == ["DistributedOptimizer" if distributed else "FP32Optimizer"]
        assert (result["step"], result["trainer"]) == (1, {"seen": 8})
        assert result["weights_differ"] == []
        assert result["next_step_differs"] == []
        # Adam's two moments and step, and the weight itself, of every weight Adam updates here
        assert result["optimizer_tensors"] == 4 * result["main_weights"] > 0
        assert result["optimizer_differ"] == []
    # The distributed optimizer keeps only a share of the replicated (non-expert) weights on
    # each of the 2 data-parallel ranks; the plain one keeps all of every rank's parameters.
    main = sum(result["main_weights_numel"] for result in results)
    local = sum(result["parameters_numel"] for result in results)
    assert main < local if distributed else main == local


@pytest.mark.parametrize("world_size", [1, 2], ids=["one_rank", "ep2"])
def test_an_update_prepares_the_gradients_once_and_steps_as_megatron_core_does(world_size):
    result = run_on_ranks(policy_worker.update_steps_once, TINY_MODEL, world_size=world_size)[0]
    assert result["prepared"] == 1  # it was 2: once for the norm, again in optimizer.step()
    assert not result["skipped"] and result["taken"]
    ours, theirs = result["grad_norm"]
    assert ours == pytest.approx(theirs, rel=1e-6) and ours > 1e-3  # the clip at 1e-3 binds
    assert result["weight_diff"] == 0.0 and result["moved"] > 1e-5


def test_non_finite_updates_are_skipped_and_keep_their_non_finite_values():
    result = run_on_ranks(policy_worker.non_finite_updates, TINY_MODEL, world_size=1)[0]
    loss, grad_norm, skipped, metrics = result["nan_loss"]
    assert math.isnan(loss) and skipped
    # the micro-batch averages used to drop the NaN micro-batch's values
    assert math.isnan(metrics["ratio/mean"]) and math.isnan(metrics["kl/k3"])
    loss, grad_norm, skipped = result["inf_norm"]
    assert math.isfinite(loss) and grad_norm == math.inf and skipped
    assert result["moved"] == 0.0  # neither touched the weights
    loss, grad_norm, skipped = result["good"]
    assert math.isfinite(loss) and math.isfinite(grad_norm) and not skipped
    assert result["lr_steps"] == 1  # only the good update advanced the schedule


@pytest.mark.parametrize("world_size", [1, 2], ids=["one_rank", "ep2"])
def test_a_step_that_kept_one_row_takes_one_update(world_size):
    metrics = run_on_ranks(policy_worker.one_row_step, TINY_MODEL, world_size=world_size)[0]
    assert metrics["steps/updates"] == 1 and metrics["steps/skipped"] == 0
    assert math.isfinite(metrics["loss/policy"]) and metrics["grad_norm"] > 0


def test_the_routing_probe_measures_a_known_change_of_routing():
    # A DeepSeek-V3-shaped model: raising the selection bias of experts 0 and 1 in the last MoE
    # layer changes the routing there and nowhere else, and not the weight of any given expert.
    deepseek = str(Path(TINY_MODEL).parent / "tiny_deepseek_v3")
    (result,) = run_on_ranks(policy_worker.routing_probe, deepseek, world_size=1)
    probed, expected = result["probed"], result["expected"]
    *earlier, last = result["moe_layers"]
    assert 0 < expected["layer"] < 1 and expected["activated"] > 0  # some routes already {0, 1}
    assert probed[f"routing/update_layer_{last}"] == pytest.approx(expected["layer"], abs=1e-6)
    assert probed[f"routing/update_activated_layer_{last}"] == pytest.approx(
        expected["activated"], abs=1e-6
    )
    for layer in earlier:
        assert probed[f"routing/update_layer_{layer}"] == 0
    # the routing before the "update" was the old policy's: since the old one, the same change
    for key in ("activated_experts", "token_layer", f"layer_{last}"):
        assert probed[f"routing/since_old_{key}"] == probed[f"routing/update_{key}"]
    layers = len(result["moe_layers"])
    assert probed["routing/update_activated_experts"] == pytest.approx(
        expected["activated"] / layers, abs=1e-6
    )
    # every (token, layer) is counted in one margin bucket; the flips are the last layer's
    buckets = bucket_names()
    routes = sum(probed[f"routing/margin_routes_{b}"] for b in buckets)
    flips = sum(probed[f"routing/margin_flips_{b}"] for b in buckets)
    assert routes == result["tokens"] * layers
    assert flips == expected["flips"]
    for layer in (*earlier, last):  # and per layer: all its tokens, its own flips
        assert (
            sum(probed[f"routing/margin_routes_layer_{layer}_{b}"] for b in buckets)
            == (result["tokens"])
        )
    assert sum(probed[f"routing/margin_flips_layer_{last}_{b}"] for b in buckets) == flips
    assert 0 <= probed["routing/margin_near_tie"] <= 1 and probed["routing/margin_median"] > 0
    # with the old routing replayed the log-probs are the old ones: routing is all of the ratio
    assert probed["routing/log_ratio_var_share"] == pytest.approx(1, abs=1e-6)
    assert probed["routing/log_ratio_abs_share"] == pytest.approx(1, abs=1e-6)
    # the float32 engine routes as the trainer does; one changed (token, layer) counts once
    assert all(value == 0 for value in result["mismatch"].values())
    one, tokens = result["mismatch_one"], result["all_tokens"]
    assert one["routing/engine_mismatch_token_layer"] == pytest.approx(1 / (tokens * layers))
    assert one["routing/engine_mismatch_activated_experts"] == pytest.approx(1 / (tokens * layers))
    assert one["routing/engine_mismatch_token_any"] == pytest.approx(1 / tokens)
    # a real update with the probe: its metrics, and the routers moved
    update = result["update"]
    assert 0 <= update["routing/update_activated_experts"] <= update["routing/update_token_layer"]
    assert result["router_change"]["routing/router_weight_change"] > 0
    assert 0 < result["router_change"]["routing/router_weight_change_rel"] < 1
    assert result["unchanged"]["routing/router_weight_change"] == 0
    # optim.freeze_router: the routers stay, the rest learns, and the routing still moves
    assert result["frozen_change"]["routing/router_weight_change"] == 0
    assert result["frozen_update"]["grad_norm"] > 0
    assert result["frozen_update"]["routing/update_token_layer"] > 0


@pytest.mark.timeout(180)
@pytest.mark.parametrize(
    ("world_size", "layout"),
    [(1, {}), (2, {"pp": 2}), (2, {}), (2, {"tp": 2}), (2, {"ep": 2})],
    ids=["one_rank", "pp2", "dp2", "tp2", "ep2"],
)
def test_token_budget_and_packed_micro_batches_give_the_same_loss_and_gradient(world_size, layout):
    results = run_on_ranks(
        policy_worker.token_budget_gradient, TINY_MODEL, layout, world_size=world_size
    )
    for result in results:
        rows, budget, packed = result["rows"], result["budget"], result["packed"]
        # micro-batches of several widths (the pipeline stages pass each activation's shape)
        assert len(budget["shapes"]) > 1 and len(rows["shapes"]) == 1
        assert all(shape[0] == 1 for shape in packed["shapes"])  # one row of many sequences
        assert budget["padding"] < rows["padding"]
        # packed: only the tails that round a pass up to the TP size
        assert packed["padding"] < layout.get("tp", 1) * len(packed["shapes"])
        assert packed["padding"] <= budget["padding"] and packed["tokens"] <= budget["tokens"]
        if not math.isnan(rows["loss"]):  # the last pipeline stage's
            assert budget["loss"] == pytest.approx(rows["loss"], rel=1e-5, abs=1e-7)
            assert packed["loss"] == pytest.approx(rows["loss"], rel=1e-5, abs=1e-7)
        assert result["largest_grad"] > 1e-4
        assert budget["grad_difference"] < 1e-5 and packed["grad_difference"] < 1e-5
