"""A real SLURM cluster for the tests: munged, slurmctld and slurmd (Debian's slurm-wlm,
installed by scripts/install_slurm.sh) as root, in the foreground as children of the test
process, with a configuration, key, ports and state of their own under one directory (and their
Unix sockets under a short one in /tmp: a socket's path must stay under 108 bytes), so that
nothing of the machine's is used or changed. Stopped by their PIDs.

`SlurmCluster(root)` is one node, the machine itself. `SlurmCluster(root, nodes=3)` is a
cluster of three hosts on the one machine (the probe ../shared/probes/slurm-multinode): each
slurmd in a network namespace of its own (its own address on a bridge in the machine's
namespace, where munged and slurmctld run) and a UTS and mount namespace of its own (its own
hostname, and a hosts file naming every node bind-mounted over /etc/hosts there only), entered
with nsenter + unshare: `ip netns exec` remounts /sys, which hides the cgroup mount slurmd needs.
Every job process inherits its node's namespaces, so hostnames, torchrun's rendezvous and gloo
resolve and connect as on a cluster; the filesystem is shared by all. Names and the subnet are
chosen per cluster, so that two clusters never collide; nothing under /etc is written."""

from __future__ import annotations

import contextlib
import itertools
import os
import re
import shlex
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

from tests.processes import free_port

DAEMONS = ("munged", "slurmctld", "slurmd")
# How long a requeued job waits before it may start again is the job credential's lifetime
# (slurm.conf, AuthInfo cred_expire; 120 s by default).
REQUEUE_WAIT_S = 5


NAMESPACE_TOOLS = ("ip", "nsenter", "unshare", "mount")


def missing_reason(nodes: int = 1) -> str | None:
    """Why this machine cannot run a cluster of `nodes` nodes, or None."""
    if os.geteuid() != 0:
        return "SLURM's daemons run as root here; the tests are not root"
    tools = ("sbatch", "shellcheck", *DAEMONS, *(NAMESPACE_TOOLS if nodes > 1 else ()))
    absent = [name for name in tools if shutil.which(name) is None]
    if absent:
        return f"{', '.join(absent)} not installed (scripts/install_slurm.sh installs them)"
    if nodes > 1:
        probe = subprocess.run(
            ["unshare", "--net", "--uts", "--mount", "true"], capture_output=True, text=True
        )
        if probe.returncode != 0:
            return f"no network, UTS and mount namespaces here ({probe.stderr.strip()})"
    return None


class SlurmCluster:
    """The cluster; `start()` waits until all its nodes are idle. `nodes` > 1: one network
    namespace per node (`node_names`, `node_addresses`), `prefix` naming everything made."""

    def __init__(self, root: Path, nodes: int = 1, slurmd_timeout_s: int | None = None) -> None:
        self.root = root
        self.nodes = nodes
        # how long a silent node stays up (slurm.conf SlurmdTimeout; SLURM's default 300 s)
        self.slurmd_timeout_s = slurmd_timeout_s
        self.host = socket.gethostname().split(".")[0]
        self.conf = root / "slurm.conf"
        # Unix sockets live under the spool directory and munge's: their paths must stay under
        # 108 bytes, which a test's tmp_path can pass (slurmstepd then cannot start a job), so
        # both go in a short directory of their own, removed by stop().
        self.sockets = Path(tempfile.mkdtemp(prefix="mrs", dir="/tmp"))
        self.spool = self.sockets / "spool"
        self.munge_socket = self.sockets / "munge.socket"
        self.env = dict(os.environ, SLURM_CONF=str(self.conf))
        self.processes: list[subprocess.Popen] = []
        self.network: NodeNetwork | None = NodeNetwork(nodes) if nodes > 1 else None

    @property
    def node_names(self) -> list[str]:
        return [self.host] if self.network is None else self.network.hostnames

    def start(self) -> SlurmCluster:
        (self.root / "munge").mkdir(parents=True, mode=0o700)
        for name in ("state", "log"):
            (self.root / name).mkdir()
        self.spool.mkdir()
        key = self.root / "munge" / "munge.key"
        key.write_bytes(os.urandom(1024))
        key.chmod(0o400)
        if self.network is not None:
            self.network.create(self.root / "hosts", controller=self.host)
        self._write_conf()
        munge = self.root / "munge"
        self._spawn(
            "munged",
            "--foreground",
            "--force",
            f"--socket={self.munge_socket}",
            f"--key-file={key}",
            f"--pid-file={munge / 'munged.pid'}",
            f"--log-file={self.root / 'log' / 'munged.log'}",
            f"--seed-file={munge / 'munged.seed'}",
        )
        self._wait(lambda: self.munge_socket.exists(), "munged's socket")
        self._spawn("slurmctld", "-D", "-i", "-f", str(self.conf))
        if self.network is None:
            self._spawn("slurmd", "-D", "-f", str(self.conf))
        else:
            for index, name in enumerate(self.network.hostnames):
                (self.spool / name).mkdir()
                self._spawn(
                    "slurmd",
                    "-D",
                    "-N",
                    name,
                    "-f",
                    str(self.conf),
                    enter=self.network.enter(index),
                )
        names = ", ".join(self.node_names)
        self._wait(lambda: self.node_state() == "idle", f"nodes {names} idle")
        return self

    def kill_node(self, index: int) -> None:
        """Node `index` dies: SIGKILL to every process in its namespaces (its slurmd, and the job
        steps and ranks running there), by PID."""
        for pid in self.network.pids(index):
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        name = self.network.hostnames[index]
        for process in [p for p in self.processes if _is_slurmd_of(p, name)]:
            process.wait(timeout=20)  # reaped: this process started it
            self.processes.remove(process)

    def restart_node(self, index: int) -> None:
        """Node `index` comes back: its slurmd starts again in fresh namespaces of its own."""
        name = self.network.hostnames[index]
        self._spawn(
            "slurmd", "-D", "-N", name, "-f", str(self.conf), enter=self.network.enter(index)
        )

    def stop(self) -> None:
        for process in reversed(self.processes):
            if process.poll() is None:
                process.terminate()
        for process in reversed(self.processes):
            try:
                process.wait(timeout=20)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait()
        self.processes.clear()
        if self.network is not None:
            self.network.delete()
        shutil.rmtree(self.sockets, ignore_errors=True)

    def node_state(self) -> str:
        """The nodes' state if they all share one (`idle`), else each node's."""
        result = self.run("sinfo", "--noheader", "--Node", "--format=%N %T", check=False)
        states = dict(line.split() for line in result.stdout.strip().splitlines() if line)
        if set(states) == set(self.node_names) and len(set(states.values())) == 1:
            return next(iter(states.values()))
        return " ".join(f"{node}:{state}" for node, state in sorted(states.items()))

    def run(self, *command: str, check: bool = True) -> subprocess.CompletedProcess:
        return subprocess.run(
            command, env=self.env, capture_output=True, text=True, check=check, timeout=60
        )

    def sbatch(
        self,
        script: Path,
        *args: str,
        cwd: Path,
        env: dict[str, str],
        options: tuple[str, ...] = (),
    ) -> str:
        """Submit `script` with its arguments `args` and sbatch's `options` (which override the
        script's #SBATCH lines), in the submitter's environment `env` (plus SLURM_CONF)."""
        result = subprocess.run(
            ["sbatch", "--parsable", *options, str(script), *args],
            env=env | {"SLURM_CONF": str(self.conf)},
            cwd=cwd,
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert result.returncode == 0, result.stderr
        return result.stdout.strip().split(";")[0]

    def launch(self, launch_args: list[str], *, cwd: Path, env: dict[str, str]) -> str:
        """Submit through `megatron-rl launch <launch_args>`, as a user does, with the
        submitter's environment `env` (plus SLURM_CONF); the job id."""
        result = subprocess.run(
            [sys.executable, "-m", "megatron_rl.cli", "launch", *launch_args],
            env=env | {"SLURM_CONF": str(self.conf)},
            cwd=cwd,
            capture_output=True,
            text=True,
            timeout=120,
        )
        assert result.returncode == 0, result.stderr[-3000:]
        assert result.stdout.startswith("submitted job "), result.stdout
        return result.stdout.split()[2]

    def job(self, job_id: str) -> dict[str, str]:
        """scontrol's fields of the job (JobState, Restarts, ExitCode, ...)."""
        text = self.run("scontrol", "--oneliner", "show", "job", job_id).stdout
        return dict(re.findall(r"(\w+)=(\S*)", text))

    def wait_for_job(
        self, job_id: str, done: Callable[[dict[str, str]], bool], timeout_s: float, what: str
    ) -> dict[str, str]:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            fields = self.job(job_id)
            if done(fields):
                return fields
            time.sleep(0.5)
        raise AssertionError(f"job {job_id}: not {what} in {timeout_s:g} s: {self.job(job_id)}")

    def _spawn(self, name: str, *args: str, enter: list[str] | None = None) -> None:
        """Start daemon `name`; with `enter`, inside a node's namespaces: `enter` is the command
        prefix that enters them and runs its last argument, a shell command, there."""
        tag = name if enter is None else f"{name}-{args[args.index('-N') + 1]}"
        log = open(self.root / "log" / f"{tag}.out", "ab")  # noqa: SIM115 (the daemon's)
        command = [shutil.which(name), *args]
        if enter is not None:
            command = [*enter[:-1], f"{enter[-1]} && exec {shlex.join(command)}"]
        self.processes.append(
            subprocess.Popen(
                command,
                env=self.env,
                stdout=log,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
            )
        )
        log.close()

    def _wait(self, ready: Callable[[], bool], what: str, timeout_s: float = 60) -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            dead = [p.args[0] for p in self.processes if p.poll() is not None]
            if dead:
                raise RuntimeError(f"{dead} exited; logs in {self.root / 'log'}")
            if ready():
                return
            time.sleep(0.2)
        raise RuntimeError(f"SLURM test cluster: no {what} in {timeout_s:g} s ({self.root})")

    def _write_conf(self) -> None:
        cpus = os.cpu_count() or 1
        memory_mib = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") // 2**20 - 1024
        root = self.root
        self.conf.write_text(
            "\n".join(
                [
                    "ClusterName=megatron-rl-tests",
                    f"SlurmctldPort={free_port()}",
                    f"SlurmdPort={free_port()}",
                    "SlurmUser=root",
                    "SlurmdUser=root",
                    "AuthType=auth/munge",
                    "CredType=cred/munge",
                    f"AuthInfo=socket={self.munge_socket},cred_expire={REQUEUE_WAIT_S}",
                    f"StateSaveLocation={root / 'state'}",
                    # %n: the node's name (one slurmd per node, all on one filesystem)
                    f"SlurmdSpoolDir={self.spool / ('%n' if self.network else '')}",
                    f"SlurmctldPidFile={root / 'slurmctld.pid'}",
                    f"SlurmdPidFile={root / 'slurmd-%n.pid'}",
                    f"SlurmctldLogFile={root / 'log' / 'slurmctld.log'}",
                    f"SlurmdLogFile={root / 'log' / 'slurmd-%n.log'}",
                    # No cgroup hierarchy to manage here (the probe, ../shared/probes/slurm).
                    "ProctrackType=proctrack/linuxproc",
                    "TaskPlugin=task/none",
                    "SchedulerType=sched/backfill",
                    "SelectType=select/cons_tres",
                    "SelectTypeParameters=CR_Core",
                    "ReturnToService=2",
                    "MpiDefault=none",
                    "JobRequeue=1",
                    *(
                        []
                        if self.slurmd_timeout_s is None
                        else [f"SlurmdTimeout={self.slurmd_timeout_s}"]
                    ),
                    *self._node_lines(cpus, memory_mib),
                    "",
                ]
            )
        )

    def _node_lines(self, cpus: int, memory_mib: int) -> list[str]:
        if self.network is None:
            return [
                f"SlurmctldHost={self.host}",
                f"NodeName={self.host} CPUs={cpus} RealMemory={memory_mib} State=UNKNOWN",
                f"PartitionName=debug Nodes={self.host} Default=YES MaxTime=INFINITE State=UP",
            ]
        network = self.network
        names = ",".join(network.hostnames)
        # every node sees the whole machine: its memory is split between them
        per_node = memory_mib // self.nodes
        return [
            # slurmctld insists on its own hostname; nodes and clients use the bridge address
            f"SlurmctldHost={self.host}({network.bridge_address})",
            f"NodeName={names} NodeAddr={','.join(network.node_addresses)} "
            f"NodeHostname={names} CPUs={cpus} RealMemory={per_node} State=UNKNOWN",
            f"PartitionName=debug Nodes={names} Default=YES MaxTime=INFINITE State=UP",
        ]


class NodeNetwork:
    """The hosts of a multi-node cluster: a bridge in the machine's namespace and one network
    namespace per node joined to it by a veth pair (`eth0` inside), on a /24 that no interface
    of the machine uses; names start with a prefix of this process's, so that concurrent
    clusters never collide (interface names: at most 15 characters)."""

    def __init__(self, nodes: int) -> None:
        self.prefix = f"mr{os.getpid() % 100000:05d}{next(_COUNTER) % 10}"
        self.hostnames = [f"{self.prefix}n{i}" for i in range(1, nodes + 1)]
        self.namespaces = [f"{self.prefix}-ns{i}" for i in range(1, nodes + 1)]
        self.bridge = f"{self.prefix}br"
        self.subnet = _free_subnet()
        self.bridge_address = f"{self.subnet}.1"
        self.node_addresses = [f"{self.subnet}.{10 + i}" for i in range(1, nodes + 1)]
        self.hosts_file: Path | None = None

    def create(self, hosts_file: Path, *, controller: str) -> None:
        """The bridge, the namespaces, their links, and `hosts_file` naming the controller and
        every node (bind-mounted over /etc/hosts inside each node)."""
        self.hosts_file = hosts_file
        lines = ["127.0.0.1 localhost", f"{self.bridge_address} {controller}"]
        _ip("link", "add", self.bridge, "type", "bridge")
        _ip("addr", "add", f"{self.bridge_address}/24", "dev", self.bridge)
        _ip("link", "set", self.bridge, "up")
        for index, (name, namespace) in enumerate(
            zip(self.hostnames, self.namespaces, strict=True)
        ):
            outside, inside = f"{self.prefix}v{index + 1}", f"{self.prefix}v{index + 1}p"
            _ip("netns", "add", namespace)
            _ip("link", "add", outside, "type", "veth", "peer", "name", inside)
            _ip("link", "set", outside, "master", self.bridge, "up")
            _ip("link", "set", inside, "netns", namespace)
            _ip("-n", namespace, "link", "set", inside, "name", "eth0")
            _ip("-n", namespace, "addr", "add", f"{self.node_addresses[index]}/24", "dev", "eth0")
            _ip("-n", namespace, "link", "set", "eth0", "up")
            _ip("-n", namespace, "link", "set", "lo", "up")
            lines.append(f"{self.node_addresses[index]} {name}")
        hosts_file.write_text("\n".join(lines) + "\n")

    def enter(self, index: int) -> list[str]:
        """The command prefix that runs a shell command as node `index`: in its network
        namespace (nsenter: /sys stays mounted), with its hostname and hosts file."""
        assert self.hosts_file is not None, "create() first"
        setup = (
            f"mount --bind {shlex.quote(str(self.hosts_file))} /etc/hosts "
            f"&& hostname {self.hostnames[index]}"
        )
        return [
            "nsenter",
            f"--net=/run/netns/{self.namespaces[index]}",
            "unshare",
            "--mount",
            "--uts",
            "--",
            "sh",
            "-c",
            setup,
        ]

    def pids(self, index: int) -> list[int]:
        """The processes in node `index`'s network namespace."""
        result = subprocess.run(
            ["ip", "netns", "pids", self.namespaces[index]], capture_output=True, text=True
        )
        return [int(pid) for pid in result.stdout.split()]

    def delete(self) -> None:
        """Kill what still runs in each namespace (by PID), then remove namespaces and links;
        what is already gone is skipped."""
        for index, namespace in enumerate(self.namespaces):
            for pid in self.pids(index):
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)
            subprocess.run(["ip", "netns", "del", namespace], capture_output=True)
            subprocess.run(["ip", "link", "del", f"{self.prefix}v{index + 1}"], capture_output=True)
        subprocess.run(["ip", "link", "del", self.bridge], capture_output=True)


_COUNTER = itertools.count()


def _is_slurmd_of(process: subprocess.Popen, node: str) -> bool:
    """Whether `process` (as SlurmCluster._spawn started it) is node `node`'s slurmd."""
    return "slurmd" in str(process.args) and f"-N {node}" in str(process.args)


def _ip(*args: str) -> None:
    result = subprocess.run(["ip", *args], capture_output=True, text=True)
    if result.returncode != 0:
        raise RuntimeError(f"ip {' '.join(args)}: {result.stderr.strip()}")


def _free_subnet() -> str:
    """A 10.x.y /24 prefix that no address of the machine is in."""
    used = subprocess.run(["ip", "-o", "-4", "addr"], capture_output=True, text=True).stdout
    taken = set(re.findall(r"inet (\d+\.\d+\.\d+)\.\d+/", used))
    start = os.getpid() % 200
    for offset in range(200):
        candidate = f"10.{201 + (start + offset) // 250 % 50}.{(start + offset) % 250}"
        if candidate not in taken:
            return candidate
    raise RuntimeError("no free 10.x.y.0/24 subnet for the test cluster")


def main(argv: list[str] | None = None) -> int:
    """`python -m tests.launch.slurm_cluster DIR [--nodes N]`: a test cluster to try jobs on by
    hand (docs/slurm.md, "Multi-node on one machine"). It starts under DIR (which must not
    exist), prints the SLURM_CONF to submit with, and runs until SIGINT or SIGTERM, then stops
    its daemons by PID and removes its namespaces."""
    import argparse

    parser = argparse.ArgumentParser(prog="python -m tests.launch.slurm_cluster")
    parser.add_argument("root", type=Path, help="a directory of its own (must not exist)")
    parser.add_argument("--nodes", type=int, default=3, help="nodes, each a host of its own (3)")
    args = parser.parse_args(argv)
    reason = missing_reason(args.nodes)
    if reason is not None:
        parser.error(reason)
    if args.root.exists():
        parser.error(f"{args.root}: exists; the cluster makes a directory of its own")
    stop = []
    for number in (signal.SIGINT, signal.SIGTERM):
        signal.signal(number, lambda signum, frame: stop.append(signum))
    cluster = SlurmCluster(args.root.resolve(), nodes=args.nodes)
    try:
        cluster.start()
        print(f"export SLURM_CONF={cluster.conf}", flush=True)
        print(f"nodes: {' '.join(cluster.node_names)} (stop: kill {os.getpid()})", flush=True)
        while not stop:
            time.sleep(0.5)
    finally:
        cluster.stop()
    return 0


if __name__ == "__main__":
    sys.exit(main())
