"""Weight sync from the trainer to the rollout engine, and the check that it took.

After every k-th sync the engine scores a fixed probe sequence and the trainer computes the
log-probs of the same tokens: if their mean absolute difference exceeds the tolerance, the
engine is not serving the trainer's weights (a sync that did not land, a name mapping that went
wrong, a server restarted from old weights) and the run stops before it trains on samples from
stale weights. Every rank takes part (the weight stream and the trainer's forward are
collectives) and every rank compares the same values, so that all of them raise together.
"""

from __future__ import annotations

from megatron_rl.rollout.config import RolloutConfig
from megatron_rl.trainer.policy import Policy
from megatron_rl.trainer.rank0_engine import Rank0Engine


class WeightSyncMismatch(RuntimeError):
    """The engine's log-probs of the probe do not match the trainer's after a weight sync."""


def sync_weights(
    policy: Policy,
    engine: Rank0Engine,
    *,
    version: int,
    probe: list[int],
    rollout: RolloutConfig,
    sync_count: int,
) -> dict[str, float]:
    """Stream the policy's weights into the engine (every rank takes part) and, on every
    `rollout.probe_every`-th sync (`sync_count` counts them from 0), check the probe."""
    stream = policy.weight_stream(bucket_bytes=rollout.sync_bucket_mb * 2**20)
    metrics = engine.update_weights(stream, version)
    if rollout.probe_every and sync_count % rollout.probe_every == 0:
        metrics |= _check_probe(policy, engine, probe, rollout.probe_tolerance, version)
    return metrics


def _check_probe(
    policy: Policy, engine: Rank0Engine, probe: list[int], tolerance: float, version: int
) -> dict[str, float]:
    trainer = policy.sequence_logprobs([probe])[0]
    difference = (engine.score([probe])[0] - trainer).abs()
    mean, largest = float(difference.mean()), float(difference.max())
    if not mean <= tolerance:
        raise WeightSyncMismatch(
            f"weight sync {version}: the engine's log-probs of the probe sequence differ from "
            f"the trainer's by {mean:.3g} on average (largest {largest:.3g}), more than "
            f"rollout.probe_tolerance={tolerance:g}; the engine is not serving the trainer's "
            "weights, so the run stops rather than train on stale samples"
        )
    return {"sync/probe_mean_abs_diff": mean, "sync/probe_max_abs_diff": largest}
