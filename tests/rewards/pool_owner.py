"""A trainer stand-in for the scoring pool's tests, a fresh process: it opens a pool of 2 workers
and

    python -m tests.rewards.pool_owner orphan     scores once (so they run), forks a child that
        holds the pool's pipes and sleeps (as a checkpoint writer does), prints `WORKER_PID
        WORKER_PID FORKED_PID` and sleeps until it is killed;
    python -m tests.rewards.pool_owner signalled  sends each worker SIGINT and SIGUSR1 at once,
        while it starts, scores, and prints the scores, whether the workers are those it
        started and whether any of them loaded torch (this module, the main one, imports it as
        a trainer's does; a worker should not import the main module).
"""

from __future__ import annotations

import os
import signal
import sys
import time
from pathlib import Path

import torch  # noqa: F401  (as a trainer's main module does)

from megatron_rl.rewards import ScoringPool, score_responses
from tests.rewards.misbehaving import misbehave


def orphan(pool: ScoringPool) -> None:
    score_responses(misbehave, ["?"] * 2, ["ok"] * 2, ["1"] * 2, pool)
    forked = os.fork()
    if forked == 0:
        time.sleep(120.0)
        os._exit(0)
    print(*pool.pids, forked, flush=True)
    time.sleep(120.0)


def signalled(pool: ScoringPool) -> None:
    started = pool.pids
    for pid in started:
        for signum in (signal.SIGINT, signal.SIGUSR1):
            os.kill(pid, signum)
    scores = score_responses(misbehave, ["?"] * 2, ["ok"] * 2, ["1"] * 2, pool)
    torch_in_workers = any("libtorch" in Path(f"/proc/{pid}/maps").read_text() for pid in started)
    print(scores, pool.pids == started, torch_in_workers, flush=True)


if __name__ == "__main__":
    with ScoringPool(workers=2, timeout_s=10.0, memory_limit_mb=1024) as owned:
        {"orphan": orphan, "signalled": signalled}[sys.argv[1]](owned)
