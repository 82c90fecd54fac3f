"""How a command stops when it is signalled: at once within a bound, or after its step.

An *immediate* signal (SIGTERM, SIGINT) unwinds the command like an error, `SystemExit(128 +
signum)`, so that its own cleanup stops what it started (rollout servers, the staging directory of
a checkpoint being written). Three things keep that bounded and honest:

- sections that must not be cut halfway (the two renames that replace a published directory)
  defer the exit to their end (`uninterrupted()`);
- Python only prints an exception raised inside a finalizer or a fork hook and goes on, so the
  request is also kept: a watchdog thread sends the signal again every NUDGE_S seconds (ignored
  while the exit unwinds), `raise_if_stopping()` raises it again, and the command's exit status
  is 128 + signum whatever happened (`exit_code`). A signal that lands in a fork's hooks does
  not raise there: the watchdog sends it again as soon as the fork has returned. A child forked
  from here that is signalled before its own handlers are set treats the signal as a forked
  child does (`children`): an immediate one ends it, a graceful one is left to the parent;
- the watchdog ends the process `deadline_s` after the signal if unwinding has not: it kills the
  processes this one started (`children.kill_all`) and calls `os._exit`.

A *graceful* signal (the recipe's `checkpoint.save_on_signals`, for SLURM's `--signal`) only
asks: the trainer finishes its step, saves a checkpoint and stops (`graceful_requested`). A
second signal, of any kind, is immediate.

A launcher that leaves the graceful signals to its ranks starts them ignoring those signals
(launch/node.py), and the recipe that names them is read seconds later. So the command's first
act (`keep_early_signals`) is to record, instead of ignoring, the graceful candidates it was
started ignoring; `StopSignals` then takes over what came: a graceful one of its own is a stop
after the step, the others stay ignored.
"""

from __future__ import annotations

import contextlib
import os
import signal
import sys
import threading
import time
from collections.abc import Iterable, Iterator
from types import FrameType

from megatron_rl.process import children

STOP_DEADLINE_S = 30.0
NUDGE_S = 3.0
IMMEDIATE_SIGNALS = (signal.SIGTERM, signal.SIGINT)
# The signals that may ask for a stop after the step (checkpoint.save_on_signals): those that
# schedulers and clusters send to mean "stop" (SLURM's --signal, a preemption's SIGTERM, a
# CPU-time limit's SIGXCPU, a lost terminal's SIGHUP, SIGQUIT).
GRACEFUL_CANDIDATES = (
    signal.SIGUSR1,
    signal.SIGUSR2,
    signal.SIGTERM,
    signal.SIGHUP,
    signal.SIGQUIT,
    signal.SIGXCPU,
)
# What an immediate stop raises (SystemExit from these handlers, KeyboardInterrupt from Python's).
STOPS = (SystemExit, KeyboardInterrupt)

# The graceful candidates this process was started ignoring, and those of them that came
# before StopSignals (keep_early_signals), in order.
_ignored_at_start: set[int] = set()
_came_early: list[int] = []

# Signals are delivered to the main thread, between two of its bytecodes; these say whether it
# is inside an `uninterrupted()` section and which exit waits for the section's end.
_open_sections = 0
_deferred_exit: int | None = None


def signal_number(name: str) -> int:
    """The number of signal `name` (`SIGUSR1`, `USR1`); ValueError naming the valid ones."""
    upper = name.upper()
    full = upper if upper.startswith("SIG") else f"SIG{upper}"
    try:
        return int(signal.Signals[full])
    except KeyError:
        valid = ", ".join(sorted(member.name for member in signal.Signals))
        raise ValueError(f"unknown signal {name!r}; valid: {valid}") from None


def keep_early_signals() -> None:
    """Record the graceful candidates that this process was started ignoring (its launcher
    leaves them to it) until `StopSignals` decides what they mean. Call it first thing: a
    signal in between is lost. A command without a graceful stop calls
    `release_early_signals`."""
    for signum in GRACEFUL_CANDIDATES:
        if signum not in _ignored_at_start and signal.getsignal(signum) is signal.SIG_IGN:
            _ignored_at_start.add(signum)
            signal.signal(signum, _record_early)


def release_early_signals() -> None:
    """Ignore again what `keep_early_signals` records (a command that no `StopSignals` will
    ask): the processes this one starts inherit the ignoring, as they did."""
    for signum in _ignored_at_start:
        signal.signal(signum, signal.SIG_IGN)
    _ignored_at_start.clear()
    _came_early.clear()


def _record_early(signum: int, frame: FrameType | None) -> None:
    _came_early.append(signum)


class StopSignals:
    """The stop signals' handlers while the `with` block runs (the previous ones after).

    `graceful`: signal numbers that ask for a stop after the step (not SIGINT: Ctrl-C stops now).
    """

    def __init__(
        self, *, graceful: Iterable[int] = (), deadline_s: float = STOP_DEADLINE_S
    ) -> None:
        self.graceful = frozenset(graceful)
        self.deadline_s = deadline_s
        self.signum: int | None = None
        self.immediate = False
        self._previous: dict[int, object] = {}
        self._left_block = threading.Event()  # no more nudges: the handlers are gone
        self._nudge_now = threading.Event()  # a fork held the exit back and has returned
        self._pid = os.getpid()  # a forked child runs these handlers until it resets them

    def __enter__(self) -> StopSignals:
        for signum in {*IMMEDIATE_SIGNALS, *self.graceful}:
            self._previous[signum] = signal.signal(signum, self._handle)
        children.leave_signals_to_parent(ignored=self.graceful)
        self._take_early_signals()
        return self

    def _take_early_signals(self) -> None:
        """What `keep_early_signals` recorded (its handlers replaced first, so that nothing
        falls between): a graceful signal of these is asked now; the rest were ignored, and
        are ignored again."""
        for signum in _ignored_at_start:
            if signum in self._previous:
                self._previous[signum] = signal.SIG_IGN  # restored on leaving, as it was
            else:
                signal.signal(signum, signal.SIG_IGN)
        came = [signum for signum in _came_early if signum in self.graceful]
        _ignored_at_start.clear()
        _came_early.clear()
        if came and self.signum is None:
            self.signum = came[0]
            name = signal.Signals(self.signum).name
            _say(f"{name} (it came while the command started): the run stops after its next step")

    def __exit__(self, *exc_info: object) -> None:
        self._left_block.set()
        for signum, handler in self._previous.items():
            signal.signal(signum, handler)
        self._previous.clear()

    @property
    def exit_code(self) -> int | None:
        """128 + the number of the signal that stops the command (the immediate one, if any
        came); None before a signal."""
        return None if self.signum is None else 128 + self.signum

    @property
    def graceful_requested(self) -> bool:
        """A stop after the step was asked (and no immediate one)."""
        return self.signum is not None and not self.immediate

    def raise_if_stopping(self) -> None:
        """Raise the immediate stop again if one came (its first raise may have been lost)."""
        if self.immediate:
            raise SystemExit(self.exit_code)

    def _handle(self, signum: int, frame: FrameType | None) -> None:
        if os.getpid() != self._pid:
            _in_forked_child(signum, graceful=signum in self.graceful)
            return
        if self.signum is None and signum in self.graceful:
            self.signum = signum
            _say(f"{signal.Signals(signum).name}: the run stops after this step's checkpoint")
            return
        if _unwinding():
            return  # its cleanup (stopping servers, removing staging) goes on, within the bound
        if not self.immediate:
            # The watchdog first: another signal may come while this handler runs.
            self.signum, self.immediate = signum, True
            self._start_watchdog()
            _say(f"{signal.Signals(signum).name}: stopping within {self.deadline_s:g} s")
        if children.in_fork():  # raised in a fork hook, the exit would be printed and dropped
            children.after_this_fork(self._nudge_now.set)
            return
        _exit_now_or_after_section(self.exit_code)

    def _start_watchdog(self) -> None:
        """Until the deadline, the signal again every NUDGE_S, and as soon as a fork that held
        it back has returned (an exit that Python swallowed or that waited is raised anew; one
        that is unwinding ignores it); then kill what is left and exit."""
        signum, main = self.signum, threading.main_thread().ident
        deadline = time.monotonic() + self.deadline_s

        def watch() -> None:
            while (left := deadline - time.monotonic()) > 0:
                self._nudge_now.wait(min(NUDGE_S, left))
                self._nudge_now.clear()
                while children.in_fork() and time.monotonic() < deadline:
                    time.sleep(0.005)  # the fork's last hooks
                if time.monotonic() < deadline and not self._left_block.is_set():
                    signal.pthread_kill(main, signum)
            _say(f"not stopped {self.deadline_s:g} s after the signal; killing what is left")
            children.kill_all()
            os._exit(128 + signum)

        threading.Thread(target=watch, name="stop-watchdog", daemon=True).start()


def _in_forked_child(signum: int, *, graceful: bool) -> None:
    """A child forked while these handlers were set, before it set its own: a graceful signal
    is the parent's to handle; an immediate one takes its default action (ends the child)."""
    if graceful:
        return
    signal.signal(signum, signal.SIG_DFL)
    os.kill(os.getpid(), signum)


def _unwinding() -> bool:
    """The main thread is unwinding from a stop: the signal handler runs inside the `except`,
    `finally` or `__exit__` code that the stop's exception passes through."""
    return isinstance(sys.exc_info()[1], STOPS)


@contextlib.contextmanager
def uninterrupted() -> Iterator[None]:
    """A section that an immediate stop does not cut: the exit comes at its end. Keep it short:
    the watchdog's deadline still runs."""
    global _open_sections, _deferred_exit
    if threading.current_thread() is not threading.main_thread():
        yield  # signals only interrupt the main thread
        return
    _open_sections += 1
    try:
        yield
    finally:
        _open_sections -= 1
    if _open_sections == 0 and _deferred_exit is not None:
        code, _deferred_exit = _deferred_exit, None
        raise SystemExit(code)


def _exit_now_or_after_section(code: int) -> None:
    global _deferred_exit
    if _open_sections:
        _deferred_exit = code
        return
    raise SystemExit(code)


def _say(message: str) -> None:
    print(f"megatron-rl: {message}", file=sys.stderr, flush=True)
