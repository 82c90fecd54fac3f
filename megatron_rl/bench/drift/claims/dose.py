"""Claims about a set dose of routing mismatch (claims 25-27): the in-process engine flips a share
of the routes at every router call (rollout.flip_routes), at the smallest top-k margins or at
random, with a float32 engine so that the flips are the only mismatch between engine and trainer
(examples/moe/route_flips_drift.yaml, issue 52).

Fixed before the dose-response grid ran:
- a dose's runs are compared with the same arm's zero-dose runs, seed by seed (stability.py:
  final accuracy against its margin, collapses by an exact test);
- claim 25, every method's stability falls with the dose, GRPO's first: PASS when each method is
  less stable than at dose 0 at some margin-chosen dose and GRPO's first such dose is no larger
  than any other's; FAIL when a method is as stable as at dose 0 even at the largest dose, or
  another method's first such dose is smaller than GRPO's; INCONCLUSIVE otherwise;
- claim 26, margin-chosen flips hurt more than random ones: the paired difference of final
  accuracy, margin minus random, over every arm, dose and seed: PASS when its 95% interval lies
  below 0, FAIL when it lies above -ACCURACY_MARGIN (no harm of that size), else INCONCLUSIVE;
- claim 27, R3 removes the dose's effect on GRPO: at the largest margin-chosen dose GRPO + R3 is
  as stable as at dose 0 (its verdict), tested only where GRPO itself was less stable there.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Callable

from megatron_rl.bench.drift.claims.common import (
    GRPO,
    GRPO_R3,
    GRPO_TIS,
    GSPO,
    MAIN_MODEL,
    Claim,
    Row,
    engine_of,
    regime_of,
)
from megatron_rl.bench.drift.stability import (
    ACCURACY_MARGIN,
    NOT_TESTED,
    Stability,
    compare,
    paired_runs,
)
from megatron_rl.bench.drift.uncertainty import FAIL, INCONCLUSIVE, PASS, paired_interval

METHODS: tuple[tuple[str, Callable[[Row], bool]], ...] = (
    ("GRPO", GRPO),
    ("GRPO + R3", GRPO_R3),
    ("GSPO", GSPO),
    ("GRPO + TIS", GRPO_TIS),
)


# k3 between engine and trainer log-probs of GRPO without replay by engine precision, as the
# 128-expert grid of 2026-12-05 measured them (docs/benchmarks/drift_grids.md, its claim 18):
# the doses of flipped routes that give the same mismatch calibrate the dose against precision
PRECISION_K3 = {"bfloat16": 1.1e-4, "float8_emulated": 5.6e-4}


def calibrated_doses(rows: list[Row]) -> dict[str, float | None]:
    """Per engine precision of `PRECISION_K3`, the margin-chosen dose at which GRPO's mean k3
    reaches that precision's, interpolated log-log between the doses measured (None outside
    them)."""
    cell = [r for r in dosed_rows(rows) if GRPO(r) and flipped_at(r) == "margin"]
    curve = []
    for dose in margin_doses(cell):
        k3 = [r["mismatch_k3"] for r in cell if dose_of(r) == dose and r.get("mismatch_k3")]
        if k3:
            curve.append((dose, sum(k3) / len(k3)))
    found: dict[str, float | None] = {}
    for precision, target in PRECISION_K3.items():
        found[precision] = None
        for (d0, k0), (d1, k1) in itertools.pairwise(curve):
            if min(k0, k1) <= target <= max(k0, k1) and k0 != k1:
                share = (math.log(target) - math.log(k0)) / (math.log(k1) - math.log(k0))
                found[precision] = math.exp(math.log(d0) + share * (math.log(d1) - math.log(d0)))
                break
    return found


def dose_of(row: Row) -> float:
    """The share of routes the run's engine flipped (missing: none)."""
    return float(row.get("flip_routes") or 0.0)


def flipped_at(row: Row) -> str:
    return row.get("flip_routes_at") or "margin"


def dosed_rows(rows: list[Row]) -> list[Row]:
    """The runs of the dose-response experiment: the main model with a float32 engine."""
    return [r for r in rows if r.get("model") == MAIN_MODEL and engine_of(r) == "float32"]


def margin_doses(rows: list[Row]) -> list[float]:
    """The margin-chosen doses above 0 among `rows`, rising."""
    return sorted({dose_of(r) for r in rows if dose_of(r) > 0 and flipped_at(r) == "margin"})


def against_zero(
    rows: list[Row], arm: Callable[[Row], bool], dose: float, at: str, name: str
) -> Stability:
    """`arm`'s runs at `dose` (flipped `at`) against its runs at dose 0, seed by seed."""
    dosed = [r for r in rows if arm(r) and dose_of(r) == dose and flipped_at(r) == at]
    zero = [r for r in rows if arm(r) and dose_of(r) == 0]
    # the two doses' cells differ in the dose alone: paired by seed, as one cell
    return compare(
        _one_cell(dosed), _one_cell(zero), (f"{name} at {dose:g} ({at})", f"{name} at 0")
    )


def _one_cell(rows: list[Row]) -> list[Row]:
    return [row | {"cell": "dose"} for row in rows]


def stability_falls_with_dose(rows: list[Row]) -> Claim:
    statement = (
        "Every method's stability falls with the share of routes the engine flips at the "
        "smallest margins, GRPO's first: each of GRPO, GRPO + R3, GSPO and GRPO + TIS becomes "
        "less stable than at dose 0 at some dose, GRPO at the smallest."
    )
    cell = dosed_rows(rows)
    doses = margin_doses(cell)
    present = [(n, arm) for n, arm in METHODS if any(arm(r) and dose_of(r) == 0 for r in cell)]
    if not doses or not any(name == "GRPO" for name, _ in present):
        needs = "needs GRPO and the other methods at dose 0 and at margin-chosen doses"
        return Claim(25, statement, NOT_TESTED, needs, regime_of(rows))
    first: dict[str, float | None] = {}
    at_largest: dict[str, str] = {}
    evidence = []
    for name, arm in present:
        verdicts = {d: against_zero(cell, arm, d, "margin", name).not_as_stable() for d in doses}
        first[name] = next((d for d in doses if verdicts[d] == PASS), None)
        at_largest[name] = verdicts[doses[-1]]
        falls = "never" if first[name] is None else f"from {first[name]:g}"
        evidence.append(
            f"{name} less stable {falls} ({', '.join(f'{d:g}: {v}' for d, v in verdicts.items())})"
        )
    grpo = first["GRPO"]
    earlier = [n for n, d in first.items() if d is not None and grpo is not None and d < grpo]
    if FAIL in at_largest.values() or earlier:
        verdict = FAIL
    elif all(d is not None for d in first.values()):
        verdict = PASS
    else:
        verdict = INCONCLUSIVE
    return Claim(25, statement, verdict, "; ".join(evidence), regime_of(cell))


def margin_flips_hurt_more(rows: list[Row]) -> Claim:
    statement = (
        "Flips at the smallest margins hurt more than as many random flips: final accuracy is "
        "lower with margin-chosen flips, paired by arm, dose and seed."
    )
    cell = dosed_rows(rows)
    random_runs = [r for r in cell if dose_of(r) > 0 and flipped_at(r) == "random"]
    margin_runs = [r for r in cell if dose_of(r) > 0 and flipped_at(r) == "margin"]

    def key(row: Row) -> Row:  # the same arm, dose and seed: one cell
        return row | {"cell": f"{row['arm']}@{dose_of(row)}"}

    pairs = paired_runs([key(r) for r in margin_runs], [key(r) for r in random_runs])
    measured = [
        (a["final_accuracy"], b["final_accuracy"])
        for a, b in pairs
        if a.get("final_accuracy") is not None and b.get("final_accuracy") is not None
    ]
    if len(measured) < 2:
        needs = "needs runs with margin-chosen and random flips at the same doses and seeds"
        return Claim(26, statement, NOT_TESTED, needs, regime_of(rows))
    interval = paired_interval([a for a, _ in measured], [b for _, b in measured])
    if interval.high < 0:
        verdict = PASS
    elif interval.low > -ACCURACY_MARGIN:
        verdict = FAIL
    else:
        verdict = INCONCLUSIVE
    k3 = [
        (a["mismatch_k3"], b["mismatch_k3"])
        for a, b in pairs
        if a.get("mismatch_k3") is not None and b.get("mismatch_k3") is not None
    ]
    shown = ""
    if k3:
        shown = (
            f"; mean k3 {sum(a for a, _ in k3) / len(k3):.2e} (margin) vs "
            f"{sum(b for _, b in k3) / len(k3):.2e} (random)"
        )
    evidence = (
        f"margin - random final accuracy {interval}, margin -{ACCURACY_MARGIN:g} "
        f"({len(measured)} pairs){shown}"
    )
    return Claim(26, statement, verdict, evidence, regime_of(cell))


def r3_removes_dose_effect(rows: list[Row]) -> Claim:
    statement = (
        "R3 removes the dose's effect on GRPO: at the largest margin-chosen dose GRPO + R3 is as "
        "stable as at dose 0, where GRPO without replay is less stable."
    )
    cell = dosed_rows(rows)
    doses = margin_doses(cell)
    if not doses:
        return Claim(27, statement, NOT_TESTED, "needs margin-chosen doses", regime_of(rows))
    largest = doses[-1]
    grpo = against_zero(cell, GRPO, largest, "margin", "GRPO")
    if grpo.not_as_stable() != PASS:
        evidence = f"GRPO not shown less stable at {largest:g}, so no effect to remove: {grpo}"
        return Claim(27, statement, NOT_TESTED, evidence, regime_of(cell))
    r3 = against_zero(cell, GRPO_R3, largest, "margin", "GRPO + R3")
    return Claim(27, statement, r3.as_stable(), f"{r3}; without replay: {grpo}", regime_of(cell))
