"""Signals the long-running subcommands handle."""

from __future__ import annotations

import signal


def _exit(signum: int, frame: object) -> None:
    raise SystemExit(128 + signum)


def exit_on_sigterm() -> None:
    """SIGTERM (a scheduler's preemption, torchrun stopping its workers) unwinds the command
    like an error, so that what it started (rollout servers, benchmark runs) is stopped too."""
    signal.signal(signal.SIGTERM, _exit)
