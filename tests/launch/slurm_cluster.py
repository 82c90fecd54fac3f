"""A real single-node SLURM cluster for the tests: munged, slurmctld and slurmd (Debian's
slurm-wlm, installed by scripts/install_slurm.sh) as root, in the foreground as children of the
test process, with a configuration, key, sockets, ports and state of their own under one
directory, so that nothing of the machine's is used or changed. Stopped by their PIDs."""

from __future__ import annotations

import os
import re
import shutil
import socket
import subprocess
import time
from collections.abc import Callable
from pathlib import Path

from tests.processes import free_port

DAEMONS = ("munged", "slurmctld", "slurmd")
# How long a requeued job waits before it may start again is the job credential's lifetime
# (slurm.conf, AuthInfo cred_expire; 120 s by default).
REQUEUE_WAIT_S = 5


def missing_reason() -> str | None:
    """Why this machine cannot run the cluster, or None."""
    if os.geteuid() != 0:
        return "SLURM's daemons run as root here; the tests are not root"
    absent = [name for name in ("sbatch", "shellcheck", *DAEMONS) if shutil.which(name) is None]
    if absent:
        return f"{', '.join(absent)} not installed (scripts/install_slurm.sh installs them)"
    return None


class SlurmCluster:
    """The cluster; `start()` waits until its one node is idle."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self.host = socket.gethostname().split(".")[0]
        self.conf = root / "slurm.conf"
        self.munge_socket = root / "munge" / "munge.socket"
        self.env = dict(os.environ, SLURM_CONF=str(self.conf))
        self.processes: list[subprocess.Popen] = []

    def start(self) -> SlurmCluster:
        (self.root / "munge").mkdir(parents=True, mode=0o700)
        for name in ("state", "spool", "log"):
            (self.root / name).mkdir()
        key = self.root / "munge" / "munge.key"
        key.write_bytes(os.urandom(1024))
        key.chmod(0o400)
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
        self._spawn("slurmd", "-D", "-f", str(self.conf))
        self._wait(lambda: self.node_state() == "idle", f"node {self.host} idle")
        return self

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

    def node_state(self) -> str:
        result = self.run("sinfo", "--noheader", "--format=%T", check=False)
        return result.stdout.strip()

    def run(self, *command: str, check: bool = True) -> subprocess.CompletedProcess:
        return subprocess.run(
            command, env=self.env, capture_output=True, text=True, check=check, timeout=60
        )

    def sbatch(self, script: Path, *, cwd: Path, env: dict[str, str]) -> str:
        """Submit `script` with the submitter's environment `env` (plus SLURM_CONF)."""
        result = subprocess.run(
            ["sbatch", "--parsable", str(script)],
            env=env | {"SLURM_CONF": str(self.conf)},
            cwd=cwd,
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert result.returncode == 0, result.stderr
        return result.stdout.strip().split(";")[0]

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

    def _spawn(self, name: str, *args: str) -> None:
        log = open(self.root / "log" / f"{name}.out", "ab")  # noqa: SIM115 (the daemon's)
        self.processes.append(
            subprocess.Popen(
                [shutil.which(name), *args],
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
                    f"SlurmctldHost={self.host}",
                    f"SlurmctldPort={free_port()}",
                    f"SlurmdPort={free_port()}",
                    "SlurmUser=root",
                    "SlurmdUser=root",
                    "AuthType=auth/munge",
                    "CredType=cred/munge",
                    f"AuthInfo=socket={self.munge_socket},cred_expire={REQUEUE_WAIT_S}",
                    f"StateSaveLocation={root / 'state'}",
                    f"SlurmdSpoolDir={root / 'spool'}",
                    f"SlurmctldPidFile={root / 'slurmctld.pid'}",
                    f"SlurmdPidFile={root / 'slurmd.pid'}",
                    f"SlurmctldLogFile={root / 'log' / 'slurmctld.log'}",
                    f"SlurmdLogFile={root / 'log' / 'slurmd.log'}",
                    # No cgroup hierarchy to manage here (the probe, ../shared/probes/slurm).
                    "ProctrackType=proctrack/linuxproc",
                    "TaskPlugin=task/none",
                    "SchedulerType=sched/backfill",
                    "SelectType=select/cons_tres",
                    "SelectTypeParameters=CR_Core",
                    "ReturnToService=2",
                    "MpiDefault=none",
                    "JobRequeue=1",
                    f"NodeName={self.host} CPUs={cpus} RealMemory={memory_mib} State=UNKNOWN",
                    f"PartitionName=debug Nodes={self.host} Default=YES MaxTime=INFINITE State=UP",
                    "",
                ]
            )
        )
