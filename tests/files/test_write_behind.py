"""Writes behind the making (`WriteBehind`): each lane runs its writes in the order put; the
making waits while more than the budget is queued; the first failed write stops every lane and is
raised, and an error of the making stops the lanes before what is queued is written."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable

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


def _put_on_a_thread(
    behind: WriteBehind, write: Callable[[], None], nbytes: int
) -> threading.Event:
    """Starts `behind.put(0, write, nbytes)` on a thread; the event is set when it returns."""
    returned = threading.Event()

    def put() -> None:
        behind.put(0, write, nbytes=nbytes)
        returned.set()

    threading.Thread(target=put, daemon=True).start()
    return returned


def test_put_waits_while_the_budget_is_queued():
    release = threading.Event()
    with WriteBehind(lanes=1, ahead_bytes=10) as behind:
        try:
            behind.put(0, release.wait, nbytes=10)  # within the budget: does not wait
            returned = _put_on_a_thread(behind, lambda: None, 1)
            time.sleep(0.3)
            assert not returned.is_set()  # 11 bytes would be queued
        finally:
            release.set()  # a failed check must not leave the lane waiting
        assert returned.wait(timeout=10)


def test_a_write_larger_than_the_budget_waits_only_for_an_empty_queue():
    release = threading.Event()
    written: list[str] = []
    with WriteBehind(lanes=1, ahead_bytes=10) as behind:
        try:
            # The queue is empty: a write over the budget is put at once (it would wait for
            # ever if it needed the budget).
            first = _put_on_a_thread(behind, lambda: (release.wait(), written.append("first")), 100)
            assert first.wait(timeout=10)
            second = _put_on_a_thread(behind, lambda: written.append("second"), 100)
            time.sleep(0.3)
            assert not second.is_set()  # the first write is still queued: the second waits
        finally:
            release.set()  # a failed check must not leave the lane waiting
        assert second.wait(timeout=10)  # once the queue is empty it goes in
    assert written == ["first", "second"]


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
