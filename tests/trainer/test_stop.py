"""Stop signals and SIGKILL at the moments of a real checkpoint save, on real `megatron-rl train`
runs (tests/trainer/stop_worker.py sends the signal): each run ends within the bound with 128 +
the signal's number, leaves no process behind (its process group is checked by id) and either a
complete checkpoint or none; after a graceful signal or a SIGKILL the resumed run repeats the
uninterrupted one to the last bit."""

from __future__ import annotations

import contextlib
import json
import os
import re
import signal
import subprocess
import tempfile
import time
from pathlib import Path
from typing import IO

import pytest

from megatron_rl.process.stop import STOP_DEADLINE_S
from tests.processes import descendants, group_gone, still_running
from tests.small_disk import on_small_disk
from tests.trainer.run_cli import (
    REPO,
    RESUMED_RUN,
    check_repeats,
    read_metrics,
    train_cli,
    train_command,
    train_environment,
)
from tests.trainer.stop_worker import sigkill_during_save, start_worker

SAVE_EVERY_STEP = ["checkpoint.save_every=1"]
# What a run takes at most beyond the bound: exiting the interpreter after the unwinding.
EXIT_SLACK_S = 10.0


def _kill_group(pgid: int) -> None:
    with contextlib.suppress(ProcessLookupError):
        os.killpg(pgid, signal.SIGKILL)


def _start(
    run_dir: Path, moment: str, signame: str, overrides: list[str], stderr: IO[str]
) -> subprocess.Popen:
    """The stop worker's run, the leader of a process group of its own."""
    train = train_command(run_dir, overrides, 1, False)[3:]  # after `python -m MODULE`
    return start_worker(moment, signame, run_dir, train, stderr)


def _run_signalled(
    run_dir: Path, moment: str, signame: str, overrides: list[str] = SAVE_EVERY_STEP
) -> tuple[int, float, str]:
    """The run's exit code, the seconds from the signal to its exit, and its stderr; a hang
    past the bound fails (and its group is killed)."""
    with tempfile.TemporaryFile("w+") as stderr:
        process = _start(run_dir, moment, signame, overrides, stderr)
        try:
            code = process.wait(timeout=180)
        except subprocess.TimeoutExpired:
            code = None
        ended = time.time()
        outlived = not group_gone(process.pid, timeout_s=5)  # before the clean-up below
        _kill_group(process.pid)
        process.wait()
        stderr.seek(0)
        log = stderr.read()
    assert code is not None, f"the run hung after {signame} at {moment}:\n{log[-3000:]}"
    signalled = re.search(r"stop_worker: signalled at ([\d.]+)", log)
    assert signalled, log[-3000:]
    assert not outlived, "a process of the run outlived it"
    return code, ended - float(signalled[1]), log


NONE, SAVED, PUBLISHED = [], ["latest", "step_000001"], ["step_000001"]


@pytest.mark.parametrize(
    ("moment", "signame", "outcomes"),
    [
        ("writer", "SIGTERM", [NONE]),
        # the main process may only notice once the writer is done (a signal that arrives in
        # a fork hook waits for the fork's end)
        ("waiting", "SIGTERM", [NONE, SAVED]),
        ("publish", "SIGTERM", [NONE]),
        ("latest", "SIGTERM", [PUBLISHED]),
        ("writer", "SIGINT", [NONE]),
        # a graceful signal: the writers ignore it, the save completes, the run stops after it
        ("writer", "SIGUSR1", [SAVED]),
    ],
)
def test_a_stop_signal_during_a_save_ends_the_run_within_the_bound(
    tmp_path, moment, signame, outcomes
):
    code, seconds, log = _run_signalled(tmp_path, moment, signame)
    assert code == 128 + signal.Signals[signame], log[-3000:]
    assert seconds < STOP_DEADLINE_S + EXIT_SLACK_S, (seconds, log[-3000:])
    assert "Exception ignored" not in log, log[-3000:]  # e.g. a stop raised in a fork hook
    # The save in flight is whole or gone: no staging stays, nor a `latest` naming nothing.
    checkpoints = tmp_path / "checkpoints"
    assert sorted(path.name for path in checkpoints.iterdir()) in outcomes
    for path in checkpoints.glob("step_*"):
        assert (path / "trainer.json").is_file()


@pytest.fixture(scope="module")
def whole_run(tmp_path_factory) -> dict[int, dict[str, float]]:
    """The metrics of the uninterrupted run that stopped and killed runs must repeat."""
    run_dir = tmp_path_factory.mktemp("whole")
    result = train_cli(run_dir, RESUMED_RUN)
    assert result.returncode == 0, result.stderr[-3000:]
    return read_metrics(run_dir)


def test_a_graceful_signal_saves_after_the_step_and_the_run_resumes_exactly(tmp_path, whole_run):
    code, _, log = _run_signalled(tmp_path, "step", "SIGUSR1", RESUMED_RUN)
    assert code == 128 + signal.SIGUSR1, log[-3000:]
    assert "stopped after step 1" in log and "--resume" in log
    assert (tmp_path / "checkpoints" / "latest").read_text().strip() == "step_000001"
    resumed = train_cli(tmp_path, RESUMED_RUN, resume=True)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    # one process: no data-parallel copies, so the plain optimizer (nothing to shard)
    final = json.loads((tmp_path / "checkpoints" / "step_000003" / "trainer.json").read_text())
    assert final["distributed_optimizer"] is False
    check_repeats(whole_run, tmp_path, (2, 3))


def test_sigkill_during_a_save_leaves_no_process_and_the_run_resumes_exactly(tmp_path, whole_run):
    train = train_command(tmp_path, RESUMED_RUN, 1, False)[3:]  # after `python -m MODULE`
    writer, main, left = sigkill_during_save(2, tmp_path, train)
    assert writer != main
    assert not left, f"processes of the run outlived its SIGKILL: {left}"
    checkpoints = tmp_path / "checkpoints"
    assert {path.name for path in checkpoints.iterdir()} >= {"step_000001", ".step_000002.partial"}
    # a fresh run takes it for an earlier run; --resume clears the staging and goes on from
    # step 1 (step 2, logged before its save, is logged again, once)
    fresh = train_cli(tmp_path, RESUMED_RUN)
    assert fresh.returncode == 2 and "holds an earlier run (checkpoints up to step_000001)" in (
        fresh.stderr
    )
    resumed = train_cli(tmp_path, RESUMED_RUN, resume=True)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert ".step_000002.partial, left by an interrupted save" in resumed.stderr
    check_repeats(whole_run, tmp_path, (2, 3))


def test_a_full_disk_at_a_save_ends_the_run_in_one_line(tmp_path):
    """The checkpoints on 8 MiB of their own, where the first one does not fit."""
    run_dir = tmp_path / "run"
    (run_dir / "checkpoints").mkdir(parents=True)
    command = train_command(run_dir, SAVE_EVERY_STEP, 1, False)
    result = subprocess.run(
        on_small_disk(str(run_dir / "checkpoints"), "8m", command),
        cwd=REPO,
        env=train_environment(),
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode == 1, result.stderr[-3000:]
    assert "no space left for the checkpoint (this rank writes about" in result.stderr
    assert "Traceback" not in result.stderr, result.stderr[-3000:]
    assert result.stdout.splitlines()[-1] == "left: "  # the staging directory was removed


def test_kill_9_of_torchrun_during_a_save_ends_both_ranks_and_their_writers(tmp_path):
    """torchrun, 2 ranks at EP 2, SIGKILLed while each rank's checkpoint writer holds its first
    save (tests/trainer/stop_worker.py, hold@1): nothing it started survives it, and the save
    it cut is not published."""
    command = train_command(tmp_path, [*RESUMED_RUN, "parallel.ep=2"], 2, False)
    worker = ["tests.trainer.stop_worker", "hold@1", "SIGKILL", str(tmp_path)]
    at = command.index("megatron_rl.cli")
    command[at : at + 1] = worker
    with tempfile.TemporaryFile("w+") as stderr:
        torchrun = subprocess.Popen(
            command, cwd=REPO, env=train_environment(), stdout=subprocess.DEVNULL, stderr=stderr
        )
        started: list[int] = []
        try:
            deadline = time.monotonic() + 240
            while not (tmp_path / "writing").is_file():
                assert torchrun.poll() is None and time.monotonic() < deadline, "no save began"
                time.sleep(0.1)
            time.sleep(1.0)  # the other rank's writer too
            started = descendants(torchrun.pid)
            os.kill(torchrun.pid, signal.SIGKILL)
            torchrun.wait()
            left = still_running(started, timeout_s=10.0)
        finally:
            for pid in descendants(torchrun.pid) + started:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)
            torchrun.kill()
            torchrun.wait()
        stderr.seek(0)
        log = stderr.read()
    assert len(started) >= 4, (started, log[-3000:])  # 2 ranks, a writer each
    assert not left, f"processes outlived torchrun's SIGKILL: {left}\n{log[-3000:]}"
    assert not (tmp_path / "checkpoints" / "latest").exists()
    assert not (tmp_path / "checkpoints" / "step_000001").exists()
