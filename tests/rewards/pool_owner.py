"""A trainer stand-in for the scoring pool's tests: it opens a pool of 2 workers, scores once (so
they run), forks a child that holds the pool's pipes and sleeps (as a checkpoint writer does),
prints `WORKER_PID WORKER_PID FORKED_PID` and sleeps until it is killed.

    python -m tests.rewards.pool_owner
"""

from __future__ import annotations

import os
import time

from megatron_rl.rewards import ScoringPool, score_responses
from tests.rewards.misbehaving import misbehave


def main() -> None:
    pool = ScoringPool(workers=2, timeout_s=10.0, memory_limit_mb=1024)
    score_responses(misbehave, ["?"] * 2, ["ok"] * 2, ["1"] * 2, pool)
    forked = os.fork()
    if forked == 0:
        time.sleep(120.0)
        os._exit(0)
    print(*pool.pids, forked, flush=True)
    time.sleep(120.0)


if __name__ == "__main__":
    main()
