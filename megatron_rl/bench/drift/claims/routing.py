"""Claims about the routing itself: that it drifts, where, how much of the token log-ratio it
causes, and which routers drift more (claims 1-4, 14, 17, 21)."""

from __future__ import annotations

import math
import statistics

from megatron_rl.bench.drift.claims.common import (
    FINE_MODELS,
    GRPO,
    GRPO_R2,
    MAIN_MODEL,
    RANK_CORRELATION,
    REGIME_METRIC,
    ROUTING_SHARE,
    SETTINGS,
    SIGMOID_MODEL,
    STRONG_DRIFT,
    Claim,
    Row,
    cells_with,
    column,
    difference,
    engine_of,
    group_by,
    layer_columns,
    main_base,
    mean_of,
    no_replay,
    paired,
    per_seed,
    pooled,
    regime_of,
    values_of,
)
from megatron_rl.bench.drift.stability import NOT_TESTED, all_hold, distinct
from megatron_rl.bench.drift.uncertainty import (
    FAIL,
    PASS,
    at_least_verdict,
    effect,
    rank_correlation_interval,
)
from megatron_rl.moe.margins import NEAR_TIE


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
    free = [r for r in rows if no_replay(r) and r.get("update_activated") is not None]
    r2 = [r for r in rows if r["routing_replay"] == "r2" and r.get("replay_miss_max") is not None]
    if not free or not r2:
        return Claim(
            1,
            statement,
            NOT_TESTED,
            "needs runs without replay that measured update_activated, and runs with R2",
            regime_of(rows),
        )
    smallest = min(r["update_activated"] for r in free)
    miss = max(r["replay_miss_max"] for r in r2)
    verdict = PASS if smallest > 0 and miss == 0 else FAIL
    evidence = (
        f"without replay: {mean_of(free, 'update_activated'):.2%} of activated experts changed "
        f"per update (smallest run {smallest:.2%}, {len(free)} runs); R2: replayed vs used "
        f"routing differ in at most {miss:.2%} of pairs ({len(r2)} runs)"
    )
    return Claim(1, statement, verdict, evidence, regime_of(free))


def later_layers_drift_more(rows: list[Row]) -> Claim:
    statement = (
        f"Later layers drift more: on the main model ({MAIN_MODEL}) at the base point, the last "
        "half of the MoE layers changes more of its activated experts per update than the first."
    )
    prefix = "update_activated_layer_"
    free = [r for r in main_base(rows) if no_replay(r)]
    layers = layer_columns(free, prefix)
    half = len(layers) // 2

    def later_minus_earlier(row: Row) -> float | None:
        changed = [row.get(f"{prefix}{i}") for i in layers]
        if half == 0 or None in changed:
            return None
        return statistics.fmean(changed[-half:]) - statistics.fmean(changed[:half])

    gap = effect("last half - first half", per_seed(free, later_minus_earlier), 0.0)
    if gap is None:
        return Claim(
            2,
            statement,
            NOT_TESTED,
            f"needs runs without replay of {MAIN_MODEL} at the base point with per-layer "
            "update_activated of two MoE layers or more, of 2 seeds or more",
            regime_of(rows),
        )
    per_layer = {i: mean_of(free, f"{prefix}{i}") or 0.0 for i in layers}
    evidence = (
        f"activated experts changed per update, layers {layers[-half]}-{layers[-1]} minus "
        f"{layers[0]}-{layers[half - 1]}, per seed: {gap} ("
        + ", ".join(f"{i}: {v:.2%}" for i, v in per_layer.items())
        + f"; {len(free)} runs)"
    )
    return Claim(2, statement, gap.above(), evidence, regime_of(free))


def tails_fatten_without_replay(rows: list[Row]) -> Claim:
    statement = (
        "Routing changes fatten the token log-ratio's tail: max |log w| and the share outside "
        "[0.8, 1.25] are larger without replay than with R2 at the same learning rate."
    )
    cells = [c for c in cells_with(rows, GRPO, GRPO_R2) if c[0][0]["updates_per_batch"] > 1]
    if not cells:
        return Claim(
            3,
            statement,
            NOT_TESTED,
            "needs GRPO with and without R2 at >1 update per batch",
            regime_of(rows),
        )
    free = pooled(cells, 0)
    r2 = pooled(cells, 1)
    parts, verdicts = [], []
    for name, label in (
        ("log_ratio_abs_max", "max |log w|"),
        ("log_ratio_outside_0.8_1.25", "outside [0.8, 1.25]"),
    ):
        # without replay minus with R2, paired over cells and seeds: larger means above 0
        larger = effect(f"{label} without replay - with R2", paired(free, r2, difference(name)), 0)
        if larger is None:
            return Claim(3, statement, NOT_TESTED, f"under 2 paired {label}", regime_of(rows))
        verdicts.append(larger.above())
        parts.append(f"{larger} (means {mean_of(free, name):.4g} vs {mean_of(r2, name):.4g})")
    evidence = "; ".join(parts) + f" ({len(cells)} cells, {len(free)}/{len(r2)} runs)"
    return Claim(3, statement, all_hold(verdicts), evidence, regime_of(free))


def routing_causes_most_log_ratio(rows: list[Row]) -> Claim:
    statement = (
        f"Routing causes most of the token log-ratio: on the main model ({MAIN_MODEL}), "
        f"replaying the old routing removes at least {ROUTING_SHARE:.0%} of its variance "
        "(paired, on the same micro-batch)."
    )
    free = [r for r in rows if no_replay(r) and r.get("model") == MAIN_MODEL]
    share = effect(
        "routing's share of the log-ratio variance (pooled per run, per seed)",
        per_seed(free, column("log_ratio_var_share_pooled")),
        ROUTING_SHARE,
    )
    if share is None:
        return Claim(
            4,
            statement,
            NOT_TESTED,
            f"needs runs without replay of {MAIN_MODEL} that measured log_ratio_var_share_pooled, "
            "of 2 seeds or more",
            regime_of(rows),
        )
    measured = [r for r in distinct(free) if r.get("log_ratio_var_share_pooled") is not None]
    abs_share = mean_of(measured, "log_ratio_abs_share")
    evidence = (
        f"{share}; smallest run {min(values_of(measured, 'log_ratio_var_share_pooled')):.1%} "
        f"({len(measured)} distinct runs)"
        + (f"; of the mean |log w| {abs_share:.1%}" if abs_share is not None else "")
    )
    return Claim(4, statement, share.at_least(), evidence, regime_of(measured))


def near_ties_predict_layer_drift(rows: list[Row]) -> Claim:
    statement = (
        "The near-tie share predicts a layer's drift: over the layers of each fine-grained "
        f"model, the share of top-k margins below {NEAR_TIE:g} (moe/margins.py's scale-free "
        "margin) and the share of activated experts changed per update (each a layer's mean "
        "over the runs without replay) have a Spearman rank correlation of at least "
        f"{RANK_CORRELATION:g}, its 95% interval above it. Per model, so that two kinds of "
        "router do not rank layers against each other. One point per layer: a run's layers are "
        "not independent of each other, nor are seeds of one arm of its layers."
    )
    free = distinct([r for r in rows if no_replay(r) and r.get("model") in FINE_MODELS])
    parts, verdicts, tested = [], [], []
    for model, model_rows in group_by(free, "model").items():
        ties, drift = [], []
        for layer in layer_columns(model_rows, "near_tie_layer_"):
            tie = mean_of(model_rows, f"near_tie_layer_{layer}")
            changed = mean_of(model_rows, f"update_activated_layer_{layer}")
            if tie is not None and changed is not None:
                ties.append(tie)
                drift.append(changed)
        rho = spearman(ties, drift)
        if rho is None or len(ties) <= 3:
            parts.append(f"{model}: {len(ties)} layers, need 4 that vary")
            continue
        tested += model_rows
        interval = rank_correlation_interval(rho, len(ties))
        verdicts.append(at_least_verdict(interval, RANK_CORRELATION))
        parts.append(f"{model}: Spearman {interval} over layers (means of {len(model_rows)} runs)")
    if not tested:
        return Claim(
            14,
            statement,
            NOT_TESTED,
            f"needs per-layer near_tie and update_activated of runs without replay on "
            f"{' or '.join(FINE_MODELS)} that vary" + (f" ({'; '.join(parts)})" if parts else ""),
            regime_of(rows),
        )
    return Claim(14, statement, all_hold(verdicts), "; ".join(parts), regime_of(tested))


def sigmoid_routers_drift_more(rows: list[Row]) -> Claim:
    statement = (
        f"Sigmoid + expert-bias routers ({SIGMOID_MODEL}) drift more than softmax + aux-loss "
        f"routers ({MAIN_MODEL}): more of their activated experts change per update, per arm "
        "without replay at equal settings."
    )
    free = distinct([r for r in rows if no_replay(r) and r.get("update_activated") is not None])

    def key(row: Row) -> tuple:
        return (row["arm"], engine_of(row), row["seed"], *(row.get(c) for c in SETTINGS))

    softmax = {key(r): r for r in free if r.get("model") == MAIN_MODEL}
    pairs = [
        (r, softmax[key(r)]) for r in free if r.get("model") == SIGMOID_MODEL and key(r) in softmax
    ]
    by_seed: dict[int, list[float]] = {}
    for a, b in pairs:
        by_seed.setdefault(a["seed"], []).append(a["update_activated"] - b["update_activated"])
    more = effect(
        f"{SIGMOID_MODEL} - {MAIN_MODEL}, per seed",
        [statistics.fmean(by_seed[seed]) for seed in sorted(by_seed)],
        0.0,
    )
    if more is None:
        return Claim(
            17,
            statement,
            NOT_TESTED,
            f"needs runs without replay of {SIGMOID_MODEL} and {MAIN_MODEL} of one arm and seed "
            "at equal settings, of 2 seeds or more",
            regime_of(rows),
        )
    runs = [r for pair in pairs for r in pair]
    arms = group_by([a for a, _ in pairs], "arm")
    per_arm = "; ".join(
        f"{arm}: {mean_of(sig, 'update_activated'):.2%} vs "
        f"{mean_of([b for a, b in pairs if a['arm'] == arm], 'update_activated'):.2%}"
        for arm, sig in arms.items()
    )
    evidence = f"activated experts changed per update, {more} ({len(pairs)} paired runs; {per_arm})"
    return Claim(17, statement, more.above(), evidence, regime_of(runs))


def main_regime_holds(rows: list[Row]) -> Claim:
    statement = (
        f"The main regime holds: on the main model ({MAIN_MODEL}) at the base point, at least "
        f"{STRONG_DRIFT:.0%} of the activated experts differ from the old policy's after each "
        "update, without replay."
    )
    free = [r for r in main_base(rows) if no_replay(r) and r.get(REGIME_METRIC) is not None]
    drift = effect(f"{REGIME_METRIC} per seed", per_seed(free, column(REGIME_METRIC)), STRONG_DRIFT)
    if drift is None:
        return Claim(
            21,
            statement,
            NOT_TESTED,
            f"needs runs without replay of {MAIN_MODEL} at the base point with {REGIME_METRIC}, "
            "of 2 seeds or more",
            regime_of(rows),
        )
    evidence = (
        f"activated experts changed since the old policy after each update, {drift} ("
        f"{len(free)} runs; smallest {min(values_of(free, REGIME_METRIC)):.2%}; one update alone: "
        f"{mean_of(free, 'update_activated') or 0:.2%})"
    )
    return Claim(21, statement, drift.at_least(), evidence, regime_of(free))
