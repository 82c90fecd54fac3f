"""`megatron-rl train` that signals itself at one moment of its first checkpoint save.

    python -m tests.trainer.stop_worker MOMENT SIGNAL TRAIN_ARGS...

The signal is real and goes where a scheduler's or a terminal's would: to the run's whole process
group (`group`), or to the main process alone. MOMENTs:

    writer    in a forked checkpoint writer, before it writes (group)
    waiting   in a forked writer, to the main process only, which waits for the writer to
              finish; the writer then takes 2 s to write
    publish   in the main process, just before the checkpoint's staging is renamed (group)
    latest    in the main process, just before `latest` is written (group)
    step      in the main process, during the first step's rollout (group)
    hold@N    no signal: at the N-th save, a forked writer writes RUN_DIR/writing (its pid),
              then waits 60 s before it writes (for a SIGKILL from outside)

The moment a signal is sent is printed to stderr as `stop_worker: signalled at UNIX_TIME`.
"""

from __future__ import annotations

import os
import signal
import sys
import time
from pathlib import Path

from megatron.core.dist_checkpointing.strategies.filesystem_async import FileSystemWriterAsync

from megatron_rl.cli import main
from megatron_rl.files import atomic
from megatron_rl.rollout.local import LocalEngine
from megatron_rl.trainer import checkpoints


def _signal(pid: int, signum: int, *, group: bool) -> None:
    print(f"stop_worker: signalled at {time.time():.3f}", file=sys.stderr, flush=True)
    (os.killpg if group else os.kill)(pid, signum)


def _once(action):
    done = []

    def fire() -> None:
        if not done:
            done.append(True)
            action()

    return fire


def _before(owner: object, name: str, action, *, static: bool = False) -> None:
    original = getattr(owner, name)

    def wrapped(*args, **kwargs):
        action()
        return original(*args, **kwargs)

    setattr(owner, name, staticmethod(wrapped) if static else wrapped)


def install(moment: str, signum: int, run_dir: Path) -> None:
    group = _once(lambda: _signal(os.getpgid(0), signum, group=True))
    if moment == "writer":
        _before(FileSystemWriterAsync, "write_preloaded_data", group, static=True)
    elif moment == "waiting":

        def signal_parent_then_write_slowly() -> None:
            _signal(os.getppid(), signum, group=False)
            time.sleep(2.0)

        _before(
            FileSystemWriterAsync,
            "write_preloaded_data",
            _once(signal_parent_then_write_slowly),
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
                (run_dir / "writing").write_text(str(os.getpid()))
                time.sleep(60.0)

        _before(checkpoints, "save_weights", lambda: saves.append(True))
        _before(FileSystemWriterAsync, "write_preloaded_data", announce_then_wait, static=True)
    else:
        raise SystemExit(f"unknown moment {moment!r}")


if __name__ == "__main__":
    moment, signame, *train_args = sys.argv[1:]
    (run_dir,) = [Path(arg.split("=", 1)[1]) for arg in train_args if arg.startswith("run.dir=")]
    install(moment, int(signal.Signals[signame]), run_dir)
    sys.exit(main(train_args))
