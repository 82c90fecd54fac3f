"""The run's rollout engine, which lives on global rank 0 and answers for every rank.

One engine samples for the whole job (it sits beside the trainer's rank 0, or in front of SGLang
servers elsewhere); the other ranks hold none. Every method of `Rank0Engine` is a collective:
all ranks call it, rank 0 does the work, and every rank returns rank 0's answer (or raises its
error), so that the loop reads the same on every rank.

Work can also be submitted ahead (`submit`, then `collect` its result): rank 0 runs it on one
background thread, in submission order, while the trainer goes on (asynchronous rollouts). The
engine never does two things at once: `run` and `update_weights` first wait until the
background work submitted before them is done.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable, Iterable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, TypeVar

from megatron_rl.models.hf_weights import HFWeightStream
from megatron_rl.parallel.collectives import from_rank0
from megatron_rl.rollout.engine import RolloutEngine, WeightBucket

T = TypeVar("T")


class Rank0Engine:
    """`engine` on global rank 0, None on every other rank."""

    def __init__(self, engine: RolloutEngine | None) -> None:
        self._engine = engine
        self._background: ThreadPoolExecutor | None = None
        self._submitted: deque[Future[Any]] = deque()  # rank 0's, oldest first

    @property
    def holds_engine(self) -> bool:
        """True on rank 0, which holds the engine."""
        return self._engine is not None

    def run(self, work: Callable[[RolloutEngine], T]) -> T:
        """`work(engine)` on rank 0, after the background work; its result on every rank."""
        return from_rank0(lambda: work(self._idle()))

    def submit(self, work: Callable[[RolloutEngine], Any]) -> None:
        """Start `work(engine)` on rank 0's background thread, after the work submitted before
        it; `collect` returns its result."""
        if not self.holds_engine:
            return
        if self._background is None:
            self._background = ThreadPoolExecutor(max_workers=1, thread_name_prefix="rollout")
        self._submitted.append(self._background.submit(work, self._engine))

    def preload(self, result: Any) -> None:
        """Queue `result` (rank 0's) as if submitted work had returned it."""
        if not self.holds_engine:
            return
        done: Future[Any] = Future()
        done.set_result(result)
        self._submitted.append(done)

    def collect(self) -> Any:
        """The result of the oldest submitted work not collected yet, waiting for it, on every
        rank (its error, if it raised)."""
        return from_rank0(lambda: self._submitted.popleft().result())

    def submitted(self) -> list[Any]:
        """The results of all submitted work not collected yet, oldest first, waiting for them
        (rank 0's; an empty list elsewhere). They stay queued."""
        return [future.result() for future in self._submitted]

    def close(self) -> None:
        """Stop the background thread: work not started is dropped, running work finishes."""
        if self._background is not None:
            self._background.shutdown(wait=True, cancel_futures=True)
            self._background = None
        self._submitted.clear()

    def _idle(self) -> RolloutEngine | None:
        """The engine, once the background work submitted so far is done (rank 0)."""
        for future in self._submitted:
            future.exception()  # waits; its error reaches whoever collects it
        return self._engine

    def update_weights(self, stream: HFWeightStream, version: int) -> dict[str, float]:
        """Load the policy's weights into the engine as weight `version`. Every rank iterates
        `stream` (its gathers are collectives); returns the bytes sent and their rate."""
        metrics: dict[str, float] = {}
        if self._engine is None:
            for _ in stream:
                pass
        else:
            counted = _Counted(stream)
            engine = self._idle()
            start = time.perf_counter()
            engine.update_weights(counted, version)
            seconds = time.perf_counter() - start
            metrics = {
                "sync/bytes": float(counted.bytes),
                "throughput/weight_sync_bytes_per_s": counted.bytes / seconds if seconds else 0.0,
            }
        return from_rank0(lambda: metrics)


class _Counted:
    """The buckets of a weight stream, passed through with their bytes counted (and the
    stream's manifest, which engines may check before anything is sent)."""

    def __init__(self, stream: Iterable[WeightBucket]) -> None:
        self.stream, self.bytes = stream, 0
        self.manifest = getattr(stream, "manifest", None)

    def __iter__(self) -> Iterator[WeightBucket]:
        for bucket in self.stream:
            self.bytes += sum(tensor.numel() * tensor.element_size() for _, tensor in bucket)
            yield bucket
