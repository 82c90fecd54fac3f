"""Reading the launcher's environment: torchrun, SLURM, or a single process."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from megatron_rl.parallel.collectives import backend
from megatron_rl.parallel.dims import ParallelDims
from megatron_rl.parallel.distributed import LaunchEnv, init_distributed
from tests.parallel import timeout_worker
from tests.parallel.harness import run_on_ranks


def test_torchrun_environment():
    env = {"RANK": "3", "WORLD_SIZE": "8", "LOCAL_RANK": "1", "MASTER_ADDR": "node0"}
    launch = LaunchEnv.from_environ(env | {"MASTER_PORT": "1234"})
    assert (launch.rank, launch.world_size, launch.local_rank) == (3, 8, 1)
    assert (launch.master_addr, launch.master_port, launch.launcher) == ("node0", 1234, "torchrun")


def test_slurm_environment():
    env = {
        "SLURM_PROCID": "5",
        "SLURM_NTASKS": "16",
        "SLURM_LOCALID": "5",
        "SLURM_NNODES": "2",
        "MASTER_ADDR": "gpu-001",
        "MASTER_PORT": "29600",
    }
    launch = LaunchEnv.from_environ(env)
    assert (launch.rank, launch.world_size, launch.local_rank, launch.launcher) == (
        5,
        16,
        5,
        "slurm",
    )
    assert launch.master_addr == "gpu-001"
    # one node needs no rendezvous address
    one_node = {k: v for k, v in env.items() if not k.startswith("MASTER")}
    assert LaunchEnv.from_environ(one_node | {"SLURM_NNODES": "1"}).master_addr == "127.0.0.1"
    with pytest.raises(ValueError, match="MASTER_ADDR: a multi-node SLURM job must export"):
        LaunchEnv.from_environ(one_node)


def test_single_process_and_bad_values():
    assert LaunchEnv.from_environ({}).launcher == "single"
    with pytest.raises(ValueError, match="RANK: expected an int, got 'x'"):
        LaunchEnv.from_environ({"RANK": "x", "WORLD_SIZE": "2"})


def test_backend_is_gloo_without_cuda():
    assert backend() == "gloo"


def test_layout_and_launch_must_agree_before_anything_starts():
    launch = LaunchEnv.from_environ({"RANK": "0", "WORLD_SIZE": "4"})
    with pytest.raises(ValueError, match=r"world_size: the layout is for 2 ranks but the launcher"):
        init_distributed(ParallelDims(world_size=2), launch)


def test_a_single_process_starts_without_a_port_or_a_file(tmp_path):
    code = (
        "import torch.distributed as dist\n"
        "from megatron_rl.parallel.dims import ParallelDims\n"
        "from megatron_rl.parallel.distributed import LaunchEnv, init_distributed, "
        "shutdown_distributed\n"
        "init_distributed(ParallelDims(world_size=1), LaunchEnv.from_environ({}))\n"
        "print(dist.get_world_size(), dist.get_backend())\n"
        "shutdown_distributed()\n"
    )
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "MASTER_PORT")}
    done = subprocess.run(
        [sys.executable, "-c", code],
        env=env | {"TMPDIR": str(tmp_path), "PYTHONWARNINGS": "ignore"},
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.split() == ["1", "gloo"]
    assert list(tmp_path.iterdir()) == []  # no rendezvous file left behind


@pytest.mark.timeout(120)
def test_a_collective_without_one_of_its_ranks_fails_after_the_timeout():
    # megatron-core's groups would wait 30 minutes by their own default
    rank0, _ = run_on_ranks(timeout_worker.collective_without_a_rank, 1.5, world_size=2)
    for group in ("data_parallel", "default"):
        assert rank0[group]["error"] is not None, group
        assert 1.2 < rank0[group]["seconds"] < 8, group
