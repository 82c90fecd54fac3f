"""Weight sync from the trainer to the rollout engine, and the check that it took.

After every k-th sync the engine scores a fixed probe sequence and the trainer computes the
log-probs of the same tokens: if their mean absolute difference exceeds the tolerance, the
engine is not serving the trainer's weights (a sync that did not land, a name mapping that went
wrong, a server restarted from old weights) and the run stops before it trains on samples from
stale weights. Every rank takes part (the weight stream and the trainer's forward are
collectives); rank 0, which holds the engine, decides, and every rank raises together.
"""

from __future__ import annotations

import time
from collections.abc import Iterable, Iterator
from dataclasses import dataclass

import torch.distributed as dist

from megatron_rl.models.policy import Policy
from megatron_rl.rollout.engine import RolloutEngine, WeightBucket


class WeightSyncMismatch(RuntimeError):
    """The engine's log-probs of the probe do not match the trainer's after a weight sync."""


@dataclass(frozen=True, kw_only=True)
class SyncSettings:
    """How weights are synced and checked (megatron_rl.config: rollout)."""

    bucket_bytes: int = 512 * 2**20
    probe_every: int = 1
    probe_tolerance: float = 0.02


def sync_weights(
    policy: Policy,
    engine: RolloutEngine | None,
    *,
    version: int,
    probe: list[int],
    settings: SyncSettings,
    sync_count: int,
) -> dict[str, float]:
    """Stream the policy's weights into the engine (on rank 0; every rank takes part) and, on
    every `probe_every`-th sync (`sync_count` counts them from 0), check the probe."""
    stream = policy.weight_stream(bucket_bytes=settings.bucket_bytes)
    metrics: dict[str, float] = {}
    if engine is not None:
        counted = _Counted(stream)
        start = time.perf_counter()
        engine.update_weights(counted, version)
        seconds = time.perf_counter() - start
        metrics = {
            "sync/bytes": float(counted.bytes),
            "throughput/weight_sync_bytes_per_s": counted.bytes / seconds if seconds else 0.0,
        }
    else:
        for _ in stream:
            pass
    if settings.probe_every and sync_count % settings.probe_every == 0:
        metrics |= _check_probe(policy, engine, probe, settings.probe_tolerance, version)
    return metrics


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


def _check_probe(
    policy: Policy,
    engine: RolloutEngine | None,
    probe: list[int],
    tolerance: float,
    version: int,
) -> dict[str, float]:
    trainer = policy.sequence_logprobs([probe])[0]
    verdict: list = [None, {}]
    if engine is not None:
        difference = (engine.score([probe])[0] - trainer).abs()
        mean, largest = float(difference.mean()), float(difference.max())
        verdict[1] = {"sync/probe_mean_abs_diff": mean, "sync/probe_max_abs_diff": largest}
        if not mean <= tolerance:
            verdict[0] = (
                f"weight sync {version}: the engine's log-probs of the probe sequence differ from "
                f"the trainer's by {mean:.3g} on average (largest {largest:.3g}), more than "
                f"rollout.probe_tolerance={tolerance:g}; the engine is not serving the trainer's "
                "weights, so the run stops rather than train on stale samples"
            )
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.broadcast_object_list(verdict, src=0)
    if verdict[0] is not None:
        raise WeightSyncMismatch(verdict[0])
    return verdict[1]
