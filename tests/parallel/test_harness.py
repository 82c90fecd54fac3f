"""The multi-rank test harness stops every process it started, and every process they started,
when a rank fails."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.parallel import harness_worker
from tests.parallel.harness import run_on_ranks


def _running(pid: int) -> bool:
    status = Path(f"/proc/{pid}/status")
    if not status.exists():
        return False
    state = next(line for line in status.read_text().splitlines() if line.startswith("State:"))
    return "zombie" not in state


def test_a_failing_rank_leaves_no_process_behind(tmp_path):
    pid_file = tmp_path / "child.pid"
    with pytest.raises(AssertionError, match="rank 0 fails while its child runs"):
        run_on_ranks(harness_worker.fail_after_starting_a_child, str(pid_file))
    assert not _running(int(pid_file.read_text()))
