"""The pieces of a SLURM job's tasks that the real job (test_slurm_job.py) cannot vary: a trainer
node's rank and torchrun arguments, which exit statuses are a graceful stop, the command of a
rollout node's server; and a trainer node's task run for real, signalled as its ranks start."""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from types import SimpleNamespace
from typing import IO

import pytest

from megatron_rl.config import load_config
from megatron_rl.launch.node import node_rank, stop_status, torchrun_argv
from megatron_rl.launch.rollout_server import route_argv, serve_argv
from megatron_rl.rollout.sglang.network import listen_address
from megatron_rl.rollout.sglang.servers import KEYED_LAUNCHER
from megatron_rl.trainer.recipe import Recipe
from tests.processes import caught_signals, descendants, free_port
from tests.trainer.run_cli import (
    RECIPE,
    REPO,
    RESUMED_RUN,
    train_command,
    train_environment,
)

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


def test_a_rollout_node_server_listens_on_its_nodes_address_with_the_runs_key(tmp_path):
    recipe = load_config(
        Recipe,
        RECIPE,
        [
            "rollout.backend=sglang",
            "rollout.sglang.base_port=31000",
            "algo.routing_replay=r3",
            f"run.dir={tmp_path}",
        ],
    )
    argv, env = serve_argv(recipe, 1, 3, "10.1.2.3")
    assert argv[argv.index("--host") + 1] == "10.1.2.3"
    assert argv[argv.index("--port") + 1] == "31001"
    # the run's key, made on first use, passed by its file (the server reads it)
    key = tmp_path / "sglang_api_key"
    assert argv[1:4] == [str(KEYED_LAUNCHER), str(key), "sglang.launch_server"]
    assert key.read_text().strip() not in " ".join(argv)
    # the job's fourth server samples as the trainer's own fourth server would
    assert argv[argv.index("--random-seed") + 1] == str(recipe.run.seed + 3)
    assert argv[argv.index("--model-path") + 1] == recipe.model.hf_path
    assert "--enable-return-routed-experts" in argv
    assert env["SGLANG_RETURN_ORIGINAL_LOGPROB"] == "1"


def test_the_router_listens_on_its_nodes_address_with_the_runs_key(tmp_path):
    recipe = load_config(
        Recipe,
        RECIPE,
        [
            "rollout.backend=sglang",
            "rollout.sglang.env={HF_TOKEN: hf_x}",
            f"run.dir={tmp_path}",
        ],
    )
    argv, env = route_argv(recipe, "10.1.2.4", 29900, ["http://a:1", "http://b:2"])
    key = str(tmp_path / "sglang_api_key")
    assert argv[1:4] == [str(KEYED_LAUNCHER), key, "sglang_router.launch_router"]
    assert argv[argv.index("--host") + 1] == "10.1.2.4"
    # its unauthenticated metrics exporter on this node only
    assert argv[argv.index("--prometheus-host") + 1 :][:3] == [
        "127.0.0.1",
        "--prometheus-port",
        "29901",
    ]
    assert argv[argv.index("--worker-urls") + 1 :] == ["http://a:1", "http://b:2"]
    # the recipe's environment reaches the router as its environment, not on its command line
    assert env["HF_TOKEN"] == "hf_x" and "hf_x" not in " ".join(argv)


def test_sockets_listen_where_peers_reach_this_machine(monkeypatch):
    assert listen_address("10.1.2.3", given_as="x") == "10.1.2.3"
    assert listen_address("127.0.0.1", given_as="x") == "127.0.0.1"
    assert listen_address("localhost", given_as="x") == "127.0.0.1"

    def resolve(name, *args, **kwargs):  # a stand-in for this machine's resolver
        answers = {"node1": ["127.0.1.1", "10.0.0.7"], "loopy": ["127.0.1.1", "::1"]}
        return [(socket.AF_INET, socket.SOCK_STREAM, 6, "", (a, 0)) for a in answers[name]]

    monkeypatch.setattr(socket, "getaddrinfo", resolve)
    assert listen_address("node1", given_as="SLURMD_NODENAME") == "10.0.0.7"
    with pytest.raises(ValueError, match=r"SLURMD_NODENAME: 'loopy' resolves to 127\.0\.1\.1"):
        listen_address("loopy", given_as="SLURMD_NODENAME")


def _node_task(run_dir: Path, stderr: IO[str]) -> subprocess.Popen:
    """A trainer node's task (torchrun for 2 ranks, SIGUSR1 graceful) as the batch script runs
    it, without SLURM, on the tiny recipe of 3 steps."""
    host = socket.gethostname()
    train = train_command(run_dir, RESUMED_RUN, 1, False)[3:]  # after `python -m MODULE`
    command = [
        sys.executable,
        "-m",
        "megatron_rl.launch.node",
        f"--nodes={host}",
        "--nproc-per-node=2",
        "--master-addr=127.0.0.1",
        f"--master-port={free_port()}",
        "--graceful",
        "SIGUSR1",
        "--",
        *train,
    ]
    return subprocess.Popen(
        command,
        cwd=REPO,
        env=train_environment({"SLURMD_NODENAME": host}),
        stdout=subprocess.DEVNULL,
        stderr=stderr,
    )


def _run_node_task(run_dir: Path, send: Callable[[int, list[int]], None]) -> tuple[int, str]:
    """`_node_task`, `send(task, ranks)` once both ranks run; its exit status and stderr."""
    with tempfile.TemporaryFile("w+") as stderr:
        task = _node_task(run_dir, stderr)
        try:
            send(task.pid, _started_ranks(task.pid))
            code = task.wait(timeout=300)
        finally:
            for pid in descendants(task.pid):
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)
            task.kill()
            task.wait()
        stderr.seek(0)
        return code, stderr.read()


def _when_caught(ranks: list[int], signum: int, timeout_s: float) -> None:
    """Wait until every rank has a handler for `signum`."""
    deadline = time.monotonic() + timeout_s
    while not all(signum in caught_signals(rank) for rank in ranks):
        assert time.monotonic() < deadline, f"the ranks do not catch {signal.Signals(signum).name}"
        time.sleep(0.05)


def test_a_graceful_signal_right_after_the_ranks_start_stops_the_run_after_its_first_step(
    tmp_path,
):
    """SIGUSR1 to the task and its ranks (SLURM signals every process of a job step) 0.5 s
    after the ranks start, long before the recipe that names SIGUSR1 is read. The ranks keep
    it, stop after step 1 with its checkpoint, and the task exits 138 (the script requeues)."""

    def usr1_soon(task: int, ranks: list[int]) -> None:
        time.sleep(0.5)
        # the ranks' own code runs by now: they catch SIGUSR1 (they were started ignoring it)
        _when_caught(ranks, signal.SIGUSR1, timeout_s=5.0)
        for pid in (task, *ranks):
            os.kill(pid, signal.SIGUSR1)

    code, log = _run_node_task(tmp_path, usr1_soon)
    assert code == 128 + signal.SIGUSR1, log[-3000:]
    assert "SIGUSR1 (it came while the command started)" in log, log[-3000:]
    assert "stopped after step 1" in log and "the ranks stopped on SIGUSR1" in log, log[-3000:]
    assert (tmp_path / "checkpoints" / "latest").read_text().strip() == "step_000001"


def test_sigterm_to_the_node_task_stops_its_ranks_and_exits_143_in_one_line(tmp_path):
    """SIGTERM to the task alone (its torchrun) once the ranks run the training command (they
    catch SIGTERM): torchrun stops them; the task exits 143 without a traceback."""

    def sigterm_in_training(task: int, ranks: list[int]) -> None:
        _when_caught(ranks, signal.SIGTERM, timeout_s=120.0)
        os.kill(task, signal.SIGTERM)

    code, log = _run_node_task(tmp_path, sigterm_in_training)
    assert code == 128 + signal.SIGTERM, log[-3000:]
    assert "Traceback" not in log, log[-3000:]
    assert "megatron-rl: node 0: SIGTERM: the ranks were stopped" in log, log[-3000:]


def _started_ranks(task: int) -> list[int]:
    """The 2 ranks of the node's torchrun, once both run `megatron_rl.cli`."""
    deadline = time.monotonic() + 60
    while True:
        ranks = []
        for pid in descendants(task):
            with contextlib.suppress(OSError):
                if b"megatron_rl.cli" in Path(f"/proc/{pid}/cmdline").read_bytes():
                    ranks.append(pid)
        if len(ranks) == 2:
            return ranks
        assert time.monotonic() < deadline, "torchrun did not start its ranks"
        time.sleep(0.02)
