"""The three-node SLURM test cluster (tests/launch/slurm_cluster.py): each node a host of its own
on one machine (hostname, address, network namespace), the nodes resolving one another by name
as torchrun's rendezvous needs, up in at most 30 s, and gone without a trace when stopped."""

from __future__ import annotations

import re
import subprocess
import time
from pathlib import Path

import pytest

from tests.launch.slurm_cluster import SlurmCluster, missing_reason
from tests.processes import is_running

pytestmark = [
    pytest.mark.skipif(missing_reason(nodes=3) is not None, reason=str(missing_reason(nodes=3))),
    pytest.mark.timeout(300),
]


def _ip_lines(*args: str) -> str:
    return subprocess.run(["ip", *args], capture_output=True, text=True, check=True).stdout


def test_three_nodes_are_hosts_of_their_own_and_leave_nothing_behind(tmp_path):
    machine_hosts = Path("/etc/hosts").read_bytes()
    started = time.monotonic()
    cluster = SlurmCluster(tmp_path / "slurm", nodes=3).start()
    try:
        assert time.monotonic() - started <= 30
        network = cluster.network
        where = cluster.run(
            "srun",
            "--nodes=3",
            "--ntasks-per-node=1",
            "sh",
            "-c",
            "echo $(hostname) $(hostname -I) $(readlink /proc/self/ns/net)",
        )
        tasks = sorted(line.split() for line in where.stdout.strip().splitlines())
        assert [task[0] for task in tasks] == network.hostnames
        assert [task[1] for task in tasks] == network.node_addresses
        assert len({task[2] for task in tasks}) == 3  # three network namespaces
        # the last node resolves and reaches the first by its name (torchrun's MASTER_ADDR)
        first, last = network.hostnames[0], network.hostnames[-1]
        resolved = cluster.run("srun", "--nodes=1", f"--nodelist={last}", "getent", "hosts", first)
        assert resolved.stdout.split() == [network.node_addresses[0], first]
        # and connects to it there: the first node's slurmd listens on its own address
        port = re.search(r"^SlurmdPort=(\d+)$", cluster.conf.read_text(), re.M).group(1)
        connect = f"import socket; socket.create_connection(({first!r}, {port}), 5); print('ok')"
        reached = cluster.run("srun", "--nodes=1", f"--nodelist={last}", "python3", "-c", connect)
        assert reached.stdout.strip() == "ok"
        daemons = [process.pid for process in cluster.processes]
    finally:
        cluster.stop()
    assert Path("/etc/hosts").read_bytes() == machine_hosts
    assert not any(is_running(pid) for pid in daemons)
    assert network.prefix not in _ip_lines("netns", "list")
    assert network.prefix not in _ip_lines("link", "show")
