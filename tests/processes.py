"""The processes a test started, found by process group or by parent in /proc (by PID, never by
name), stopped with their descendants when the test ends early; and the ports they may listen
on."""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any


def _running() -> dict[int, tuple[int, int]]:
    """(parent PID, process group) of every running process by PID (zombies, which only wait to
    be reaped by whoever inherited them, are left out)."""
    found = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue  # exited meanwhile
        if fields[0] != "Z":
            found[int(stat.parent.name)] = (int(fields[1]), int(fields[2]))
    return found


def is_running(pid: int) -> bool:
    """Whether process `pid` runs (a zombie does not)."""
    return pid in _running()


def live_group_members(pgid: int) -> list[int]:
    """PIDs of the processes of group `pgid` that still run."""
    return [pid for pid, (_, group) in _running().items() if group == pgid]


def descendants(pid: int) -> list[int]:
    """PIDs of the running processes descended from `pid` (children, their children, ...)."""
    children: dict[int, list[int]] = {}
    for child, (parent, _) in _running().items():
        children.setdefault(parent, []).append(child)
    found, waiting = [], list(children.get(pid, []))
    while waiting:
        child = waiting.pop()
        found.append(child)
        waiting += children.get(child, [])
    return found


def still_running(pids: list[int], timeout_s: float) -> list[int]:
    """Those of `pids` that still run after up to `timeout_s` (they are waited for)."""
    deadline = time.monotonic() + timeout_s
    while (left := [pid for pid in pids if is_running(pid)]) and time.monotonic() < deadline:
        time.sleep(0.1)
    return left


def caught_signals(pid: int) -> set[int]:
    """The signals that process `pid` has a handler for (its SigCgt in /proc)."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("SigCgt:"):
            mask = int(line.split()[1], 16)
            return {bit + 1 for bit in range(64) if mask >> bit & 1}
    return set()


def kill_tree(pid: int) -> None:
    """SIGKILL `pid`, every process descended from it and the process groups they lead, all
    found before any is killed (a killed process's children pass to init and cannot be traced
    back to it). torchrun starts each rank in a session of its own, so that killing torchrun's
    group alone leaves the ranks running."""
    found = [pid, *descendants(pid)]
    ours = os.getpgrp()
    for member in found:
        with contextlib.suppress(ProcessLookupError):
            if os.getpgid(member) == member != ours:
                os.killpg(member, signal.SIGKILL)
            os.kill(member, signal.SIGKILL)


def run_bounded(
    command: Sequence[str], *, timeout: float, **popen: Any
) -> subprocess.CompletedProcess:
    """`subprocess.run(command, timeout=timeout, **popen)` without capturing (pass files as
    stdout and stderr), in a session of its own; when it does not end by itself (its timeout,
    or the test's, which pytest-timeout raises in this thread, or Ctrl-C) it is killed with
    every process it started (`kill_tree`) before the error goes on."""
    process = subprocess.Popen(command, start_new_session=True, **popen)
    try:
        returncode = process.wait(timeout=timeout)
    except BaseException:
        kill_tree(process.pid)
        process.wait()
        raise
    return subprocess.CompletedProcess(command, returncode)


def group_gone(pgid: int, timeout_s: float = 15.0) -> bool:
    """Whether process group `pgid` has no running process left, waiting up to `timeout_s`
    (killed processes take a moment to exit)."""
    deadline = time.monotonic() + timeout_s
    while live_group_members(pgid):
        if time.monotonic() > deadline:
            return False
        time.sleep(0.1)
    return True


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on now."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]
