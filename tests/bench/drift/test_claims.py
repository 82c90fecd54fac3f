"""Each claim on synthetic summary rows: it passes on data that supports it, fails when the data
behind it is changed, and is not tested without the runs it needs. And the collapse events and
their precursor on hand-made per-step records."""

from __future__ import annotations

import pytest

from megatron_rl.bench.drift import claims, stability
from megatron_rl.bench.drift.claims import common, routing
from megatron_rl.bench.drift.collapse import collapse_events, collapse_precursor

# arm -> (loss, routing_replay, mismatch, freeze_router)
ARMS = {
    "grpo": ("grpo", "none", "none", False),
    "grpo_r2": ("grpo", "r2", "none", False),
    "grpo_r3": ("grpo", "r3", "none", False),
    "grpo_r3_weights": ("grpo", "r3_weights", "none", False),
    "gspo": ("gspo", "none", "none", False),
    "gspo_engine_logp": ("gspo", "none", "bypass", False),
    "grpo_frozen_router": ("grpo", "none", "none", True),
    "grpo_tis": ("grpo", "none", "tis", False),
    "grpo_mis_geometric": ("grpo", "none", "mis", False),
    "grpo_tis_mis_geometric": ("grpo", "none", "tis+mis_geometric", False),
    "gspo_r2": ("gspo", "r2", "none", False),
}


def row(arm: str, seed: int = 1, cell: str = "base", **values) -> dict:
    """A run of `arm`: each arm's runs differ from every other arm's (a duplicate arm is not
    tested, stability.py) by less than the accuracy margin."""
    loss, replay, mismatch, frozen = ARMS[arm]
    arm_index = list(ARMS).index(arm)
    drift = None if replay != "none" else 0.02
    return {
        "run_id": f"{arm}--{cell}--seed{seed}",
        "arm": arm,
        "cell": cell,
        "seed": seed,
        "state": "done",
        "model": "fine_qwen3_e128",
        "engine_dtype": "float32",
        "loss": loss,
        "routing_replay": replay,
        "mismatch": mismatch,
        "freeze_router": frozen,
        "updates_per_batch": 4,
        "lr": 2e-4,
        "layers": 8,
        "collapse_events": 0,
        "precursor": "",
        "false_alarm": "",
        "final_accuracy": 0.7 + 0.01 * seed + 0.001 * arm_index * (seed % 2),
        "reward_mean": 0.5 + 0.001 * arm_index,
        "update_activated": drift,
        "since_old_activated": drift,
        "drift_token_layer": drift,
        "drift_token_any": None if drift is None else 0.08,
        "replay_miss_max": 0.0 if replay != "none" else None,
        "clip_frac_token": 0.2 if loss == "gspo" else 0.002,
        "log_ratio_abs_max": 1.0 if replay == "none" else 0.5,
        "log_ratio_outside_0.8_1.25": 0.01 if replay == "none" else 0.005,
        "log_ratio_var_share_pooled": 0.7 if replay == "none" else None,
        "mismatch_k3": 1e-4,
        "tis_truncated_frac": 0.01 if "tis" in mismatch else 0.0,
        "mis_masked_frac": 0.02 if "mis" in mismatch else 0.0,
        "engine_routing_mismatch": 0.0,
        "old_logprob_s": 0.0 if mismatch == "bypass" else 0.2,
        "step_s": 1.2,
        "learn_s_per_1k_tokens": 0.5,
        "record_bytes": 40_000.0,
    } | values


def arms(*names: str, seeds=(1, 2, 3), cell="base", **values) -> list[dict]:
    return [row(name, seed, cell, **values) for name in names for seed in seeds]


def change(rows: list[dict], arm: str, **values) -> list[dict]:
    """`rows` with `values` set in the rows of `arm`."""
    return [r | values if r["arm"] == arm else r for r in rows]


def same_as(rows: list[dict], arm: str, other: str) -> list[dict]:
    """`rows` with the runs of `arm` computing what those of `other` computed, seed by seed."""
    of_other = {r["seed"]: r for r in rows if r["arm"] == other}
    copied = stability.DUPLICATE_COLUMNS
    return [
        r | {c: of_other[r["seed"]].get(c) for c in copied} if r["arm"] == arm else r for r in rows
    ]


def by_seed(rows: list[dict], column: str, values: dict[int, float], arm: str | None = None):
    """`rows` with `column` set to values[seed] (in the rows of `arm`, or in all)."""
    return [r | {column: values[r["seed"]]} if arm is None or r["arm"] == arm else r for r in rows]


def verdict(check, rows) -> str:
    return check(rows).verdict


def test_regime_is_the_share_of_activated_experts_changed_since_the_old_policy():
    regime = claims.drift_after_update(arms("grpo", "grpo_r2")).regime
    assert regime == (
        "2.00% of activated experts changed since the old policy after each update (mean of "
        "the runs without replay, model fine_qwen3_e128, engine float32)"
    )
    two_models = arms("grpo") + arms("grpo", cell="m", model="fine_deepseek_e128")
    assert "model" not in common.regime_of(two_models)
    per_update = change(arms("grpo"), "grpo", update_activated=0.5)  # not the regime's measure
    assert common.regime_of(per_update).startswith("2.00%")
    old = [r | {"update_activated": None, "since_old_activated": None} for r in arms("grpo")]
    assert common.regime_of(old) == (
        "2.00% token-layer drift per step (mean of the runs without replay)"
    )


def test_grpo_arm_leaves_out_frozen_routers_and_reads_a_missing_flag_as_trained():
    frozen = arms("grpo_frozen_router", "grpo_r2")
    assert verdict(claims.tails_fatten_without_replay, frozen) == "NOT TESTED"
    unflagged = [{k: v for k, v in r.items() if k != "freeze_router"} for r in arms("grpo")]
    assert all(common.GRPO(r) for r in unflagged)
    assert common.GRPO_FROZEN(row("grpo_frozen_router") | {"freeze_router": "True"})


def test_the_dense_controls_runs_have_no_routing_to_drift():
    rows = arms("grpo", "grpo_r2")
    dense = arms("grpo", cell="dense", model="dense_control", update_activated=0.0)
    assert verdict(claims.drift_after_update, rows + dense) == "PASS"


def test_drift_after_update_fails_on_zero_drift_or_a_replay_miss():
    rows = arms("grpo", "grpo_r2")
    assert verdict(claims.drift_after_update, rows) == "PASS"
    still = [*rows[1:], rows[0] | {"update_activated": 0.0}]
    assert verdict(claims.drift_after_update, still) == "FAIL"
    missed = [*rows[:-1], rows[-1] | {"replay_miss_max": 0.01}]
    assert verdict(claims.drift_after_update, missed) == "FAIL"
    unmeasured = [r | {"update_activated": None} for r in rows]
    assert verdict(claims.drift_after_update, unmeasured) == "NOT TESTED"
    assert verdict(claims.drift_after_update, arms("grpo")) == "NOT TESTED"


def layer_rows(later: bool = True, model: str = "fine_qwen3_e128", layers=range(8)) -> list[dict]:
    n = len(layers)
    per_layer = {
        f"update_activated_layer_{i}": 0.01 * (k + 1 if later else n - k)
        for k, i in enumerate(layers)
    }
    return arms("grpo", "grpo_r2", model=model, **per_layer)


def test_later_layers_drift_more_on_the_main_model():
    assert verdict(claims.later_layers_drift_more, layer_rows()) == "PASS"
    dense_first = layer_rows(layers=range(1, 8))  # model layer numbering: layer 0 is dense
    assert verdict(claims.later_layers_drift_more, dense_first) == "PASS"
    assert verdict(claims.later_layers_drift_more, layer_rows(later=False)) == "FAIL"
    other = layer_rows(model="fine_deepseek_e128")
    assert verdict(claims.later_layers_drift_more, other) == "NOT TESTED"
    assert verdict(claims.later_layers_drift_more, layer_rows(layers=[3])) == "NOT TESTED"
    off_base = [r | {"cell": "lr=4e-4"} for r in layer_rows()]
    assert verdict(claims.later_layers_drift_more, off_base) == "NOT TESTED"
    # later layers drift more in two seeds, less in the third: the interval over seeds spans 0
    mixed = layer_rows()[:2] + layer_rows(later=False)[2:3] + layer_rows()[3:]
    claim = claims.later_layers_drift_more(mixed)
    assert claim.verdict == "INCONCLUSIVE" and "(95%, n=3)" in claim.evidence


def test_tails_fatten_without_replay_fails_when_replay_has_the_fatter_tail():
    rows = arms("grpo", "grpo_r2")
    assert verdict(claims.tails_fatten_without_replay, rows) == "PASS"
    swapped = change(rows, "grpo_r2", **{"log_ratio_outside_0.8_1.25": 0.02})
    assert verdict(claims.tails_fatten_without_replay, swapped) == "FAIL"
    # larger in two seeds of three, smaller in the third: not decided
    mixed = [
        r | {"log_ratio_abs_max": 0.3} if r["arm"] == "grpo" and r["seed"] == 3 else r for r in rows
    ]
    claim = claims.tails_fatten_without_replay(mixed)
    assert (
        claim.verdict == "INCONCLUSIVE"
        and "max |log w| without replay - with R2 +0.2667" in claim.evidence
    )
    assert verdict(claims.tails_fatten_without_replay, arms("grpo")) == "NOT TESTED"


def test_routing_causes_most_log_ratio_on_the_main_model():
    rows = arms("grpo", "gspo", "grpo_r2")
    claim = claims.routing_causes_most_log_ratio(rows)
    assert claim.verdict == "PASS" and "70.0%" in claim.evidence
    half_off = change(rows, "gspo", log_ratio_var_share_pooled=0.2)  # mean 45%
    assert verdict(claims.routing_causes_most_log_ratio, half_off) == "FAIL"
    tiny = [r | {"model": "tiny"} for r in rows]
    assert verdict(claims.routing_causes_most_log_ratio, tiny) == "NOT TESTED"
    # GSPO-token computing what GSPO computed counts once, not twice
    token = [r | {"arm": "gspo_token"} for r in half_off if r["arm"] == "gspo"]
    pooled = claims.routing_causes_most_log_ratio(half_off + token).evidence
    assert "(6 distinct runs)" in pooled
    spread = by_seed(rows, "log_ratio_var_share_pooled", {1: 0.9, 2: 0.6, 3: 0.3})
    claim = claims.routing_causes_most_log_ratio(spread)  # mean 60%, three seeds far apart
    assert claim.verdict == "INCONCLUSIVE" and "against 0.5" in claim.evidence


def test_gspo_clips_far_more_needs_ten_times_grpo():
    rows = arms("gspo", "grpo_r2")
    assert verdict(claims.gspo_clips_far_more, rows) == "PASS"
    close = [r | {"clip_frac_token": 0.05} if r["loss"] == "grpo" else r for r in rows]
    assert verdict(claims.gspo_clips_far_more, close) == "FAIL"
    # 100x, 100x and 2x: the geometric mean's interval spans 10x
    spread = by_seed(rows, "clip_frac_token", {1: 0.2, 2: 0.2, 3: 0.004}, arm="gspo")
    claim = claims.gspo_clips_far_more(spread)
    assert claim.verdict == "INCONCLUSIVE" and "against 1" in claim.evidence
    # on-policy cells clip nothing: left out, and said
    on_policy = arms("gspo", "grpo", cell="on", clip_frac_token=0.0)
    claim = claims.gspo_clips_far_more(rows + on_policy)
    assert claim.verdict == "PASS" and "3 where one clipped none left out" in claim.evidence
    assert verdict(claims.gspo_clips_far_more, on_policy) == "NOT TESTED"
    assert verdict(claims.gspo_clips_far_more, arms("grpo")) == "NOT TESTED"


def test_gspo_stability_is_tested_only_at_strong_drift():
    weak = arms("gspo", "grpo_r2")
    claim = claims.gspo_as_stable_as_r2(weak)  # 2% < 5% of activated experts
    assert claim.verdict == "NOT TESTED" and "largest mean: 2.00%" in claim.evidence
    strong = change(weak, "gspo", since_old_activated=0.08)
    assert verdict(claims.gspo_as_stable_as_r2, strong) == "PASS"
    one_update = change(weak, "gspo", update_activated=0.08)  # since the old policy: 2%
    assert verdict(claims.gspo_as_stable_as_r2, one_update) == "NOT TESTED"
    collapsing = change(strong, "gspo", collapse_events=1)
    assert verdict(claims.gspo_as_stable_as_r2, collapsing) == "FAIL"
    worse = change(strong, "gspo", final_accuracy=0.5)
    assert verdict(claims.gspo_as_stable_as_r2, worse) == "FAIL"


def test_on_policy_claim_needs_both_halves():
    # on-policy, replay changes nothing: the two arms are one computation
    on = same_as(
        arms("grpo", "grpo_r2", cell="updates_per_batch=1", updates_per_batch=1), "grpo_r2", "grpo"
    )
    off_fine = arms("grpo", "grpo_r2", cell="updates_per_batch=8", updates_per_batch=8)
    off_bad = change(off_fine, "grpo", collapse_events=2)
    assert verdict(claims.on_policy_needs_no_replay, on + off_bad) == "PASS"
    assert verdict(claims.on_policy_needs_no_replay, on + off_fine) == "FAIL"
    on_bad = change(on, "grpo", final_accuracy=0.3)
    assert verdict(claims.on_policy_needs_no_replay, on_bad + off_bad) == "FAIL"
    # one off-policy run of three collapsed, its final accuracy with it: not enough to tell
    off_one = [
        r | {"collapse_events": 1, "final_accuracy": 0.5}
        if r["arm"] == "grpo" and r["seed"] == 1
        else r
        for r in off_fine
    ]
    assert verdict(claims.on_policy_needs_no_replay, on + off_one) == "INCONCLUSIVE"
    assert verdict(claims.on_policy_needs_no_replay, off_bad) == "NOT TESTED"


def test_engine_logprobs_claim_needs_stability_and_a_saving():
    rows = arms("gspo", "gspo_engine_logp")
    claim = claims.engine_logprobs_suffice(rows)
    assert claim.verdict == "PASS" and "time saved, s per step +0.2 " in claim.evidence
    # the trainer logs no old-policy time for a run that skips that forward: 0 s, not unmeasured
    unlogged = change(rows, "gspo_engine_logp", old_logprob_s=None)
    assert claims.engine_logprobs_suffice(unlogged).evidence == claim.evidence
    no_saving = [r | {"old_logprob_s": 0.2} for r in rows]
    assert verdict(claims.engine_logprobs_suffice, no_saving) == "FAIL"
    unstable = change(rows, "gspo_engine_logp", collapse_events=1)
    assert verdict(claims.engine_logprobs_suffice, unstable) == "FAIL"
    assert verdict(claims.engine_logprobs_suffice, arms("gspo")) == "NOT TESTED"


def test_replay_cost_claim_fails_above_its_threshold():
    rows = arms("grpo", "grpo_r2")
    assert verdict(claims.replay_is_cheap, rows) == "PASS"
    slow = change(rows, "grpo_r2", learn_s_per_1k_tokens=0.6)
    assert verdict(claims.replay_is_cheap, slow) == "FAIL"  # +20%
    # seed by seed +0%, +20%, -10%: the interval holds both answers
    noisy = [
        r | {"learn_s_per_1k_tokens": {1: 0.5, 2: 0.6, 3: 0.45}[r["seed"]]}
        if r["arm"] == "grpo_r2"
        else r
        for r in rows
    ]
    claim = claims.replay_is_cheap(noisy)
    assert claim.verdict == "INCONCLUSIVE" and "paired overhead +0.03333" in claim.evidence
    assert verdict(claims.replay_is_cheap, arms("grpo")) == "NOT TESTED"


def test_time_claims_say_when_their_runs_ran_on_several_machines():
    one = [r | {"machine": "cpu A"} for r in arms("grpo", "grpo_r2", "grpo_frozen_router")]
    for check in (claims.replay_is_cheap, claims.frozen_router_as_stable_and_cheaper):
        assert "machines" not in check(one).evidence
    # GRPO + R2 resumed on another machine; runs of before 2026-12-05 record none
    mixed = change(one, "grpo_r2", machine="cpu B")
    assert "times of runs on 2 machines (cpu A: 3, cpu B: 3 runs)" in (
        claims.replay_is_cheap(mixed).evidence
    )
    assert "2 machines" in claims.frozen_router_as_stable_and_cheaper(mixed).evidence
    unrecorded = change(one, "grpo_r2", machine="")
    assert "machines" not in claims.replay_is_cheap(unrecorded).evidence
    gspo = [r | {"machine": "cpu A"} for r in arms("gspo", "gspo_engine_logp")]
    engine = change(gspo, "gspo_engine_logp", machine="cpu B")
    assert "2 machines" in claims.engine_logprobs_suffice(engine).evidence


def test_two_minibatches_need_r2():
    fine = arms("grpo", "grpo_r2", cell="updates_per_batch=2", updates_per_batch=2)
    unstable = change(fine, "grpo", collapse_events=1)
    assert verdict(claims.two_minibatches_need_r2, unstable) == "PASS"
    assert verdict(claims.two_minibatches_need_r2, fine) == "FAIL"
    bf16 = [r | {"engine_dtype": "bfloat16"} for r in unstable]  # the off-policy sweep's engine
    assert verdict(claims.two_minibatches_need_r2, bf16) == "PASS"
    four = [r | {"updates_per_batch": 4} for r in unstable]
    assert verdict(claims.two_minibatches_need_r2, four) == "NOT TESTED"


def test_four_minibatches_need_r3_only_with_a_low_precision_engine():
    fine = arms("grpo_r2", "grpo_r3", cell="engine=bf16", engine_dtype="bfloat16")
    r2_worse = change(fine, "grpo_r2", final_accuracy=0.4)
    assert verdict(claims.four_minibatches_need_r3, r2_worse) == "PASS"
    fp8 = [r | {"engine_dtype": "float8_emulated", "updates_per_batch": 8} for r in r2_worse]
    assert verdict(claims.four_minibatches_need_r3, fp8) == "PASS"
    assert verdict(claims.four_minibatches_need_r3, fine) == "FAIL"
    float32 = [r | {"engine_dtype": "float32"} for r in r2_worse]
    assert verdict(claims.four_minibatches_need_r3, float32) == "NOT TESTED"
    two = [r | {"updates_per_batch": 2} for r in r2_worse]
    assert verdict(claims.four_minibatches_need_r3, two) == "NOT TESTED"


def test_r3_cuts_the_engine_mismatch_with_a_low_precision_engine():
    rows = change(
        arms("grpo", "grpo_r3", cell="engine=bf16", engine_dtype="bfloat16"),
        "grpo",
        mismatch_k3=2e-3,
        engine_routing_mismatch=0.03,
    )
    rows = change(rows, "grpo_r3", mismatch_k3=5e-4)
    assert verdict(claims.r3_cuts_engine_mismatch, rows) == "PASS"
    higher = change(rows, "grpo_r3", mismatch_k3=3e-3)
    assert verdict(claims.r3_cuts_engine_mismatch, higher) == "FAIL"
    missed = change(rows, "grpo_r3", replay_miss_max=0.01)
    assert verdict(claims.r3_cuts_engine_mismatch, missed) == "FAIL"
    same_routing = change(rows, "grpo", engine_routing_mismatch=0.0)
    assert verdict(claims.r3_cuts_engine_mismatch, same_routing) == "FAIL"
    float32 = [r | {"engine_dtype": "float32"} for r in rows]
    assert verdict(claims.r3_cuts_engine_mismatch, float32) == "NOT TESTED"
    # lower with R3 in two seeds, higher in the third
    mixed = by_seed(rows, "mismatch_k3", {1: 1e-4, 2: 1e-4, 3: 4e-3}, arm="grpo_r3")
    assert verdict(claims.r3_cuts_engine_mismatch, mixed) == "INCONCLUSIVE"


def test_gate_weights_cut_k3_below_id_only_r3_at_both_low_precisions():
    rows = [
        r
        for precision, cell in (("bfloat16", "bf16"), ("float8_emulated", "fp8"))
        for r in arms("grpo", "grpo_r3", "grpo_r3_weights", cell=cell, engine_dtype=precision)
    ]
    rows = change(change(rows, "grpo_r3", mismatch_k3=5e-4), "grpo_r3_weights", mismatch_k3=1e-4)
    claim = claims.gate_weights_cut_k3(rows)
    assert claim.number == 28 and claim.verdict == "PASS"
    assert "bfloat16: log10(k3 R3 / R3 + gate weights) +0.699" in claim.evidence
    assert "1e-04 without replay" in claim.evidence or "0.0001 without replay" in claim.evidence
    # no lower with the weights at float8
    fp8_same = [
        r | {"mismatch_k3": 5e-4}
        if r["arm"] == "grpo_r3_weights" and r["engine_dtype"] == "float8_emulated"
        else r
        for r in rows
    ]
    assert verdict(claims.gate_weights_cut_k3, fp8_same) == "FAIL"
    # lower in two seeds of three at bfloat16, higher in the third
    mixed = [
        r | {"mismatch_k3": 4e-3}
        if r["arm"] == "grpo_r3_weights" and r["engine_dtype"] == "bfloat16" and r["seed"] == 3
        else r
        for r in rows
    ]
    assert verdict(claims.gate_weights_cut_k3, mixed) == "INCONCLUSIVE"
    bf16_only = [r for r in rows if r["engine_dtype"] == "bfloat16"]
    assert verdict(claims.gate_weights_cut_k3, bf16_only) == "NOT TESTED"


def test_frozen_router_needs_stability_and_shorter_steps():
    rows = change(arms("grpo_frozen_router", "grpo_r2"), "grpo_frozen_router", step_s=1.0)
    assert verdict(claims.frozen_router_as_stable_and_cheaper, rows) == "PASS"
    slower = change(rows, "grpo_frozen_router", step_s=1.3)
    assert verdict(claims.frozen_router_as_stable_and_cheaper, slower) == "FAIL"
    mixed = by_seed(rows, "step_s", {1: 1.0, 2: 1.0, 3: 1.5}, arm="grpo_frozen_router")
    claim = claims.frozen_router_as_stable_and_cheaper(mixed)
    assert claim.verdict == "INCONCLUSIVE" and "step time, s +0.03333" in claim.evidence
    collapsing = change(rows, "grpo_frozen_router", collapse_events=1)
    assert verdict(claims.frozen_router_as_stable_and_cheaper, collapsing) == "FAIL"
    no_frozen = arms("grpo", "grpo_r2")
    assert verdict(claims.frozen_router_as_stable_and_cheaper, no_frozen) == "NOT TESTED"


def test_spearman_uses_average_ranks_for_ties():
    assert routing.spearman([1, 2, 3], [10, 20, 30]) == pytest.approx(1.0)
    assert routing.spearman([1, 2, 3], [3, 1, 0]) == pytest.approx(-1.0)
    # ranks 1, 2.5, 2.5, 4 against 1..4: 4.5 / sqrt(4.5 x 5)
    assert routing.spearman([1, 2, 2, 3], [1, 2, 3, 4]) == pytest.approx(4.5 / (4.5 * 5) ** 0.5)
    assert routing.spearman([1, 1, 1], [1, 2, 3]) is None
    assert routing.spearman([1], [1]) is None


def tie_rows(
    predicts: bool = True, model: str = "fine_qwen3_e128", layers=(1, 2, 3, 4)
) -> list[dict]:
    rows = []
    for seed in (1, 2, 3):
        values = {}
        for layer in layers:
            tie = 0.01 * layer + 0.001 * seed
            values[f"near_tie_layer_{layer}"] = tie
            values[f"update_activated_layer_{layer}"] = 2 * tie if predicts else 0.1 - tie
        rows.append(row("grpo", seed, model=model, **values))
        rows.append(row("grpo_r2", seed, model=model, **values))
    return rows


def test_near_ties_predict_layer_drift_on_the_fine_models():
    claim = claims.near_ties_predict_layer_drift(tie_rows())
    assert claim.verdict == "PASS" and "+1 [+1, +1] (95%, n=4) over layers (means of 3 runs)" in (
        claim.evidence
    )
    deepseek = tie_rows(model="fine_deepseek_e128")
    assert verdict(claims.near_ties_predict_layer_drift, deepseek) == "PASS"
    assert verdict(claims.near_ties_predict_layer_drift, tie_rows(predicts=False)) == "FAIL"
    tiny = tie_rows(model="tiny")
    assert verdict(claims.near_ties_predict_layer_drift, tiny) == "NOT TESTED"
    # 8 layers, drift ranked alike but for each neighbouring pair swapped: Spearman 0.905, and
    # at 8 points its interval reaches below 0.5
    pairs = {1: 2, 2: 1, 3: 4, 4: 3, 5: 6, 6: 5, 7: 8, 8: 7}
    swapped = [
        r
        | {
            f"update_activated_layer_{i}": r[f"update_activated_layer_{j}"]
            for i, j in pairs.items()
        }
        for r in tie_rows(layers=range(1, 9))
    ]
    claim = claims.near_ties_predict_layer_drift(swapped)
    assert claim.verdict == "INCONCLUSIVE" and "Spearman +0.9048 [+0.4" in claim.evidence
    few = tie_rows(layers=(1, 2, 3))
    assert verdict(claims.near_ties_predict_layer_drift, few) == "NOT TESTED"


def test_near_ties_are_ranked_within_each_model():
    # The sigmoid model: fewer near-ties on its scale, more drift; each model's layers predict.
    qwen = tie_rows()
    deepseek = [
        r
        | {
            k: (v / 10 if k.startswith("near_tie") else v + 0.5)
            for k, v in r.items()
            if k.startswith(("near_tie_layer_", "update_activated_layer_"))
        }
        for r in tie_rows(model="fine_deepseek_e128")
    ]
    claim = claims.near_ties_predict_layer_drift(qwen + deepseek)
    assert claim.verdict == "PASS", claim.evidence
    assert "fine_qwen3_e128: Spearman +1 " in claim.evidence
    assert "fine_deepseek_e128: Spearman +1 " in claim.evidence
    one_fails = qwen + tie_rows(predicts=False, model="fine_deepseek_e128")
    claim = claims.near_ties_predict_layer_drift(one_fails)
    assert claim.verdict == "FAIL" and "fine_deepseek_e128: Spearman -1 " in claim.evidence


def test_every_collapse_needs_a_precursor():
    rows = change(arms("grpo", "grpo_r2"), "grpo", collapse_events=1, precursor="grad_norm")
    claim = claims.precursor_before_collapse(rows)
    assert claim.verdict == "PASS" and "3 of 3 collapsed runs" in claim.evidence
    silent = [*rows[1:], rows[0] | {"precursor": ""}]
    claim = claims.precursor_before_collapse(silent)
    assert claim.verdict == "FAIL" and rows[0]["run_id"] in claim.evidence
    assert verdict(claims.precursor_before_collapse, arms("grpo", "grpo_r2")) == "NOT TESTED"
    # a rule that also fires in a third of the runs that never collapse tells nothing
    calm = [r for r in rows if r["arm"] == "grpo_r2"]
    alarmed = [r for r in rows if r["arm"] == "grpo"] + [calm[0] | {"false_alarm": "drift"}]
    claim = claims.precursor_before_collapse(alarmed + calm[1:])
    assert claim.verdict == "NOT TESTED" and "fires in 1 of 3 runs that never collapse" in (
        claim.evidence
    )
    assert "false alarms in 0 of 3" in claims.precursor_before_collapse(rows).evidence
    unmeasured = [{k: v for k, v in r.items() if k != "false_alarm"} for r in rows]
    claim = claims.precursor_before_collapse(unmeasured)
    assert claim.verdict == "NOT TESTED" and "false alarms" in claim.evidence


def dense_rows(lr: float = 2e-4) -> list[dict]:
    main = arms("grpo", "grpo_r2")
    dense = arms("grpo", "grpo_r2", cell="model=dense", model="dense_control", lr=lr)
    return main + dense


def test_dense_control_does_not_collapse_at_the_main_learning_rate():
    assert verdict(claims.dense_control_does_not_collapse, dense_rows()) == "PASS"
    claim = claims.dense_control_does_not_collapse(dense_rows())
    assert "0 of 6 dense_control runs collapsed (its collapse rate is below 39%" in claim.evidence
    collapsed = [
        r | {"collapse_events": 1} if r["model"] == "dense_control" and r["seed"] == 2 else r
        for r in dense_rows()
    ]
    assert verdict(claims.dense_control_does_not_collapse, collapsed) == "FAIL"
    other_lr = dense_rows(lr=4e-4)
    assert verdict(claims.dense_control_does_not_collapse, other_lr) == "NOT TESTED"


def model_rows(deepseek_drift: float = 0.09, **deepseek_values) -> list[dict]:
    qwen = arms("grpo", "gspo", "grpo_r2", update_activated=0.06)
    deepseek = arms(
        "grpo",
        "gspo",
        "grpo_r2",
        cell="model=fine_deepseek_e128",
        model="fine_deepseek_e128",
        update_activated=deepseek_drift,
        **deepseek_values,
    )
    return qwen + deepseek


def test_sigmoid_routers_drift_more_per_arm_at_equal_settings():
    claim = claims.sigmoid_routers_drift_more(model_rows())
    assert claim.verdict == "PASS" and "grpo: 9.00% vs 6.00%" in claim.evidence
    assert "grpo_r2" not in claim.evidence  # replay arms do not count
    one_arm_less = [
        r | {"update_activated": 0.03}
        if r["model"] == "fine_deepseek_e128" and r["arm"] == "gspo"
        else r
        for r in model_rows()
    ]
    assert verdict(claims.sigmoid_routers_drift_more, one_arm_less) == "FAIL"
    unequal = model_rows(lr=4e-4)
    assert verdict(claims.sigmoid_routers_drift_more, unequal) == "NOT TESTED"
    deeper = model_rows(layers=12)
    assert verdict(claims.sigmoid_routers_drift_more, deeper) == "NOT TESTED"
    # more in two seeds, less in the third
    rows = by_seed(model_rows(), "update_activated", {1: 0.2, 2: 0.2, 3: 0.0})
    rows = [
        r if r["model"] == "fine_deepseek_e128" else r | {"update_activated": 0.06} for r in rows
    ]
    assert verdict(claims.sigmoid_routers_drift_more, rows) == "INCONCLUSIVE"


def precision_rows(k3: dict[str, float], routing: dict[str, float]) -> list[dict]:
    return [
        r
        for dtype in k3
        for r in arms(
            "grpo",
            "grpo_r3",
            cell=f"engine={dtype}",
            engine_dtype=dtype,
            mismatch_k3=k3[dtype],
            engine_routing_mismatch=routing[dtype],
        )
    ]


def test_engine_precision_orders_the_mismatch():
    k3 = {"float32": 0.0, "bfloat16": 5e-4, "float8_emulated": 2e-3}
    routing = {"float32": 0.0, "bfloat16": 0.01, "float8_emulated": 0.03}
    assert verdict(claims.engine_precision_orders_mismatch, precision_rows(k3, routing)) == "PASS"
    swapped = k3 | {"bfloat16": 3e-3}
    rows = precision_rows(swapped, routing)
    assert verdict(claims.engine_precision_orders_mismatch, rows) == "FAIL"
    flat = routing | {"bfloat16": 0.0}
    assert verdict(claims.engine_precision_orders_mismatch, precision_rows(k3, flat)) == "FAIL"
    # bfloat16 above float32 in two seeds, equal in the third
    rows = [
        r | {"mismatch_k3": 1e-3 if r["seed"] < 3 else 0.0}
        if r["engine_dtype"] == "bfloat16"
        else r
        for r in precision_rows(k3, routing)
    ]
    claim = claims.engine_precision_orders_mismatch(rows)
    assert claim.verdict == "INCONCLUSIVE" and "k3 bfloat16 - float32 +0.0006667" in claim.evidence
    two = {d: v for d, v in k3.items() if d != "bfloat16"}
    rows = precision_rows(two, routing)
    assert verdict(claims.engine_precision_orders_mismatch, rows) == "NOT TESTED"


def test_float8_engine_reaches_the_moe_mismatch_regime():
    rows = arms("grpo", "grpo_tis", "grpo_r3", engine_dtype="float8_emulated", mismatch_k3=2e-3)
    dense = arms("grpo", cell="dense", engine_dtype="float8_emulated", model="dense_control")
    assert verdict(claims.float8_reaches_moe_mismatch, rows + dense) == "PASS"  # dense left out
    small = change(rows, "grpo", mismatch_k3=2e-4)  # mean of GRPO and GRPO + TIS: 1.1e-3
    assert verdict(claims.float8_reaches_moe_mismatch, small) == "PASS"
    smaller = change(small, "grpo_tis", mismatch_k3=1.5e-3)  # 8.5e-4
    assert verdict(claims.float8_reaches_moe_mismatch, smaller) == "FAIL"
    spread = by_seed(rows, "mismatch_k3", {1: 3e-3, 2: 2e-3, 3: 1e-4})
    assert verdict(claims.float8_reaches_moe_mismatch, spread) == "INCONCLUSIVE"
    float32 = [r | {"engine_dtype": "float32"} for r in rows]
    assert verdict(claims.float8_reaches_moe_mismatch, float32) == "NOT TESTED"


def test_corrections_are_as_stable_as_r3_with_a_float8_engine():
    corrections = ("grpo_tis", "grpo_mis_geometric", "grpo_tis_mis_geometric")
    rows = arms(*corrections, "grpo_r3", engine_dtype="float8_emulated")
    assert verdict(claims.corrections_instead_of_replay, rows) == "PASS"
    both_collapse = change(rows, "grpo_tis_mis_geometric", collapse_events=1)
    assert verdict(claims.corrections_instead_of_replay, both_collapse) == "FAIL"
    no_combined = [r for r in rows if r["arm"] != "grpo_tis_mis_geometric"]
    assert verdict(claims.corrections_instead_of_replay, no_combined) == "NOT TESTED"
    tis_collapses = change(rows, "grpo_tis", collapse_events=1)
    assert verdict(claims.corrections_instead_of_replay, tis_collapses) == "FAIL"
    mis_worse = change(rows, "grpo_mis_geometric", final_accuracy=0.4)
    assert verdict(claims.corrections_instead_of_replay, mis_worse) == "FAIL"
    no_mis = [r for r in rows if r["arm"] != "grpo_mis_geometric"]
    assert verdict(claims.corrections_instead_of_replay, no_mis) == "NOT TESTED"
    no_mis_tis_collapses = [r for r in tis_collapses if r["arm"] != "grpo_mis_geometric"]
    assert verdict(claims.corrections_instead_of_replay, no_mis_tis_collapses) == "FAIL"
    bf16 = [r | {"engine_dtype": "bfloat16"} for r in rows]
    assert verdict(claims.corrections_instead_of_replay, bf16) == "NOT TESTED"
    # a band that never masks leaves plain TIS: the combination is not tested, and says why
    silent = change(rows, "grpo_tis_mis_geometric", mis_masked_frac=0.0)
    claim = claims.corrections_instead_of_replay(silent)
    assert claim.verdict == "NOT TESTED"
    assert "TIS + geometric MIS (never acted: mis_masked_frac 0)" in claim.evidence
    unrecorded = change(rows, "grpo_tis", tis_truncated_frac=None)
    assert "TIS (never acted: tis_truncated_frac not recorded)" in (
        claims.corrections_instead_of_replay(unrecorded).evidence
    )


def test_main_regime_holds_at_five_percent():
    rows = arms("grpo", "gspo", "grpo_r2", since_old_activated=0.06)
    assert verdict(claims.main_regime_holds, rows) == "PASS"
    per_update = arms("grpo", "gspo", "grpo_r2", update_activated=0.06)
    assert verdict(claims.main_regime_holds, per_update) == "FAIL"
    weak = arms("grpo", "gspo", "grpo_r2")  # 2%
    assert verdict(claims.main_regime_holds, weak) == "FAIL"
    tiny = [r | {"model": "tiny"} for r in rows]
    assert verdict(claims.main_regime_holds, tiny) == "NOT TESTED"
    spread = by_seed(rows, "since_old_activated", {1: 0.09, 2: 0.06, 3: 0.02})
    assert verdict(claims.main_regime_holds, spread) == "INCONCLUSIVE"
    one_seed = [r for r in rows if r["seed"] == 1]
    assert verdict(claims.main_regime_holds, one_seed) == "NOT TESTED"


def test_check_claims_numbers_all_21_and_leaves_out_unfinished_runs():
    rows = arms("grpo", "grpo_r2")
    checked = claims.check_claims(rows)
    assert [c.number for c in checked] == list(range(1, 22))
    verdicts = ("PASS", "FAIL", "INCONCLUSIVE", "NOT TESTED")
    assert all(c.verdict in verdicts and c.regime for c in checked)
    crashed = change(rows, "grpo_r2", state="crashed")
    by_number = {c.number: c.verdict for c in claims.check_claims(crashed)}
    assert by_number[1] == "NOT TESTED" and len(by_number) == 21


def records(accuracies: dict[int, float], rewards: dict[int, float] | None = None) -> list[dict]:
    steps = sorted(set(accuracies) | set(rewards or {}))
    return [
        {"step": s, "eval/accuracy": accuracies.get(s), "reward/mean": (rewards or {}).get(s, 0.5)}
        for s in steps
    ]


@pytest.mark.parametrize(
    ("accuracies", "expected"),
    [
        ({0: 0.6, 5: 0.7, 10: 0.72, 15: 0.74}, []),
        ({0: 0.6, 5: 0.7, 10: 0.5, 15: 0.69, 20: 0.7}, []),  # a dip that recovers
        ({0: 0.6, 5: 0.7, 10: 0.5, 15: 0.5, 20: 0.4}, [(10, "accuracy")]),
        ({0: 0.6, 5: 0.7, 10: 0.5, 15: 0.5}, [(10, "accuracy")]),  # at the end, twice low
        ({0: 0.6, 5: 0.7, 10: 0.5}, []),  # one low last evaluation: noise as often as not
        (
            {0: 0.7, 5: 0.5, 10: 0.5, 15: 0.5, 20: 0.7, 25: 0.5, 30: 0.5, 35: 0.5},
            [(5, "accuracy"), (25, "accuracy")],
        ),
    ],
)
def test_accuracy_collapse_is_a_lasting_fall_below_the_best(accuracies, expected):
    assert collapse_events(records(accuracies)) == expected


def test_a_run_still_going_counts_a_fall_only_once_it_is_confirmed():
    # what the runner reads to stop a run at its first collapse (stop_at_collapse)
    once_low = records({0: 0.6, 5: 0.7, 10: 0.5, 15: 0.5})
    assert collapse_events(once_low) == [(10, "accuracy")]  # the run ended there
    assert collapse_events(once_low, finished=False) == []  # step 20 may recover
    twice_low = records({0: 0.6, 5: 0.7, 10: 0.5, 15: 0.5, 20: 0.4})
    assert collapse_events(twice_low, finished=False) == [(10, "accuracy")]


def test_reward_and_nonfinite_collapses():
    low = records({0: 0.6}, {1: 0.5, 2: 0.0, 3: 0.01, 4: 0.0, 5: 0.0})
    assert collapse_events(low) == [(4, "reward")]
    skipped = [{"step": 1, "steps/skipped": 1.0}, {"step": 2, "steps/skipped": 0.0}]
    assert collapse_events(skipped) == [(1, "nonfinite")]


def step_records(jumps: dict[str, int], steps: int = 15) -> list[dict]:
    """Steps 1..`steps` with every precursor metric noisy around a level, and metric `m`
    jumping far from it from step `jumps[m]` on; a step-0 evaluation record first."""
    levels = {
        "grad_norm": 1.0,
        "routing/update_activated_experts": 0.05,
        "mismatch/k3": 1e-3,
        "entropy/mean": 0.8,
    }
    out = [{"step": 0, "eval/accuracy": 0.6}]
    for step in range(1, steps + 1):
        record = {"step": step}
        for key, level in levels.items():
            value = level * (1 + 0.02 * (-1) ** step)
            record[key] = value * 5 if step >= jumps.get(key, steps + 1) else value
        out.append(record)
    return out


def test_precursor_is_the_metric_that_moved_first_before_the_collapse():
    assert collapse_precursor(step_records({"grad_norm": 8}), 12) == ("grad_norm", 8)
    assert collapse_precursor(step_records({}), 12) == ("", None)
    later = {"grad_norm": 9, "entropy/mean": 7, "mismatch/k3": 10}
    assert collapse_precursor(step_records(later), 12) == ("entropy", 7)
    # a tie goes to the earlier metric: grad_norm, drift, mismatch, entropy
    tie = {"mismatch/k3": 8, "routing/update_activated_experts": 8}
    assert collapse_precursor(step_records(tie), 12) == ("drift", 8)
    # a move at or after the collapse is no precursor
    assert collapse_precursor(step_records({"grad_norm": 12}), 12) == ("", None)
    # the baseline is the first 5 steps: a collapse at step 6 leaves nothing to compare
    assert collapse_precursor(step_records({"grad_norm": 2}), 6) == ("", None)


def test_precursor_drift_falls_back_and_a_flat_baseline_moves_on_any_change():
    old = [
        {
            ("routing/drift_token_layer" if k == "routing/update_activated_experts" else k): v
            for k, v in r.items()
        }
        for r in step_records({"routing/update_activated_experts": 9})
    ]
    assert collapse_precursor(old, 12) == ("drift", 9)
    flat = [{"step": s, "grad_norm": 1.0 if s < 7 else 1.001} for s in range(1, 13)]
    assert collapse_precursor(flat, 12) == ("grad_norm", 7)


def collapse_point(arm: str, collapsed_seeds: set[int], seeds: int = 12) -> list[dict]:
    """`arm`'s runs at the collapse point over `seeds` paired seeds, those in `collapsed_seeds`
    collapsing at step 20 + seed (stopped there), the others running all 60 steps."""
    at = {"updates_per_batch": 8, "engine_dtype": "bfloat16", "cell": "collapse"}
    rows = []
    for seed in range(1, seeds + 1):
        collapsed = seed in collapsed_seeds
        rows.append(
            row(arm, seed, **at)
            | {
                "collapse_events": int(collapsed),
                "first_collapse_step": 20 + seed if collapsed else None,
                "steps": 22 + seed if collapsed else 60,
            }
        )
    return rows


def test_gspo_survives_as_well_when_grpo_with_replay_collapses_far_more():
    rows = collapse_point("gspo", set()) + collapse_point("grpo_r2", {1, 2, 3, 4, 5, 6})
    claim = claims.gspo_survives_as_well_as_r2(rows)
    assert claim.number == 22 and claim.verdict == "PASS"  # -0.5, interval under +0.10
    assert "GSPO 0 of 12 collapsed" in claim.evidence and "GRPO + R2 6 of 12" in claim.evidence
    assert "collapsed first: candidate in 0, reference in 6 of 12 seeds" in claim.evidence
    # the reverse: GSPO collapses in 8 more seeds than R2
    worse = collapse_point("gspo", set(range(1, 11))) + collapse_point("grpo_r2", {1, 2})
    assert verdict(claims.gspo_survives_as_well_as_r2, worse) == "FAIL"
    # one collapse against none: too few seeds to tell, and it says how many would
    close = collapse_point("gspo", {3}) + collapse_point("grpo_r2", set())
    claim = claims.gspo_survives_as_well_as_r2(close)
    assert claim.verdict == "INCONCLUSIVE" and "paired seeds to decide" in claim.evidence


def test_survival_claims_need_a_cell_that_collapsed_and_the_arms_in_it():
    calm = collapse_point("gspo", set()) + collapse_point("grpo_r3", set())
    claim = claims.gspo_survives_as_well_as_r3(calm)
    assert claim.verdict == "NOT TESTED" and "not a collapse point" in claim.evidence
    base = arms("gspo", "grpo_r3")  # 4 updates, float32 engine: not the collapse point
    assert "needs GSPO and GRPO + R3" in claims.gspo_survives_as_well_as_r3(base).evidence


def test_replay_helps_grpo_survive_only_with_fewer_collapses_over_paired_seeds():
    helps = collapse_point("grpo_r2", set()) + collapse_point("grpo", {1, 2, 3, 4, 5, 6, 7})
    assert verdict(claims.replay_helps_grpo_survive, helps) == "PASS"
    # as many collapses with replay as without: a gain of 10 points is not excluded by 12 seeds
    same = collapse_point("grpo_r2", {1, 2, 3}) + collapse_point("grpo", {1, 2, 3})
    assert verdict(claims.replay_helps_grpo_survive, same) == "INCONCLUSIVE"
    # far more collapses with replay: no gain of 10 points
    worse = collapse_point("grpo_r2", set(range(1, 10))) + collapse_point("grpo", {1})
    assert verdict(claims.replay_helps_grpo_survive, worse) == "FAIL"


def test_a_grid_checks_the_claims_it_names():
    rows = collapse_point("gspo", set()) + collapse_point("grpo_r2", {1, 2})
    checked = claims.check_claims(rows, (15, 22, 23, 24))
    assert [c.number for c in checked] == [15, 22, 23, 24]
    with pytest.raises(ValueError, match="claims: 29 is not a claim's number \\(1 \\.\\. 28\\)"):
        claims.check_claims(rows, (22, 29))


DOSES = (0.03, 0.1, 0.3)


def dosed(arm: str, accuracy, seeds=(1, 2, 3, 4)) -> list[dict]:
    """`arm`'s runs at dose 0 and at each margin- and random-chosen dose of DOSES, float32 engine;
    final accuracy `accuracy(dose, at, seed)`."""
    out = []
    for dose, at in [(0.0, "margin"), *((d, a) for d in DOSES for a in ("margin", "random"))]:
        for seed in seeds:
            cell = "base" if dose == 0 else f"flip_routes={dose}__flip_routes_at={at}"
            out.append(
                row(arm, seed, cell)
                | {
                    "flip_routes": dose,
                    "flip_routes_at": at,
                    "final_accuracy": accuracy(dose, at, seed),
                    # runs of two doses are never the same computation (stability.duplicates)
                    "reward_mean": 0.5 + 0.01 * dose + (at == "random") * 0.001,
                    "mismatch_k3": 1e-4 * dose,
                }
            )
    return out


def falls_from(threshold: float, step: float = 0.2):
    """Final accuracy 0.7 (+ a seed wobble) below `threshold`, `step` lower from it on."""
    return lambda dose, at, seed: 0.7 + 0.002 * seed - (step if dose >= threshold else 0.0)


def test_every_method_falls_with_the_dose_and_grpo_first():
    methods = ("grpo", "grpo_r3", "gspo", "grpo_tis")
    rows = dosed("grpo", falls_from(0.03)) + [
        r for arm in methods[1:] for r in dosed(arm, falls_from(0.1))
    ]
    claim = claims.stability_falls_with_dose(rows)
    assert claim.number == 25 and claim.verdict == "PASS"
    assert "GRPO less stable from 0.03" in claim.evidence
    assert "GSPO less stable from 0.1" in claim.evidence
    # GSPO unmoved even at 0.3: its stability does not fall
    flat = [r for r in rows if r["arm"] != "gspo"] + dosed("gspo", falls_from(9.0))
    assert verdict(claims.stability_falls_with_dose, flat) == "FAIL"
    # another method falls before GRPO
    late = dosed("grpo", falls_from(0.3)) + [
        r for arm in methods[1:] for r in dosed(arm, falls_from(0.1))
    ]
    assert verdict(claims.stability_falls_with_dose, late) == "FAIL"
    assert verdict(claims.stability_falls_with_dose, arms("grpo", "gspo")) == "NOT TESTED"


def test_margin_flips_hurt_more_than_random_ones_paired_by_arm_dose_and_seed():
    def hurt(margin_loss: float):
        return lambda dose, at, seed: (
            0.7 + 0.01 * seed - (margin_loss if at == "margin" and dose else 0)
        )

    assert verdict(claims.margin_flips_hurt_more, dosed("grpo", hurt(0.1))) == "PASS"
    claim = claims.margin_flips_hurt_more(dosed("grpo", hurt(0.0)))
    assert claim.verdict == "FAIL" and "(12 pairs)" in claim.evidence  # 3 doses x 4 seeds
    noisy = dosed("grpo", lambda d, at, seed: 0.7 + (0.2 if (seed + (at == "margin")) % 2 else 0))
    assert verdict(claims.margin_flips_hurt_more, noisy) == "INCONCLUSIVE"


def test_r3_removes_the_dose_effect_only_where_grpo_had_one():
    rows = dosed("grpo", falls_from(0.1)) + dosed("grpo_r3", falls_from(9.0))
    claim = claims.r3_removes_dose_effect(rows)
    assert claim.number == 27 and claim.verdict == "PASS" and "without replay" in claim.evidence
    both_fall = dosed("grpo", falls_from(0.1)) + dosed("grpo_r3", falls_from(0.3))
    assert verdict(claims.r3_removes_dose_effect, both_fall) == "FAIL"
    no_effect = dosed("grpo", falls_from(9.0)) + dosed("grpo_r3", falls_from(9.0))
    claim = claims.r3_removes_dose_effect(no_effect)
    assert claim.verdict == "NOT TESTED" and "no effect to remove" in claim.evidence
