"""Each claim on synthetic summary rows: it passes on data that supports it, fails when the data
behind it is changed, and is not tested without the runs it needs."""

from __future__ import annotations

import pytest

from megatron_rl.bench.drift import claims
from megatron_rl.bench.drift.summary import collapse_events, collapse_precursor

ARMS = {
    "grpo": ("grpo", "none", "none"),
    "grpo_r2": ("grpo", "r2", "none"),
    "gspo": ("gspo", "none", "none"),
    "gspo_engine_logp": ("gspo", "none", "bypass"),
}


def row(arm: str, seed: int = 1, cell: str = "base", **values) -> dict:
    loss, replay, mismatch = ARMS[arm]
    drift = None if replay != "none" or mismatch == "bypass" else 0.02
    return {
        "run_id": f"{arm}--{cell}--seed{seed}",
        "arm": arm,
        "cell": cell,
        "seed": seed,
        "state": "done",
        "loss": loss,
        "routing_replay": replay,
        "mismatch": mismatch,
        "updates_per_batch": 4,
        "lr": 2e-4,
        "layers": 4,
        "collapse_events": 0,
        "final_accuracy": 0.7 + 0.01 * seed,
        "drift_token_layer": drift,
        "drift_token_any": None if drift is None else 0.08,
        "replay_miss_max": 0.0 if replay == "r2" else None,
        "clip_frac_token": 0.2 if loss == "gspo" else 0.002,
        "log_ratio_abs_max": 1.0 if replay == "none" else 0.5,
        "log_ratio_outside_0.8_1.25": 0.01 if replay == "none" else 0.005,
        "old_logprob_s": 0.0 if mismatch == "bypass" else 0.2,
        "step_s": 1.2,
        "learn_s_per_1k_tokens": 0.5,
        "record_bytes": 40_000.0,
    } | values


def arms(*names: str, seeds=(1, 2, 3), cell="base", **values) -> list[dict]:
    return [row(name, seed, cell, **values) for name in names for seed in seeds]


def verdict(check, rows) -> str:
    return check(rows).verdict


def test_drift_after_update_fails_on_zero_drift_or_a_replay_miss():
    rows = arms("grpo", "grpo_r2")
    assert verdict(claims.drift_after_update, rows) == "PASS"
    still = [r | {"drift_token_layer": 0.0} if r["arm"] == "grpo" else r for r in rows]
    assert verdict(claims.drift_after_update, still) == "FAIL"
    missed = [*rows[:-1], rows[-1] | {"replay_miss_max": 0.01}]
    assert verdict(claims.drift_after_update, missed) == "FAIL"
    on_policy = [r | {"updates_per_batch": 1} for r in rows]
    assert verdict(claims.drift_after_update, on_policy) == "NOT TESTED"


def depth_rows(token_any: dict[int, float], later: bool = True) -> list[dict]:
    rows = []
    for depth, share in token_any.items():
        per_layer = {
            f"drift_layer_{i}": 0.01 * (i + 1 if later else depth - i) for i in range(depth)
        }
        cell = "base" if depth == 4 else f"layers={depth}"
        rows += arms("grpo", cell=cell, layers=depth, drift_token_any=share, **per_layer)
    return rows


def test_drift_grows_with_depth_fails_when_it_does_not():
    assert verdict(claims.drift_grows_with_depth, depth_rows({2: 0.1, 4: 0.2, 8: 0.4})) == "PASS"
    flat = depth_rows({2: 0.1, 4: 0.2, 8: 0.15})
    assert verdict(claims.drift_grows_with_depth, flat) == "FAIL"
    early = depth_rows({2: 0.1, 4: 0.2, 8: 0.4}, later=False)
    assert verdict(claims.drift_grows_with_depth, early) == "FAIL"
    assert verdict(claims.drift_grows_with_depth, depth_rows({4: 0.2})) == "NOT TESTED"


def test_tails_fatten_without_replay_fails_when_replay_has_the_fatter_tail():
    rows = arms("grpo", "grpo_r2")
    assert verdict(claims.tails_fatten_without_replay, rows) == "PASS"
    swapped = [
        r | {"log_ratio_outside_0.8_1.25": 0.02} if r["arm"] == "grpo_r2" else r for r in rows
    ]
    assert verdict(claims.tails_fatten_without_replay, swapped) == "FAIL"
    assert verdict(claims.tails_fatten_without_replay, arms("grpo")) == "NOT TESTED"


def test_gspo_clips_far_more_needs_ten_times_grpo():
    rows = arms("gspo", "grpo_r2")
    assert verdict(claims.gspo_clips_far_more, rows) == "PASS"
    close = [r | {"clip_frac_token": 0.05} if r["loss"] == "grpo" else r for r in rows]
    assert verdict(claims.gspo_clips_far_more, close) == "FAIL"


def test_gspo_stability_is_tested_only_at_strong_drift():
    weak = arms("gspo", "grpo_r2")
    assert verdict(claims.gspo_as_stable_as_r2, weak) == "NOT TESTED"  # 2% < 5% drift
    strong = [r | {"drift_token_layer": 0.08} if r["arm"] == "gspo" else r for r in weak]
    assert verdict(claims.gspo_as_stable_as_r2, strong) == "PASS"
    collapsing = [r | {"collapse_events": 1} if r["arm"] == "gspo" else r for r in strong]
    assert verdict(claims.gspo_as_stable_as_r2, collapsing) == "FAIL"
    worse = [r | {"final_accuracy": 0.5} if r["arm"] == "gspo" else r for r in strong]
    assert verdict(claims.gspo_as_stable_as_r2, worse) == "FAIL"


def test_on_policy_claim_needs_both_halves():
    on = arms("grpo", "grpo_r2", cell="updates_per_batch=1", updates_per_batch=1)
    off_bad = [
        r | {"collapse_events": 2} if r["arm"] == "grpo" else r
        for r in arms("grpo", "grpo_r2", cell="updates_per_batch=8", updates_per_batch=8)
    ]
    assert verdict(claims.on_policy_needs_no_replay, on + off_bad) == "PASS"
    off_fine = arms("grpo", "grpo_r2", cell="updates_per_batch=8", updates_per_batch=8)
    assert verdict(claims.on_policy_needs_no_replay, on + off_fine) == "FAIL"
    on_bad = [r | {"final_accuracy": 0.3} if r["arm"] == "grpo" else r for r in on]
    assert verdict(claims.on_policy_needs_no_replay, on_bad + off_bad) == "FAIL"
    assert verdict(claims.on_policy_needs_no_replay, off_bad) == "NOT TESTED"


def test_engine_logprobs_claim_needs_stability_and_a_saving():
    rows = arms("gspo", "gspo_engine_logp")
    claim = claims.engine_logprobs_suffice(rows)
    assert claim.verdict == "PASS" and "0.200 s per step" in claim.evidence
    no_saving = [r | {"old_logprob_s": 0.2} for r in rows]
    assert verdict(claims.engine_logprobs_suffice, no_saving) == "FAIL"
    unstable = [r | {"collapse_events": 1} if r["mismatch"] == "bypass" else r for r in rows]
    assert verdict(claims.engine_logprobs_suffice, unstable) == "FAIL"


def test_replay_cost_claim_fails_above_its_threshold():
    rows = arms("grpo", "grpo_r2")
    assert verdict(claims.replay_is_cheap, rows) == "PASS"
    slow = [r | {"learn_s_per_1k_tokens": 0.6} if r["arm"] == "grpo_r2" else r for r in rows]
    assert verdict(claims.replay_is_cheap, slow) == "FAIL"  # +20%


def test_check_claims_leaves_out_unfinished_runs():
    rows = arms("grpo", "grpo_r2")
    crashed = [r | {"state": "crashed"} if r["arm"] == "grpo_r2" else r for r in rows]
    by_number = {c.number: c.verdict for c in claims.check_claims(crashed)}
    assert by_number[1] == "NOT TESTED" and len(by_number) == 8


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
        ({0: 0.6, 5: 0.7, 10: 0.5}, [(10, "accuracy")]),  # at the end, not recovered
        (
            {0: 0.7, 5: 0.5, 10: 0.5, 15: 0.5, 20: 0.7, 25: 0.5, 30: 0.5, 35: 0.5},
            [(5, "accuracy"), (25, "accuracy")],
        ),
    ],
)
def test_accuracy_collapse_is_a_lasting_fall_below_the_best(accuracies, expected):
    assert collapse_events(records(accuracies)) == expected


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
