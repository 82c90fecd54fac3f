"""`megatron-rl ARGS` (a conversion) held inside its checkpoint writer, for a SIGKILL from
outside: when the writer begins, it writes MARKER_DIR/writing (the pid of the process that
writes) and waits 60 s before it writes.

    python -m tests.checkpoint.hold_worker MARKER_DIR MEGATRON_RL_ARGS...
"""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path

from megatron_rl.cli import main
from megatron_rl.files import distcp


def hold_in_writer(marker_dir: Path) -> None:
    write = distcp._ItemWriter.write

    def announce_then_wait(self: distcp._ItemWriter) -> None:
        (marker_dir / "writing").write_text(str(os.getpid()))
        time.sleep(60.0)
        write(self)

    distcp._ItemWriter.write = announce_then_wait


if __name__ == "__main__":
    marker_dir, *args = sys.argv[1:]
    hold_in_writer(Path(marker_dir))
    sys.exit(main(args))
