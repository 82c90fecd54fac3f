"""No process a run starts outlives it, whatever ends the run; nor does a rank outlive the
launcher that started it (`end_with_parent`).

megatron-core's checkpoint writer forks one process per write bucket. A process forked from here
on (after `forks_die_with_this_process`) is killed by the kernel when its parent dies, even by
SIGKILL (Linux's parent-death signal), and leaves the stop signals to its parent: the immediate
ones take their default action (a writer cut by Ctrl-C dies instead of unwinding into a queue
its parent no longer reads), the graceful ones are ignored (the parent finishes the save). The
parent-death signal follows the thread that forked: megatron-core forks its writers from the
main thread (a synchronous save); servers, started from any thread, are supervised instead
(`supervise.py`). Process groups this one starts with `subprocess` (rollout servers) are registered
(`started_group`) so that a stop that runs out of time kills them too (`kill_all`).

A fork's hooks run Python code in which an exception is only printed ("Exception ignored") and
dropped: `in_fork` says that one is running, so that a stop signal's handler can wait for the
fork's end (`after_this_fork`) instead of raising there.
"""

from __future__ import annotations

import contextlib
import ctypes
import functools
import multiprocessing
import os
import signal
import sys
import threading
import time
from collections.abc import Callable, Iterable

_PR_SET_PDEATHSIG = 1
PARENT_POLL_S = 0.5
_IMMEDIATE = (signal.SIGTERM, signal.SIGINT)

_ignored_in_children: frozenset[int] = frozenset()
_hook_registered = False
_parent_pid = os.getpid()  # the forking process, as the child sees it
_groups: set[int] = set()
# One item per fork in progress, from before its first hook to after its last one in the parent.
# Counted by C calls (list.append, list.pop), not Python functions: a signal's Python handler
# runs between two Python bytecodes, so none can run between the fork's start and the count.
_forks_in_progress: list[bool] = []
_after_fork_in_parent: list[Callable[[], None]] = []


def forks_die_with_this_process() -> None:
    """From now on a forked child dies with this process and does not handle the stop signals
    itself (idempotent; called before anything that forks)."""
    global _hook_registered
    if not _hook_registered:
        os.register_at_fork(
            before=_remember_parent,
            after_in_parent=_fork_returned_in_parent,
            after_in_child=_in_forked_child,
        )
        # Registered last: before a fork the hooks run last-registered first, after it
        # first-registered first, so the count spans every hook registered until now.
        os.register_at_fork(
            before=functools.partial(_forks_in_progress.append, True),
            after_in_parent=_forks_in_progress.pop,
            after_in_child=_forks_in_progress.clear,
        )
        _hook_registered = True


def in_fork() -> bool:
    """A fork's hooks are running (in some thread): an exception raised now may be dropped."""
    return bool(_forks_in_progress)


def after_this_fork(callback: Callable[[], None]) -> None:
    """Call `callback` (in the parent) when the fork in progress has run its hooks but the
    last; it must not raise."""
    _after_fork_in_parent.append(callback)


def leave_signals_to_parent(*, ignored: Iterable[int] = ()) -> None:
    """`forks_die_with_this_process`, and forked children ignore the `ignored` signals (the
    graceful ones: the parent finishes what they were doing)."""
    global _ignored_in_children
    _ignored_in_children = frozenset(ignored)
    forks_die_with_this_process()


def die_with_parent(parent_pid: int) -> None:
    """Ask the kernel to SIGKILL this process when its parent dies; exit at once if the parent
    `parent_pid` is already gone (it may die between the fork and this call)."""
    if sys.platform == "linux":
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(_PR_SET_PDEATHSIG, int(signal.SIGKILL))
    if os.getppid() != parent_pid:
        os._exit(1)


def end_with_parent() -> None:
    """SIGKILL this process and what it forked when its parent dies, however the parent dies
    (for a rank: torchrun killed with -9). Two watches: the kernel's parent-death signal
    (Linux only; it follows the parent's thread that started this process, and torchrun starts
    its workers from its main thread), and a thread that polls the parent's pid every
    PARENT_POLL_S (anywhere). Nothing half-written stays visible: a checkpoint is published by
    a rename, and an interrupted one is cleared on resume."""
    parent = os.getppid()
    die_with_parent(parent)
    exit_when_orphaned(parent)


def exit_when_orphaned(parent_pid: int) -> None:
    """Start a thread that kills what this process started, then the process itself, once its
    parent `parent_pid` is gone (polled every PARENT_POLL_S; it runs whenever the main thread
    releases the GIL). Unlike the parent-death signal it does not depend on which of the
    parent's threads started this process."""
    threading.Thread(
        target=_exit_when_orphaned, args=(parent_pid,), name="parent-watch", daemon=True
    ).start()


def _exit_when_orphaned(parent: int) -> None:
    while os.getppid() == parent:
        time.sleep(PARENT_POLL_S)
    kill_all()
    os.kill(os.getpid(), signal.SIGKILL)


def _remember_parent() -> None:
    global _parent_pid
    _parent_pid = os.getpid()


def _fork_returned_in_parent() -> None:
    while _after_fork_in_parent:
        _after_fork_in_parent.pop()()


def _in_forked_child() -> None:
    die_with_parent(_parent_pid)
    _groups.clear()
    _after_fork_in_parent.clear()
    for signum in (*_IMMEDIATE, *_ignored_in_children):
        handler = signal.SIG_IGN if signum in _ignored_in_children else signal.SIG_DFL
        with contextlib.suppress(ValueError):  # forked from another thread than the main one
            signal.signal(signum, handler)


def started_group(pgid: int) -> None:
    """Process group `pgid` (a server started in a session of its own) is this run's."""
    _groups.add(pgid)


def stopped_group(pgid: int) -> None:
    """Process group `pgid` was stopped."""
    _groups.discard(pgid)


def kill_forked() -> None:
    """SIGKILL every live child forked by `multiprocessing` (checkpoint writers) and reap it."""
    for child in multiprocessing.active_children():
        with contextlib.suppress(ProcessLookupError):
            os.kill(child.pid, signal.SIGKILL)
        child.join(timeout=5.0)


def kill_all() -> None:
    """SIGKILL the forked children and every registered process group (a last resort)."""
    for pgid in list(_groups):
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(pgid, signal.SIGKILL)
    for child in multiprocessing.active_children():
        with contextlib.suppress(ProcessLookupError):
            os.kill(child.pid, signal.SIGKILL)
