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

from tests.trainer.run_cli import SGLANG_RECIPE, train_cli

torch.set_num_threads(1)

# The test command runs the suite on two pytest-xdist workers (scripts/test.sh, `--dist
# loadgroup`), each test module whole on one worker (its module fixtures built once). These share
# one worker, in order: they start servers on the example recipe's fixed ports (its SGLang server
# on 30100: two at once, the second's own warm-up reached the first and got a 401) and on the
# SGLang tier's (tests/sglang/conftest.py), and share the two-rank SGLang run below.
SERVER_TESTS = (
    "launch",
    "sglang",
    "process/test_redaction.py",
    "bench/test_rl_step_bench.py",  # its SGLang arm runs the example recipe
)
SERVER_GROUP = "servers"


@pytest.hookimpl(tryfirst=True)  # before xdist's hook, which reads the groups
def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    here = Path(__file__).parent
    for item in items:
        path = item.path.relative_to(here).as_posix()
        shares_servers = any(path == name or path.startswith(f"{name}/") for name in SERVER_TESTS)
        item.add_marker(pytest.mark.xdist_group(SERVER_GROUP if shares_servers else path))


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
