"""Verifiers for the scoring tests that misbehave as their response asks. They are module-level
functions, so that a scoring worker can import them, in a module that imports little beside the
standard library, so that a fresh worker starts scoring at once."""

from __future__ import annotations

import math
import os
import signal
import time

ALLOCATED_MB = 512
"""What the "allocate" response allocates: more than the tests' scoring workers may."""
HANG_S = 120.0


def misbehave(prompt: str, response: str, reference: str) -> float:
    """1.0 for "ok", 0.0 for anything it does not know; otherwise as the response says."""
    if response == "raise":
        raise RuntimeError("verifier bug")
    if response == "nan":
        return math.nan
    if response == "inf":
        return math.inf
    if response == "text":
        return "1.0"  # type: ignore[return-value]
    if response == "sleep":
        time.sleep(HANG_S)
    if response == "hang in C":
        # CPython multiplies big integers in C without releasing the GIL: minutes, at least.
        return float(9**9**9 > 0)
    if response == "allocate":
        return float(len(bytearray(ALLOCATED_MB * 2**20)) > 0)
    if response == "die":
        os.kill(os.getpid(), signal.SIGKILL)
    if response == "pid":
        return float(os.getpid())
    return 1.0 if response == "ok" else 0.0


def math_verify_unscreened(prompt: str, response: str, reference: str) -> float:
    """The `math` verifier without its screen for huge numbers: math-verify on the whole
    response, as sympy sees it."""
    from math_verify import parse, verify

    gold = parse(f"\\boxed{{{reference}}}", parsing_timeout=None)
    return float(verify(gold, parse(response, parsing_timeout=None), timeout_seconds=None))


def misbehave_on_reference(prompt: str, response: str, reference: str) -> float:
    """`misbehave` as the reference asks, whatever the response (a model's own text)."""
    return misbehave(prompt, reference, reference)
