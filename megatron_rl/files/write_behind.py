"""Writing files behind the thread that makes their bytes.

A conversion makes a tensor (reads it, converts it) and writes it: one after the other on one
core, although the writing (torch.save's checksum, the kernel's copy into the page cache, the
wait for the disk once the page cache is full of unwritten data) runs without the GIL. Here the
writes go to threads of their own, one per lane; each lane runs its writes in the order they were
put, so that a file's bytes are those a plain loop writes.
"""

from __future__ import annotations

from collections.abc import Callable
from queue import Queue
from threading import Condition, Thread

Write = Callable[[], None]

# Bytes put and not yet written: how far the making may run ahead of the writing (a quarter of a
# second of a 1 GB/s disk), and the most memory the queued tensors hold.
AHEAD_BYTES = 256 * 2**20


class WriteBehind:
    """Lanes of writes, each run in order by a thread of its own (a context manager).

    `put(lane, write, nbytes)` queues `write` (a callable that holds `nbytes` of memory until it
    has run) and waits while more than `ahead_bytes` are queued. The first write that raises
    stops every lane: its error is raised by the next `put` or on leaving the block, and what is
    still queued is dropped unwritten. Leaving the block by an exception stops the lanes too."""

    def __init__(self, lanes: int, ahead_bytes: int = AHEAD_BYTES) -> None:
        self.ahead_bytes = ahead_bytes
        self.queues: list[Queue[tuple[Write, int] | None]] = [Queue() for _ in range(lanes)]
        self.queued_bytes = 0
        self.done = Condition()
        self.error: BaseException | None = None
        self.threads = [
            Thread(target=self._run, args=(queue,), name=f"write lane {lane}")
            for lane, queue in enumerate(self.queues)
        ]

    def __enter__(self) -> WriteBehind:
        for thread in self.threads:
            thread.start()
        return self

    def put(self, lane: int, write: Write, nbytes: int = 0) -> None:
        with self.done:
            self.done.wait_for(
                lambda: (
                    self.error is not None
                    or self.queued_bytes == 0
                    or self.queued_bytes + nbytes <= self.ahead_bytes
                )
            )
            if self.error is not None:
                raise self.error
            self.queued_bytes += nbytes
        self.queues[lane].put((write, nbytes))

    def __exit__(self, kind: type[BaseException] | None, error: BaseException | None, _: object):
        if error is not None:
            self._fail(error)
        for queue in self.queues:
            queue.put(None)
        for thread in self.threads:
            thread.join()
        if error is None and self.error is not None:
            raise self.error

    def _run(self, queue: Queue[tuple[Write, int] | None]) -> None:
        while (entry := queue.get()) is not None:
            write, nbytes = entry
            try:
                if self.error is None:
                    write()
            except BaseException as error:
                self._fail(error)
            finally:
                del entry, write  # its memory is free once written, not at the next write
                with self.done:
                    self.queued_bytes -= nbytes
                    self.done.notify_all()

    def _fail(self, error: BaseException) -> None:
        with self.done:
            self.error = self.error or error
            self.done.notify_all()
