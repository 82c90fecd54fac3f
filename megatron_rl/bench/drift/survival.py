"""Time to collapse as survival data, for arms run on paired seeds (seed k of every arm sees the
same prompts, minibatch order and engine seeds): Kaplan-Meier curves with pointwise intervals,
the log-rank test stratified by seed, exact, and the paired difference of two arms' collapse
rates with its interval. Standard library only.

A run is a `RunTime`: the step of its first collapse event, or the last step it ran (censored:
no collapse by then).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from statistics import NormalDist

from megatron_rl.bench.drift.uncertainty import LEVEL, Interval


@dataclass(frozen=True)
class RunTime:
    """One run: `step` of its first collapse event when `collapsed`, else the last step it ran."""

    step: int
    collapsed: bool


@dataclass(frozen=True)
class SurvivalPoint:
    """The Kaplan-Meier estimate just after `step`: `survival` = P(no collapse by `step`), its
    pointwise interval [`low`, `high`], and the runs `at_risk` then and `events` at it."""

    step: int
    at_risk: int
    events: int
    survival: float
    low: float
    high: float


def kaplan_meier(runs: Sequence[RunTime], level: float = LEVEL) -> list[SurvivalPoint]:
    """The Kaplan-Meier curve of `runs`, one point per step at which some run collapsed (the
    curve is flat in between, 1 before the first); the interval is Greenwood's on the
    log(-log) scale, which keeps it inside [0, 1] (at survival 0 it is [0, 0])."""
    z = NormalDist().inv_cdf((1 + level) / 2)
    survival, greenwood, points = 1.0, 0.0, []
    for step in sorted({run.step for run in runs if run.collapsed}):
        at_risk = sum(run.step >= step for run in runs)
        events = sum(run.collapsed and run.step == step for run in runs)
        survival *= 1 - events / at_risk
        if at_risk > events:
            greenwood += events / (at_risk * (at_risk - events))
        low, high = _log_log_interval(survival, greenwood, z)
        points.append(SurvivalPoint(step, at_risk, events, survival, low, high))
    return points


def _log_log_interval(survival: float, greenwood: float, z: float) -> tuple[float, float]:
    if survival <= 0:
        return 0.0, 0.0
    if survival >= 1:
        return 1.0, 1.0
    spread = z * math.sqrt(greenwood) / abs(math.log(survival))
    log_log = math.log(-math.log(survival))
    return math.exp(-math.exp(log_log + spread)), math.exp(-math.exp(log_log - spread))


@dataclass(frozen=True)
class PairedLogRank:
    """The log-rank test of a candidate arm against a reference, stratified by seed (one run of
    each per seed). In a stratum of two runs only the first collapse while both still ran adds
    to the statistic (a tie or a collapse after the other run ended adds nothing), so the
    statistic is the count of seeds where the candidate collapsed first, and under equal hazards
    it is binomial(discordant, 1/2): the p-values are exact."""

    candidate_first: int  # seeds where the candidate collapsed while the reference still ran
    reference_first: int
    seeds: int

    @property
    def discordant(self) -> int:
        return self.candidate_first + self.reference_first

    @property
    def p_candidate_worse(self) -> float:
        """One-sided: P(candidate first in >= `candidate_first` of the discordant seeds)."""
        return _binomial_tail(self.candidate_first, self.discordant)

    @property
    def p_two_sided(self) -> float:
        extreme = max(self.candidate_first, self.reference_first)
        return min(1.0, 2 * _binomial_tail(extreme, self.discordant))

    def __str__(self) -> str:
        return (
            f"collapsed first: candidate in {self.candidate_first}, reference in "
            f"{self.reference_first} of {self.seeds} seeds (exact stratified log-rank p "
            f"{self.p_two_sided:.3g} two-sided)"
        )


def paired_log_rank(candidate: Sequence[RunTime], reference: Sequence[RunTime]) -> PairedLogRank:
    """The stratified log-rank test of `candidate` against `reference`, run k of each on seed k."""
    _check_paired(candidate, reference)
    pairs = list(zip(candidate, reference, strict=True))
    return PairedLogRank(
        candidate_first=sum(_first(mine, theirs) for mine, theirs in pairs),
        reference_first=sum(_first(theirs, mine) for mine, theirs in pairs),
        seeds=len(pairs),
    )


def _first(run: RunTime, other: RunTime) -> bool:
    """Whether `run` collapsed while `other` still ran (a censored run is at risk at its last
    step, so a collapse at that step comes first)."""
    return run.collapsed and (
        other.step > run.step or (other.step == run.step and not other.collapsed)
    )


def collapse_rate_difference(
    candidate: Sequence[RunTime], reference: Sequence[RunTime], level: float = LEVEL
) -> Interval:
    """The candidate's collapse rate minus the reference's over paired seeds (a run collapsed or
    not, whenever), with Newcombe's hybrid score interval for paired proportions (his method
    10: Wilson intervals of each rate, joined with the pairs' correlation phi)."""
    _check_paired(candidate, reference)
    pairs = list(zip(candidate, reference, strict=True))
    n = len(pairs)
    both = sum(c.collapsed and r.collapsed for c, r in pairs)
    only_c = sum(c.collapsed and not r.collapsed for c, r in pairs)
    only_r = sum(r.collapsed and not c.collapsed for c, r in pairs)
    neither = n - both - only_c - only_r
    rate_c, rate_r = (both + only_c) / n, (both + only_r) / n
    low_c, high_c = wilson(both + only_c, n, level)
    low_r, high_r = wilson(both + only_r, n, level)
    margins = (both + only_c) * (only_r + neither) * (both + only_r) * (only_c + neither)
    phi = (both * neither - only_c * only_r) / math.sqrt(margins) if margins else 0.0
    difference = rate_c - rate_r
    below = _joined(rate_c - low_c, high_r - rate_r, phi)
    above = _joined(high_c - rate_c, rate_r - low_r, phi)
    return Interval(difference, difference - below, difference + above, level, n)


def _joined(first: float, second: float, phi: float) -> float:
    """Newcombe's half-width from the two rates' one-sided Wilson distances."""
    return math.sqrt(max(0.0, first * first - 2 * phi * first * second + second * second))


def wilson(events: int, runs: int, level: float = LEVEL) -> tuple[float, float]:
    """Wilson's score interval of the rate `events` / `runs`."""
    if not 0 <= events <= runs or runs < 1:
        raise ValueError(f"events: expected 0..runs with runs >= 1, got {events} of {runs}")
    z = NormalDist().inv_cdf((1 + level) / 2)
    rate = events / runs
    centre = (rate + z * z / (2 * runs)) / (1 + z * z / runs)
    half = z * math.sqrt(rate * (1 - rate) / runs + z * z / (4 * runs * runs)) / (1 + z * z / runs)
    return max(0.0, centre - half), min(1.0, centre + half)


def _binomial_tail(at_least: int, trials: int) -> float:
    """P(X >= `at_least`) for X ~ binomial(`trials`, 1/2)."""
    return sum(math.comb(trials, k) for k in range(at_least, trials + 1)) / 2**trials


def _check_paired(candidate: Sequence[RunTime], reference: Sequence[RunTime]) -> None:
    if len(candidate) != len(reference) or not candidate:
        raise ValueError(
            f"paired arms need one run per seed each: got {len(candidate)} and {len(reference)}"
        )
