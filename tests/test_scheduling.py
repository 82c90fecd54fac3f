"""The test command's workers (tests/scheduling.py): modules whole, the server modules together,
and the scheduler the one xdist uses."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from collections import defaultdict
from pathlib import Path

import pytest

from tests.scheduling import SERVER_TESTS, SERVER_UNIT, work_unit

pytestmark = pytest.mark.timeout(300)
REPO = Path(__file__).resolve().parents[1]


def test_modules_are_units_and_the_server_modules_one_unit():
    assert work_unit("tests/algo/test_losses.py::test_x[a-b]") == "tests/algo/test_losses.py"
    assert work_unit("tests/algo/test_losses.py::TestA::test_x") == "tests/algo/test_losses.py"
    for nodeid in (
        "tests/sglang/test_auth.py::test_x",
        "tests/launch/test_slurm_multinode.py::test_y[2]",
        "tests/process/test_redaction.py::test_z",
        "tests/bench/test_rl_step_bench.py::test_w",
    ):
        assert work_unit(nodeid) == SERVER_UNIT
    assert work_unit("tests/process/test_stop.py::test_z") == "tests/process/test_stop.py"


def test_every_server_path_exists():
    # a renamed module would silently leave the server unit and race for its ports
    assert all((REPO / path).exists() for path in SERVER_TESTS)


def test_two_workers_keep_the_server_modules_together(tmp_path):
    """Two fast server modules and two others, on two workers as the test command runs them:
    the server modules on one worker, each other module whole on one."""
    modules = [
        "tests/sglang/test_api_key.py",
        "tests/launch/test_slurm_script.py",
        "tests/test_config.py",
        "tests/test_timeouts.py",
    ]
    command = [sys.executable, "-m", "pytest", "-n", "2", "-v", "-p", "no:cacheprovider"]
    command += ["-o", "addopts=", f"--basetemp={tmp_path / 'inner'}", *modules]
    # the outer run's options (PYTEST_ADDOPTS: its --basetemp, which a second pytest would
    # empty under the outer run's feet, its --junitxml) are not the inner run's
    env = {name: value for name, value in os.environ.items() if name != "PYTEST_ADDOPTS"}
    result = subprocess.run(command, cwd=REPO, env=env, capture_output=True, text=True, timeout=240)
    assert result.returncode == 0, result.stdout[-3000:]
    workers: dict[str, set[str]] = defaultdict(set)
    for line in result.stdout.splitlines():
        found = re.match(r"\[(gw\d)\] \[\s*\d+%\] \w+ (tests/[^:]+)::", line)
        if found:
            workers[work_unit(found.group(2))].add(found.group(1))
    assert set(workers) == {SERVER_UNIT, "tests/test_config.py", "tests/test_timeouts.py"}
    assert all(len(names) == 1 for names in workers.values()), dict(workers)
