"""Context parallelism at the loss level: sequences sharded over 2 ranks, load-balanced as
megatron-core shards them; the ranks' losses add up to the full loss and their gradients to the
full gradient, for sequence (gspo, gmpo), token (grpo) and segment (sspo) level losses."""

from __future__ import annotations

import pytest
import torch

from megatron_rl.algo import LOSS_AGG_MODES
from megatron_rl.parallel.context import load_balanced_positions, shard_mask
from tests.parallel import context_worker
from tests.parallel.harness import run_on_ranks


def test_load_balanced_positions():
    assert load_balanced_positions(8, 2, 0).tolist() == [0, 1, 6, 7]
    assert load_balanced_positions(8, 2, 1).tolist() == [2, 3, 4, 5]
    covered = torch.cat([load_balanced_positions(12, 3, r) for r in range(3)])
    assert sorted(covered.tolist()) == list(range(12))
    with pytest.raises(ValueError, match=r"seq_len: .* 2\*cp = 4 chunks; 10 is not divisible"):
        load_balanced_positions(10, 2, 0)
    mask = torch.ones(1, 8, dtype=torch.bool)
    assert shard_mask(mask, 2, 1).tolist() == [[False, False, True, True, True, True, False, False]]


@pytest.mark.parametrize("loss_agg", LOSS_AGG_MODES)
def test_cp2_shards_sum_to_the_full_loss_and_gradient(loss_agg):
    reports = run_on_ranks(context_worker.loss_level_invariance, loss_agg)
    for report in reports:
        for name, result in report.items():
            assert 0 < result["local_tokens"] < result["all_tokens"], name
            assert result["sum_of_shards"] == pytest.approx(result["full"], rel=1e-10, abs=1e-12)
            assert result["grad_error"] <= 1e-10 * result["grad_scale"], (name, result)
            assert result["local_grad_outside_shard"] == 0
