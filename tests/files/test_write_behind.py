"""Writes behind the making (`WriteBehind`): each lane runs its writes in the order put; the
making waits while more than the budget is queued; the first failed write stops every lane and is
raised, and an error of the making stops the lanes before what is queued is written."""

from __future__ import annotations

import threading
import time

import pytest

from megatron_rl.files.write_behind import WriteBehind


def test_each_lane_writes_in_the_order_put():
    written: dict[int, list[int]] = {0: [], 1: []}
    with WriteBehind(lanes=2, ahead_bytes=8) as behind:
        for step in range(200):
            lane = step % 3 % 2  # uneven lanes
            behind.put(lane, lambda lane=lane, step=step: written[lane].append(step), nbytes=1)
    assert written[0] == [step for step in range(200) if step % 3 % 2 == 0]
    assert written[1] == [step for step in range(200) if step % 3 % 2 == 1]


def test_put_waits_while_the_budget_is_queued():
    release = threading.Event()
    returned = threading.Event()
    with WriteBehind(lanes=1, ahead_bytes=10) as behind:
        behind.put(0, release.wait, nbytes=10)  # within the budget: does not wait

        def put_more() -> None:
            behind.put(0, lambda: None, nbytes=1)
            returned.set()

        putter = threading.Thread(target=put_more)
        putter.start()
        time.sleep(0.3)
        assert not returned.is_set()  # 11 bytes would be queued
        release.set()
        putter.join(timeout=10)
        assert returned.is_set()


def test_a_write_larger_than_the_budget_waits_only_for_an_empty_queue():
    with WriteBehind(lanes=1, ahead_bytes=10) as behind:
        behind.put(0, lambda: None, nbytes=100)
        behind.put(0, lambda: None, nbytes=100)


def _fail() -> None:
    raise OSError("No space left on device")


def test_a_failed_write_is_raised_by_the_next_put_and_stops_every_lane():
    written: list[str] = []
    go = threading.Event()
    with pytest.raises(OSError, match="No space left"), WriteBehind(2, ahead_bytes=10) as behind:
        try:
            behind.put(1, go.wait, nbytes=1)
            behind.put(1, lambda: written.append("queued before the failure"))
            behind.put(0, _fail)
            # over the budget until lane 1 moves on: waits, then raises lane 0's error
            behind.put(1, lambda: written.append("put after the failure"), nbytes=10)
        finally:
            go.set()
    assert written == []


def test_an_error_of_the_making_drops_what_is_queued():
    written: list[str] = []
    go = threading.Event()
    with pytest.raises(ValueError, match="bad value"), WriteBehind(lanes=1) as behind:
        behind.put(0, go.wait)
        behind.put(0, lambda: written.append("queued"))
        threading.Timer(1.0, go.set).start()  # after the error below has stopped the lane
        raise ValueError("bad value")
    assert written == []
