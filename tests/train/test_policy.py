"""The Megatron-Core policy and the in-process engine stay in step through weight syncs."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.parallel.harness import run_on_ranks
from tests.train import policy_worker

TINY_MODEL = str(Path(__file__).resolve().parents[2] / "examples" / "moe" / "tiny_qwen3_moe")


@pytest.mark.parametrize("world_size", [1, 2], ids=["one_rank", "ep2"])
def test_engine_log_probs_equal_the_trainers_after_each_sync(world_size):
    result = run_on_ranks(policy_worker.weight_sync, TINY_MODEL, world_size=world_size)[0]
    assert result["start"] < 1e-4
    assert result["grad_norm"] > 0
    assert result["before_sync"] > 1e-3  # the update moved the trainer away from the engine
    assert result["after_sync"] < 1e-4
    assert result["version"] == 1
