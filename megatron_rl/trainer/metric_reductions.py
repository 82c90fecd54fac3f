"""The reductions of every metric an update reports (megatron_rl.algo.reductions): the loss's,
the mismatch correction's, the routing drift's, and the trainer's own, which combine over
micro-batches and data-parallel ranks (`Policy.update`) and over a step's updates (`learn`)."""

from __future__ import annotations

from megatron_rl.algo import LOSS_METRICS, MISMATCH_METRICS, MetricReductions, Reduction
from megatron_rl.moe.drift import DRIFT_METRICS, LOG_RATIO_SHARE_METRICS
from megatron_rl.moe.margins import MARGIN_METRICS


def routing_metric_name(drift_key: str) -> str:
    """The trainer's name of a `routing_drift` or `margin_metrics` metric (`drift/layer/3`:
    `routing/drift_layer_3`; `margin/near_tie`: `routing/margin_near_tie`)."""
    return f"routing/{drift_key.replace('/', '_')}"


def update_change_name(drift_key: str, since: str = "update") -> str:
    """The name of a `routing_drift` metric of what an update changed: since the routing before
    it (`since="update"`; `drift/activated_experts`: `routing/update_activated_experts`,
    `drift/layer/3`: `routing/update_layer_3`) or since the old policy's (`since="since_old"`:
    `routing/since_old_activated_experts`)."""
    return f"routing/{since}_{drift_key.removeprefix('drift/').replace('/', '_')}"


ROUTING_METRICS = (
    {routing_metric_name(key): value for key, value in DRIFT_METRICS.items()}
    | {update_change_name(key): value for key, value in DRIFT_METRICS.items()}
    | {update_change_name(key, "since_old"): value for key, value in DRIFT_METRICS.items()}
    | {routing_metric_name(key): value for key, value in MARGIN_METRICS.items()}
    | dict(LOG_RATIO_SHARE_METRICS)
    | {
        # under replay: (token, layer) pairs whose forward used other experts than the replayed
        "routing/replay_miss_token_layer": Reduction.MEAN,
    }
)

# The update's own, and what the old-policy forward reports when the update's forward is it.
TRAINER_METRICS = {
    "loss/policy": Reduction.MEAN,
    "grad_norm": Reduction.MEAN,
    "entropy/mean": Reduction.MEAN,
}

UPDATE_METRICS = MetricReductions(LOSS_METRICS, MISMATCH_METRICS, ROUTING_METRICS, TRAINER_METRICS)
