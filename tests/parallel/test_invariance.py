"""Loss, gradients and gradient norm of a real Megatron-Core MoE model split by TP (with SP), EP
(alltoall and allgather), TP with experts replicated or split by EP (etp=1), PP (1F1B, with
untied and tied embeddings) and DP on 2 gloo ranks equal the single-process ones. The model has
a shared expert besides its routed ones."""

from __future__ import annotations

import math

import pytest

from tests.parallel import invariance
from tests.parallel.harness import run_on_ranks

TOLERANCE = 1e-5  # relative, float32


# The terms around the surrogate (mismatch corrections, entropy bonus, dual-clip, KL penalty)
# ride along on one layout of each kind.
CORRECTED_LAYOUTS = ("tp2", "ep2_alltoall", "pp2")


@pytest.mark.parametrize("layout", list(invariance.LAYOUTS))
def test_split_model_matches_single_process(layout, tmp_path):
    corrected = list(invariance.CORRECTED_LOSSES) if layout in CORRECTED_LAYOUTS else []
    losses = list(invariance.LOSSES) + corrected
    reports = run_on_ranks(invariance.compare_layout, layout, losses, str(tmp_path))
    for rank, report in enumerate(reports):
        for name in losses:
            result = report[name]
            assert result["smallest_ref_grad"] > 0, f"{name}: a parameter has no gradient at all"
            assert result["num_params"] > 20
            assert result["worst_grad_error"] <= TOLERANCE, (layout, rank, name, result)
            # the norm gradient clipping uses, summed over the shards without double counting
            assert result["grad_norm"] == pytest.approx(result["ref_grad_norm"], rel=TOLERANCE)
            if not math.isnan(result["loss"]):
                assert result["loss"] == pytest.approx(result["ref_loss"], rel=TOLERANCE)
                if name in corrected:  # the correction masked or truncated some tokens, not all
                    assert 0 < result["corrected_frac"] < 1, (name, result)
    # the loss is reported on the last pipeline stage (under PP=2, rank 1 only)
    with_loss = [r for r in reports if not math.isnan(r["gspo"]["loss"])]
    assert len(with_loss) == (1 if layout.startswith("pp2") else 2)


def test_gradient_accumulation_over_four_micro_batches_equals_one_batch():
    for report in run_on_ranks(invariance.accumulation, "gspo"):
        assert report["loss_four"] == pytest.approx(report["loss_one"], rel=TOLERANCE)
        assert report["worst_grad_error"] <= TOLERANCE
