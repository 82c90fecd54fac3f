"""Worker processes that run verifiers under a deadline, a memory limit and a CPU-time limit.

A generated answer can make a verifier compute for hours: sympy evaluates `9^{9^{9^{9}}}`
exactly, in C code that holds the GIL, so that a thread can neither stop it nor let the
trainer's other threads run meanwhile. A process can be stopped. Each worker scores one sample
at a time; the pool waits on the workers' pipes, which releases the GIL; a worker that overruns
its sample's deadline is killed (SIGKILL, by PID) and replaced, and the sample scores 0.0 as a
timeout. A worker that dies otherwise (its memory limit, a crash) is replaced too, and its
sample scores 0.0 as a failure.

The workers are fresh interpreters (scoring_worker.py), started once, that serve batch after
batch: a fork would copy the locks of the trainer's threads, and torch's state, into a process
that has none of those threads, and multiprocessing's 'spawn' would import the trainer's main
module again in each (seconds of torch and megatron-core for a script that imports them); a
worker imports this package and sympy, a second or so. Each sets its own limits
once started: its address space may grow by `memory_limit_mb` (RLIMIT_AS: an allocation past it
raises MemoryError, on which the worker exits and is replaced, its heap possibly left full), and
each sample may use twice the deadline plus CPU_GRACE_S of CPU time (RLIMIT_CPU). The pool's
kill at the deadline comes first; the CPU limit is the backstop that ends a worker computing for
a pool that is gone or stuck. A worker whose trainer process is gone (killed, even by SIGKILL)
exits within PARENT_POLL_S (process/children.py) unless it holds the GIL computing, which its CPU
limit ends.
"""

from __future__ import annotations

import contextlib
import math
import os
import pickle
import signal
import socket
import subprocess
import sys
import threading
import time
from collections import deque
from collections.abc import Sequence
from multiprocessing.connection import Connection, wait
from types import TracebackType

from megatron_rl.rewards.scoring import RewardScores
from megatron_rl.rewards.scoring_worker import (
    OWNERS_SIGNALS,
    READY,
    WORKER_CODE,
    Request,
    UnloadableVerifier,
)
from megatron_rl.rewards.verifiers import Verifier

CPU_GRACE_S = 5
"""CPU seconds a sample may use beyond twice its deadline before its worker's RLIMIT_CPU ends
it."""
START_TIMEOUT_S = 60.0
"""How long a worker may take to start (a fresh interpreter importing this package) before the
pool gives up on it and raises."""


class ScoringPool:
    """`workers` scoring processes, started now; each verifier call gets `timeout_s` seconds
    from its start and `memory_limit_mb` of memory. Scores one batch at a time (`score`; a
    second caller waits); `close` (or leaving the `with` block) stops the workers.

    Raises:
        ValueError: `workers` or `memory_limit_mb` is not a positive int, or `timeout_s` not a
            positive finite number.
    """

    def __init__(self, *, workers: int, timeout_s: float, memory_limit_mb: int) -> None:
        for name, value in (("workers", workers), ("memory_limit_mb", memory_limit_mb)):
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name}: expected an int >= 1, got {value!r}")
        if not (isinstance(timeout_s, (int, float)) and 0 < timeout_s < math.inf):
            raise ValueError(f"timeout_s: expected seconds > 0, got {timeout_s!r}")
        self.timeout_s = float(timeout_s)
        self._memory_limit_bytes = memory_limit_mb * 2**20
        self._cpu_limit_s = math.ceil(2 * self.timeout_s) + CPU_GRACE_S
        self._lock = threading.Lock()
        self._closed = False
        self._workers = [self._start_worker() for _ in range(workers)]

    @property
    def pids(self) -> list[int]:
        """The workers' PIDs; a worker killed or dead is replaced by one with a new PID."""
        return [worker.process.pid for worker in self._workers]

    def score(self, verifier: Verifier, samples: Sequence[tuple[str, str, str]]) -> RewardScores:
        """The rewards of `samples`, each `(prompt, response, reference)`, scored by `verifier`
        in the workers, in parallel; see `score_responses`.

        Raises:
            ValueError: `verifier` cannot be sent to a worker (it is not a module-level function
                the worker can import).
            RuntimeError: the pool is closed, or a worker failed to start.
        """
        name, pickled = _pickled(verifier)
        with self._lock:
            if self._closed:
                raise RuntimeError("the scoring pool is closed")
            batch = _Batch(samples, name, pickled)
            try:
                while batch.waiting or any(w.sample is not None for w in self._workers):
                    self._hand_out(batch)
                    self._wait_for_news()
                    self._take_news(batch)
            finally:
                # A worker still scoring (this call was interrupted) would answer the next
                # batch's request with this one's reward.
                for slot, worker in enumerate(self._workers):
                    if worker.sample is not None:
                        self._replace(slot)
        return RewardScores.of(batch.outcomes, batch.timeouts)

    def close(self) -> None:
        """Kill the workers (SIGKILL, by PID) and reap them; later calls do nothing."""
        with self._lock:
            if not self._closed:
                self._closed = True
                for worker in self._workers:
                    worker.stop()

    def __enter__(self) -> ScoringPool:
        return self

    def __exit__(
        self,
        kind: type[BaseException] | None,
        error: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        self.close()

    def _start_worker(self) -> _Worker:
        return _Worker(self._memory_limit_bytes)

    def _replace(self, slot: int) -> None:
        self._workers[slot].stop()
        self._workers[slot] = self._start_worker()

    def _hand_out(self, batch: _Batch) -> None:
        """Send a waiting sample to each worker that is ready and idle."""
        for slot, worker in enumerate(self._workers):
            if not batch.waiting:
                return
            if not worker.ready or worker.sample is not None:
                continue
            index = batch.waiting.popleft()
            request = Request(batch.verifier, tuple(batch.samples[index]), self._cpu_limit_s)
            try:
                worker.connection.send(request)
            except OSError:  # it died while idle: the sample goes to its replacement
                batch.waiting.appendleft(index)
                self._replace(slot)
                continue
            worker.sample, worker.deadline = index, time.monotonic() + self.timeout_s

    def _wait_for_news(self) -> None:
        """Block (the GIL released) until a worker answers, is ready or dies, or a deadline
        passes."""
        busy = [w for w in self._workers if w.sample is not None or not w.ready]
        if busy:
            due = min(w.deadline if w.ready else w.started + START_TIMEOUT_S for w in busy)
            waited = [w.connection for w in busy] + [w.sentinel for w in busy]
            wait(waited, timeout=max(0.0, due - time.monotonic()))

    def _take_news(self, batch: _Batch) -> None:
        """Record what the workers answered; replace those that died or ran out of time."""
        now = time.monotonic()
        for slot, worker in enumerate(self._workers):
            if not worker.ready:
                worker.check_started(now)
            elif worker.sample is None:
                continue
            elif worker.connection.poll():
                try:
                    answer = worker.connection.recv()
                except (EOFError, OSError):  # it died: the sample failed
                    self._replace(slot)
                    continue
                index, worker.sample = worker.sample, None
                if isinstance(answer, UnloadableVerifier):
                    raise ValueError(_unsendable(batch.verifier_name, answer.error))
                batch.outcomes[index] = answer
            elif worker.process.poll() is not None:  # dead, its pipe held open by a forked copy
                self._replace(slot)
            elif now >= worker.deadline:
                batch.timeouts += 1
                self._replace(slot)


class _Batch:
    """One `score` call's samples, which of them wait for a worker, and what came back."""

    def __init__(
        self, samples: Sequence[tuple[str, str, str]], verifier_name: str, verifier: bytes
    ) -> None:
        self.samples = samples
        self.verifier_name, self.verifier = verifier_name, verifier
        self.waiting = deque(range(len(samples)))
        self.outcomes: list[float | None] = [None] * len(samples)  # None: failed or timed out
        self.timeouts = 0


class _Worker:
    """One worker process, the pool's end of its socket, a descriptor that becomes readable when
    the process ends (Linux's pidfd), and the sample it is scoring."""

    def __init__(self, memory_limit: int) -> None:
        ours, theirs = socket.socketpair()
        self.connection = Connection(ours.detach())
        worker_end = theirs.detach()
        command = [sys.executable, "-c", WORKER_CODE, str(worker_end), str(memory_limit)]
        # The worker imports the verifiers' modules from where this process imports them.
        paths = os.pathsep.join(path or os.getcwd() for path in sys.path)
        # The worker starts with the requests to stop or save blocked (the mask survives the
        # exec), so that one sent to the trainer's whole process group while the worker imports
        # cannot end it before it ignores them.
        blocked = signal.pthread_sigmask(signal.SIG_BLOCK, OWNERS_SIGNALS)
        try:
            self.process = subprocess.Popen(
                [*command, str(os.getpid())],
                pass_fds=(worker_end,),
                stdin=subprocess.DEVNULL,
                env=dict(os.environ, PYTHONPATH=paths),
            )
        finally:
            signal.pthread_sigmask(signal.SIG_SETMASK, blocked)
            os.close(worker_end)
        # A process forked from the trainer meanwhile may hold the worker's end too: its death
        # is watched on the pidfd, not only on the socket.
        self.sentinel = os.pidfd_open(self.process.pid)
        self.started = time.monotonic()
        self.ready = False
        self.sample: int | None = None  # the index in its batch of the sample it is scoring
        self.deadline = math.inf

    def check_started(self, now: float) -> None:
        """Mark the worker ready if it said so; raise if it died or took too long starting."""
        if self.connection.poll():
            with contextlib.suppress(EOFError, OSError):
                self.ready = self.connection.recv() == READY
        elif self.process.poll() is None and now < self.started + START_TIMEOUT_S:
            return
        if not self.ready:
            self.process.kill()
            self.process.wait()
            raise RuntimeError(
                f"a scoring worker (PID {self.process.pid}) did not start: exit code "
                f"{self.process.returncode} after {now - self.started:.1f} s"
            )

    def stop(self) -> None:
        """Kill the process (SIGKILL, by PID), reap it, and close its socket and pidfd."""
        self.process.kill()
        self.process.wait()
        self.connection.close()
        os.close(self.sentinel)


def _pickled(verifier: Verifier) -> tuple[str, bytes]:
    """`verifier`'s name, and the verifier pickled as the workers receive it: by reference."""
    name = getattr(verifier, "__qualname__", repr(verifier))
    try:
        return name, pickle.dumps(verifier)
    except (pickle.PicklingError, AttributeError, TypeError) as error:
        raise ValueError(_unsendable(name, f"{type(error).__name__}: {error}")) from error


def _unsendable(name: str, error: str) -> str:
    return (
        f"verifier {name}: cannot be sent to a scoring worker process ({error}); a verifier "
        "scored in worker processes must be a module-level function that they can import "
        "(of a module, not of the script run as __main__)"
    )
