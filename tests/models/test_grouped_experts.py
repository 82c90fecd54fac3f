"""Routed experts in grouped GEMMs (megatron_rl.models.grouped_experts) give megatron-core's
SequentialMLP loop's outputs and gradients on a real fine-grained model (64 experts, top-8),
on one rank and split over two expert-parallel ranks."""

from __future__ import annotations

import pytest

from tests.models import grouped_experts_worker
from tests.parallel.harness import run_on_ranks


@pytest.mark.timeout(300)
@pytest.mark.parametrize("ep", [1, 2], ids=["one_rank", "ep2"])
def test_grouped_experts_equal_the_loop(ep):
    for result in run_on_ranks(grouped_experts_worker.grouped_equals_loop, ep, world_size=ep):
        assert result["grouped_modules"] == grouped_experts_worker.FINE.num_layers
        assert result["same_grads"] and result["expert_grads"] > 0
        assert result["expert_grad_norm"] > 0
        assert result["logits_diff"] <= 1e-5 * result["logits_scale"]
        assert result["grad_diff"] <= 1e-5
