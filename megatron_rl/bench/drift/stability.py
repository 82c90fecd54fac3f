"""Whether one arm of a drift grid is as stable as another: a paired comparison over seeds.

Seed k of every arm sees the same prompts, minibatch order and engine seeds, so two arms are
compared run by run: each candidate run against the reference run of the same cell, model and
seed (a blocked design: the seed's and the cell's own effects cancel). The decision is made here,
once, for every stability claim (claims/), from two measures fixed before the grid's rerun:
- final held-out accuracy, candidate minus reference: its paired 95% interval against the
  non-inferiority margin `ACCURACY_MARGIN` (uncertainty.at_least_verdict at -margin);
- collapses: the runs with a collapse event, compared by the exact test stratified by cell
  (uncertainty.stratified_exact_p); p <= `ALPHA` that the candidate collapses more decides on
  its own (3 of 3 runs against 0 of 3 is p = 0.05; a collapse also lowers the final accuracy,
  but the two arms' collapses are counted directly too).
"As stable": PASS when the candidate does not collapse significantly more and its accuracy
interval lies above -margin; FAIL when it collapses significantly more or the interval lies
below -margin; INCONCLUSIVE otherwise. "Not as stable" is the reverse. Two arms whose paired
runs are equal in every identifying column (`DUPLICATE_COLUMNS`) computed the same thing: the
comparison is NOT TESTED, whatever the numbers.
"""

from __future__ import annotations

import statistics
from collections import defaultdict
from dataclasses import dataclass
from typing import Any

from megatron_rl.bench.drift.uncertainty import (
    FAIL,
    INCONCLUSIVE,
    PASS,
    Interval,
    Stratum,
    at_least_verdict,
    detectable_difference,
    paired_interval,
    seeds_to_detect,
    stratified_exact_p,
)

NOT_TESTED = "NOT TESTED"
# 0.05 of final held-out accuracy: about 3 of the 64 evaluation problems, under the 0.057 standard
# deviation the evaluation alone gives one run (the 128-expert grid, docs/drift.md)
ACCURACY_MARGIN = 0.05
ALPHA = 0.05
# per-run values that two different computations do not share to the last digit
DUPLICATE_COLUMNS = ("final_accuracy", "reward_mean", "grad_norm", "kl_k3")

Row = dict[str, Any]


def _pair_key(row: Row) -> tuple[Any, Any, Any]:
    return row["cell"], row.get("model"), row["seed"]


def paired_runs(candidate: list[Row], reference: list[Row]) -> list[tuple[Row, Row]]:
    """(candidate run, reference run) of each cell, model and seed both arms ran, in the
    candidate's order."""
    by_key = {_pair_key(row): row for row in reference}
    return [(row, by_key[_pair_key(row)]) for row in candidate if _pair_key(row) in by_key]


def duplicates(pairs: list[tuple[Row, Row]]) -> bool:
    """Every pair agrees in every `DUPLICATE_COLUMNS` value both runs recorded (at least one)."""
    if not pairs:
        return False
    for a, b in pairs:
        shared = [c for c in DUPLICATE_COLUMNS if a.get(c) is not None and b.get(c) is not None]
        if not shared or any(a[c] != b[c] for c in shared):
            return False
    return True


def distinct(rows: list[Row]) -> list[Row]:
    """`rows` less each run that repeats an earlier one of the same cell, model and seed (the two
    `duplicates`): arms that computed the same thing count once where runs are pooled."""
    kept: list[Row] = []
    for row in rows:
        if not any(_pair_key(k) == _pair_key(row) and duplicates([(row, k)]) for k in kept):
            kept.append(row)
    return kept


@dataclass(frozen=True)
class Stability:
    """The paired comparison of a candidate arm's runs with a reference arm's."""

    names: tuple[str, str]  # (candidate, reference), for the evidence
    pairs: int
    accuracy: Interval | None  # candidate - reference final accuracy; None under 2 pairs
    detectable: float | None  # the smallest accuracy difference this design detects
    seeds_needed: int | None  # paired seeds whose detectable difference is the margin
    collapsed: tuple[int, int]  # runs with a collapse event: candidate, reference
    collapse_p: float  # one-sided: the candidate collapses more
    duplicate: bool

    def as_stable(self) -> str:
        """PASS, FAIL, INCONCLUSIVE or NOT TESTED (module docstring)."""
        if self.duplicate or self.accuracy is None:
            return NOT_TESTED
        if self.collapse_p <= ALPHA:
            return FAIL
        return at_least_verdict(self.accuracy, -ACCURACY_MARGIN)

    def not_as_stable(self) -> str:
        """The reverse claim: the candidate is less stable than the reference."""
        if self.duplicate or self.accuracy is None:
            return NOT_TESTED
        if self.collapse_p <= ALPHA:
            return PASS
        return {PASS: FAIL, FAIL: PASS}.get(
            at_least_verdict(self.accuracy, -ACCURACY_MARGIN), INCONCLUSIVE
        )

    def __str__(self) -> str:
        candidate, reference = self.names
        if self.duplicate:
            return (
                f"{candidate} and {reference} are the same computation: equal in "
                f"{', '.join(DUPLICATE_COLUMNS)} in all {self.pairs} paired runs"
            )
        if self.accuracy is None:
            return f"{candidate} vs {reference}: {self.pairs} paired run(s), need 2"
        seeds = "over 1000" if self.seeds_needed is None else str(self.seeds_needed)
        return (
            f"{candidate} - {reference} final accuracy {self.accuracy}, margin "
            f"-{ACCURACY_MARGIN:g}, detectable {self.detectable:.3f} (paired runs for the "
            f"margin: {seeds}); collapsed runs {self.collapsed[0]} vs {self.collapsed[1]} of "
            f"{self.pairs} (p {self.collapse_p:.3g})"
        )


def compare(candidate: list[Row], reference: list[Row], names: tuple[str, str]) -> Stability:
    """The paired comparison of the runs of two arms (any cells: paired within each)."""
    pairs = paired_runs(candidate, reference)
    measured = [
        (a["final_accuracy"], b["final_accuracy"])
        for a, b in pairs
        if a.get("final_accuracy") is not None and b.get("final_accuracy") is not None
    ]
    accuracy = detectable = seeds = None
    if len(measured) >= 2:
        accuracy = paired_interval([a for a, _ in measured], [b for _, b in measured])
        spread = statistics.stdev(a - b for a, b in measured)
        detectable = detectable_difference(spread, len(measured))
        seeds = seeds_to_detect(spread, ACCURACY_MARGIN)
    strata: dict[Any, list[int]] = defaultdict(lambda: [0, 0, 0, 0])
    for a, b in pairs:
        counts = strata[a["cell"], a.get("model")]
        counts[0] += a["collapse_events"] > 0
        counts[1] += 1
        counts[2] += b["collapse_events"] > 0
        counts[3] += 1
    collapse_p = stratified_exact_p([Stratum(*counts) for counts in strata.values()])
    return Stability(
        names,
        len(pairs),
        accuracy,
        detectable,
        seeds,
        (sum(c[0] for c in strata.values()), sum(c[2] for c in strata.values())),
        collapse_p,
        duplicates(pairs),
    )


def all_hold(verdicts: list[str]) -> str:
    """The verdict of a claim that needs every one of `verdicts`: FAIL if any fails, else NOT
    TESTED if any is, else INCONCLUSIVE if any is, else PASS (none: NOT TESTED)."""
    for verdict in (FAIL, NOT_TESTED, INCONCLUSIVE):
        if verdict in verdicts:
            return verdict
    return PASS if verdicts else NOT_TESTED
