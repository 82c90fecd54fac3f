"""The processes a test started, found by process group or parent in /proc (by PID, never by
name), and the ports they may listen on."""

from __future__ import annotations

import socket
import time
from pathlib import Path


def live_group_members(pgid: int) -> list[int]:
    """PIDs of the processes of group `pgid` that still run (zombies, which only wait to be
    reaped by whoever inherited them, do not count)."""
    members = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue  # exited meanwhile
        state, group = fields[0], int(fields[2])
        if group == pgid and state != "Z":
            members.append(int(stat.parent.name))
    return members


def _running() -> dict[int, int]:
    """Parent PID of every running process (zombies left out), by PID."""
    parents = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue  # exited meanwhile
        if fields[0] != "Z":
            parents[int(stat.parent.name)] = int(fields[1])
    return parents


def descendants(pid: int) -> list[int]:
    """The running children of `pid`, theirs, and so on (torchrun's ranks are in sessions of
    their own: their group is not torchrun's)."""
    parents = _running()
    found, frontier = [], [pid]
    while frontier:
        children = [child for child, parent in parents.items() if parent in frontier]
        found += children
        frontier = children
    return found


def still_running(pids: list[int], timeout_s: float) -> list[int]:
    """Those of `pids` that still run after up to `timeout_s` (they are waited for)."""
    deadline = time.monotonic() + timeout_s
    while (left := [pid for pid in pids if pid in _running()]) and time.monotonic() < deadline:
        time.sleep(0.1)
    return left


def caught_signals(pid: int) -> set[int]:
    """The signals that process `pid` has a handler for (its SigCgt in /proc)."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("SigCgt:"):
            mask = int(line.split()[1], 16)
            return {bit + 1 for bit in range(64) if mask >> bit & 1}
    return set()


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
