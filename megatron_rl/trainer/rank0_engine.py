"""The run's rollout engine, which lives on global rank 0 and answers for every rank.

One engine samples for the whole job (it sits beside the trainer's rank 0, or in front of SGLang
servers elsewhere); the other ranks hold none. Every method of `Rank0Engine` is a collective:
all ranks call it, rank 0 does the work, and every rank returns rank 0's answer (or raises its
error), so that the loop reads the same on every rank.

Work can also be submitted ahead (`submit`, then `collect` its result): rank 0 runs it on one
background thread, in submission order, while the trainer goes on (asynchronous rollouts). The
engine never does two things at once: `run` and `update_weights` first wait until the
background work submitted before them is done; with partial rollouts `update_weights` pauses
the generation in flight instead, which then goes on with the new weights.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable, Iterable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from contextlib import nullcontext
from typing import Any, TypeVar

from torch import Tensor

from megatron_rl.models.hf_weights import HFWeightStream
from megatron_rl.parallel.collectives import from_rank0
from megatron_rl.rollout.engine import PausableEngine, RolloutEngine, WeightBucket

T = TypeVar("T")


class Rank0Engine:
    """`engine` on global rank 0, None on every other rank.

    Args:
        engine: rank 0's engine; None elsewhere.
        partial_rollouts: weight updates pause the generation in flight rather than wait for
            it (the engine must be a PausableEngine).
    """

    def __init__(self, engine: RolloutEngine | None, *, partial_rollouts: bool = False) -> None:
        if partial_rollouts and engine is not None and not isinstance(engine, PausableEngine):
            raise ValueError(
                f"rollout.partial_rollouts: the {type(engine).__name__} engine cannot pause a "
                "generation for a weight update; set rollout.partial_rollouts=false"
            )
        self._engine = engine
        self.partial_rollouts = partial_rollouts
        self._background: ThreadPoolExecutor | None = None
        self._submitted: deque[Future[Any]] = deque()  # rank 0's, oldest first

    @property
    def holds_engine(self) -> bool:
        """True on rank 0, which holds the engine."""
        return self._engine is not None

    def run(self, work: Callable[[RolloutEngine], T]) -> T:
        """`work(engine)` on rank 0, after the background work; its result on every rank."""
        return from_rank0(lambda: work(self._idle()))

    def score(self, sequences: list[list[int]]) -> list[Tensor]:
        """The engine's `score` on rank 0, at once (beside a generation in flight, which engines
        allow); its result on every rank."""
        return from_rank0(lambda: self._engine.score(sequences))

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
        """Load the policy's weights into the engine as weight `version` (after the background
        work, or pausing it with partial rollouts). Every rank iterates `stream` (its gathers are
        collectives); returns the bytes sent and their rate."""
        metrics: dict[str, float] = {}
        if self._engine is None:
            for _ in stream:
                pass
        else:
            counted = _Counted(stream)
            engine = self._engine if self.partial_rollouts else self._idle()
            if self.partial_rollouts:
                in_flight = any(not future.done() for future in self._submitted)
                metrics["sync/paused_generation"] = float(in_flight)
            start = time.perf_counter()
            with engine.paused() if self.partial_rollouts else nullcontext():
                engine.update_weights(counted, version)
            seconds = time.perf_counter() - start
            metrics |= {
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
