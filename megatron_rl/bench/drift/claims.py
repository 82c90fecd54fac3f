"""The literature's claims, checked on a drift grid's summary rows: PASS, FAIL, INCONCLUSIVE or
NOT TESTED, with the numbers and the drift regime behind each verdict.

Pure functions of the rows (summary.py; the ones of finished runs), so that each claim is tested
on synthetic rows in both directions. The thresholds are fixed here, before any checked-in run:
- `STRONG_DRIFT`: the papers' regime starts at 5% of activated experts ((token, layer, chosen
  expert) triples) that the old policy did not choose, after each update (`REGIME_METRIC`,
  `since_old_activated`: the GSPO paper's "after each update, ~10% of the experts activated
  under the new policy differ from the old policy's"); claim 6 is tested only there, and claim
  21 asks the main model's base point to reach it. Claims about one update's own change use
  `update_activated` (the routing before that update against after it);
- `CLIP_RATIO`: "far larger" is at least 10x (the GSPO paper reports ~100x);
- `REPLAY_TIME_OVERHEAD`: replay is cheap if the learning phases take < 10% longer with it (the
  95% interval of the per-seed overhead, paired within each cell, below it);
- `ROUTING_SHARE`: routing "causes most" of the token log-ratio if replaying the old routing
  removes at least half of its variance, pooled over a run's steps
  (`log_ratio_var_share_pooled` >= 0.5);
- `RANK_CORRELATION`: the near-tie share "predicts" a layer's drift if their Spearman rank
  correlation over the layers (each a mean over runs) is at least 0.5;
- `PRECURSOR_FALSE_ALARMS`: a precursor rule tells a collapse coming only if it fires in at most
  10% of the runs that never collapse (summary.py's `false_alarm`); otherwise claim 15 is NOT
  TESTED;
- `MOE_K3`: the MoE mismatch regime is a k3 KL between engine and trainer log-probs of at least
  1e-3 (the R3 paper reports ~1.5e-3 for MoE models).
"As stable as" is decided in stability.py: paired over seeds, final accuracy's 95% interval
against a non-inferiority margin and collapses by an exact test stratified by cell, giving PASS,
FAIL or INCONCLUSIVE (or NOT TESTED where the two arms are the same computation).

The rows name their base model in `model` (`MAIN_MODEL` is the main one; `FINE_MODELS` the
fine-grained MoE ones; `DENSE_MODEL` the one-expert control) and the rollout engine's precision
in `engine_dtype` (missing: float32). An arm is its (loss, routing_replay, mismatch) and whether
it freezes the routers (`freeze_router`, missing: not frozen). "Runs without replay" are those
with routing_replay none and trained routers, on a model with routing (not `DENSE_MODEL`).
"""

from __future__ import annotations

import itertools
import math
import statistics
from collections import Counter, defaultdict
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from megatron_rl.bench.drift.stability import NOT_TESTED, all_hold, compare, distinct, paired_runs
from megatron_rl.bench.drift.uncertainty import (
    FAIL,
    INCONCLUSIVE,
    PASS,
    at_least_verdict,
    detectable_difference,
    paired_interval,
)

STRONG_DRIFT = 0.05
REGIME_METRIC = "since_old_activated"
CLIP_RATIO = 10.0
REPLAY_TIME_OVERHEAD = 0.10
ROUTING_SHARE = 0.5
RANK_CORRELATION = 0.5
MOE_K3 = 1e-3
PRECURSOR_FALSE_ALARMS = 0.1

# The grid's models (grid.DEFAULT_GRID): both fine-grained ones at 128 experts, so that claim 17
# compares the router kinds at one expert count.
MAIN_MODEL = "fine_qwen3_e128"
FINE_MODELS = ("fine_qwen3_e128", "fine_deepseek_e128")
SIGMOID_MODEL = "fine_deepseek_e128"
DENSE_MODEL = "dense_control"
LOW_PRECISION = ("bfloat16", "float8_emulated")
ENGINE_DTYPES = ("float32", "bfloat16", "float8_emulated")  # in rising rounding error


Row = dict[str, Any]


@dataclass(frozen=True)
class Claim:
    number: int
    statement: str
    verdict: str
    evidence: str
    regime: str


def _frozen(row: Row) -> bool:
    """The run froze its routers (`freeze_router`; missing: no; a CSV's "True" counts)."""
    value = row.get("freeze_router")
    return value is True or str(value).lower() in ("true", "1")


def _engine(row: Row) -> str:
    return row.get("engine_dtype") or "float32"


def _is(
    loss: str, replay: str, mismatch: str = "none", frozen: bool = False
) -> Callable[[Row], bool]:
    def matches(row: Row) -> bool:
        return (
            row["loss"] == loss
            and row["routing_replay"] == replay
            and row["mismatch"] == mismatch
            and _frozen(row) == frozen
        )

    return matches


GRPO = _is("grpo", "none")
GRPO_R2 = _is("grpo", "r2")
GRPO_R3 = _is("grpo", "r3")
GRPO_FROZEN = _is("grpo", "none", frozen=True)
GRPO_TIS = _is("grpo", "none", mismatch="tis")
GRPO_MIS = _is("grpo", "none", mismatch="mis")
GRPO_TIS_MIS = _is("grpo", "none", mismatch="tis+mis_geometric")
GSPO = _is("gspo", "none")
GSPO_ENGINE = _is("gspo", "none", mismatch="bypass")


def _no_replay(row: Row) -> bool:
    """A run whose routers choose freely and are trained (module docstring), on a model that has
    a choice to make: the dense control's one expert is always chosen."""
    return row["routing_replay"] == "none" and not _frozen(row) and row.get("model") != DENSE_MODEL


def _values(rows: list[Row], column: str) -> list[float]:
    return [row[column] for row in rows if row.get(column) is not None]


def _mean(rows: list[Row], column: str) -> float | None:
    values = _values(rows, column)
    return statistics.fmean(values) if values else None


def group_by(rows: list[Row], column: str) -> dict[Any, list[Row]]:
    """The rows by their value of `column`, in first-seen order."""
    groups: dict[Any, list[Row]] = defaultdict(list)
    for row in rows:
        groups[row[column]].append(row)
    return groups


def _cells(rows: list[Row], *arms: Callable[[Row], bool]) -> list[list[list[Row]]]:
    """Per cell holding every one of `arms`: that cell's rows of each arm."""
    cells = []
    for cell_rows in group_by(rows, "cell").values():
        per_arm = [[row for row in cell_rows if arm(row)] for arm in arms]
        if all(per_arm):
            cells.append(per_arm)
    return cells


def _pooled(cells: list[list[list[Row]]], arm: int) -> list[Row]:
    """The rows of the `arm`-th arm of `_cells` over all of `cells`."""
    return [row for cell in cells for row in cell[arm]]


def _main_base(rows: list[Row]) -> list[Row]:
    """The rows of the main model at the base point."""
    return [r for r in rows if r["cell"] == "base" and r.get("model") == MAIN_MODEL]


def _regime(rows: list[Row]) -> str:
    """The papers' drift metric over the runs without replay among `rows`, naming the model and
    the engine when those runs share one."""
    free = [row for row in rows if _no_replay(row)]
    measured = [row for row in free if row.get(REGIME_METRIC) is not None]
    if not measured:
        drift = _mean(free, "drift_token_layer")
        if drift is None:
            return "no drift measured (no run without replay)"
        return f"{drift:.2%} token-layer drift per step (mean of the runs without replay)"
    where = ""
    models = {row.get("model") for row in measured}
    if len(models) == 1 and None not in models:
        where += f", model {models.pop()}"
    engines = {_engine(row) for row in measured}
    if len(engines) == 1:
        where += f", engine {engines.pop()}"
    drift = _mean(measured, REGIME_METRIC)
    return (
        f"{drift:.2%} of activated experts changed since the old policy after each update "
        f"(mean of the runs without replay{where})"
    )


def machine_counts(rows: list[Row]) -> Counter[str]:
    """How many of `rows` each machine ran (as status.json records it; older runs record none)."""
    return Counter(row["machine"] for row in rows if row.get("machine"))


def _machines(rows: list[Row]) -> str:
    """For evidence built on times: which machines ran `rows` when they were more than one
    (a grid resumed elsewhere), else nothing."""
    counts = machine_counts(rows)
    if len(counts) < 2:
        return ""
    ran = ", ".join(f"{name}: {count}" for name, count in sorted(counts.items()))
    return f"; times of runs on {len(counts)} machines ({ran} runs)"


def _layer_columns(rows: list[Row], prefix: str) -> list[int]:
    """The layer numbers i of the `prefix<i>` columns any of `rows` has, in order."""
    return sorted(
        {int(key[len(prefix) :]) for row in rows for key in row if key.startswith(prefix)}
    )


def _ranks(values: list[float]) -> list[float]:
    """1-based ranks of `values`, tied values sharing the mean of their ranks."""
    order = sorted(range(len(values)), key=values.__getitem__)
    ranks = [0.0] * len(values)
    start = 0
    while start < len(order):
        end = start
        while end + 1 < len(order) and values[order[end + 1]] == values[order[start]]:
            end += 1
        for position in range(start, end + 1):
            ranks[order[position]] = (start + end) / 2 + 1
        start = end + 1
    return ranks


def spearman(xs: list[float], ys: list[float]) -> float | None:
    """Spearman's rank correlation: Pearson's on the ranks (average ranks for ties); None with
    fewer than 2 pairs or when either side is constant."""
    if len(xs) != len(ys):
        raise ValueError(f"spearman: {len(xs)} x values but {len(ys)} y values")
    if len(xs) < 2:
        return None
    rx, ry = _ranks(xs), _ranks(ys)
    mx, my = statistics.fmean(rx), statistics.fmean(ry)
    cov = sum((a - mx) * (b - my) for a, b in zip(rx, ry, strict=True))
    vx = sum((a - mx) ** 2 for a in rx)
    vy = sum((b - my) ** 2 for b in ry)
    if vx == 0 or vy == 0:
        return None
    return cov / math.sqrt(vx * vy)


def drift_after_update(rows: list[Row]) -> Claim:
    statement = (
        "Without replay the routing drifts after an update (> 0 of the activated experts "
        "change); with R2 the routing used in the training forward equals the recorded one."
    )
    free = [r for r in rows if _no_replay(r) and r.get("update_activated") is not None]
    r2 = [r for r in rows if r["routing_replay"] == "r2" and r.get("replay_miss_max") is not None]
    if not free or not r2:
        return Claim(
            1,
            statement,
            NOT_TESTED,
            "needs runs without replay that measured update_activated, and runs with R2",
            _regime(rows),
        )
    smallest = min(r["update_activated"] for r in free)
    miss = max(r["replay_miss_max"] for r in r2)
    verdict = PASS if smallest > 0 and miss == 0 else FAIL
    evidence = (
        f"without replay: {_mean(free, 'update_activated'):.2%} of activated experts changed "
        f"per update (smallest run {smallest:.2%}, {len(free)} runs); R2: replayed vs used "
        f"routing differ in at most {miss:.2%} of pairs ({len(r2)} runs)"
    )
    return Claim(1, statement, verdict, evidence, _regime(free))


def later_layers_drift_more(rows: list[Row]) -> Claim:
    statement = (
        f"Later layers drift more: on the main model ({MAIN_MODEL}) at the base point, the last "
        "half of the MoE layers changes more of its activated experts per update than the first."
    )
    prefix = "update_activated_layer_"
    free = [r for r in _main_base(rows) if _no_replay(r)]
    layers = _layer_columns(free, prefix)
    if len(layers) < 2:
        return Claim(
            2,
            statement,
            NOT_TESTED,
            f"needs runs without replay of {MAIN_MODEL} at the base point with per-layer "
            "update_activated of two MoE layers or more",
            _regime(rows),
        )
    half = len(layers) // 2
    per_layer = {i: _mean(free, f"{prefix}{i}") or 0.0 for i in layers}
    first = statistics.fmean(per_layer[i] for i in layers[:half])
    last = statistics.fmean(per_layer[i] for i in layers[-half:])
    evidence = (
        f"layers {layers[0]}-{layers[half - 1]}: {first:.2%}, layers {layers[-half]}-"
        f"{layers[-1]}: {last:.2%} of activated experts changed per update ("
        + ", ".join(f"{i}: {v:.2%}" for i, v in per_layer.items())
        + f"; {len(free)} runs)"
    )
    return Claim(2, statement, PASS if last > first else FAIL, evidence, _regime(free))


def tails_fatten_without_replay(rows: list[Row]) -> Claim:
    statement = (
        "Routing changes fatten the token log-ratio's tail: max |log w| and the share outside "
        "[0.8, 1.25] are larger without replay than with R2 at the same learning rate."
    )
    cells = [c for c in _cells(rows, GRPO, GRPO_R2) if c[0][0]["updates_per_batch"] > 1]
    if not cells:
        return Claim(
            3,
            statement,
            NOT_TESTED,
            "needs GRPO with and without R2 at >1 update per batch",
            _regime(rows),
        )
    free = _pooled(cells, 0)
    r2 = _pooled(cells, 1)
    parts, verdicts = [], []
    for column, label in (
        ("log_ratio_abs_max", "max |log w|"),
        ("log_ratio_outside_0.8_1.25", "outside [0.8, 1.25]"),
    ):
        pairs = [
            (a[column], b[column])
            for a, b in paired_runs(free, r2)
            if a.get(column) is not None and b.get(column) is not None
        ]
        if len(pairs) < 2:
            return Claim(3, statement, NOT_TESTED, f"no paired {label}", _regime(rows))
        # without replay minus with R2, paired over cells and seeds: larger means above 0
        difference = paired_interval([a for a, _ in pairs], [b for _, b in pairs])
        verdicts.append(at_least_verdict(difference, 0.0) if difference.high > 0 else FAIL)
        parts.append(
            f"{label}: {_mean(free, column):.4g} without replay vs {_mean(r2, column):.4g} with "
            f"R2, paired difference {difference}"
        )
    evidence = "; ".join(parts) + f" ({len(cells)} cells, {len(free)}/{len(r2)} runs)"
    return Claim(3, statement, all_hold(verdicts), evidence, _regime(free))


def routing_causes_most_log_ratio(rows: list[Row]) -> Claim:
    statement = (
        f"Routing causes most of the token log-ratio: on the main model ({MAIN_MODEL}), "
        f"replaying the old routing removes at least {ROUTING_SHARE:.0%} of its variance "
        "(paired, on the same micro-batch)."
    )
    free = distinct(
        [
            r
            for r in rows
            if _no_replay(r)
            and r.get("model") == MAIN_MODEL
            and r.get("log_ratio_var_share_pooled") is not None
        ]
    )
    if not free:
        return Claim(
            4,
            statement,
            NOT_TESTED,
            f"needs runs without replay of {MAIN_MODEL} that measured log_ratio_var_share_pooled",
            _regime(rows),
        )
    share = _mean(free, "log_ratio_var_share_pooled")
    abs_share = _mean(free, "log_ratio_abs_share")
    evidence = f"routing's share of the log-ratio variance {share:.1%}, pooled per run" + (
        f"; of its mean |log w| {abs_share:.1%}" if abs_share is not None else ""
    )
    smallest = min(_values(free, "log_ratio_var_share_pooled"))
    evidence += f" (mean of {len(free)} runs; smallest run {smallest:.1%})"
    return Claim(4, statement, PASS if share >= ROUTING_SHARE else FAIL, evidence, _regime(free))


def gspo_clips_far_more(rows: list[Row]) -> Claim:
    statement = (
        f"GSPO's token clip fraction is far larger (>= {CLIP_RATIO:g}x) than GRPO's at the "
        "papers' clip ranges."
    )
    cells = _cells(rows, lambda r: r["loss"] == "gspo", lambda r: r["loss"] == "grpo")
    if not cells:
        return Claim(5, statement, NOT_TESTED, "needs GSPO and GRPO runs", _regime(rows))
    gspo = _mean(_pooled(cells, 0), "clip_frac_token") or 0.0
    grpo = _mean(_pooled(cells, 1), "clip_frac_token") or 0.0
    ratio = gspo / grpo if grpo > 0 else (float("inf") if gspo > 0 else 0.0)
    evidence = (
        f"clipped tokens: GSPO {gspo:.2%}, GRPO {grpo:.3%} ({ratio:.0f}x, {len(cells)} cells)"
    )
    return Claim(5, statement, PASS if ratio >= CLIP_RATIO else FAIL, evidence, _regime(rows))


def gspo_as_stable_as_r2(rows: list[Row]) -> Claim:
    statement = (
        "GSPO without replay is at least as stable as GRPO + R2, where at least "
        f"{STRONG_DRIFT:.0%} of GSPO's activated experts differ from the old policy's after "
        "each update."
    )
    cells = _cells(rows, GSPO, GRPO_R2)
    strong = [c for c in cells if (_mean(c[0], REGIME_METRIC) or 0) >= STRONG_DRIFT]
    if not strong:
        reached = max((_mean(c[0], REGIME_METRIC) or 0 for c in cells), default=0.0)
        return Claim(
            6,
            statement,
            NOT_TESTED,
            f"no cell with GSPO and GRPO + R2 reached {STRONG_DRIFT:.0%} (GSPO's largest mean: "
            f"{reached:.2%} of activated experts changed since the old policy, {len(cells)} "
            "cells)",
            _regime(rows),
        )
    stability = compare(_pooled(strong, 0), _pooled(strong, 1), ("GSPO", "GRPO + R2"))
    evidence = f"{stability} ({', '.join(c[0][0]['cell'] for c in strong)})"
    return Claim(6, statement, stability.as_stable(), evidence, _regime(_pooled(strong, 0)))


def on_policy_needs_no_replay(rows: list[Row]) -> Claim:
    statement = (
        "On-policy (1 update per rollout batch) GRPO without replay and with R2 are the same "
        "computation (the old policy is the one being trained: replaying its routing changes "
        "nothing); with several off-policy updates, GRPO without replay is not as stable as with "
        "R2 (arXiv 2512.01374)."
    )
    cells = _cells(rows, GRPO, GRPO_R2)
    on = [c for c in cells if c[0][0]["updates_per_batch"] == 1]
    off_degree = max((c[0][0]["updates_per_batch"] for c in cells), default=1)
    off = [c for c in cells if c[0][0]["updates_per_batch"] == off_degree > 1]
    if not on or not off:
        return Claim(
            7,
            statement,
            NOT_TESTED,
            "needs GRPO with and without R2 at 1 and at >1 updates per batch",
            _regime(rows),
        )
    on_policy = compare(_pooled(on, 0), _pooled(on, 1), ("GRPO", "GRPO + R2"))
    off_policy = compare(_pooled(off, 0), _pooled(off, 1), ("GRPO", "GRPO + R2"))
    verdict = all_hold([PASS if on_policy.duplicate else FAIL, off_policy.not_as_stable()])
    evidence = f"1 update: {on_policy}. {off_degree} updates: {off_policy}"
    return Claim(7, statement, verdict, evidence, _regime(_pooled(off, 0)))


def engine_logprobs_suffice(rows: list[Row]) -> Claim:
    statement = (
        "GSPO trained on the engine's log-probs (no old-policy forward) is as stable as GSPO "
        "with the forward, and saves that phase's time."
    )
    cells = _cells(rows, GSPO_ENGINE, GSPO)
    if not cells:
        return Claim(
            8,
            statement,
            NOT_TESTED,
            "needs GSPO with and without the engine's log-probs",
            _regime(rows),
        )
    engine = _pooled(cells, 0)
    forward = _pooled(cells, 1)
    stability = compare(engine, forward, ("GSPO on engine log-probs", "GSPO"))
    saved = (_mean(forward, "old_logprob_s") or 0) - (_mean(engine, "old_logprob_s") or 0)
    step = _mean(forward, "step_s") or float("nan")
    verdict = all_hold([stability.as_stable(), PASS if saved > 0 else FAIL])
    evidence = (
        f"{stability}; no old-policy forward saved {saved:.3f} s per step "
        f"({saved / step:.1%} of GSPO's step){_machines(engine + forward)}"
    )
    return Claim(8, statement, verdict, evidence, _regime(forward))


def replay_is_cheap(rows: list[Row]) -> Claim:
    statement = (
        f"Replay's overhead: R2's learning phases (old-policy pass + updates, per response token) "
        f"take less than {REPLAY_TIME_OVERHEAD:.0%} longer than without replay."
    )
    cells = _cells(rows, GRPO_R2, GRPO)
    if not cells:
        return Claim(9, statement, NOT_TESTED, "needs GRPO with and without R2", _regime(rows))
    r2 = _pooled(cells, 0)
    free = _pooled(cells, 1)
    column = "learn_s_per_1k_tokens"
    overheads = [
        a[column] / b[column] - 1
        for a, b in paired_runs(r2, free)
        if a.get(column) is not None and b.get(column)
    ]
    if len(overheads) < 2:
        return Claim(9, statement, NOT_TESTED, "under 2 paired learning-phase times", _regime(rows))
    # paired over seeds: each R2 run's time against the run without replay of its cell and seed
    overhead = paired_interval(overheads, [0.0] * len(overheads))
    detectable = detectable_difference(statistics.stdev(overheads), len(overheads))
    verdict = {PASS: FAIL, FAIL: PASS}.get(
        at_least_verdict(overhead, REPLAY_TIME_OVERHEAD), INCONCLUSIVE
    )
    memory = _mean(r2, "record_bytes") or 0
    evidence = (
        f"{_mean(r2, column):.3f} vs {_mean(free, column):.3f} s per 1000 response tokens; "
        f"paired overhead {overhead} against {REPLAY_TIME_OVERHEAD:.0%} (detectable "
        f"{detectable:.1%}); R2 holds {memory / 2**20:.2f} MiB of recorded routing per step "
        f"({len(r2)}/{len(free)} runs){_machines(r2 + free)}"
    )
    return Claim(9, statement, verdict, evidence, _regime(free))


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
        return Claim(number, statement, NOT_TESTED, needs, _regime(rows))
    stability = compare(_pooled(cells, 0), _pooled(cells, 1), names)
    evidence = f"{stability} ({', '.join(c[0][0]['cell'] for c in cells)})"
    return Claim(number, statement, stability.not_as_stable(), evidence, _regime(_pooled(cells, 0)))


def two_minibatches_need_r2(rows: list[Row]) -> Claim:
    statement = (
        "Two minibatches per rollout batch need R2 (arXiv 2512.01374): at 2 updates per batch "
        "GRPO without replay is not as stable as GRPO + R2 (at any engine precision)."
    )
    eligible = [r for r in rows if r["updates_per_batch"] == 2]
    return _not_as_stable(
        10,
        statement,
        _cells(eligible, GRPO, GRPO_R2),
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
    eligible = [r for r in rows if r["updates_per_batch"] >= 4 and _engine(r) in LOW_PRECISION]
    return _not_as_stable(
        11,
        statement,
        _cells(eligible, GRPO_R2, GRPO_R3),
        ("GRPO + R2", "GRPO + R3"),
        "needs GRPO + R2 and GRPO + R3 at >= 4 updates per batch with a bfloat16 or "
        "float8_emulated engine",
        rows,
    )


def r3_cuts_engine_mismatch(rows: list[Row]) -> Claim:
    statement = (
        "R3 cuts the train-vs-engine mismatch with a low-precision engine: GRPO + R3's k3 KL "
        "between engine and trainer log-probs is below GRPO's, R3 replays the engine's routing "
        "exactly, and without it the trainer routes differently from the engine."
    )
    eligible = [r for r in rows if _engine(r) in LOW_PRECISION]
    cells = [
        c
        for c in _cells(eligible, GRPO, GRPO_R3)
        if _mean(c[0], "mismatch_k3") is not None and _mean(c[1], "mismatch_k3") is not None
    ]
    if not cells:
        return Claim(
            12,
            statement,
            NOT_TESTED,
            "needs GRPO and GRPO + R3 with a bfloat16 or float8_emulated engine, with mismatch_k3",
            _regime(rows),
        )
    parts, holds = [], True
    for free, r3 in cells:
        k3, k3_r3 = _mean(free, "mismatch_k3"), _mean(r3, "mismatch_k3")
        misses = _values(r3, "replay_miss_max")
        miss = max(misses) if misses else None
        routing = _mean(free, "engine_routing_mismatch")
        holds &= k3_r3 < k3 and miss == 0 and routing is not None and routing > 0
        parts.append(
            f"{free[0]['cell']} ({_engine(free[0])}): k3 {k3_r3:.3g} with R3 vs {k3:.3g} without; "
            + ("R3 replay miss not measured" if miss is None else f"R3 replay miss {miss:.2%}")
            + "; "
            + (
                "GRPO's engine routing mismatch not measured"
                if routing is None
                else f"GRPO's engine routing mismatch {routing:.2%} of (token, layer) pairs"
            )
        )
    return Claim(
        12, statement, PASS if holds else FAIL, "; ".join(parts), _regime(_pooled(cells, 0))
    )


def frozen_router_as_stable_and_cheaper(rows: list[Row]) -> Claim:
    statement = (
        "A frozen router makes GRPO as stable as GRPO + R2, at a lower cost (shorter steps)."
    )
    cells = _cells(rows, GRPO_FROZEN, GRPO_R2)
    if not cells:
        return Claim(
            13,
            statement,
            NOT_TESTED,
            "needs GRPO with a frozen router and GRPO + R2",
            _regime(rows),
        )
    stability = compare(_pooled(cells, 0), _pooled(cells, 1), ("frozen-router GRPO", "GRPO + R2"))
    verdicts, parts = [stability.as_stable()], [str(stability)]
    for frozen, r2 in cells:
        step, step_r2 = _mean(frozen, "step_s"), _mean(r2, "step_s")
        cheaper = step is not None and step_r2 is not None and step < step_r2
        verdicts.append(PASS if cheaper else FAIL)
        steps = (
            "no step times"
            if step is None or step_r2 is None
            else f"{step:.2f} vs {step_r2:.2f} s per step"
        )
        parts.append(f"{frozen[0]['cell']}: {steps}{_machines(frozen + r2)}")
    regime = _regime([r for c in cells for arm in c for r in arm])
    return Claim(13, statement, all_hold(verdicts), "; ".join(parts), regime)


def near_ties_predict_layer_drift(rows: list[Row]) -> Claim:
    statement = (
        "The near-tie share predicts a layer's drift: over the layers of each fine-grained "
        "model, the share of top-k margins below 1e-3 and the share of activated experts changed "
        f"per update (each a layer's mean over the runs without replay) have a Spearman rank "
        f"correlation >= {RANK_CORRELATION:g}. Per model: a softmax router's scores and a "
        "sigmoid router's are on different scales, so one absolute threshold ranks them apart. "
        "One point per layer: a run's layers are not independent of each other, nor are seeds "
        "of one arm of its layers."
    )
    free = distinct([r for r in rows if _no_replay(r) and r.get("model") in FINE_MODELS])
    parts, holds, tested = [], True, []
    for model, model_rows in group_by(free, "model").items():
        ties, drift = [], []
        for layer in _layer_columns(model_rows, "near_tie_layer_"):
            tie = _mean(model_rows, f"near_tie_layer_{layer}")
            changed = _mean(model_rows, f"update_activated_layer_{layer}")
            if tie is not None and changed is not None:
                ties.append(tie)
                drift.append(changed)
        rho = spearman(ties, drift)
        if rho is None:
            parts.append(f"{model}: no varying layers ({len(ties)})")
            continue
        tested += model_rows
        holds &= rho >= RANK_CORRELATION
        parts.append(
            f"{model}: Spearman {rho:.2f} over {len(ties)} layers (means of {len(model_rows)} runs)"
        )
    if not tested:
        return Claim(
            14,
            statement,
            NOT_TESTED,
            f"needs per-layer near_tie and update_activated of runs without replay on "
            f"{' or '.join(FINE_MODELS)} that vary" + (f" ({'; '.join(parts)})" if parts else ""),
            _regime(rows),
        )
    return Claim(14, statement, PASS if holds else FAIL, "; ".join(parts), _regime(tested))


def precursor_before_collapse(rows: list[Row]) -> Claim:
    statement = (
        "A precursor comes before every collapse: in every run with a collapse event, gradient "
        "norm, drift, mismatch or entropy moved beyond its early range before the first event, "
        f"and the same rule fires in at most {PRECURSOR_FALSE_ALARMS:.0%} of the runs that never "
        "collapse."
    )
    collapsed = [r for r in rows if r["collapse_events"] > 0]
    if not collapsed:
        return Claim(15, statement, NOT_TESTED, "no run collapsed", _regime(rows))
    calm = [r for r in rows if r["collapse_events"] == 0 and "false_alarm" in r]
    alarms = Counter(r["false_alarm"] for r in calm if r["false_alarm"])
    if not calm or sum(alarms.values()) > PRECURSOR_FALSE_ALARMS * len(calm):
        fired = (
            f"it fires in {sum(alarms.values())} of {len(calm)} runs that never collapse ("
            + ", ".join(f"{name} {n}" for name, n in alarms.most_common())
            + "): it cannot tell a collapse coming"
            if calm
            else "no run without a collapse measured the rule's false alarms"
        )
        return Claim(15, statement, NOT_TESTED, fired, _regime(rows))
    missing = [r["run_id"] for r in collapsed if not r.get("precursor")]
    found = Counter(r["precursor"] for r in collapsed if r.get("precursor"))
    evidence = f"{len(collapsed) - len(missing)} of {len(collapsed)} collapsed runs had one" + (
        " (" + ", ".join(f"{name} {n}" for name, n in found.most_common()) + ")" if found else ""
    )
    if missing:
        evidence += "; none before the collapse in " + ", ".join(missing)
    evidence += f"; false alarms in {sum(alarms.values())} of {len(calm)} runs that never collapse"
    return Claim(15, statement, FAIL if missing else PASS, evidence, _regime(rows))


def dense_control_does_not_collapse(rows: list[Row]) -> Claim:
    statement = (
        f"The dense control ({DENSE_MODEL}) does not collapse at the main model's base learning "
        "rate."
    )
    main = _main_base(rows)
    rates = {r["lr"] for r in main}
    dense = [r for r in rows if r.get("model") == DENSE_MODEL and r["lr"] in rates]
    if not dense:
        return Claim(
            16,
            statement,
            NOT_TESTED,
            f"needs {DENSE_MODEL} runs at the learning rate of {MAIN_MODEL}'s base point",
            _regime(rows),
        )
    events = sum(r["collapse_events"] for r in dense)
    evidence = (
        f"{events} collapse events over {len(dense)} {DENSE_MODEL} runs at lr "
        + ", ".join(f"{lr:g}" for lr in sorted(rates))
        + f" ({sum(r['collapse_events'] for r in main)} over {len(main)} {MAIN_MODEL} base runs)"
    )
    return Claim(16, statement, PASS if events == 0 else FAIL, evidence, _regime(main))


# what must be equal for two runs of different models or engines to be compared (besides the
# arm): the swept fields the rows name (other swept fields are not told apart)
_SETTINGS = ("updates_per_batch", "lr", "layers")


def sigmoid_routers_drift_more(rows: list[Row]) -> Claim:
    statement = (
        f"Sigmoid + expert-bias routers ({SIGMOID_MODEL}) drift more than softmax + aux-loss "
        f"routers ({MAIN_MODEL}): more of their activated experts change per update, per arm "
        "without replay at equal settings."
    )
    free = [r for r in rows if _no_replay(r) and r.get("update_activated") is not None]

    def key(row: Row) -> tuple:
        return (row["arm"], _engine(row), *(row.get(c) for c in _SETTINGS))

    by_model = {
        model: group_by([r | {"_key": key(r)} for r in free if r.get("model") == model], "_key")
        for model in (SIGMOID_MODEL, MAIN_MODEL)
    }
    shared = [k for k in by_model[SIGMOID_MODEL] if k in by_model[MAIN_MODEL]]
    if not shared:
        return Claim(
            17,
            statement,
            NOT_TESTED,
            f"needs runs without replay of {SIGMOID_MODEL} and {MAIN_MODEL} of one arm at equal "
            "settings",
            _regime(rows),
        )
    parts, holds, pooled = [], True, []
    for arm in dict.fromkeys(k[0] for k in shared):
        sigmoid = [r for k in shared if k[0] == arm for r in by_model[SIGMOID_MODEL][k]]
        softmax = [r for k in shared if k[0] == arm for r in by_model[MAIN_MODEL][k]]
        a, b = _mean(sigmoid, "update_activated"), _mean(softmax, "update_activated")
        holds &= a > b
        pooled += sigmoid + softmax
        parts.append(f"{arm}: {a:.2%} vs {b:.2%} (n={len(sigmoid)}/{len(softmax)})")
    evidence = (
        f"activated experts changed per update, {SIGMOID_MODEL} vs {MAIN_MODEL}: "
        + "; ".join(parts)
    )
    return Claim(17, statement, PASS if holds else FAIL, evidence, _regime(pooled))


def engine_precision_orders_mismatch(rows: list[Row]) -> Claim:
    statement = (
        "Engine precision orders the train-vs-engine mismatch: the routing mismatch and the k3 "
        "KL of GRPO without replay rise from a float32 to a bfloat16 to a float8 engine."
    )
    grpo = [r for r in rows if GRPO(r)]
    groups = group_by(
        [r | {"_key": (r.get("model"), *(r.get(c) for c in _SETTINGS))} for r in grpo], "_key"
    )
    complete = [g for g in groups.values() if {_engine(r) for r in g} >= set(ENGINE_DTYPES)]
    if not complete:
        return Claim(
            18,
            statement,
            NOT_TESTED,
            "needs GRPO runs without replay with float32, bfloat16 and float8_emulated engines "
            "at otherwise equal settings",
            _regime(rows),
        )
    pooled = [r for g in complete for r in g]
    parts, holds = [], True
    for column, label, form in (
        ("engine_routing_mismatch", "routing mismatch", "{:.2%}"),
        ("mismatch_k3", "k3", "{:.3g}"),
    ):
        means = [_mean([r for r in pooled if _engine(r) == e], column) for e in ENGINE_DTYPES]
        if any(m is None for m in means):
            holds = False
            parts.append(f"{label}: not measured for every engine")
            continue
        holds &= all(a < b for a, b in itertools.pairwise(means))
        parts.append(
            f"{label}: "
            + " < ".join(f"{e} {form.format(m)}" for e, m in zip(ENGINE_DTYPES, means, strict=True))
        )
    evidence = "; ".join(parts) + f" ({len(pooled)} runs)"
    return Claim(18, statement, PASS if holds else FAIL, evidence, _regime(pooled))


def float8_reaches_moe_mismatch(rows: list[Row]) -> Claim:
    statement = (
        "The float8 engine reaches the MoE mismatch regime: the k3 KL between engine and trainer "
        f"log-probs of runs without replay is >= {MOE_K3:g} (the R3 paper's ~1.5e-3 for MoE)."
    )
    fp8 = [
        r
        for r in rows
        if _no_replay(r)
        and _engine(r) == "float8_emulated"
        and r.get("model") != DENSE_MODEL
        and r.get("mismatch_k3") is not None
    ]
    if not fp8:
        return Claim(
            19,
            statement,
            NOT_TESTED,
            "needs MoE runs without replay with a float8_emulated engine",
            _regime(rows),
        )
    k3 = _mean(fp8, "mismatch_k3")
    evidence = (
        f"k3 {k3:.3g} (mean of {len(fp8)} runs; smallest {min(_values(fp8, 'mismatch_k3')):.3g})"
    )
    return Claim(19, statement, PASS if k3 >= MOE_K3 else FAIL, evidence, _regime(fp8))


def corrections_instead_of_replay(rows: list[Row]) -> Claim:
    statement = (
        "Mismatch corrections instead of replay: with a float8 engine, GRPO + TIS, GRPO + "
        "geometric MIS and GRPO + TIS masked by geometric MIS are each as stable as GRPO + R3."
    )
    fp8 = [r for r in rows if _engine(r) == "float8_emulated"]
    parts, verdicts, tested, untested = [], [], [], []
    # each correction with the summary column saying how often it acted (its fire rate): one
    # that never acted duplicates plain GRPO (for the combination, TIS alone)
    corrections = (
        ("TIS", GRPO_TIS, "tis_truncated_frac"),
        ("geometric MIS", GRPO_MIS, "mis_masked_frac"),
        ("TIS + geometric MIS", GRPO_TIS_MIS, "mis_masked_frac"),
    )
    for name, arm, fire_rate in corrections:
        cells = _cells(fp8, arm, GRPO_R3)
        if not cells:
            untested.append(name)
            continue
        fired = [row[fire_rate] for row in _pooled(cells, 0) if row.get(fire_rate) is not None]
        if not any(fired):
            untested.append(f"{name} (never acted: {fire_rate} {'0' if fired else 'not recorded'})")
            continue
        tested += _pooled(cells, 0)
        stability = compare(_pooled(cells, 0), _pooled(cells, 1), (f"GRPO + {name}", "GRPO + R3"))
        verdicts.append(stability.as_stable())
        parts.append(f"{stability} ({', '.join(c[0][0]['cell'] for c in cells)})")
    if untested:
        verdicts.append(NOT_TESTED)
        parts.append("not tested with GRPO + R3 in a float8 cell: GRPO + " + ", ".join(untested))
    return Claim(20, statement, all_hold(verdicts), "; ".join(parts), _regime(tested or rows))


def main_regime_holds(rows: list[Row]) -> Claim:
    statement = (
        f"The main regime holds: on the main model ({MAIN_MODEL}) at the base point, at least "
        f"{STRONG_DRIFT:.0%} of the activated experts differ from the old policy's after each "
        "update, without replay."
    )
    free = [r for r in _main_base(rows) if _no_replay(r) and r.get(REGIME_METRIC) is not None]
    if not free:
        return Claim(
            21,
            statement,
            NOT_TESTED,
            f"needs runs without replay of {MAIN_MODEL} at the base point with {REGIME_METRIC}",
            _regime(rows),
        )
    drift = _mean(free, REGIME_METRIC)
    evidence = (
        f"{drift:.2%} of activated experts changed since the old policy after each update (mean "
        f"of {len(free)} runs; smallest {min(_values(free, REGIME_METRIC)):.2%}; one update "
        f"alone: {_mean(free, 'update_activated') or 0:.2%})"
    )
    return Claim(21, statement, PASS if drift >= STRONG_DRIFT else FAIL, evidence, _regime(free))


CLAIMS = (
    drift_after_update,
    later_layers_drift_more,
    tails_fatten_without_replay,
    routing_causes_most_log_ratio,
    gspo_clips_far_more,
    gspo_as_stable_as_r2,
    on_policy_needs_no_replay,
    engine_logprobs_suffice,
    replay_is_cheap,
    two_minibatches_need_r2,
    four_minibatches_need_r3,
    r3_cuts_engine_mismatch,
    frozen_router_as_stable_and_cheaper,
    near_ties_predict_layer_drift,
    precursor_before_collapse,
    dense_control_does_not_collapse,
    sigmoid_routers_drift_more,
    engine_precision_orders_mismatch,
    float8_reaches_moe_mismatch,
    corrections_instead_of_replay,
    main_regime_holds,
)


def check_claims(rows: list[Row]) -> list[Claim]:
    """Every claim on the rows of the runs that finished."""
    done = [row for row in rows if row["state"] == "done"]
    return [claim(done) for claim in CLAIMS]
