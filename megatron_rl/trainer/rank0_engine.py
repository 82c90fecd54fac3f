"""The run's rollout engine, which lives on global rank 0 and answers for every rank.

One engine samples for the whole job (it sits beside the trainer's rank 0, or in front of SGLang
servers elsewhere); the other ranks hold none. Every method of `Rank0Engine` is a collective:
all ranks call it, rank 0 does the work, and every rank returns rank 0's answer (or raises its
error), so that the loop reads the same on every rank.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable, Iterator
from typing import TypeVar

from megatron_rl.models.hf_weights import HFWeightStream
from megatron_rl.parallel.collectives import from_rank0
from megatron_rl.rollout.engine import RolloutEngine, WeightBucket

T = TypeVar("T")


class Rank0Engine:
    """`engine` on global rank 0, None on every other rank."""

    def __init__(self, engine: RolloutEngine | None) -> None:
        self._engine = engine

    def run(self, work: Callable[[RolloutEngine], T]) -> T:
        """`work(engine)` on rank 0; its result on every rank."""
        return from_rank0(lambda: work(self._engine))

    def update_weights(self, stream: HFWeightStream, version: int) -> dict[str, float]:
        """Load the policy's weights into the engine as weight `version`. Every rank iterates
        `stream` (its gathers are collectives); returns the bytes sent and their rate."""
        metrics: dict[str, float] = {}
        if self._engine is None:
            for _ in stream:
                pass
        else:
            counted = _Counted(stream)
            start = time.perf_counter()
            self._engine.update_weights(counted, version)
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
