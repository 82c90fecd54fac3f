"""The literature's claims, checked on a drift grid's summary rows: PASS, FAIL, INCONCLUSIVE or
NOT TESTED, with the numbers and the drift regime behind each verdict.

Each claim is a pure function of the rows (summary.py; the ones of finished runs), so that it is
tested on synthetic rows in both directions. Its rule sits beside it, in the module of what it is
about: routing.py (the routing's drift), training.py (clipping, stability, collapses), engine.py
(the rollout engine, replay's cost and gate-weight replay), survival.py (the collapse point),
dose.py (routes the engine flips on purpose); the thresholds, models and arms they share are in
common.py. `CLAIMS` lists them in the report's order, which is their number; a grid checks the
ones it names (its `claims`; the default grid's are `DRIFT_CLAIMS`).
"""

from __future__ import annotations

from megatron_rl.bench.drift.claims.common import Claim, Row
from megatron_rl.bench.drift.claims.dose import (
    margin_flips_hurt_more,
    r3_removes_dose_effect,
    stability_falls_with_dose,
)
from megatron_rl.bench.drift.claims.engine import (
    engine_logprobs_suffice,
    engine_precision_orders_mismatch,
    float8_reaches_moe_mismatch,
    gate_weights_cut_k3,
    r3_cuts_engine_mismatch,
    replay_is_cheap,
)
from megatron_rl.bench.drift.claims.routing import (
    drift_after_update,
    later_layers_drift_more,
    main_regime_holds,
    near_ties_predict_layer_drift,
    routing_causes_most_log_ratio,
    sigmoid_routers_drift_more,
    tails_fatten_without_replay,
)
from megatron_rl.bench.drift.claims.survival import (
    gspo_survives_as_well_as_r2,
    gspo_survives_as_well_as_r3,
    replay_helps_grpo_survive,
)
from megatron_rl.bench.drift.claims.training import (
    corrections_instead_of_replay,
    dense_control_does_not_collapse,
    four_minibatches_need_r3,
    frozen_router_as_stable_and_cheaper,
    gspo_as_stable_as_r2,
    gspo_clips_far_more,
    on_policy_needs_no_replay,
    precursor_before_collapse,
    two_minibatches_need_r2,
)

CLAIMS = (
    drift_after_update,
    later_layers_drift_more,
    tails_fatten_without_replay,
    routing_causes_most_log_ratio,
    gspo_clips_far_more,
    gspo_as_stable_as_r2,
    on_policy_needs_no_replay,
    engine_logprobs_suffice,
    replay_is_cheap,
    two_minibatches_need_r2,
    four_minibatches_need_r3,
    r3_cuts_engine_mismatch,
    frozen_router_as_stable_and_cheaper,
    near_ties_predict_layer_drift,
    precursor_before_collapse,
    dense_control_does_not_collapse,
    sigmoid_routers_drift_more,
    engine_precision_orders_mismatch,
    float8_reaches_moe_mismatch,
    corrections_instead_of_replay,
    main_regime_holds,
    gspo_survives_as_well_as_r2,
    gspo_survives_as_well_as_r3,
    replay_helps_grpo_survive,
    stability_falls_with_dose,
    margin_flips_hurt_more,
    r3_removes_dose_effect,
    gate_weights_cut_k3,
)
# the literature's claims on routing drift, which the default grid checks
DRIFT_CLAIMS = tuple(range(1, 22))


def check_claims(rows: list[Row], numbers: tuple[int, ...] = DRIFT_CLAIMS) -> list[Claim]:
    """The claims numbered `numbers`, in that order, on the rows of the runs that finished."""
    unknown = [n for n in numbers if not 1 <= n <= len(CLAIMS)]
    if unknown:
        raise ValueError(f"claims: {unknown[0]} is not a claim's number (1 .. {len(CLAIMS)})")
    done = [row for row in rows if row["state"] == "done"]
    return [CLAIMS[number - 1](done) for number in numbers]
