"""Stop signals at the moments Python cannot raise an exception in: a fork's hooks (where an
exception is printed as "Exception ignored" and dropped). Each case is a real process
(tests/process/signal_worker.py) that signals itself."""

from __future__ import annotations

import re
import signal
import subprocess
import sys
import time

import pytest

from megatron_rl.process.stop import NUDGE_S
from tests.trainer.run_cli import REPO


def _run_worker(moment: str, signame: str) -> tuple[subprocess.CompletedProcess, float]:
    """The worker's run, and the seconds from its signal to its exit."""
    result = subprocess.run(
        [sys.executable, "-m", "tests.process.signal_worker", moment, signame],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=60,
    )
    ended = time.time()
    signalled = re.search(r"signalled at ([\d.]+)", result.stderr)
    assert signalled, result.stderr
    return result, ended - float(signalled[1])


@pytest.mark.parametrize("moment", ["before-fork", "after-fork"])
def test_a_stop_in_the_parents_fork_hook_waits_for_the_fork_and_is_quiet(moment):
    result, seconds = _run_worker(moment, "SIGTERM")
    assert result.returncode == 128 + signal.SIGTERM, result.stderr
    assert "Exception ignored" not in result.stderr and "Traceback" not in result.stderr, (
        result.stderr
    )
    assert "not stopped" not in result.stdout
    # raised when the fork has returned, not when the watchdog sends the signal again
    assert seconds < NUDGE_S - 0.5, seconds


def test_a_stop_in_the_childs_fork_hook_ends_the_child_as_its_default_does():
    result, _ = _run_worker("child-fork-hook", "SIGTERM")
    assert "Exception ignored" not in result.stderr, result.stderr
    assert f"child exit {-signal.SIGTERM}" in result.stdout, (result.stdout, result.stderr)


def test_a_graceful_signal_in_the_childs_fork_hook_is_left_to_the_parent():
    result, _ = _run_worker("child-fork-hook", "SIGUSR1")
    assert "Exception ignored" not in result.stderr, result.stderr
    assert "the run stops" not in result.stderr, result.stderr  # the child does not take it
    assert "child exit 0" in result.stdout, (result.stdout, result.stderr)


# Started ignoring SIGUSR1 (as launch/node.py starts its ranks), signalled before StopSignals.
EARLY = """
import os, signal, sys, time
from megatron_rl.process.stop import StopSignals, keep_early_signals
keep_early_signals()
os.kill(os.getpid(), signal.SIGUSR1)
time.sleep(0.2)
with StopSignals(graceful=[signal.Signals[name] for name in sys.argv[1:]]) as stop:
    print("asked", stop.graceful_requested, stop.signum, flush=True)
os.kill(os.getpid(), signal.SIGUSR1)  # ignored again, as the process was started
time.sleep(0.2)
print("alive", flush=True)
"""


@pytest.mark.parametrize(("graceful", "asked"), [(["SIGUSR1"], True), ([], False)])
def test_a_signal_ignored_at_start_and_sent_early_is_kept_for_stop_signals(graceful, asked):
    result = subprocess.run(
        [sys.executable, "-c", EARLY, *graceful],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=60,
        preexec_fn=lambda: signal.signal(signal.SIGUSR1, signal.SIG_IGN),
    )
    assert result.returncode == 0, result.stderr
    signum = int(signal.SIGUSR1) if asked else None
    assert result.stdout.split("\n")[:2] == [f"asked {asked} {signum}", "alive"], result
