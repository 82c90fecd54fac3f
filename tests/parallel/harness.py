"""Run a function on N gloo ranks in spawned processes; every process is stopped, by its handle,
whatever happens (error, hang, test failure), and so is every process a rank started (by the
rank's process group)."""

from __future__ import annotations

import contextlib
import multiprocessing as mp
import os
import pickle
import queue as queue_module
import signal
import time
import traceback
from collections.abc import Callable
from typing import Any

import torch

from megatron_rl.parallel.distributed import LaunchEnv, shutdown_distributed
from tests.processes import free_port

# What the ranks import, imported once: ranks are forked from a server process that has them
# (multiprocessing's forkserver), not spawned to import megatron-core again (seconds per rank).
# The server is a fresh interpreter that has run nothing, so forking it is safe.
PRELOAD = [
    "megatron.core.dist_checkpointing",
    "megatron.core.models.gpt",
    "megatron_rl.models.build",
    "megatron_rl.trainer.schedule",
    "tests.parallel.harness",
]


def _context() -> mp.context.BaseContext:
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(PRELOAD)
    return ctx


def _worker(target: Callable[..., Any], launch: LaunchEnv, results: Any, args: tuple) -> None:
    # Lead a process group of its own: what the rank starts (megatron-core's checkpoint
    # writers, say) is stopped with it, even when the rank itself is killed.
    os.setpgrp()
    # One torch thread per rank, as torchrun sets it (OMP_NUM_THREADS=1): 2 ranks of 2 threads
    # each on 2 cores wait for each other's threads.
    torch.set_num_threads(1)
    try:
        # Pickled here, by value: a tensor put on the queue as it is goes by a file descriptor
        # that the parent fetches from this process, which may have exited by then (EOFError).
        results.put((launch.rank, "ok", pickle.dumps(target(launch, *args))))
    except BaseException:
        results.put((launch.rank, "error", traceback.format_exc()))
    finally:
        shutdown_distributed()


def run_on_ranks(
    target: Callable[..., Any], *args: Any, world_size: int = 2, timeout: float = 300.0
) -> list[Any]:
    """`target(launch, *args)` on `world_size` ranks; returns their results in rank order.

    The first rank that raises fails the call with its traceback, and the other ranks (which
    may be waiting in a collective) are terminated at once.
    """
    ctx = _context()
    results = ctx.Queue()
    port = free_port()
    # Not daemonic: dist_checkpointing starts writer processes of its own.
    processes = [
        ctx.Process(
            target=_worker,
            args=(
                target,
                LaunchEnv(
                    rank=rank,
                    world_size=world_size,
                    local_rank=rank,
                    master_addr="127.0.0.1",
                    master_port=port,
                    launcher="torchrun",
                ),
                results,
                args,
            ),
        )
        for rank in range(world_size)
    ]
    for process in processes:
        process.start()
    collected: dict[int, Any] = {}
    deadline = time.monotonic() + timeout
    try:
        while len(collected) < world_size:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                missing = sorted(set(range(world_size)) - set(collected))
                raise TimeoutError(f"ranks {missing} gave no result within {timeout:.0f} s")
            try:
                rank, status, payload = results.get(timeout=min(remaining, 1.0))
            except queue_module.Empty:
                for rank, process in enumerate(processes):
                    if rank not in collected and process.exitcode not in (None, 0):
                        raise RuntimeError(
                            f"rank {rank} died with exit code {process.exitcode}"
                        ) from None
                continue
            if status == "error":
                raise AssertionError(f"rank {rank} failed:\n{payload}")
            collected[rank] = pickle.loads(payload)  # from the ranks this test started
    finally:
        for process in processes:
            process.join(timeout=10 if len(collected) == world_size else 0.1)
            if process.is_alive():
                process.terminate()
                process.join(timeout=5)
            if process.is_alive():
                process.kill()
                process.join()
            with contextlib.suppress(ProcessLookupError):  # no member of the group is left
                os.killpg(process.pid, signal.SIGKILL)
    return [collected[rank] for rank in range(world_size)]
