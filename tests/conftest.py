"""The test process computes on one torch thread, as each rank that torchrun starts does
(OMP_NUM_THREADS=1) and as `megatron-rl train` runs in the tests (tests/trainer/run_cli.py).
On the 2-core CI machine the tiny models' operations gain nothing from a second thread, and
torch's threads wait for each other on a busy machine: a test of the in-process engine took
14 s with 2 threads, 0.6 s with 1."""

import os
import threading
from collections.abc import Callable
from pathlib import Path
from subprocess import CompletedProcess

import pytest
import torch

from tests.scheduling import ModulesAndServers
from tests.trainer.run_cli import SGLANG_RECIPE, train_cli

torch.set_num_threads(1)


@pytest.hookimpl(tryfirst=True, optionalhook=True)  # before xdist's own; only under xdist
def pytest_xdist_make_scheduler(config: pytest.Config, log: object) -> ModulesAndServers:
    """The test command's two workers share the suite by tests/scheduling.py's units."""
    return ModulesAndServers(config, log)


# The CPU SGLang recipe's short run on two ranks under torchrun, experts split over them (EP 2),
# weights sent over a process group into the server rank 0 starts, each rank with as many threads
# as the machine has CPUs (a SLURM test cluster node's ranks get them all: tests/launch).
TWO_RANK_SGLANG_OVERRIDES = ("parallel.ep=2", "rollout.sglang.weight_sync=distributed")


@pytest.fixture(scope="session")
def two_rank_sglang_run(tmp_path_factory) -> Callable[[], tuple[CompletedProcess, Path]]:
    """A function that returns that run's result and directory, running it the first time it is
    called in the session (from any thread; a second caller waits for the first): two tests
    check it, tests/sglang as the shipped example and tests/launch against a two-node job."""
    lock = threading.Lock()
    done: list[tuple[CompletedProcess, Path]] = []

    def run() -> tuple[CompletedProcess, Path]:
        with lock:
            if not done:
                run_dir = tmp_path_factory.mktemp("two_rank_sglang")
                result = train_cli(
                    run_dir,
                    list(TWO_RANK_SGLANG_OVERRIDES),
                    nproc=2,
                    recipe=SGLANG_RECIPE,
                    timeout=600,
                    extra_env={"OMP_NUM_THREADS": str(os.cpu_count())},
                )
                done.append((result, run_dir))
            return done[0]

    return run
