"""Claims about how training goes: GSPO's clipping, whether an arm is as stable as another
(stability.py decides), collapses and their precursors (claims 5-7, 10, 11, 13, 15, 16, 20)."""

from __future__ import annotations

import math
import statistics
from collections import Counter, defaultdict

from megatron_rl.bench.drift.claims.common import (
    CLIP_RATIO,
    DENSE_MODEL,
    GRPO,
    GRPO_FROZEN,
    GRPO_MIS,
    GRPO_R2,
    GRPO_R3,
    GRPO_TIS,
    GRPO_TIS_MIS,
    GSPO,
    LOW_PRECISION,
    MAIN_MODEL,
    PRECURSOR_FALSE_ALARMS,
    REGIME_METRIC,
    STRONG_DRIFT,
    Claim,
    Row,
    cells_with,
    counted,
    difference,
    engine_of,
    machines_note,
    main_base,
    mean_of,
    paired,
    pooled,
    regime_of,
)
from megatron_rl.bench.drift.stability import NOT_TESTED, all_hold, compare, distinct
from megatron_rl.bench.drift.uncertainty import FAIL, PASS, effect, zero_event_bound


def gspo_clips_far_more(rows: list[Row]) -> Claim:
    statement = (
        f"GSPO's token clip fraction is far larger (>= {CLIP_RATIO:g}x) than GRPO's at the "
        "papers' clip ranges."
    )
    # each cell, model and seed: the mean clipped share of its GSPO-loss runs and of its GRPO ones
    shares: dict[tuple, dict[str, list[float]]] = defaultdict(lambda: {"gspo": [], "grpo": []})
    for row in distinct(rows):
        if row["loss"] in ("gspo", "grpo") and row.get("clip_frac_token") is not None:
            key = (row["cell"], row.get("model"), row["seed"])
            shares[key][row["loss"]].append(row["clip_frac_token"])
    both = [
        (statistics.fmean(s["gspo"]), statistics.fmean(s["grpo"]))
        for s in shares.values()
        if s["gspo"] and s["grpo"]
    ]
    ratios = [math.log10(gspo / grpo) for gspo, grpo in both if gspo > 0 and grpo > 0]
    far = effect("log10(GSPO / GRPO clipped tokens)", ratios, math.log10(CLIP_RATIO))
    unclipped = len(both) - len(ratios)  # on-policy cells: a ratio of 1 clips nothing
    if far is None:
        return Claim(
            5,
            statement,
            NOT_TESTED,
            f"under 2 paired (cell, seed)s where GSPO and GRPO both clipped tokens ({len(both)} "
            f"paired, {unclipped} where one clipped none)",
            regime_of(rows),
        )
    gspo, grpo = (statistics.fmean(side) for side in zip(*both, strict=True))
    evidence = (
        f"clipped tokens: GSPO {gspo:.2%}, GRPO {grpo:.3%}; {far}: "
        f"{10**far.interval.estimate:.0f}x (geometric mean over {len(ratios)} paired (cell, seed)s"
        + (f"; {unclipped} where one clipped none left out" if unclipped else "")
        + ")"
    )
    return Claim(5, statement, far.at_least(), evidence, regime_of(rows))


def gspo_as_stable_as_r2(rows: list[Row]) -> Claim:
    statement = (
        "GSPO without replay is at least as stable as GRPO + R2, where at least "
        f"{STRONG_DRIFT:.0%} of GSPO's activated experts differ from the old policy's after "
        "each update."
    )
    cells = cells_with(rows, GSPO, GRPO_R2)
    strong = [c for c in cells if (mean_of(c[0], REGIME_METRIC) or 0) >= STRONG_DRIFT]
    if not strong:
        reached = max((mean_of(c[0], REGIME_METRIC) or 0 for c in cells), default=0.0)
        return Claim(
            6,
            statement,
            NOT_TESTED,
            f"no cell with GSPO and GRPO + R2 reached {STRONG_DRIFT:.0%} (GSPO's largest mean: "
            f"{reached:.2%} of activated experts changed since the old policy, {len(cells)} "
            "cells)",
            regime_of(rows),
        )
    stability = compare(pooled(strong, 0), pooled(strong, 1), ("GSPO", "GRPO + R2"))
    evidence = f"{stability} ({', '.join(c[0][0]['cell'] for c in strong)})"
    return Claim(6, statement, stability.as_stable(), evidence, regime_of(pooled(strong, 0)))


def on_policy_needs_no_replay(rows: list[Row]) -> Claim:
    statement = (
        "On-policy (1 update per rollout batch) GRPO without replay and with R2 are the same "
        "computation (the old policy is the one being trained: replaying its routing changes "
        "nothing); with several off-policy updates, GRPO without replay is not as stable as with "
        "R2 (arXiv 2512.01374)."
    )
    cells = cells_with(rows, GRPO, GRPO_R2)
    on = [c for c in cells if c[0][0]["updates_per_batch"] == 1]
    off_degree = max((c[0][0]["updates_per_batch"] for c in cells), default=1)
    off = [c for c in cells if c[0][0]["updates_per_batch"] == off_degree > 1]
    if not on or not off:
        return Claim(
            7,
            statement,
            NOT_TESTED,
            "needs GRPO with and without R2 at 1 and at >1 updates per batch",
            regime_of(rows),
        )
    on_policy = compare(pooled(on, 0), pooled(on, 1), ("GRPO", "GRPO + R2"))
    off_policy = compare(pooled(off, 0), pooled(off, 1), ("GRPO", "GRPO + R2"))
    verdict = all_hold([PASS if on_policy.duplicate else FAIL, off_policy.not_as_stable()])
    evidence = f"1 update: {on_policy}. {off_degree} updates: {off_policy}"
    return Claim(7, statement, verdict, evidence, regime_of(pooled(off, 0)))


def _not_as_stable(
    number: int,
    statement: str,
    cells: list[list[list[Row]]],
    names: tuple[str, str],
    needs: str,
    rows: list[Row],
) -> Claim:
    """The first arm of `cells` is not as stable as the second, paired over all of them."""
    if not cells:
        return Claim(number, statement, NOT_TESTED, needs, regime_of(rows))
    stability = compare(pooled(cells, 0), pooled(cells, 1), names)
    evidence = f"{stability} ({', '.join(c[0][0]['cell'] for c in cells)})"
    return Claim(
        number, statement, stability.not_as_stable(), evidence, regime_of(pooled(cells, 0))
    )


def two_minibatches_need_r2(rows: list[Row]) -> Claim:
    statement = (
        "Two minibatches per rollout batch need R2 (arXiv 2512.01374): at 2 updates per batch "
        "GRPO without replay is not as stable as GRPO + R2 (at any engine precision)."
    )
    eligible = [r for r in rows if r["updates_per_batch"] == 2]
    return _not_as_stable(
        10,
        statement,
        cells_with(eligible, GRPO, GRPO_R2),
        ("GRPO", "GRPO + R2"),
        "needs GRPO with and without R2 at 2 updates per batch",
        rows,
    )


def four_minibatches_need_r3(rows: list[Row]) -> Claim:
    statement = (
        "Four or more minibatches need R3: at >= 4 updates per batch with a bfloat16 or float8 "
        "engine, GRPO + R2 is not as stable as GRPO + R3 (with a float32 engine the two replay "
        "the same routing, so only low-precision engines count)."
    )
    eligible = [r for r in rows if r["updates_per_batch"] >= 4 and engine_of(r) in LOW_PRECISION]
    return _not_as_stable(
        11,
        statement,
        cells_with(eligible, GRPO_R2, GRPO_R3),
        ("GRPO + R2", "GRPO + R3"),
        "needs GRPO + R2 and GRPO + R3 at >= 4 updates per batch with a bfloat16 or "
        "float8_emulated engine",
        rows,
    )


def frozen_router_as_stable_and_cheaper(rows: list[Row]) -> Claim:
    statement = (
        "A frozen router makes GRPO as stable as GRPO + R2, at a lower cost (shorter steps)."
    )
    cells = cells_with(rows, GRPO_FROZEN, GRPO_R2)
    if not cells:
        return Claim(
            13,
            statement,
            NOT_TESTED,
            "needs GRPO with a frozen router and GRPO + R2",
            regime_of(rows),
        )
    frozen, r2 = pooled(cells, 0), pooled(cells, 1)
    stability = compare(frozen, r2, ("frozen-router GRPO", "GRPO + R2"))
    saved = effect(
        "GRPO + R2 - frozen-router step time, s", paired(r2, frozen, difference("step_s")), 0.0
    )
    verdict = all_hold([stability.as_stable(), saved.above() if saved else NOT_TESTED])
    evidence = (
        f"{stability}; {saved or 'under 2 paired step times'}{machines_note(frozen + r2)} ("
        + ", ".join(c[0][0]["cell"] for c in cells)
        + ")"
    )
    return Claim(13, statement, verdict, evidence, regime_of(frozen + r2))


def precursor_before_collapse(rows: list[Row]) -> Claim:
    statement = (
        "A precursor comes before every collapse: in every run with a collapse event, gradient "
        "norm, drift, mismatch or entropy moved beyond its early range before the first event, "
        f"and the same rule fires in at most {PRECURSOR_FALSE_ALARMS:.0%} of the runs that never "
        "collapse."
    )
    collapsed = [r for r in rows if r["collapse_events"] > 0]
    if not collapsed:
        return Claim(15, statement, NOT_TESTED, "no run collapsed", regime_of(rows))
    calm = [r for r in rows if r["collapse_events"] == 0 and "false_alarm" in r]
    alarms = Counter(r["false_alarm"] for r in calm if r["false_alarm"])
    if not calm or sum(alarms.values()) > PRECURSOR_FALSE_ALARMS * len(calm):
        fired = (
            f"it fires in {sum(alarms.values())} of {len(calm)} runs that never collapse ("
            + counted(alarms)
            + "): it cannot tell a collapse coming"
            if calm
            else "no run without a collapse measured the rule's false alarms"
        )
        return Claim(15, statement, NOT_TESTED, fired, regime_of(rows))
    missing = [r["run_id"] for r in collapsed if not r.get("precursor")]
    found = Counter(r["precursor"] for r in collapsed if r.get("precursor"))
    evidence = f"{len(collapsed) - len(missing)} of {len(collapsed)} collapsed runs had one" + (
        f" ({counted(found)})" if found else ""
    )
    if missing:
        evidence += "; none before the collapse in " + ", ".join(missing)
    evidence += f"; false alarms in {sum(alarms.values())} of {len(calm)} runs that never collapse"
    return Claim(15, statement, FAIL if missing else PASS, evidence, regime_of(rows))


def dense_control_does_not_collapse(rows: list[Row]) -> Claim:
    statement = (
        f"The dense control ({DENSE_MODEL}) does not collapse at the main model's base learning "
        "rate."
    )
    main = main_base(rows)
    rates = {r["lr"] for r in main}
    dense = distinct([r for r in rows if r.get("model") == DENSE_MODEL and r["lr"] in rates])
    if not dense:
        return Claim(
            16,
            statement,
            NOT_TESTED,
            f"needs {DENSE_MODEL} runs at the learning rate of {MAIN_MODEL}'s base point",
            regime_of(rows),
        )
    collapsed = sum(r["collapse_events"] > 0 for r in dense)
    bound = (
        f" (its collapse rate is below {zero_event_bound(len(dense)):.0%}, one-sided 95%)"
        if collapsed == 0
        else ""
    )
    evidence = (
        f"{collapsed} of {len(dense)} {DENSE_MODEL} runs collapsed{bound} at lr "
        + ", ".join(f"{lr:g}" for lr in sorted(rates))
        + f"; {sum(r['collapse_events'] > 0 for r in main)} of {len(main)} {MAIN_MODEL} base runs"
    )
    return Claim(16, statement, PASS if collapsed == 0 else FAIL, evidence, regime_of(main))


def corrections_instead_of_replay(rows: list[Row]) -> Claim:
    statement = (
        "Mismatch corrections instead of replay: with a float8 engine, GRPO + TIS, GRPO + "
        "geometric MIS and GRPO + TIS masked by geometric MIS are each as stable as GRPO + R3."
    )
    fp8 = [r for r in rows if engine_of(r) == "float8_emulated"]
    parts, verdicts, tested, untested = [], [], [], []
    # each correction with the summary column saying how often it acted (its fire rate): one
    # that never acted duplicates plain GRPO (for the combination, TIS alone)
    corrections = (
        ("TIS", GRPO_TIS, "tis_truncated_frac"),
        ("geometric MIS", GRPO_MIS, "mis_masked_frac"),
        ("TIS + geometric MIS", GRPO_TIS_MIS, "mis_masked_frac"),
    )
    for name, arm, fire_rate in corrections:
        cells = cells_with(fp8, arm, GRPO_R3)
        if not cells:
            untested.append(name)
            continue
        fired = [row[fire_rate] for row in pooled(cells, 0) if row.get(fire_rate) is not None]
        if not any(fired):
            untested.append(f"{name} (never acted: {fire_rate} {'0' if fired else 'not recorded'})")
            continue
        tested += pooled(cells, 0)
        stability = compare(pooled(cells, 0), pooled(cells, 1), (f"GRPO + {name}", "GRPO + R3"))
        verdicts.append(stability.as_stable())
        parts.append(f"{stability} ({', '.join(c[0][0]['cell'] for c in cells)})")
    if untested:
        verdicts.append(NOT_TESTED)
        parts.append("not tested with GRPO + R3 in a float8 cell: GRPO + " + ", ".join(untested))
    return Claim(20, statement, all_hold(verdicts), "; ".join(parts), regime_of(tested or rows))
