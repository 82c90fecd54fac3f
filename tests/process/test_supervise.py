"""The supervisor of the rollout servers (megatron_rl/process/supervise.py): it stops its
command when the starter's pipe closes, also when the pipe's descriptor is numbered past the
1024 that select() takes (a test process that has opened many files), and passes the command's
exit status on."""

from __future__ import annotations

import os
import subprocess
import sys
import time

import pytest

from megatron_rl.process.supervise import supervised_command
from tests.processes import still_running

pytestmark = pytest.mark.timeout(60)
HIGH_FD = 1500


def _start(command: list[str], read_fd: int) -> subprocess.Popen:
    # a session of its own: the supervisor stops its whole process group
    return subprocess.Popen(
        supervised_command(command, read_fd), pass_fds=(read_fd,), start_new_session=True
    )


def test_the_command_stops_when_the_starters_pipe_closes_even_past_fd_1024(tmp_path):
    pid_file = tmp_path / "pid"
    command = f"import os, time; open({str(pid_file)!r}, 'w').write(str(os.getpid())); "
    command += "time.sleep(60)"
    read_end, write_end = os.pipe()
    os.dup2(read_end, HIGH_FD)
    os.close(read_end)
    supervisor = _start([sys.executable, "-c", command], HIGH_FD)
    try:
        deadline = time.monotonic() + 20
        while not (pid_file.exists() and pid_file.read_text()) and time.monotonic() < deadline:
            time.sleep(0.1)
        time.sleep(1.5)  # past a poll of the open pipe
        assert supervisor.poll() is None  # the pipe is open: the command runs on
        os.close(write_end)
        code = supervisor.wait(timeout=20)
    finally:
        os.close(HIGH_FD)
        if supervisor.poll() is None:
            supervisor.kill()
    assert code == -9  # it ends its whole group, itself last (SIGKILL)
    assert still_running([int(pid_file.read_text())], timeout_s=5) == []


def test_the_commands_exit_status_is_the_supervisors():
    read_end, write_end = os.pipe()
    try:
        supervisor = _start([sys.executable, "-c", "raise SystemExit(3)"], read_end)
        assert supervisor.wait(timeout=20) == 3
    finally:
        os.close(read_end)
        os.close(write_end)
