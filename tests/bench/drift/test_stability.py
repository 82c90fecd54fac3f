"""The paired stability comparison of two drift-grid arms (bench/drift/stability.py): pairing by
cell, model and seed, its verdicts in both directions, duplicate arms and how verdicts combine."""

from __future__ import annotations

import pytest

from megatron_rl.bench.drift.stability import (
    ACCURACY_MARGIN,
    all_hold,
    compare,
    distinct,
    duplicates,
    paired_runs,
)

NAMES = ("candidate", "reference")


def runs(accuracies: list[float], *, collapsed=(), cell="base", reward=0.5) -> list[dict]:
    """One run per seed (0, 1, ...) with these final accuracies; `collapsed`: seeds that had a
    collapse event."""
    return [
        {
            "cell": cell,
            "model": "m",
            "seed": seed,
            "final_accuracy": accuracy,
            "reward_mean": reward,
            "collapse_events": int(seed in collapsed),
        }
        for seed, accuracy in enumerate(accuracies)
    ]


def test_runs_pair_by_cell_model_and_seed_and_unpaired_runs_are_left_out():
    candidate = runs([0.5, 0.6, 0.7]) + runs([0.1], cell="other")
    reference = runs([0.4, 0.5]) + [r | {"model": "n"} for r in runs([0.9, 0.9, 0.9])]
    pairs = paired_runs(candidate, reference)
    assert [(a["seed"], b["final_accuracy"]) for a, b in pairs] == [(0, 0.4), (1, 0.5)]
    assert all(a["model"] == b["model"] == "m" for a, b in pairs)


def test_pairing_removes_the_seeds_own_effect():
    # seeds differ by 0.3, the arms by 0.01 within each seed: paired, the interval is tight
    reference = runs([0.4, 0.7, 0.55, 0.45])
    candidate = runs([0.41, 0.705, 0.56, 0.455], reward=0.6)
    stability = compare(candidate, reference, NAMES)
    assert stability.accuracy.low > 0 and stability.accuracy.high < ACCURACY_MARGIN
    assert stability.as_stable() == "PASS" and stability.not_as_stable() == "FAIL"
    assert stability.seeds_needed <= 4 and stability.detectable < ACCURACY_MARGIN


def test_clearly_worse_accuracy_fails_as_stable_and_passes_not_as_stable():
    stability = compare(runs([0.5, 0.52, 0.49]), runs([0.7, 0.71, 0.72], reward=0.6), NAMES)
    assert stability.accuracy.high < -ACCURACY_MARGIN
    assert stability.as_stable() == "FAIL" and stability.not_as_stable() == "PASS"


def test_noisy_differences_are_inconclusive_and_say_how_many_seeds_would_decide():
    stability = compare(runs([0.5, 0.8, 0.6]), runs([0.7, 0.6, 0.65], reward=0.6), NAMES)
    assert stability.as_stable() == stability.not_as_stable() == "INCONCLUSIVE"
    assert stability.seeds_needed > 3 and stability.detectable > ACCURACY_MARGIN
    text = str(stability)
    assert f"paired runs for the margin: {stability.seeds_needed}" in text
    assert f"detectable {stability.detectable:.3f}" in text


def test_collapses_decide_at_the_exact_tests_level():
    reference = runs([0.7, 0.71, 0.72], reward=0.6)
    every_seed = compare(runs([0.7, 0.71, 0.72], collapsed=(0, 1, 2)), reference, NAMES)
    assert every_seed.collapse_p == pytest.approx(0.05)  # 3 of 3 against 0 of 3
    assert every_seed.as_stable() == "FAIL" and every_seed.not_as_stable() == "PASS"
    assert every_seed.collapsed == (3, 0)
    one_seed = compare(runs([0.7, 0.71, 0.72], collapsed=(0,)), reference, NAMES)
    assert one_seed.collapse_p == pytest.approx(0.5)
    assert one_seed.as_stable() == "PASS"  # its accuracy held: one collapse of three tells nothing


def test_collapses_are_stratified_by_cell():
    # each cell alone is 1 of 1 against 0 of 1 (p 0.5); the two cells together p 0.25
    candidate = runs([0.7], collapsed=(0,)) + runs([0.7], collapsed=(0,), cell="b")
    reference = runs([0.7], reward=0.6) + runs([0.7], reward=0.6, cell="b")
    assert compare(candidate, reference, NAMES).collapse_p == pytest.approx(0.25)


def test_duplicate_arms_are_not_tested_whatever_their_numbers():
    reference = runs([0.7, 0.71, 0.72])
    same = compare(runs([0.7, 0.71, 0.72]), reference, NAMES)
    assert same.duplicate and same.as_stable() == same.not_as_stable() == "NOT TESTED"
    assert "same computation" in str(same)
    # one identifying column apart in one seed: a different computation
    differs = runs([0.7, 0.71, 0.72])
    differs[2]["reward_mean"] = 0.51
    assert not duplicates(paired_runs(differs, reference))
    assert not duplicates([])
    unmeasured = [{"final_accuracy": None}]
    assert not duplicates([(unmeasured[0], unmeasured[0])])


def test_under_two_pairs_nothing_is_decided():
    stability = compare(runs([0.5]), runs([0.9], reward=0.6), NAMES)
    assert stability.accuracy is None and stability.as_stable() == "NOT TESTED"
    assert "need 2" in str(stability)


@pytest.mark.parametrize(
    ("verdicts", "expected"),
    [
        (["PASS", "PASS"], "PASS"),
        (["PASS", "INCONCLUSIVE"], "INCONCLUSIVE"),
        (["INCONCLUSIVE", "NOT TESTED"], "NOT TESTED"),
        (["NOT TESTED", "FAIL", "PASS"], "FAIL"),
        ([], "NOT TESTED"),
    ],
)
def test_a_claim_needing_several_verdicts_holds_only_when_all_do(verdicts, expected):
    assert all_hold(verdicts) == expected


def test_distinct_keeps_the_first_of_runs_that_computed_the_same_thing():
    first = runs([0.7, 0.71])
    again = [r | {"arm": "again"} for r in runs([0.7, 0.71])]
    other_seed = runs([0.7], reward=0.5)[0] | {"seed": 5}
    different = runs([0.7, 0.9])
    kept = distinct(first + again + [other_seed] + different[1:])
    assert kept == [*first, other_seed, different[1]]
