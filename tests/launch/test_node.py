"""The pieces of a SLURM job's tasks that the real job (test_slurm_job.py) cannot vary: a trainer
node's rank and torchrun arguments, which exit statuses are a graceful stop, and the command of a
rollout node's server."""

from __future__ import annotations

import signal
from types import SimpleNamespace

import pytest

from megatron_rl.config import load_config
from megatron_rl.launch.node import node_rank, stop_status, torchrun_argv
from megatron_rl.launch.rollout_server import serve_argv
from megatron_rl.trainer.recipe import Recipe
from tests.trainer.run_cli import RECIPE

USR1 = [signal.SIGUSR1]


def test_node_rank_is_the_place_in_the_job_node_list():
    nodes = ["gpu-001", "gpu-002.cluster", "gpu-010"]
    assert [node_rank(nodes, name) for name in ("gpu-001.cluster", "gpu-002", "gpu-010")] == [
        0,
        1,
        2,
    ]
    with pytest.raises(ValueError, match=r"--nodes: this node \(gpu-003\) is not among"):
        node_rank(nodes, "gpu-003")


def test_torchrun_rendezvous_is_static_on_the_first_node():
    args = SimpleNamespace(
        nodes=["a", "b"],
        nproc_per_node=8,
        master_addr="a",
        master_port=29500,
        command=["train", "r.yaml", "--resume"],
    )
    assert torchrun_argv(args, 1) == [
        "--nnodes=2",
        "--node-rank=1",
        "--nproc-per-node=8",
        "--master-addr=a",
        "--master-port=29500",
        "--max-restarts=0",
        "-m",
        "megatron_rl.cli",
        "train",
        "r.yaml",
        "--resume",
    ]


@pytest.mark.parametrize(
    ("codes", "status"),
    [
        ([138, 138], 138),
        ([138, -signal.SIGTERM], 138),  # the rest ended by torchrun once the first had stopped
        ([138, 143], 138),
        ([1, 138], None),  # a rank failed
        ([143], None),  # SIGTERM is not graceful here: an immediate stop
        ([-signal.SIGKILL, 138], None),
    ],
)
def test_which_rank_exits_are_a_graceful_stop(codes, status):
    assert stop_status(codes, USR1) == status


def test_a_rollout_node_server_listens_everywhere_on_its_own_port():
    recipe = load_config(
        Recipe,
        RECIPE,
        ["rollout.backend=sglang", "rollout.sglang.base_port=31000", "algo.routing_replay=r3"],
    )
    argv, env = serve_argv(recipe, 1)
    assert argv[argv.index("--host") + 1] == "0.0.0.0"
    assert argv[argv.index("--port") + 1] == "31001"
    assert argv[argv.index("--model-path") + 1] == recipe.model.hf_path
    assert "--enable-return-routed-experts" in argv
    assert env["SGLANG_RETURN_ORIGINAL_LOGPROB"] == "1"
