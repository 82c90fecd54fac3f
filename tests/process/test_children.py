"""A rank ends when the launcher that started it dies, however it dies; a process that no
launcher started does not. Each case is real: a middle process (the launcher) starts the
command, is SIGKILLed once the command runs its own code, and the command is looked for."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time

import pytest

from tests.processes import caught_signals, still_running
from tests.trainer.run_cli import RECIPE, REPO, SHORT_RUN, train_environment

# The launcher: starts its arguments as a command that ignores SIGUSR1 (as launch/node.py
# starts its ranks: the command records it instead once it runs, which shows that it does),
# prints its pid, waits.
LAUNCHER = """
import signal, subprocess, sys, time
ignore = lambda: signal.signal(signal.SIGUSR1, signal.SIG_IGN)
print(subprocess.Popen(sys.argv[1:], preexec_fn=ignore).pid, flush=True)
time.sleep(600)
"""
# `end_with_parent` where the kernel has no parent-death signal (not Linux): the watch on the
# parent's pid alone.
WATCH_ONLY = """
import signal, sys, time
signal.signal(signal.SIGUSR1, lambda *_: None)  # runs its own code from here
sys.platform = "darwin"
from megatron_rl.process.children import end_with_parent
end_with_parent()
time.sleep(600)
"""


def _orphaned_command_survives(command: list[str], env: dict[str, str]) -> bool:
    """Whether `command` still runs 3 s after its launcher's SIGKILL (it is killed then)."""
    launcher = subprocess.Popen(
        [sys.executable, "-c", LAUNCHER, *command],
        cwd=REPO,
        env=env,
        stdout=subprocess.PIPE,
        text=True,
    )
    pid = int(launcher.stdout.readline())
    try:
        deadline = time.monotonic() + 60
        while signal.SIGUSR1 not in caught_signals(pid):
            assert time.monotonic() < deadline, "the command did not start"
            time.sleep(0.05)
        time.sleep(0.3)
        launcher.kill()
        launcher.wait()
        return bool(still_running([pid], timeout_s=3.0))
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
        launcher.kill()
        launcher.wait()
        launcher.stdout.close()


def _train(run_dir) -> list[str]:
    return [
        sys.executable,
        "-m",
        "megatron_rl.cli",
        "train",
        str(RECIPE),
        *SHORT_RUN,
        f"run.dir={run_dir}",
    ]


@pytest.mark.parametrize(("torchrun", "survives"), [(True, False), (False, True)])
def test_a_torchrun_rank_ends_with_its_launcher_and_only_a_torchrun_rank(
    tmp_path, torchrun, survives
):
    env = train_environment({"TORCHELASTIC_RUN_ID": "none"} if torchrun else {})
    assert _orphaned_command_survives(_train(tmp_path), env) is survives


def test_without_the_kernels_parent_death_signal_the_watch_on_the_parent_ends_it():
    env = train_environment()
    assert not _orphaned_command_survives([sys.executable, "-c", WATCH_ONLY], env)
