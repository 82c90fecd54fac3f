"""Read-ahead hints: ranges that overlap or touch are asked for as one."""

from __future__ import annotations

import os

from megatron_rl.files import readahead


def test_touching_ranges_are_asked_for_once(tmp_path, monkeypatch):
    first, second = tmp_path / "a", tmp_path / "b"
    first.write_bytes(b"x" * 100)
    second.write_bytes(b"y" * 100)
    asked = []

    # records the hints instead of giving them: what the kernel reads ahead cannot be observed
    def advise(fd, offset, length, advice):
        asked.append((os.readlink(f"/proc/self/fd/{fd}"), offset, length, advice))

    monkeypatch.setattr(readahead.os, "posix_fadvise", advise)
    readahead.read_ahead({first: [(10, 5), (0, 10), (30, 4), (12, 8), (40, 1)], second: [(50, 10)]})
    willneed = os.POSIX_FADV_WILLNEED
    assert asked == [
        (str(first), 0, 20, willneed),
        (str(first), 30, 4, willneed),
        (str(first), 40, 1, willneed),
        (str(second), 50, 10, willneed),
    ]
