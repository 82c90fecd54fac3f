"""The reductions of every metric an update reports (megatron_rl.algo.reductions): the loss's,
the mismatch correction's, the routing drift's, and the trainer's own, which combine over
micro-batches and data-parallel ranks (`Policy.update`) and over a step's updates (`learn`)."""

from __future__ import annotations

from megatron_rl.algo import LOSS_METRICS, MISMATCH_METRICS, MetricReductions, Reduction
from megatron_rl.moe.drift import DRIFT_METRICS


def routing_metric_name(drift_key: str) -> str:
    """The trainer's name of a `routing_drift` metric (`drift/layer/3`: `routing/drift_layer_3`)."""
    return f"routing/{drift_key.replace('/', '_')}"


ROUTING_METRICS = {routing_metric_name(key): value for key, value in DRIFT_METRICS.items()} | {
    # under replay: (token, layer) pairs whose forward used other experts than the replayed ones
    "routing/replay_miss_token_layer": Reduction.MEAN,
}

# The update's own, and what the old-policy forward reports when the update's forward is it.
TRAINER_METRICS = {
    "loss/policy": Reduction.MEAN,
    "grad_norm": Reduction.MEAN,
    "entropy/mean": Reduction.MEAN,
}

UPDATE_METRICS = MetricReductions(LOSS_METRICS, MISMATCH_METRICS, ROUTING_METRICS, TRAINER_METRICS)
