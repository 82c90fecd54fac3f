"""The scoring pool that this package's tests share (starting workers takes a second or more)."""

from __future__ import annotations

import pytest

from megatron_rl.rewards import ScoringPool

DEADLINE_S = 2.0
"""The shared pool's deadline per verifier call."""


@pytest.fixture(scope="session")
def scoring_pool():
    """Two scoring workers with a DEADLINE_S deadline. A test that kills or crashes workers
    leaves them replaced, as the pool does in a run; 2 GiB each leaves a verifier that computes
    a huge integer to the deadline, not to the memory limit."""
    with ScoringPool(workers=2, timeout_s=DEADLINE_S, memory_limit_mb=2048) as pool:
        yield pool
