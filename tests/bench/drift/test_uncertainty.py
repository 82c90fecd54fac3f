"""The drift grid's uncertainty: Student's t against its tables and closed form, the paired
interval's coverage and the detectable difference's power by simulation, the exact stratified
test against Fisher's and against a brute-force count, and the verdicts' three outcomes."""

from __future__ import annotations

import itertools
import math
import random
import statistics

import pytest

from megatron_rl.bench.drift.uncertainty import (
    FAIL,
    INCONCLUSIVE,
    PASS,
    Interval,
    Stratum,
    at_least_verdict,
    detectable_difference,
    effect,
    paired_interval,
    rank_correlation_interval,
    seeds_to_detect,
    stratified_exact_p,
    student_t_cdf,
    student_t_quantile,
    zero_event_bound,
)

pytestmark = pytest.mark.timeout(60)


@pytest.mark.parametrize(
    ("p", "df", "table"),
    [
        (0.975, 2, 4.302652729911275),
        (0.975, 5, 2.570581835636314),
        (0.975, 30, 2.042272456301238),
        (0.8, 2, 1.060660171779821),
        (0.025, 9, -2.262157162740992),
    ],
)
def test_t_quantiles_match_the_tables(p, df, table):
    assert student_t_quantile(p, df) == pytest.approx(table, rel=1e-9)


def test_t_with_one_degree_of_freedom_is_cauchy():
    for x in (-7.0, -1.0, 0.0, 0.3, 2.5, 40.0):
        assert student_t_cdf(x, 1) == pytest.approx(0.5 + math.atan(x) / math.pi, abs=1e-12)


def test_the_paired_interval_covers_the_true_difference_95_percent_of_the_time():
    rng = random.Random(0)
    runs, covered = 1500, 0
    for _ in range(runs):
        reference = [rng.gauss(0.0, 1.0) for _ in range(4)]
        # the seed's own effect (shared by both arms) cancels in the pairs
        candidate = [value + 0.3 + rng.gauss(0.0, 0.5) for value in reference]
        interval = paired_interval(candidate, reference)
        covered += interval.low <= 0.3 <= interval.high
    assert abs(covered / runs - 0.95) < 0.02


def test_a_design_finds_its_detectable_difference_with_the_stated_power():
    # the noncentral-t approximation: about 0.80 at 6 seeds (0.77 at 3)
    rng = random.Random(1)
    difference, runs, found = detectable_difference(1.0, 6), 3000, 0
    for _ in range(runs):
        interval = paired_interval([rng.gauss(difference, 1.0) for _ in range(6)], [0.0] * 6)
        found += interval.low > 0 or interval.high < 0
    assert abs(found / runs - 0.8) < 0.03


def test_seeds_to_detect_is_the_fewest_that_reach_the_difference():
    n = seeds_to_detect(0.072, 0.05)
    assert detectable_difference(0.072, n) <= 0.05 < detectable_difference(0.072, n - 1)
    assert detectable_difference(0.072, 3) == pytest.approx(0.2229, abs=1e-4)
    assert seeds_to_detect(1.0, 0.0) is None


def test_unpaired_or_too_few_seeds_are_refused():
    with pytest.raises(ValueError, match="one value per seed each: got 3 and 2"):
        paired_interval([1.0, 2.0, 3.0], [1.0, 2.0])
    with pytest.raises(ValueError, match="at least 2 paired seeds"):
        paired_interval([1.0], [0.0])


@pytest.mark.parametrize(
    ("low", "high", "verdict"), [(0.1, 0.4, PASS), (-0.5, -0.2, FAIL), (-0.1, 0.3, INCONCLUSIVE)]
)
def test_an_interval_passes_fails_or_leaves_open_a_threshold(low, high, verdict):
    assert at_least_verdict(Interval((low + high) / 2, low, high, 0.95, 5), 0.0) == verdict


def test_one_cell_is_fishers_exact_test():
    # the lady tasting tea: 3 of 4 right against 1 of 4
    assert stratified_exact_p([Stratum(3, 4, 1, 4)]) == pytest.approx(17 / 70, rel=1e-12)
    assert stratified_exact_p([Stratum(0, 4, 4, 4)]) == pytest.approx(1.0)


def _brute_force_p(strata: list[Stratum]) -> float:
    """Every equally likely placement of each cell's events among its runs, counted."""
    placements = []
    for stratum in strata:
        runs = stratum.runs_a + stratum.runs_b
        events = stratum.events_a + stratum.events_b
        placements.append(
            [
                sum(run < stratum.runs_a for run in chosen)
                for chosen in itertools.combinations(range(runs), events)
            ]
        )
    observed = sum(stratum.events_a for stratum in strata)
    outcomes = list(itertools.product(*placements))
    return sum(sum(outcome) >= observed for outcome in outcomes) / len(outcomes)


def test_cells_combine_as_a_brute_force_count_says():
    strata = [Stratum(2, 4, 0, 3), Stratum(1, 3, 1, 5), Stratum(3, 3, 1, 4)]
    assert stratified_exact_p(strata) == pytest.approx(_brute_force_p(strata), rel=1e-12)


def test_counts_outside_their_runs_are_refused():
    with pytest.raises(ValueError, match=r"events_b: expected 0..runs_b \(3\), got 4"):
        Stratum(1, 3, 4, 3)


def test_an_effect_is_the_interval_of_its_observations_against_its_threshold():
    observations = [0.12, 0.08, 0.10, 0.11]
    spread = statistics.stdev(observations)
    measured = effect("share", observations, 0.05)
    assert measured.interval == paired_interval(observations, [0.0] * 4)
    assert measured.detectable == pytest.approx(detectable_difference(spread, 4))
    # the seeds that decide it: the fewest whose detectable difference is the distance measured
    assert measured.seeds_needed == seeds_to_detect(spread, 0.1025 - 0.05)
    assert measured.at_least() == measured.above() == PASS and measured.below() == FAIL
    assert str(measured).startswith("share +0.1025 [") and "against 0.05" in str(measured)
    spanning = effect("share", [0.10, 0.00, 0.05], 0.05)
    assert spanning.at_least() == spanning.above() == spanning.below() == INCONCLUSIVE
    assert spanning.seeds_needed is None  # measured on the threshold: no number of seeds decides
    assert effect("share", [0.1], 0.05) is None


def test_above_is_strict_and_at_least_is_not():
    on_threshold = effect("gap", [0.0, 0.0, 0.0], 0.0)
    assert on_threshold.at_least() == PASS and on_threshold.above() == FAIL


def test_the_zero_event_bound_is_the_rate_that_leaves_no_event_five_percent_of_the_time():
    for runs in (1, 3, 9, 30):
        rate = zero_event_bound(runs)
        assert (1 - rate) ** runs == pytest.approx(0.05)
    assert zero_event_bound(3) == pytest.approx(0.6316, abs=1e-4)
    with pytest.raises(ValueError, match="runs: expected at least 1"):
        zero_event_bound(0)


def test_a_rank_correlations_interval_is_fishers_z_with_spearmans_standard_error():
    interval = rank_correlation_interval(0.5, 10)
    z, half = math.atanh(0.5), 1.959963985 * math.sqrt((1 + 0.125) / 7)
    assert (interval.low, interval.high) == pytest.approx(
        (math.tanh(z - half), math.tanh(z + half))
    )
    assert interval.low == pytest.approx(-0.2322, abs=1e-4) and interval.estimate == 0.5
    assert rank_correlation_interval(-1.0, 4).high < -0.99  # a perfect rank order
    with pytest.raises(ValueError, match="more than 3 points"):
        rank_correlation_interval(0.5, 3)
