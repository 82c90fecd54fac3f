"""Survival of paired runs (bench/drift/survival.py): Kaplan-Meier, the stratified log-rank test
and the paired collapse-rate difference, against hand counts and a published interval."""

from __future__ import annotations

import math
from statistics import NormalDist

import pytest

from megatron_rl.bench.drift.survival import (
    RunTime,
    collapse_rate_difference,
    kaplan_meier,
    paired_log_rank,
    wilson,
)

COLLAPSED, CALM = (lambda step: RunTime(step, True)), (lambda step: RunTime(step, False))


def test_kaplan_meier_counts_the_runs_at_risk_past_censoring():
    runs = [COLLAPSED(3), CALM(5), COLLAPSED(6), COLLAPSED(6), CALM(8), COLLAPSED(10)]
    points = kaplan_meier(runs)
    assert [(p.step, p.at_risk, p.events) for p in points] == [(3, 6, 1), (6, 4, 2), (10, 1, 1)]
    assert [p.survival for p in points] == pytest.approx([5 / 6, 5 / 12, 0.0])
    # the log(-log) interval in its closed form S ** exp(+-z * sigma), sigma from Greenwood
    z = NormalDist().inv_cdf(0.975)
    for point, greenwood in zip(points[:2], (1 / 30, 1 / 30 + 2 / 8), strict=True):
        sigma = math.sqrt(greenwood) / abs(math.log(point.survival))
        assert point.low == pytest.approx(point.survival ** math.exp(z * sigma))
        assert point.high == pytest.approx(point.survival ** math.exp(-z * sigma))
        assert 0 < point.low < point.survival < point.high < 1
    assert (points[2].low, points[2].high) == (0.0, 0.0)
    assert kaplan_meier([CALM(60)] * 4) == []  # no collapse: the curve stays at 1


def test_without_censoring_the_curve_is_the_share_still_running():
    steps = [4, 9, 9, 20, 31, 31, 31, 45]
    points = kaplan_meier([COLLAPSED(step) for step in steps] + [CALM(60)] * 4)
    for point in points:
        assert point.survival == pytest.approx(sum(s > point.step for s in steps + [60] * 4) / 12)


def test_the_paired_log_rank_counts_who_collapsed_first_and_is_exact():
    candidate = [COLLAPSED(10), COLLAPSED(12), COLLAPSED(30), CALM(60), COLLAPSED(60), COLLAPSED(5)]
    reference = [CALM(60), COLLAPSED(20), COLLAPSED(30), CALM(60), CALM(60), COLLAPSED(3)]
    test = paired_log_rank(candidate, reference)
    # first: seeds 0, 1 and 4 (a collapse at the reference's last step comes first); tie at 30
    assert (test.candidate_first, test.reference_first, test.seeds) == (3, 1, 6)
    assert test.p_candidate_worse == pytest.approx(5 / 16)  # P(X >= 3), X ~ binomial(4, 1/2)
    assert test.p_two_sided == pytest.approx(10 / 16)
    five_nil = paired_log_rank([COLLAPSED(9)] * 5, [CALM(60)] * 5)
    assert five_nil.p_candidate_worse == pytest.approx(1 / 32)
    assert "candidate in 5, reference in 0 of 5 seeds" in str(five_nil)


def test_the_paired_rate_difference_is_newcombes_hybrid_score_interval():
    # Newcombe (1998), Statistics in Medicine 17: 2635-2650, Table II example (a): 36 pairs where
    # both had the event, 12 the first only, 2 the second only, none neither: 0.0569 to 0.3404
    candidate = [COLLAPSED(1)] * 48 + [CALM(9)] * 2
    reference = [COLLAPSED(1)] * 36 + [CALM(9)] * 12 + [COLLAPSED(1)] * 2
    interval = collapse_rate_difference(candidate, reference)
    assert interval.estimate == pytest.approx(0.2)
    assert (round(interval.low, 4), round(interval.high, 4)) == (0.0569, 0.3404)
    # no collapse in either arm: an interval around 0 as wide as Wilson's at 0 of n
    calm = collapse_rate_difference([CALM(60)] * 12, [CALM(60)] * 12)
    assert calm.estimate == 0 and calm.high == pytest.approx(wilson(0, 12)[1])


def test_unpaired_arms_are_refused():
    with pytest.raises(ValueError, match="one run per seed each: got 2 and 3"):
        paired_log_rank([CALM(1)] * 2, [CALM(1)] * 3)
    with pytest.raises(ValueError, match=r"expected 0\.\.runs"):
        wilson(4, 3)
