"""The uncertainty of a drift-grid comparison: intervals for paired differences over seeds, the
smallest difference a design can detect, how many seeds would decide a question, an exact
stratified test for event counts, and the verdict an interval gives against a margin.

Seed k of every arm sees the same prompts, minibatch order and engine seeds, so arms are compared
on their per-seed differences (a paired design: the seed's own effect cancels). Everything here is
standard library only and exact where the sample sizes are this small (3 to 10 seeds): Student's t
from its CDF (the regularized incomplete beta function), hypergeometric tails by enumeration.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Sequence
from dataclasses import dataclass
from statistics import NormalDist

PASS, FAIL, INCONCLUSIVE = "PASS", "FAIL", "INCONCLUSIVE"
LEVEL = 0.95
POWER = 0.8
_MAX_SEEDS = 1000


@dataclass(frozen=True)
class Interval:
    """A two-sided `level` confidence interval for `estimate` from `n` paired observations."""

    estimate: float
    low: float
    high: float
    level: float
    n: int

    def __str__(self) -> str:
        bounds = f"[{self.low:+.4g}, {self.high:+.4g}]"
        return f"{self.estimate:+.4g} {bounds} ({self.level:.0%}, n={self.n})"


def student_t_cdf(x: float, df: float) -> float:
    """P(T <= x) for Student's t with `df` > 0 degrees of freedom."""
    if df <= 0:
        raise ValueError(f"df: expected > 0, got {df!r}")
    tail = 0.5 * _regularized_incomplete_beta(df / (df + x * x), df / 2, 0.5)
    return 1.0 - tail if x > 0 else tail


def student_t_quantile(p: float, df: float) -> float:
    """The x with P(T <= x) = `p` (0 < p < 1), by bisection on the CDF (to 1e-12)."""
    if not 0 < p < 1:
        raise ValueError(f"p: expected a probability strictly between 0 and 1, got {p!r}")
    if p < 0.5:
        return -student_t_quantile(1 - p, df)
    low, high = 0.0, 1.0
    while student_t_cdf(high, df) < p:
        low, high = high, 2 * high
    while high - low > 1e-12 * max(1.0, high):
        middle = (low + high) / 2
        low, high = (middle, high) if student_t_cdf(middle, df) < p else (low, middle)
    return (low + high) / 2


def paired_differences(candidate: Sequence[float], reference: Sequence[float]) -> list[float]:
    """candidate[k] - reference[k] per seed k; ValueError unless both have one value per seed."""
    if len(candidate) != len(reference):
        raise ValueError(
            f"paired arms need one value per seed each: got {len(candidate)} and {len(reference)}"
        )
    return [c - r for c, r in zip(candidate, reference, strict=True)]


def paired_interval(
    candidate: Sequence[float], reference: Sequence[float], level: float = LEVEL
) -> Interval:
    """The paired-t interval of the mean of candidate - reference over seeds ([seeds] each, seed
    k of both arms paired); at least 2 seeds."""
    differences = paired_differences(candidate, reference)
    n = len(differences)
    if n < 2:
        raise ValueError(f"an interval needs at least 2 paired seeds, got {n}")
    mean = statistics.fmean(differences)
    half = student_t_quantile((1 + level) / 2, n - 1) * statistics.stdev(differences) / math.sqrt(n)
    return Interval(mean, mean - half, mean + half, level, n)


def detectable_difference(
    sd_of_differences: float, n: int, level: float = LEVEL, power: float = POWER
) -> float:
    """The smallest true mean difference that a paired design of `n` seeds finds (its `level`
    interval excludes 0) with probability `power`, when the per-seed differences have standard
    deviation `sd_of_differences`: (t_{(1+level)/2} + t_{power}) * sd / sqrt(n), n - 1 degrees
    of freedom (the usual approximation of the noncentral t: at 6 seeds the power is 0.80, at 3
    about 0.77)."""
    if n < 2:
        raise ValueError(f"n: expected at least 2 seeds, got {n}")
    df = n - 1
    spread = student_t_quantile((1 + level) / 2, df) + student_t_quantile(power, df)
    return spread * sd_of_differences / math.sqrt(n)


def seeds_to_detect(
    sd_of_differences: float, difference: float, level: float = LEVEL, power: float = POWER
) -> int | None:
    """The fewest seeds whose `detectable_difference` is at most `difference` (None past
    1000 seeds, or for a difference of 0)."""
    if difference <= 0:
        return None
    for n in range(2, _MAX_SEEDS + 1):
        if detectable_difference(sd_of_differences, n, level, power) <= difference:
            return n
    return None


def at_least_verdict(interval: Interval, threshold: float) -> str:
    """Whether the interval says the true difference is at least `threshold`: PASS when all of
    it is (low >= threshold), FAIL when none of it is (high < threshold), INCONCLUSIVE between.
    A non-inferiority claim ("no worse than by more than margin m") is threshold -m."""
    if interval.low >= threshold:
        return PASS
    if interval.high < threshold:
        return FAIL
    return INCONCLUSIVE


@dataclass(frozen=True)
class Effect:
    """A claim's measured effect: the mean of paired observations (per-seed differences between
    two arms, or one arm's per-seed values) with its interval, against a `threshold` fixed before
    the runs; the smallest distance from the mean that the design detects, and the paired seeds
    that would decide the claim were the true effect what was measured (None: over 1000, or a
    mean on the threshold)."""

    label: str
    interval: Interval
    threshold: float
    detectable: float
    seeds_needed: int | None

    def at_least(self) -> str:
        """PASS when the interval lies at or above the threshold, FAIL below, else INCONCLUSIVE."""
        return at_least_verdict(self.interval, self.threshold)

    def above(self) -> str:
        """PASS when the interval lies strictly above the threshold, FAIL when none of it does,
        else INCONCLUSIVE (a claim that one arm's value is larger: threshold 0)."""
        if self.interval.low > self.threshold:
            return PASS
        if self.interval.high <= self.threshold:
            return FAIL
        return INCONCLUSIVE

    def below(self) -> str:
        """The reverse of `at_least`: the effect is under the threshold."""
        return {PASS: FAIL, FAIL: PASS}.get(self.at_least(), INCONCLUSIVE)

    def __str__(self) -> str:
        seeds = "over 1000" if self.seeds_needed is None else str(self.seeds_needed)
        return (
            f"{self.label} {self.interval} against {self.threshold:.4g}, detectable "
            f"{self.detectable:.3g}, seeds to decide {seeds}"
        )


def effect(
    label: str, observations: Sequence[float], threshold: float, level: float = LEVEL
) -> Effect | None:
    """The `Effect` of `observations` ([pairs]: one per seed, or per paired run) against
    `threshold`; None under 2 observations."""
    if len(observations) < 2:
        return None
    interval = paired_interval(observations, [0.0] * len(observations), level)
    spread = statistics.stdev(observations)
    return Effect(
        label,
        interval,
        threshold,
        detectable_difference(spread, len(observations), level),
        seeds_to_detect(spread, abs(interval.estimate - threshold), level),
    )


def rank_correlation_interval(rho: float, n: int, level: float = LEVEL) -> Interval:
    """The `level` interval of a Spearman rank correlation `rho` over `n` > 3 points: Fisher's z
    with Bonett and Wright's standard error for Spearman's rho, sqrt((1 + rho^2 / 2) / (n - 3)).
    (A perfect rho of +-1 is taken as +-(1 - 1e-12), whose interval is all but the point.)"""
    if n <= 3:
        raise ValueError(f"n: a rank correlation's interval needs more than 3 points, got {n}")
    z = math.atanh(max(-1 + 1e-12, min(1 - 1e-12, rho)))
    half = NormalDist().inv_cdf((1 + level) / 2) * math.sqrt((1 + rho * rho / 2) / (n - 3))
    return Interval(rho, math.tanh(z - half), math.tanh(z + half), level, n)


def zero_event_bound(runs: int, level: float = LEVEL) -> float:
    """The exact one-sided `level` upper bound of an event rate after 0 events in `runs`
    independent runs: the rate p at which (1 - p)^runs = 1 - level (3 of 3 calm runs: 63%)."""
    if runs < 1:
        raise ValueError(f"runs: expected at least 1, got {runs}")
    return 1 - (1 - level) ** (1 / runs)


@dataclass(frozen=True)
class Stratum:
    """One cell's event counts: `events_a` of `runs_a` runs of arm A, the same for arm B."""

    events_a: int
    runs_a: int
    events_b: int
    runs_b: int

    def __post_init__(self) -> None:
        for events, runs, arm in (
            (self.events_a, self.runs_a, "a"),
            (self.events_b, self.runs_b, "b"),
        ):
            if not 0 <= events <= runs:
                raise ValueError(f"events_{arm}: expected 0..runs_{arm} ({runs}), got {events}")


def stratified_exact_p(strata: Sequence[Stratum]) -> float:
    """One-sided p-value that arm A has the higher event rate, stratified by cell: conditional
    on each cell's margins, A's events in a cell are hypergeometric, independent across cells;
    p = P(sum of A's events >= observed) under equal rates (Fisher's exact test for one cell)."""
    distribution = {0: 1.0}  # total events of A -> probability
    for stratum in strata:
        cell = _hypergeometric(stratum)
        combined: dict[int, float] = {}
        for total, p_total in distribution.items():
            for events, p_events in cell.items():
                combined[total + events] = combined.get(total + events, 0.0) + p_total * p_events
        distribution = combined
    observed = sum(stratum.events_a for stratum in strata)
    return min(1.0, sum(p for total, p in distribution.items() if total >= observed))


def _hypergeometric(stratum: Stratum) -> dict[int, float]:
    """P(A has k of the cell's events) for each possible k, given the cell's margins."""
    events = stratum.events_a + stratum.events_b
    runs = stratum.runs_a + stratum.runs_b
    ways = math.comb(runs, events)
    return {
        k: math.comb(stratum.runs_a, k) * math.comb(stratum.runs_b, events - k) / ways
        for k in range(max(0, events - stratum.runs_b), min(events, stratum.runs_a) + 1)
    }


def _regularized_incomplete_beta(x: float, a: float, b: float) -> float:
    """I_x(a, b) by its continued fraction (modified Lentz), on the side where it converges."""
    if x <= 0:
        return 0.0
    if x >= 1:
        return 1.0
    if x > (a + 1) / (a + b + 2):
        return 1.0 - _regularized_incomplete_beta(1 - x, b, a)
    log_front = a * math.log(x) + b * math.log1p(-x) - math.log(a)
    log_front -= math.lgamma(a) + math.lgamma(b) - math.lgamma(a + b)
    tiny = 1e-300
    c, d = 1.0, 1.0 - (a + b) * x / (a + 1)
    d = 1.0 / (d if abs(d) > tiny else tiny)
    fraction = d
    for m in range(1, 500):
        for numerator in (
            m * (b - m) * x / ((a + 2 * m - 1) * (a + 2 * m)),
            -(a + m) * (a + b + m) * x / ((a + 2 * m) * (a + 2 * m + 1)),
        ):
            d = 1.0 + numerator * d
            d = 1.0 / (d if abs(d) > tiny else tiny)
            c = 1.0 + numerator / c
            c = c if abs(c) > tiny else tiny
            fraction *= c * d
        if abs(c * d - 1.0) < 1e-15:
            break
    return math.exp(log_front) * fraction
