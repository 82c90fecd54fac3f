"""A scoring worker's side of the pool (scoring_pool.py): what it is sent, what it answers, and
its life, in a fresh interpreter that imports this package and the verifiers' modules, nothing of
the trainer's.

    python -c "from megatron_rl.rewards.scoring_worker import main; main()" \
        FD MEMORY_LIMIT_BYTES TRAINER_PID

FD is the worker's end of a socket pair to the pool (passed open); the worker scores request after
request on it until the pool kills it, the pool's end closes or its trainer process is gone.
"""

from __future__ import annotations

import contextlib
import math
import os
import pickle
import resource
import signal
import sys
from multiprocessing.connection import Connection
from pathlib import Path
from typing import NamedTuple

from megatron_rl.process.children import exit_when_orphaned
from megatron_rl.rewards.scoring import checked_reward
from megatron_rl.rewards.verifiers import Verifier

# Signals a terminal or a launcher sends the trainer's whole process group to interrupt it or
# have it save and stop: the trainer's to answer, not its scoring workers'.
OWNERS_SIGNALS = frozenset({signal.SIGINT, signal.SIGHUP, signal.SIGUSR1, signal.SIGUSR2})
# What the pool runs to start a worker (arguments follow).
WORKER_CODE = "from megatron_rl.rewards.scoring_worker import main; main()"
READY = "ready"  # what a worker sends once it has started and set its limits


class Request(NamedTuple):
    """One sample for a worker to score."""

    verifier: bytes  # pickled: a reference to a module-level function
    sample: tuple[str, str, str]  # (prompt, response, reference)
    cpu_limit_s: int


class UnloadableVerifier(NamedTuple):
    """A worker's answer to a request whose verifier it cannot unpickle."""

    error: str


def main() -> None:
    """The worker's command line (above)."""
    fd, memory_limit, trainer_pid = (int(argument) for argument in sys.argv[1:4])
    serve(Connection(fd), memory_limit, trainer_pid)


def serve(connection: Connection, memory_limit: int, trainer_pid: int) -> None:
    """A worker's life: set its limits, say it is ready, then score request after request
    until the pool kills it or goes away."""
    # The end of its pipe only reaches a worker once every process holding the pool's end has
    # closed it, and processes forked from the trainer (checkpoint writers) hold it too.
    exit_when_orphaned(trainer_pid)
    # Ctrl-C in a terminal, and a launcher's request to save (SIGUSR1 from SLURM, ...), reach
    # the whole process group: the pool's owner decides (ignored here, they are dropped if they
    # came while blocked at the start). The launcher may have started the trainer ignoring
    # SIGTERM or SIGXCPU (stop signals left to it); a worker takes their default action (the CPU
    # limit needs SIGXCPU's).
    for signum in OWNERS_SIGNALS:
        signal.signal(signum, signal.SIG_IGN)
    signal.pthread_sigmask(signal.SIG_UNBLOCK, OWNERS_SIGNALS)
    for signum in (signal.SIGTERM, signal.SIGXCPU):
        signal.signal(signum, signal.SIG_DFL)
    _set_soft_limit(resource.RLIMIT_CORE, 0)  # a worker ended by its CPU limit dumps no core
    _set_soft_limit(resource.RLIMIT_AS, _address_space_bytes() + memory_limit)
    loaded: tuple[bytes, Verifier] | None = None
    with contextlib.suppress(EOFError, BrokenPipeError, ConnectionResetError):  # the pool is gone
        connection.send(READY)
        while True:
            request: Request = connection.recv()  # from the trainer that started this process
            if loaded is None or loaded[0] != request.verifier:
                try:
                    loaded = (request.verifier, pickle.loads(request.verifier))
                except Exception as error:
                    connection.send(UnloadableVerifier(f"{type(error).__name__}: {error}"))
                    continue
            _set_soft_limit(resource.RLIMIT_CPU, _cpu_seconds_used() + request.cpu_limit_s)
            try:
                outcome = checked_reward(loaded[1], *request.sample)
            except MemoryError:
                return  # no answer: the pool counts a failure and starts a fresh worker
            except Exception:
                outcome = None  # a verifier bug or a malformed response costs one sample
            connection.send(outcome)


def _set_soft_limit(kind: int, value: int) -> None:
    """Set resource `kind`'s soft limit to `value`, or to the hard limit if that is lower."""
    _, hard = resource.getrlimit(kind)
    resource.setrlimit(kind, (value if hard == resource.RLIM_INFINITY else min(value, hard), hard))


def _address_space_bytes() -> int:
    """This process's address space now (Linux: its size in pages, in /proc/self/statm)."""
    return int(Path("/proc/self/statm").read_text().split()[0]) * os.sysconf("SC_PAGE_SIZE")


def _cpu_seconds_used() -> int:
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return math.ceil(usage.ru_utime + usage.ru_stime)
