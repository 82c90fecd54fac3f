"""The processes a test started, found by process group in /proc (by PID, never by name), and
the ports they may listen on."""

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
