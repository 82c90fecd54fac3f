"""megatron-core's distributed optimizer on 2 gloo ranks, in float32 and bfloat16 (made possible
on the host by the `optimizer_host_params` CPU patch): it trains exactly as the plain optimizer
does in the same layout, while keeping Adam's state for only its share of the replicated
weights."""

from __future__ import annotations

import pytest

from tests.parallel import optimizer_worker
from tests.parallel.harness import run_on_ranks

LAYOUTS = {
    "dp2": {},
    "ep2": {"ep": 2},  # dense weights DP=2, each expert on one rank
    "tp2_etp1": {"tp": 2, "etp": 1},  # dense weights split by TP (DP=1), experts on both ranks
}
PLAIN = {"float32": "FP32Optimizer", "bfloat16": "Float16OptimizerWithFloat16Params"}


@pytest.mark.parametrize("dtype", list(PLAIN))
@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_distributed_optimizer_trains_as_the_plain_one(layout, dtype):
    reports = run_on_ranks(optimizer_worker.plain_and_distributed, LAYOUTS[layout], dtype)
    for report in reports:
        assert report["optimizers"] == ([PLAIN[dtype]], ["DistributedOptimizer"])
        plain, distributed = report["losses"]
        assert distributed == pytest.approx(plain, rel=1e-6)
        assert len(set(plain)) == optimizer_worker.STEPS  # every step changed the loss
        plain_norms, distributed_norms = report["grad_norms"]
        assert distributed_norms == pytest.approx(plain_norms, rel=1e-5)
        assert min(plain_norms) > 0
        # lr 1e-4 moves weights by ~1e-4 per step; the two optimizers agree to float rounding
        # (in bfloat16 both round the same float32 main weights)
        assert report["moved"] > 1e-4
        assert report["worst_weight_diff"] < 1e-6
    # The plain optimizer keeps state for every weight of every rank; the distributed one for
    # one share of each weight over its data-parallel group, so that over all ranks each weight
    # is held once: replicated weights once instead of twice, a weight only one rank holds
    # (an expert under EP=2, a TP shard) once as before.
    plain_total = sum(report["state_numel"][0] for report in reports)
    distributed_total = sum(report["state_numel"][1] for report in reports)
    assert distributed_total == sum(report["share_numel"] for report in reports)
    assert distributed_total < plain_total
