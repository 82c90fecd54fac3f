"""Worker for the harness test: a rank that starts a process of its own, then fails."""

from __future__ import annotations

import multiprocessing as mp
import time
from pathlib import Path

from megatron_rl.parallel.distributed import LaunchEnv


def fail_after_starting_a_child(launch: LaunchEnv, pid_file: str) -> None:
    if launch.rank == 0:
        # not daemonic, as megatron-core's checkpoint writers: the rank waits for it at exit
        child = mp.get_context("spawn").Process(target=time.sleep, args=(300,))
        child.start()
        Path(pid_file).write_text(str(child.pid))
        raise RuntimeError("rank 0 fails while its child runs")
    time.sleep(300)  # rank 1 would wait in a collective
