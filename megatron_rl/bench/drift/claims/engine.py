"""Claims about the rollout engine and the cost of replay: its log-probs in place of the
old-policy forward, its precision and the mismatch it causes, replay's time, and what replaying
the engine's gate weights adds to replaying its experts (claims 8, 9, 12, 18, 19, 28).

Claim 28 was fixed before the gate-weight grid ran (examples/moe/gate_weight_replay_drift.yaml,
issue 52): at each low-precision engine (bfloat16, float8_emulated) the paired per-seed
log10(k3 of GRPO + R3 / k3 of GRPO + R3 with gate weights) must lie above 0 (its 95% interval):
PASS when it does at both precisions, FAIL when at either the interval lies at or below 0,
INCONCLUSIVE otherwise; NOT TESTED without both arms at both precisions. A log ratio, because k3
spans orders of magnitude across precisions and seeds; 10 to its estimate is the factor by which
the weights cut k3."""

from __future__ import annotations

import itertools
import math
from collections.abc import Callable

from megatron_rl.bench.drift.claims.common import (
    ENGINE_DTYPES,
    GRPO,
    GRPO_R2,
    GRPO_R3,
    GRPO_R3_WEIGHTS,
    GSPO,
    GSPO_ENGINE,
    LOW_PRECISION,
    MOE_K3,
    REPLAY_TIME_OVERHEAD,
    SETTINGS,
    Claim,
    Row,
    cells_with,
    column,
    difference,
    engine_of,
    machines_note,
    mean_of,
    no_replay,
    paired,
    per_seed,
    pooled,
    regime_of,
    values_of,
)
from megatron_rl.bench.drift.stability import NOT_TESTED, all_hold, compare
from megatron_rl.bench.drift.uncertainty import FAIL, INCONCLUSIVE, PASS, effect


def engine_logprobs_suffice(rows: list[Row]) -> Claim:
    statement = (
        "GSPO trained on the engine's log-probs (no old-policy forward) is as stable as GSPO "
        "with the forward, and saves that phase's time."
    )
    cells = cells_with(rows, GSPO_ENGINE, GSPO)
    if not cells:
        return Claim(
            8,
            statement,
            NOT_TESTED,
            "needs GSPO with and without the engine's log-probs",
            regime_of(rows),
        )
    engine = pooled(cells, 0)
    forward = pooled(cells, 1)
    stability = compare(engine, forward, ("GSPO on engine log-probs", "GSPO"))
    saved = effect(
        "old-policy forward's time saved, s per step", paired(forward, engine, _time_saved), 0.0
    )
    step = mean_of(forward, "step_s")
    share = f" ({saved.interval.estimate / step:.1%} of GSPO's step)" if saved and step else ""
    verdict = all_hold([stability.as_stable(), saved.above() if saved else NOT_TESTED])
    evidence = (
        f"{stability}; {saved or 'under 2 paired old-policy times'}{share}"
        f"{machines_note(engine + forward)}"
    )
    return Claim(8, statement, verdict, evidence, regime_of(forward))


def _time_saved(forward: Row, engine: Row) -> float | None:
    """The old-policy forward's seconds per step in `forward`'s run less `engine`'s: a run on
    the engine's log-probs runs no such forward, so it logs no time for it: 0 s."""
    if forward.get("old_logprob_s") is None:
        return None
    return forward["old_logprob_s"] - (engine.get("old_logprob_s") or 0.0)


def replay_is_cheap(rows: list[Row]) -> Claim:
    statement = (
        f"Replay's overhead: R2's learning phases (old-policy pass + updates, per response token) "
        f"take less than {REPLAY_TIME_OVERHEAD:.0%} longer than without replay."
    )
    cells = cells_with(rows, GRPO_R2, GRPO)
    if not cells:
        return Claim(9, statement, NOT_TESTED, "needs GRPO with and without R2", regime_of(rows))
    r2 = pooled(cells, 0)
    free = pooled(cells, 1)
    name = "learn_s_per_1k_tokens"

    def overhead_of(a: Row, b: Row) -> float | None:
        return a[name] / b[name] - 1 if a.get(name) is not None and b.get(name) else None

    # paired over seeds: each R2 run's time against the run without replay of its cell and seed
    overhead = effect("R2's paired overhead", paired(r2, free, overhead_of), REPLAY_TIME_OVERHEAD)
    if overhead is None:
        return Claim(9, statement, NOT_TESTED, "under 2 paired learning times", regime_of(rows))
    memory = mean_of(r2, "record_bytes") or 0
    evidence = (
        f"{mean_of(r2, name):.3f} vs {mean_of(free, name):.3f} s per 1000 response tokens; "
        f"{overhead}; R2 holds {memory / 2**20:.2f} MiB of recorded routing per step "
        f"({len(r2)}/{len(free)} runs){machines_note(r2 + free)}"
    )
    return Claim(9, statement, overhead.below(), evidence, regime_of(free))


def r3_cuts_engine_mismatch(rows: list[Row]) -> Claim:
    statement = (
        "R3 cuts the train-vs-engine mismatch with a low-precision engine: GRPO + R3's k3 KL "
        "between engine and trainer log-probs is below GRPO's, R3 replays the engine's routing "
        "exactly, and without it the trainer routes differently from the engine."
    )
    eligible = [r for r in rows if engine_of(r) in LOW_PRECISION]
    cells = cells_with(eligible, GRPO, GRPO_R3)
    free, r3 = pooled(cells, 0), pooled(cells, 1)
    cut = effect("k3 without R3 - with R3", paired(free, r3, difference("mismatch_k3")), 0.0)
    if cut is None:
        return Claim(
            12,
            statement,
            NOT_TESTED,
            "needs GRPO and GRPO + R3 with a bfloat16 or float8_emulated engine, with "
            "mismatch_k3, of 2 paired seeds or more",
            regime_of(rows),
        )
    misses = values_of(r3, "replay_miss_max")
    routing = values_of(free, "engine_routing_mismatch")
    exact = PASS if misses and max(misses) == 0 else FAIL
    routed_apart = PASS if routing and min(routing) > 0 else FAIL
    evidence = (
        f"{cut} (means {mean_of(r3, 'mismatch_k3'):.3g} with R3, "
        f"{mean_of(free, 'mismatch_k3'):.3g} without); "
        + (f"R3 replay miss at most {max(misses):.2%}" if misses else "R3 replay miss not measured")
        + "; "
        + (
            f"GRPO's engine routing mismatch at least {min(routing):.2%} of (token, layer) pairs"
            if routing
            else "GRPO's engine routing mismatch not measured"
        )
        + " ("
        + ", ".join(f"{c[0][0]['cell']} ({engine_of(c[0][0])})" for c in cells)
        + ")"
    )
    verdict = all_hold([cut.above(), exact, routed_apart])
    return Claim(12, statement, verdict, evidence, regime_of(free))


def engine_precision_orders_mismatch(rows: list[Row]) -> Claim:
    statement = (
        "Engine precision orders the train-vs-engine mismatch: the routing mismatch and the k3 "
        "KL of GRPO without replay rise from a float32 to a bfloat16 to a float8 engine."
    )

    def key(row: Row) -> tuple:
        return (row.get("model"), row["seed"], *(row.get(c) for c in SETTINGS))

    # runs of one model, seed and settings at each engine precision, paired across them
    by_engine = {
        e: {key(r): r for r in rows if GRPO(r) and engine_of(r) == e} for e in ENGINE_DTYPES
    }
    keys = [k for k in by_engine[ENGINE_DTYPES[0]] if all(k in by_engine[e] for e in ENGINE_DTYPES)]
    if not keys:
        return Claim(
            18,
            statement,
            NOT_TESTED,
            "needs GRPO runs without replay with float32, bfloat16 and float8_emulated engines "
            "at otherwise equal settings",
            regime_of(rows),
        )
    parts, verdicts = [], []
    for name, label in (("engine_routing_mismatch", "routing mismatch"), ("mismatch_k3", "k3")):
        for lower, higher in itertools.pairwise(ENGINE_DTYPES):
            rise = effect(
                f"{label} {higher} - {lower}",
                [
                    by_engine[higher][k][name] - by_engine[lower][k][name]
                    for k in keys
                    if by_engine[higher][k].get(name) is not None
                    and by_engine[lower][k].get(name) is not None
                ],
                0.0,
            )
            verdicts.append(rise.above() if rise else NOT_TESTED)
            parts.append(str(rise) if rise else f"{label}: under 2 paired {lower}/{higher} runs")
    runs = [by_engine[e][k] for e in ENGINE_DTYPES for k in keys]
    evidence = "; ".join(parts) + f" ({len(keys)} runs per engine)"
    return Claim(18, statement, all_hold(verdicts), evidence, regime_of(runs))


def float8_reaches_moe_mismatch(rows: list[Row]) -> Claim:
    statement = (
        "The float8 engine reaches the MoE mismatch regime: the k3 KL between engine and trainer "
        f"log-probs of runs without replay is >= {MOE_K3:g} (the R3 paper's ~1.5e-3 for MoE)."
    )
    fp8 = [
        r
        for r in rows
        if no_replay(r) and engine_of(r) == "float8_emulated" and r.get("mismatch_k3") is not None
    ]
    k3 = effect("k3 per seed", per_seed(fp8, column("mismatch_k3")), MOE_K3)
    if k3 is None:
        return Claim(
            19,
            statement,
            NOT_TESTED,
            "needs MoE runs without replay with a float8_emulated engine, of 2 seeds or more",
            regime_of(rows),
        )
    evidence = f"{k3} ({len(fp8)} runs; smallest {min(values_of(fp8, 'mismatch_k3')):.3g})"
    return Claim(19, statement, k3.at_least(), evidence, regime_of(fp8))


def gate_weights_cut_k3(rows: list[Row]) -> Claim:
    statement = (
        "Replaying the engine's gate weights with its experts lowers the train-vs-engine k3 "
        "below id-only R3's, with a bfloat16 and with a float8 engine."
    )
    verdicts, evidence = [], []
    for precision in LOW_PRECISION:
        eligible = [r for r in rows if engine_of(r) == precision]
        cells = cells_with(eligible, GRPO_R3, GRPO_R3_WEIGHTS)
        ids, weights = pooled(cells, 0), pooled(cells, 1)
        cut = effect(
            f"{precision}: log10(k3 R3 / R3 + gate weights)",
            paired(ids, weights, _log_ratio("mismatch_k3")),
            0.0,
        )
        if cut is None:
            return Claim(
                28,
                statement,
                NOT_TESTED,
                f"needs GRPO + R3 with and without gate weights at {precision}, with "
                "mismatch_k3, of 2 paired seeds or more",
                regime_of(rows),
            )
        verdicts.append(cut.above())
        free = [r for r in eligible if GRPO(r)]
        none = f", {mean_of(free, 'mismatch_k3'):.3g} without replay" if free else ""
        evidence.append(
            f"{cut}: mean k3 {mean_of(ids, 'mismatch_k3'):.3g} with R3, "
            f"{mean_of(weights, 'mismatch_k3'):.3g} with its gate weights{none}"
        )
    verdict = FAIL if FAIL in verdicts else PASS if set(verdicts) == {PASS} else INCONCLUSIVE
    return Claim(28, statement, verdict, "; ".join(evidence), regime_of(rows))


def _log_ratio(column_name: str) -> Callable[[Row, Row], float | None]:
    """log10(a[column] / b[column]) of a pair of runs, None unless both measured a positive one."""

    def of(a: Row, b: Row) -> float | None:
        x, y = a.get(column_name), b.get(column_name)
        return math.log10(x / y) if x and y and x > 0 and y > 0 else None

    return of
