"""`megatron-rl` (train, or a conversion) that signals itself at one moment of its first
checkpoint save.

    python -m tests.trainer.stop_worker MOMENT SIGNAL MARKER_DIR MEGATRON_RL_ARGS...

The signal is real and goes where a scheduler's or a terminal's would: to the run's whole process
group (`group`), or to the main process alone. MOMENTs:

    writer    in a forked checkpoint writer, before it writes (group)
    waiting   in a forked writer, to the main process only, which waits for the writer to
              finish; the writer then takes 2 s to write
    publish   in the main process, just before the checkpoint's staging is renamed (group)
    latest    in the main process, just before `latest` is written (group)
    step      in the main process, during the first step's rollout (group)
    hold@N    no signal: at the N-th save, a forked writer writes MARKER_DIR/writing (its
              pid), then waits 60 s before it writes (for a SIGKILL from outside)

The moment a signal is sent is printed to stderr as `stop_worker: signalled at UNIX_TIME`.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import IO

from megatron.core.dist_checkpointing.strategies.filesystem_async import FileSystemWriterAsync

from megatron_rl.cli import main
from megatron_rl.files import atomic
from megatron_rl.rollout.local import LocalEngine
from megatron_rl.trainer import checkpoints
from tests.processes import group_gone, live_group_members
from tests.trainer.run_cli import REPO, train_environment


def _signal(pid: int, signum: int, *, group: bool) -> None:
    print(f"stop_worker: signalled at {time.time():.3f}", file=sys.stderr, flush=True)
    (os.killpg if group else os.kill)(pid, signum)


def _once(action, marker_dir: Path):
    """`action` the first time any process of the run (the writers are forked) calls it."""

    def fire() -> None:
        try:
            os.close(os.open(marker_dir / "signalled", os.O_CREAT | os.O_EXCL | os.O_WRONLY))
        except FileExistsError:
            return
        action()

    return fire


def _before(owner: object, name: str, action, *, static: bool = False) -> None:
    original = getattr(owner, name)

    def wrapped(*args, **kwargs):
        action()
        return original(*args, **kwargs)

    setattr(owner, name, staticmethod(wrapped) if static else wrapped)


def install(moment: str, signum: int, marker_dir: Path) -> None:
    group = _once(lambda: _signal(os.getpgid(0), signum, group=True), marker_dir)
    if moment == "writer":
        _before(FileSystemWriterAsync, "write_preloaded_data", group, static=True)
    elif moment == "waiting":

        def signal_parent_then_write_slowly() -> None:
            _signal(os.getppid(), signum, group=False)
            time.sleep(2.0)

        _before(
            FileSystemWriterAsync,
            "write_preloaded_data",
            _once(signal_parent_then_write_slowly, marker_dir),
            static=True,
        )
    elif moment == "publish":
        _before(atomic, "publish", group)
    elif moment == "latest":
        original = checkpoints.write_text_atomic

        def write_latest(path, text):
            if path.name == checkpoints.LATEST:
                group()
            return original(path, text)

        checkpoints.write_text_atomic = write_latest
    elif moment == "step":
        _before(LocalEngine, "generate", group)
    elif moment.startswith("hold@"):
        saves, held_save = [], int(moment.removeprefix("hold@"))

        def announce_then_wait() -> None:
            if len(saves) == held_save:  # the writer is forked: it sees the parent's count
                (marker_dir / "writing").write_text(str(os.getpid()))
                time.sleep(60.0)

        def count() -> None:  # in this process, once per save, before the writers are forked
            saves.append(True)

        _before(FileSystemWriterAsync, "write_preloaded_data_multiproc", count, static=True)
        _before(FileSystemWriterAsync, "write_preloaded_data", announce_then_wait, static=True)
    else:
        raise SystemExit(f"unknown moment {moment!r}")


def start_worker(
    moment: str, signame: str, marker_dir: Path, args: list[str], stderr: IO[str] | int
) -> subprocess.Popen:
    """`megatron-rl ARGS` under this worker, the leader of a process group of its own."""
    worker = [sys.executable, "-m", "tests.trainer.stop_worker", moment, signame]
    return subprocess.Popen(
        [*worker, str(marker_dir), *args],
        cwd=REPO,
        env=train_environment(),
        stdout=subprocess.DEVNULL,
        stderr=stderr,
        start_new_session=True,
    )


def sigkill_during_save(save: int, marker_dir: Path, args: list[str]) -> tuple[int, int, list[int]]:
    """`megatron-rl ARGS`, its main process alone SIGKILLed (as `kill -9 PID`) while a writer
    of its `save`-th save holds; returns the writer's pid, the main one's, and the processes of
    its group still alive 10 s after the kill (none is expected)."""
    process = start_worker(f"hold@{save}", "SIGKILL", marker_dir, args, subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 180
        while not (marker_dir / "writing").is_file():
            assert process.poll() is None and time.monotonic() < deadline, "no save began"
            time.sleep(0.1)
        writer = int((marker_dir / "writing").read_text())
        os.kill(process.pid, signal.SIGKILL)
        process.wait()
        group_gone(process.pid, timeout_s=10)
        return writer, process.pid, live_group_members(process.pid)
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(process.pid, signal.SIGKILL)
        process.wait()


if __name__ == "__main__":
    moment, signame, marker_dir, *args = sys.argv[1:]
    install(moment, int(signal.Signals[signame]), Path(marker_dir))
    sys.exit(main(args))
