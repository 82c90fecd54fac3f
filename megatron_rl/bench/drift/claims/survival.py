"""Claims about surviving the collapse point (claims 22-24): at 8 updates per rollout batch with a
bfloat16 engine on the main model, where the 128-expert grid's collapses gathered, does GSPO
without replay survive as well as GRPO with replay, and does replay help GRPO?

Fixed before the collapse-point grid ran (examples/moe/collapse_point_drift.yaml, issue 52):
- `COLLAPSE_POINT`: the cell, by its updates per batch and engine precision;
- a run's time is the step of its first collapse event, or its last step (censored);
- "survives at least as well" compares collapse rates over paired seeds: the candidate's minus
  the reference's, Newcombe's 95% interval (survival.collapse_rate_difference). PASS when the
  interval lies below `SURVIVAL_MARGIN` (the candidate collapses at most 10 points more often),
  FAIL when it lies above it, INCONCLUSIVE otherwise;
- "replay helps" is the reverse test of GRPO + R2 against GRPO: PASS when the interval lies below
  0 (fewer collapses with replay), FAIL when it lies above -`SURVIVAL_MARGIN` (no gain of 10
  points or more), INCONCLUSIVE otherwise;
- a comparison in which neither arm collapsed is NOT TESTED: the cell was no collapse point.
The exact stratified log-rank test of who collapsed first (survival.paired_log_rank) is reported
beside each verdict, and so is about how many paired seeds the interval would need to decide.
"""

from __future__ import annotations

import math
from collections.abc import Callable

from megatron_rl.bench.drift.claims.common import (
    GRPO,
    GRPO_R2,
    GRPO_R3,
    GSPO,
    MAIN_MODEL,
    Claim,
    Row,
    engine_of,
    regime_of,
)
from megatron_rl.bench.drift.stability import NOT_TESTED, paired_runs
from megatron_rl.bench.drift.survival import (
    RunTime,
    collapse_rate_difference,
    paired_log_rank,
    wilson,
)
from megatron_rl.bench.drift.uncertainty import FAIL, INCONCLUSIVE, PASS, Interval

COLLAPSE_POINT = {"updates_per_batch": 8, "engine_dtype": "bfloat16"}
SURVIVAL_MARGIN = 0.10


def at_collapse_point(row: Row) -> bool:
    """A run of the main model in the collapse-point cell (`COLLAPSE_POINT`)."""
    return (
        row.get("model") == MAIN_MODEL
        and int(row["updates_per_batch"]) == COLLAPSE_POINT["updates_per_batch"]
        and engine_of(row) == COLLAPSE_POINT["engine_dtype"]
    )


def run_time(row: Row) -> RunTime:
    """The run as survival data: its first collapse step, or its last step (censored)."""
    if int(row["collapse_events"] or 0) > 0:
        return RunTime(int(row["first_collapse_step"]), True)
    return RunTime(int(row["steps"]), False)


def gspo_survives_as_well_as_r2(rows: list[Row]) -> Claim:
    return _survives_as_well(22, rows, GRPO_R2, "GRPO + R2")


def gspo_survives_as_well_as_r3(rows: list[Row]) -> Claim:
    return _survives_as_well(23, rows, GRPO_R3, "GRPO + R3")


def replay_helps_grpo_survive(rows: list[Row]) -> Claim:
    statement = (
        "Replay helps GRPO survive the collapse point (8 updates per rollout batch, bfloat16 "
        "engine): GRPO + R2 collapses less often than GRPO without replay, over paired seeds."
    )
    pairs = _pairs(rows, GRPO_R2, GRPO)
    if not _any_collapse(pairs):
        return _not_tested(24, statement, rows, pairs, "GRPO + R2 and GRPO")
    interval = collapse_rate_difference(*_times(pairs))
    verdict = _verdict(interval, pass_below=0.0, fail_above=-SURVIVAL_MARGIN)
    evidence = _evidence(pairs, ("GRPO + R2", "GRPO"), interval, -SURVIVAL_MARGIN)
    return Claim(24, statement, verdict, evidence, regime_of([r for r, _ in pairs]))


def _survives_as_well(
    number: int, rows: list[Row], reference: Callable[[Row], bool], name: str
) -> Claim:
    statement = (
        f"GSPO without replay survives the collapse point (8 updates per rollout batch, bfloat16 "
        f"engine) at least as well as {name}: its collapse rate is at most "
        f"{SURVIVAL_MARGIN:.0%} higher, over paired seeds."
    )
    pairs = _pairs(rows, GSPO, reference)
    if not _any_collapse(pairs):
        return _not_tested(number, statement, rows, pairs, f"GSPO and {name}")
    interval = collapse_rate_difference(*_times(pairs))
    verdict = _verdict(interval, pass_below=SURVIVAL_MARGIN, fail_above=SURVIVAL_MARGIN)
    evidence = _evidence(pairs, ("GSPO", name), interval, SURVIVAL_MARGIN)
    return Claim(number, statement, verdict, evidence, regime_of([r for r, _ in pairs]))


def _pairs(
    rows: list[Row], candidate: Callable[[Row], bool], reference: Callable[[Row], bool]
) -> list[tuple[Row, Row]]:
    cell = [row for row in rows if at_collapse_point(row)]
    return paired_runs([r for r in cell if candidate(r)], [r for r in cell if reference(r)])


def _times(pairs: list[tuple[Row, Row]]) -> tuple[list[RunTime], list[RunTime]]:
    return [run_time(c) for c, _ in pairs], [run_time(r) for _, r in pairs]


def _any_collapse(pairs: list[tuple[Row, Row]]) -> bool:
    candidate, reference = _times(pairs)
    return any(run.collapsed for run in candidate + reference)


def _not_tested(
    number: int, statement: str, rows: list[Row], pairs: list[tuple[Row, Row]], arms: str
) -> Claim:
    if not pairs:
        needs = f"needs {arms} on the main model at the collapse point, on paired seeds"
    else:
        needs = f"neither arm collapsed in {len(pairs)} paired seeds: not a collapse point"
    return Claim(number, statement, NOT_TESTED, needs, regime_of(rows))


def _verdict(interval: Interval, *, pass_below: float, fail_above: float) -> str:
    if interval.high < pass_below:
        return PASS
    if interval.low > fail_above:
        return FAIL
    return INCONCLUSIVE


def _evidence(
    pairs: list[tuple[Row, Row]], names: tuple[str, str], interval: Interval, margin: float
) -> str:
    candidate, reference = _times(pairs)
    rates = []
    for name, runs in zip(names, (candidate, reference), strict=True):
        collapsed = sum(run.collapsed for run in runs)
        low, high = wilson(collapsed, len(runs))
        rates.append(f"{name} {collapsed} of {len(runs)} collapsed [{low:.2f}, {high:.2f}]")
    half = (interval.high - interval.low) / 2
    distance = abs(interval.estimate - margin)
    # the interval narrows as 1 / sqrt(seeds): about this many would put it clear of the margin
    needed = math.ceil(interval.n * (half / distance) ** 2) if distance > 0 else None
    decide = f"about {needed} paired seeds to decide" if needed else "undecidable at its margin"
    return (
        f"{'; '.join(rates)}; collapse rate {names[0]} - {names[1]} {interval}, margin "
        f"{margin:+.2f}, half-width {half:.2f}, {decide}; {paired_log_rank(candidate, reference)}"
    )
