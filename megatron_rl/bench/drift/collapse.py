"""The collapse events of a run and what moved before them, from its per-step records (its
metrics.jsonl), the same rule for every arm: the summary counts them, and the runner can stop a
run at its first (a grid's `stop_at_collapse`).

A **collapse event** is one of:
- `nonfinite`: a step whose loss or gradient was not finite (its updates were skipped), or a run
  the trainer aborted for too many of them;
- `accuracy`: held-out accuracy falls more than `ACCURACY_DROP` below the best so far and is
  still that far below after `RECOVERY_EVALS` more evaluations (at the run's end, after those
  that remain, at least one: a single low last evaluation is evaluation noise as often as not,
  and flagged about 11% of flat runs). 0.15 is 2.5 standard errors of an accuracy near 0.6 on 64
  held-out problems: noise alone rarely makes it twice in a row, a lasting fall does. Counted
  once per fall;
- `reward`: the mean sampled reward at or below `REWARD_FLOOR` on `REWARD_FLOOR_STEPS`
  consecutive steps (the policy has stopped producing right answers). Counted once per stretch.

A run with collapse events also gets its **precursor**: of the gradient norm, the routing drift
(`routing/update_activated_experts`, else `routing/drift_token_layer`), the train-vs-engine
mismatch (`mismatch/k3`) and the entropy (`entropy/mean`), the one that moved first strictly
before the first collapse step. A metric moves at the first step whose value is more than
`PRECURSOR_Z` standard deviations from its baseline's mean, the baseline being its first
`PRECURSOR_BASELINE` values (population standard deviation, floored at 1e-12 x |mean| + 1e-12 so
that a flat baseline does not divide by zero). Ties go to the earlier metric in the order above;
none if no metric moved or fewer than `PRECURSOR_BASELINE` values precede the collapse.
A run without collapse events gets its **false alarm** instead: the metric the same rule finds
moving anywhere in the run ("" if none), so that the rule's false-alarm rate is measured on the
runs that never collapse (claims/training.py, claim 15).
"""

from __future__ import annotations

import math
import statistics
from typing import Any

ACCURACY_DROP = 0.15
RECOVERY_EVALS = 2
REWARD_FLOOR = 0.02
REWARD_FLOOR_STEPS = 3
PRECURSOR_Z = 3.0
PRECURSOR_BASELINE = 5

# precursor name -> the per-step metrics it reads, the first one any record has
PRECURSOR_METRICS = {
    "grad_norm": ("grad_norm",),
    "drift": ("routing/update_activated_experts", "routing/drift_token_layer"),
    "mismatch": ("mismatch/k3",),
    "entropy": ("entropy/mean",),
}


def collapse_events(
    records: list[dict[str, Any]], *, finished: bool = True
) -> list[tuple[int, str]]:
    """(step, kind) of every collapse event of one run's per-step records (module docstring).
    Of a run still going (`finished` false) an accuracy fall counts only once `RECOVERY_EVALS`
    evaluations have followed it: the end-of-run clause would count a fall the next evaluation
    may still take back."""
    events = [(r["step"], "nonfinite") for r in records if r.get("steps/skipped")]
    evals = [(r["step"], r["eval/accuracy"]) for r in records if r.get("eval/accuracy") is not None]
    best, index = -math.inf, 0
    while index < len(evals):
        step, accuracy = evals[index]
        if accuracy < best - ACCURACY_DROP:
            later = evals[index + 1 : index + 1 + RECOVERY_EVALS]
            seen = len(later) == RECOVERY_EVALS or (finished and bool(later))
            if seen and all(value < best - ACCURACY_DROP for _, value in later):
                events.append((step, "accuracy"))
                # one event per fall: the next counts only after a recovery to within the drop
                index += 1
                while index < len(evals) and evals[index][1] < best - ACCURACY_DROP:
                    index += 1
                continue
        best = max(best, accuracy)
        index += 1
    low = 0
    for record in records:
        reward = record.get("reward/mean")
        low = low + 1 if reward is not None and reward <= REWARD_FLOOR else 0
        if low == REWARD_FLOOR_STEPS:
            events.append((record["step"], "reward"))
    return sorted(events)


def collapse_precursor(records: list[dict[str, Any]], collapse_step: int) -> tuple[str, int | None]:
    """(name, step) of the metric that moved first before `collapse_step` (module docstring), or
    ("", None) when none did. Training steps only (step > 0), like the summary's means."""
    first: tuple[str, int | None] = ("", None)
    for name, keys in PRECURSOR_METRICS.items():
        key = next((k for k in keys if any(r.get(k) is not None for r in records)), None)
        if key is None:
            continue
        series = sorted(
            (r["step"], r[key])
            for r in records
            if r.get(key) is not None and 0 < r["step"] < collapse_step
        )
        if len(series) <= PRECURSOR_BASELINE:
            continue
        baseline = [value for _, value in series[:PRECURSOR_BASELINE]]
        mean = statistics.fmean(baseline)
        std = max(statistics.pstdev(baseline), 1e-12 * abs(mean) + 1e-12)
        moved = next(
            (
                step
                for step, value in series[PRECURSOR_BASELINE:]
                if abs(value - mean) > PRECURSOR_Z * std
            ),
            None,
        )
        if moved is not None and (first[1] is None or moved < first[1]):
            first = (name, moved)
    return first
