"""Every test has a time limit (pytest-timeout, configured in pyproject.toml): a test that hangs
fails when it runs out, a test marked with a larger limit gets it, and what a test started
through `tests.processes.run_bounded` (a process and the processes it started in sessions of
their own, as torchrun starts its ranks) ends with it."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.processes import is_running, run_bounded

pytest_plugins = ("pytester",)
REPO = Path(__file__).resolve().parents[1]

# A launcher that starts a "rank" in a session of its own, writes the rank's PID, and waits.
TREE = """
import subprocess, sys, time
rank = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"],
                        start_new_session=True)
with open(sys.argv[1], "w") as pids:
    pids.write(f"{rank.pid}\\n")
time.sleep(120)
"""

HANGING_TESTS = f"""
import subprocess, sys, time
import pytest
from tests.processes import run_bounded

def test_hangs():
    time.sleep(120)

@pytest.mark.timeout(60)
def test_needs_longer_than_the_default():
    time.sleep(4)

def test_hangs_in_a_process_tree(tmp_path):
    run_bounded([sys.executable, "-c", {TREE!r}, str(tmp_path / "pids")], timeout=120,
                stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
"""


def _ended(pid: int) -> bool:
    """Whether process `pid` ends within 10 s; if not, it is killed (and False returned)."""
    deadline = time.monotonic() + 10
    while is_running(pid) and time.monotonic() < deadline:
        time.sleep(0.1)
    if not is_running(pid):
        return True
    with contextlib.suppress(ProcessLookupError):
        os.kill(pid, signal.SIGKILL)
    return False


def test_the_limit_is_on_by_default(pytestconfig):
    assert pytestconfig.pluginmanager.hasplugin("timeout"), "pytest-timeout is not installed"
    limit = pytestconfig.getini("timeout")
    assert limit and float(limit) > 0, "pyproject.toml's [tool.pytest.ini_options] sets no timeout"
    assert pytestconfig.getini("timeout_method") == "signal"


def test_a_test_that_runs_out_of_time_fails_and_its_processes_end(pytester, monkeypatch):
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")]))
    pytester.makepyfile(test_hanging=HANGING_TESTS)
    # The project's method, with a limit short enough to wait for.
    started = time.monotonic()
    result = pytester.runpytest_subprocess(
        "-p", "timeout", "-o", "timeout=3", "-o", "timeout_method=signal", "--basetemp=tmp"
    )
    assert time.monotonic() - started < 60  # not the 120 s the tests would sleep
    result.assert_outcomes(passed=1, failed=2)
    result.stdout.fnmatch_lines(["*Timeout (>3.0s) from pytest-timeout*"])
    (pids,) = (pytester.path / "tmp").rglob("pids")
    assert _ended(int(pids.read_text())), "a process of the timed-out test outlived it"


def test_a_command_that_runs_out_of_time_is_killed_with_what_it_started(tmp_path):
    pids = tmp_path / "pids"
    with pytest.raises(subprocess.TimeoutExpired):
        run_bounded(
            [sys.executable, "-c", TREE, str(pids)],
            timeout=3,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
    assert _ended(int(pids.read_text()))
