"""`python -m megatron_rl.process.supervise FD -- COMMAND...`: run COMMAND, and stop its
process group when the process that started this one dies, however it dies (SIGKILL included).

The starter keeps the write end of a pipe whose read end is FD here; nothing is ever written.
When the starter is gone the pipe reads end-of-file, and COMMAND's process group (this one's: the
starter gives it a session of its own) gets SIGTERM, then SIGKILL after GRACE_S. A pipe rather
than a parent-death signal: that signal follows the starter's *thread*, and servers are started
from worker threads too. This process exits with COMMAND's status (128 + signal if killed), and
leaves SIGTERM to COMMAND: a group-wide SIGTERM stops COMMAND, then this process follows it.

`supervised_command` builds the command line; the rollout servers are started through it.
"""

from __future__ import annotations

import contextlib
import os
import select
import signal
import subprocess
import sys

GRACE_S = 10.0


def supervised_command(command: list[str], pipe_fd: int) -> list[str]:
    """`command` run under this supervisor, watching the read end `pipe_fd` (pass it on with
    `pass_fds`; keep the write end open for as long as `command` may run)."""
    return [sys.executable, "-m", "megatron_rl.process.supervise", str(pipe_fd), "--", *command]


def _stop_group(child: subprocess.Popen) -> None:
    group = os.getpgid(0)
    os.killpg(group, signal.SIGTERM)  # this process ignores it
    with contextlib.suppress(subprocess.TimeoutExpired):
        child.wait(timeout=GRACE_S)
    os.killpg(group, signal.SIGKILL)  # this process too


def main(argv: list[str]) -> int:
    fd_text, separator, *command = argv
    if separator != "--" or not command:
        raise SystemExit("usage: python -m megatron_rl.process.supervise FD -- COMMAND...")
    pipe_fd = int(fd_text)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    child = subprocess.Popen(command, preexec_fn=_default_sigterm)  # one thread here: safe
    # poll, not select: the fd keeps the starter's number, which may be past select's 1024
    starter = select.poll()
    starter.register(pipe_fd, select.POLLIN | select.POLLHUP)
    while child.poll() is None:
        if starter.poll(1000) and not os.read(pipe_fd, 1):  # end of file: the starter is gone
            _stop_group(child)
    code = child.returncode
    return 128 - code if code < 0 else code


def _default_sigterm() -> None:
    # This process ignores SIGTERM, and ignored signals are inherited: COMMAND must not be.
    signal.signal(signal.SIGTERM, signal.SIG_DFL)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
