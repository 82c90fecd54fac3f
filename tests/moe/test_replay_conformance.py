"""The routing-replay conformance suite (docs/routing_replay.md, "Conformance suite"): under
every layout, cut of the rollouts into micro-batches and model shape, R2 and R3 force exactly
the target routing (the recorded one, the engine's) on every token of every micro-batch, the
routers would have chosen otherwise, and they still receive a gradient; gate-weight replay
(r3_weights) forces the engine's gate weights too, and its routers still receive a gradient."""

from __future__ import annotations

import pytest

from tests.moe import conformance_worker
from tests.parallel.harness import run_on_ranks

# (ranks, layout, full activation recomputation)
LAYOUTS = {
    "one_rank": (1, {}, False),
    "one_rank_recompute": (1, {}, True),
    "tp2_sequence_parallel": (2, {"tp": 2}, False),
    "ep2_dp2": (2, {"ep": 2}, False),  # the dense layers data-parallel over the same 2 ranks
    "pp2_1f1b": (2, {"pp": 2}, False),
}


@pytest.mark.timeout(300)
@pytest.mark.parametrize("layout", LAYOUTS.values(), ids=LAYOUTS.keys())
def test_replay_forces_the_target_routing_on_every_token(layout):
    world_size, dims, recompute = layout
    reports = run_on_ranks(conformance_worker.conformance, dims, recompute, world_size=world_size)
    for rank, cases in enumerate(reports):
        assert len(cases) == 18  # 2 models x 3 cuts x R2, R3, R3 with gate weights
        for case, report in cases.items():
            where = f"rank {rank}, {case}"
            assert report["replay_mismatch"] == 0, where
            assert report["free_mismatch"] > 0.05, where  # the routers moved: replay matters
            assert report["smallest_router_grad"] > 0, where  # every router still learns
            if case.endswith("r3_weights"):  # the engine's weights on every routed token
                assert report["weights_compared"] > 0, where
                assert report["weight_mismatch"] <= 1e-6, where
            if "token_budget" in case or "packed" in case:  # micro-batches of several widths
                assert report["shapes"] > 1, where
