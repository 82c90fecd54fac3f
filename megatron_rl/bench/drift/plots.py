"""The drift grid's plots: each a function of the finished runs' summary rows and per-step
records that draws one PNG and returns (title, file name), or None when the grid has no data for
it (an older or smaller grid: the tiny recipe's, a grid without the routing probe, a grid where
nothing collapsed). `PLOTS` lists them in the report's order."""

from __future__ import annotations

import math
import statistics
from collections import defaultdict
from collections.abc import Callable
from pathlib import Path
from typing import Any

# The object-oriented API without pyplot: figures drawn straight to files, no display backend.
from matplotlib.figure import Figure

from megatron_rl.bench.drift.claims.common import (
    ENGINE_DTYPES,
    REGIME_METRIC,
    engine_of,
    group_by,
    is_frozen,
)
from megatron_rl.bench.drift.claims.dose import dose_of, dosed_rows, flipped_at
from megatron_rl.bench.drift.claims.survival import at_collapse_point, run_time
from megatron_rl.bench.drift.collapse import (
    PRECURSOR_BASELINE,
    PRECURSOR_METRICS,
    PRECURSOR_Z,
)
from megatron_rl.bench.drift.survival import RunTime, kaplan_meier
from megatron_rl.bench.drift.uncertainty import student_t_quantile
from megatron_rl.moe.margins import bucket_names

Row = dict[str, Any]
Series = dict[int, float]
Plot = tuple[str, str]

# the arms of the mismatch-by-precision plot: no correction, replay, sequence ratio, corrections
_MISMATCH_ARMS = (
    "grpo",
    "grpo_r2",
    "grpo_r3",
    "gspo",
    "grpo_tis",
    "grpo_mis_geometric",
    "grpo_tis_mis_geometric",
)
_MAX_COLLAPSED_PLOTS = 6
# moe/margins.py's scale-free margin: one axis for softmax and sigmoid routers
MARGIN_AXIS = "margin (logit gap: softmax; score gap / score spread: sigmoid + bias)"


def routers_free(row: Row) -> bool:
    """Routers that choose freely and are trained: claims/common.py's runs without replay, the
    dense control's included (it is drawn, at no drift)."""
    return row["routing_replay"] == "none" and not is_frozen(row)


def _series(records: list[Row], key: str) -> Series:
    return {r["step"]: r[key] for r in records if r.get(key) is not None}


def _band(ax: Any, runs: list[Series], label: str) -> bool:
    """Mean over runs per step, with the range of the runs as a band; False if nothing to draw."""
    steps = sorted({step for run in runs for step in run})
    values = [[run[s] for run in runs if s in run] for s in steps]
    if not steps:
        return False
    mean = [statistics.fmean(v) for v in values]
    (line,) = ax.plot(steps, mean, label=label)
    ax.fill_between(
        steps, [min(v) for v in values], [max(v) for v in values], alpha=0.2, color=line.get_color()
    )
    return True


def _at_base_except(rows: list[Row], *varied: str) -> list[Row]:
    """Rows equal to the base point in updates, learning rate, engine precision and depth,
    except `varied`."""
    base = [r for r in rows if r["cell"] == "base"]
    fixed = [c for c in ("updates_per_batch", "lr", "engine_dtype", "layers") if c not in varied]

    def key(row: Row) -> tuple[Any, ...]:
        return tuple(engine_of(row) if c == "engine_dtype" else row.get(c) for c in fixed)

    values = {key(r) for r in base}
    return [r for r in rows if key(r) in values]


def _drift_column(rows: list[Row]) -> tuple[str, str]:
    """(summary column, axis label) of drift: the papers' metric where the runs measured it."""
    if any(r.get(REGIME_METRIC) is not None for r in rows):
        return REGIME_METRIC, "activated experts changed since the old policy"
    return "drift_token_layer", "token-layer drift"


def _save(fig: Any, out: Path, name: str, title: str) -> Plot:
    fig.tight_layout()
    fig.savefig(out / name, dpi=90)
    return title, name


def _plot_drift_vs_step(rows: list[Row], curves: dict[str, list[Row]], out: Path) -> Plot | None:
    """(a) Drift per step per arm at the base point: the papers' metric when the runs have it."""
    base = [r for r in rows if r["cell"] == "base"]
    measured = any(
        r.get("routing/since_old_activated_experts") is not None
        for row in base
        for r in curves.get(row["run_id"], [])
    )
    key, label = (
        ("routing/since_old_activated_experts", "activated experts changed since the old policy")
        if measured
        else ("routing/drift_token_layer", "token-layer drift")
    )
    fig = Figure(figsize=(7, 4))
    ax = fig.subplots()
    drawn = [
        _band(ax, [_series(curves.get(r["run_id"], []), key) for r in arm_rows], arm)
        for arm, arm_rows in group_by(base, "arm").items()
    ]
    if not any(drawn):
        return None
    ax.set(xlabel="step", ylabel=label, title="Routing drift per step (base point)")
    ax.legend(fontsize=7)
    return _save(fig, out, "drift_vs_step.png", "Drift vs step per arm")


def _plot_layers(rows: list[Row], curves: dict[str, list[Row]], out: Path) -> Plot | None:
    """(b) Share of activated experts changed per update, per layer, for each base model: the
    runs without replay at the base point's updates, learning rate and engine."""
    free = [r for r in _at_base_except(rows, "layers") if routers_free(r)]
    prefix = "update_activated_layer_"
    per_model = {}
    for model, model_rows in group_by(free, "model").items():
        layers = sorted(
            {int(k[len(prefix) :]) for r in model_rows for k in r if k.startswith(prefix)}
        )
        means = [
            statistics.fmean(values)
            for layer in layers
            if (
                values := [
                    r[f"{prefix}{layer}"]
                    for r in model_rows
                    if r.get(f"{prefix}{layer}") is not None
                ]
            )
        ]
        if means:
            per_model[model] = (layers, means)
    if not per_model:
        return None
    fig = Figure(figsize=(7, 4))
    ax = fig.subplots()
    for model, (layers, means) in per_model.items():
        ax.plot(layers, means, marker="o", label=model)
    ax.set(
        xlabel="layer",
        ylabel="activated experts changed per update",
        title="Drift per layer (no replay, base point)",
    )
    ax.legend(fontsize=7)
    return _save(fig, out, "drift_layers.png", "Share of activated experts changed per layer")


def _plot_depth(rows: list[Row], curves: dict[str, list[Row]], out: Path) -> Plot | None:
    """Token-layer drift per layer and vs depth, when the grid has several depths."""
    free = [
        r
        for r in _at_base_except(rows, "layers")
        if r["routing_replay"] == "none" and r.get("drift_token_layer") is not None
    ]
    depths = sorted({r["layers"] for r in free if r.get("layers") is not None})
    if len(depths) < 2:
        return None
    fig = Figure(figsize=(10, 4))
    per_layer, by_depth = fig.subplots(1, 2)
    for depth in depths:
        at = [r for r in free if r["layers"] == depth]
        means = [
            statistics.fmean(values)
            for i in range(depth)
            if (
                values := [
                    r[f"drift_layer_{i}"] for r in at if r.get(f"drift_layer_{i}") is not None
                ]
            )
        ]
        per_layer.plot(range(len(means)), means, marker="o", label=f"{depth} layers")
    per_layer.set(
        xlabel="layer", ylabel="share of tokens re-routed", title="Drift per layer (no replay)"
    )
    per_layer.legend(fontsize=7)
    for column in ("drift_token_any", "drift_token_layer"):
        by_depth.plot(
            depths,
            [
                statistics.fmean(
                    [r[column] for r in free if r["layers"] == d and r.get(column) is not None]
                    or [math.nan]
                )
                for d in depths
            ],
            marker="o",
            label=column,
        )
    by_depth.set(xlabel="layers", ylabel="drift", title="Drift vs depth (no replay)")
    by_depth.legend(fontsize=7)
    return _save(fig, out, "drift_depth.png", "Drift per layer and vs depth")


def margin_buckets(rows: list[Row]) -> dict[str, tuple[list[float], list[float]]]:
    """Per base model, over its runs without replay among `rows`: (share of routes, flip rate)
    per margin bucket (margins.bucket_names' order), the flip rate pooled over the runs as the
    flips summed (`routes_<b>` x `flip_rate_<b>`) over the routes summed (NaN: no routes)."""
    buckets = bucket_names()
    pooled = {}
    for model, model_rows in group_by([r for r in rows if routers_free(r)], "model").items():
        routes = [sum(r.get(f"routes_{b}") or 0 for r in model_rows) for b in buckets]
        if not sum(routes):
            continue
        flips = [
            sum((r.get(f"routes_{b}") or 0) * (r.get(f"flip_rate_{b}") or 0) for r in model_rows)
            for b in buckets
        ]
        pooled[model] = (
            [n / sum(routes) for n in routes],
            [f / n if n else math.nan for f, n in zip(flips, routes, strict=True)],
        )
    return pooled


def _plot_margins(rows: list[Row], curves: dict[str, list[Row]], out: Path) -> Plot | None:
    """(d) Per base model, over its runs without replay: the share of routes in each margin
    bucket, and the flip rate per bucket pooled over the runs (margin_buckets)."""
    buckets = bucket_names()
    pooled = margin_buckets(rows)
    shares = {model: share for model, (share, _) in pooled.items()}
    rates = {model: rate for model, (_, rate) in pooled.items()}
    if not shares:
        return None
    fig = Figure(figsize=(11, 4))
    share_ax, rate_ax = fig.subplots(1, 2)
    width = 0.8 / len(shares)
    for index, model in enumerate(shares):
        x = [i + (index - (len(shares) - 1) / 2) * width for i in range(len(buckets))]
        share_ax.bar(x, shares[model], width, label=model)
        rate_ax.bar(x, rates[model], width, label=model)
    for ax, label, title in (
        (share_ax, "share of routes", "Routes per top-k margin (no replay)"),
        (rate_ax, "routes flipped by the update", "Flip rate per margin (no replay, pooled)"),
    ):
        ax.set_xticks(range(len(buckets)), buckets, fontsize=7)
        ax.set(xlabel=MARGIN_AXIS, ylabel=label, title=title)
        ax.legend(fontsize=7)
    return _save(fig, out, "margins.png", "Router margins and flip rate per margin")


def _plot_mismatch(rows: list[Row], curves: dict[str, list[Row]], out: Path) -> Plot | None:
    """(e) Train-vs-engine mismatch by engine precision: one bar group per arm, one bar per
    precision, on the base point's model(s)."""
    models = {r.get("model") for r in rows if r["cell"] == "base"}
    at = [r for r in rows if r.get("model") in models and r["arm"] in _MISMATCH_ARMS]
    columns = (
        ("engine_routing_mismatch", "(token, layer) routed differently by engine and trainer"),
        ("mismatch_k3", "k3 KL, engine vs trainer log-probs (log scale)"),
    )
    at = [r for r in at if any(r.get(column) is not None for column, _ in columns)]
    if not at:
        return None
    engines = [d for d in ENGINE_DTYPES if any(engine_of(r) == d for r in at)]
    engines += sorted({engine_of(r) for r in at} - set(engines))
    arms = [arm for arm in _MISMATCH_ARMS if any(r["arm"] == arm for r in at)]
    fig = Figure(figsize=(12, 4))
    width = 0.8 / len(engines)
    for ax, (column, title) in zip(fig.subplots(1, 2), columns, strict=True):
        for index, engine in enumerate(engines):
            means = [
                statistics.fmean(values)
                if (values := _values(at, column, arm, engine))
                else math.nan
                for arm in arms
            ]
            x = [i + (index - (len(engines) - 1) / 2) * width for i in range(len(arms))]
            ax.bar(x, means, width, label=f"{engine} engine")
        if column == "mismatch_k3" and any(v > 0 for v in _values(at, column)):
            ax.set_yscale("log")  # bars of 0 (a float32 engine) are left out there
        ax.set_xticks(range(len(arms)), arms, rotation=30, fontsize=7)
        ax.set_title(title, fontsize=9)
        ax.legend(fontsize=7)
    return _save(fig, out, "mismatch_precision.png", "Train-vs-engine mismatch by engine precision")


def _values(
    rows: list[Row], column: str, arm: str | None = None, engine: str | None = None
) -> list[float]:
    """`column` of the rows (of `arm`, with an `engine` engine) that have it."""
    return [
        r[column]
        for r in rows
        if r.get(column) is not None
        and (arm is None or r["arm"] == arm)
        and (engine is None or engine_of(r) == engine)
    ]


def z_scores(records: list[Row], keys: tuple[str, ...], collapse_step: int) -> Series:
    """A precursor metric's distance from its baseline in baseline standard deviations, per step
    (collapse.collapse_precursor's baseline: its first values before the collapse)."""
    key = next((k for k in keys if any(r.get(k) is not None for r in records)), None)
    if key is None:
        return {}
    series = {step: value for step, value in _series(records, key).items() if step > 0}
    baseline = [series[s] for s in sorted(series) if s < collapse_step][:PRECURSOR_BASELINE]
    if len(baseline) < PRECURSOR_BASELINE:
        return {}
    mean = statistics.fmean(baseline)
    std = max(statistics.pstdev(baseline), 1e-12 * abs(mean) + 1e-12)
    return {step: (value - mean) / std for step, value in sorted(series.items())}


def _plot_precursors(rows: list[Row], curves: dict[str, list[Row]], out: Path) -> Plot | None:
    """(f) For up to 6 collapsed runs: each precursor metric's z-score against its first steps,
    over steps, and the first collapse."""
    collapsed = [r for r in rows if r.get("first_collapse_step") is not None]
    if not collapsed:
        return None
    shown = collapsed[:_MAX_COLLAPSED_PLOTS]
    columns = min(3, len(shown))
    fig = Figure(figsize=(4.5 * columns, 3.5 * math.ceil(len(shown) / columns)))
    axes = list(fig.subplots(math.ceil(len(shown) / columns), columns, squeeze=False).flat)
    for ax, row in zip(axes, shown, strict=False):
        collapse = row["first_collapse_step"]
        for name, keys in PRECURSOR_METRICS.items():
            z = z_scores(curves.get(row["run_id"], []), keys, collapse)
            if z:
                ax.plot(list(z), list(z.values()), label=name)
        for bound in (-PRECURSOR_Z, PRECURSOR_Z):
            ax.axhline(bound, color="grey", linestyle=":", linewidth=0.8)
        ax.axvline(collapse, color="black", linestyle="--", label="first collapse")
        # linear inside the threshold, logarithmic beyond: a jump does not flatten the rest
        ax.set_yscale("symlog", linthresh=PRECURSOR_Z)
        moved = (
            f"{row['precursor']} moved at step {row['precursor_step']}"
            if row.get("precursor")
            else "no precursor"
        )
        ax.set(
            xlabel="step",
            ylabel=f"z vs first {PRECURSOR_BASELINE} steps",
            title=f"{row['run_id']}\n{moved}",
        )
        ax.title.set_fontsize(7)
        ax.legend(fontsize=6)
    for ax in axes[len(shown) :]:  # the grid's unused places
        ax.set_visible(False)
    title = "Collapse precursors"
    if len(collapsed) > len(shown):
        title += f" (the first {len(shown)} of {len(collapsed)} collapsed runs)"
    return _save(fig, out, "collapse_precursors.png", title)


def off_policy_groups(rows: list[Row], column: str) -> dict[tuple[Any, ...], list[Row]]:
    """(model, engine precision, lr) -> the rows with `column` that share them, for every such
    setting run at more than one number of updates per batch."""
    groups: dict[tuple[Any, ...], list[Row]] = defaultdict(list)
    for row in rows:
        if row.get(column) is not None:
            groups[(row.get("model"), engine_of(row), row.get("lr"))].append(row)
    return {
        setting: group
        for setting, group in groups.items()
        if len({r["updates_per_batch"] for r in group}) > 1
    }


def _plot_off_policy(rows: list[Row], curves: dict[str, list[Row]], out: Path) -> Plot | None:
    """(g) Drift vs updates per batch, per arm, over the rows that differ only in updates per
    batch (off_policy_groups)."""
    column, label = _drift_column(rows)
    swept = off_policy_groups(rows, column)
    if not swept:
        return None
    fig = Figure(figsize=(7, 4))
    ax = fig.subplots()
    for (model, engine, lr), group in swept.items():
        for arm, arm_rows in group_by(group, "arm").items():
            degrees = sorted({r["updates_per_batch"] for r in arm_rows})
            means = [
                statistics.fmean(r[column] for r in arm_rows if r["updates_per_batch"] == d)
                for d in degrees
            ]
            name = arm if len(swept) == 1 else f"{arm} ({model}, {engine}, lr {lr})"
            ax.plot(degrees, means, marker="o", label=name)
    ax.set(xlabel="updates per rollout batch", ylabel=label, xscale="log")
    degrees = sorted({r["updates_per_batch"] for group in swept.values() for r in group})
    ax.set_xticks(degrees, [str(d) for d in degrees], minor=False)
    ax.set_xticks([], minor=True)
    if len(swept) == 1:
        ((model, engine, lr),) = swept
        ax.set_title(f"Drift vs off-policy degree ({model}, {engine} engine, lr {lr})", fontsize=9)
    else:
        ax.set_title("Drift vs off-policy degree")
    ax.legend(fontsize=7)
    return _save(fig, out, "drift_off_policy.png", "Drift vs off-policy degree")


def _plot_curves(rows: list[Row], curves: dict[str, list[Row]], out: Path) -> Plot | None:
    """(c) Sampled reward and held-out accuracy per arm at the base point."""
    base = [r for r in rows if r["cell"] == "base"]
    fig = Figure(figsize=(11, 4))
    axes = fig.subplots(1, 2)
    drawn = False
    for ax, key, title in (
        (axes[0], "reward/mean", "Sampled reward"),
        (axes[1], "eval/accuracy", "Held-out accuracy"),
    ):
        for arm, arm_rows in group_by(base, "arm").items():
            series = [_series(curves.get(r["run_id"], []), key) for r in arm_rows]
            drawn = _band(ax, series, arm) or drawn
        ax.set(xlabel="step", title=f"{title} (base point; band: range over seeds)")
    if not drawn:
        return None
    for ax in axes:
        if ax.get_legend_handles_labels()[0]:
            ax.legend(fontsize=7)
    return _save(fig, out, "curves.png", "Reward and held-out accuracy")


def _bars(
    out: Path, rows: list[Row], columns: tuple[tuple[str, str], ...], name: str, title: str
) -> Plot | None:
    if not rows:
        return None
    arms = group_by(rows, "arm")
    fig = Figure(figsize=(5 * len(columns), 4))
    axes = fig.subplots(1, len(columns))
    for ax, (column, label) in zip(axes, columns, strict=True):
        means = [
            statistics.fmean([r[column] for r in arm_rows if r.get(column) is not None] or [0])
            for arm_rows in arms.values()
        ]
        ax.bar(list(arms), means)
        ax.set(title=label)
        ax.tick_params(axis="x", rotation=45, labelsize=7)
    return _save(fig, out, name, title)


def _plot_clip(rows: list[Row], curves: dict[str, list[Row]], out: Path) -> Plot | None:
    """(h) Token and sequence clip fractions per arm at the base point."""
    base = [r for r in rows if r["cell"] == "base"]
    columns = (
        ("clip_frac_token", "clipped tokens (base point)"),
        ("clip_frac_seq", "clipped sequences (base point)"),
    )
    return _bars(out, base, columns, "clip_fractions.png", "Clip fractions")


def _plot_tails(rows: list[Row], curves: dict[str, list[Row]], out: Path) -> Plot | None:
    """(h) The token log-ratio's tails per arm at the point where the runs without replay
    drifted most."""
    drift = defaultdict(list)
    for row in rows:
        if row.get("drift_token_layer") is not None and row["routing_replay"] == "none":
            drift[row["cell"]].append(row["drift_token_layer"])
    if not drift:
        return None
    strongest = max(drift, key=lambda cell: statistics.fmean(drift[cell]))
    at = [r for r in rows if r["cell"] == strongest]
    columns = (
        ("log_ratio_abs_max", "max |log w| per step"),
        ("log_ratio_outside_0.8_1.25", "share of w outside [0.8, 1.25]"),
    )
    return _bars(
        out,
        at,
        columns,
        "ratio_tails.png",
        f"Token log-ratio tails at the point of most drift (`{strongest}`)",
    )


# Every plot of the report, in its order: (finished rows, run id -> per-step records, directory)
def survival_by_arm(rows: list[Row]) -> dict[str, list[RunTime]]:
    """The runs at the collapse point (claims/survival.py) as survival data, by arm, when any
    of them collapsed; {} otherwise."""
    at_point = [row for row in rows if at_collapse_point(row)]
    by_arm = {
        arm: [run_time(r) for r in arm_rows] for arm, arm_rows in group_by(at_point, "arm").items()
    }
    return by_arm if any(run.collapsed for runs in by_arm.values() for run in runs) else {}


def _plot_survival(rows: list[Row], curves: dict[str, list[Row]], out: Path) -> Plot | None:
    """Kaplan-Meier curves of the arms at the collapse point: the share of runs without a
    collapse by each step, with its pointwise 95% interval."""
    by_arm = survival_by_arm(rows)
    if not by_arm:
        return None
    fig = Figure(figsize=(7, 4))
    ax = fig.subplots()
    last = max(run.step for runs in by_arm.values() for run in runs)
    for arm, runs in by_arm.items():
        points = kaplan_meier(runs)
        steps = [0, *(p.step for p in points), last]
        survival = [1.0, *(p.survival for p in points)]
        low = [1.0, *(p.low for p in points)]
        high = [1.0, *(p.high for p in points)]
        (line,) = ax.step(
            steps, [*survival, survival[-1]], where="post", label=f"{arm} ({len(runs)})"
        )
        ax.fill_between(
            steps,
            [*low, low[-1]],
            [*high, high[-1]],
            step="post",
            alpha=0.15,
            color=line.get_color(),
        )
    ax.set(
        xlabel="step",
        ylabel="share of runs without a collapse",
        ylim=(-0.02, 1.02),
        title="Survival at the collapse point (Kaplan-Meier, 95% band)",
    )
    ax.legend(fontsize=7)
    return _save(fig, out, "survival.png", "Survival at the collapse point")


def _plot_doses(rows: list[Row], curves: dict[str, list[Row]], out: Path) -> Plot | None:
    """Final held-out accuracy and the engine-vs-trainer k3 (means over seeds, 95% t intervals)
    against the share of routes the engine flipped, per arm: margin-chosen flips solid, random
    ones dashed, both from the arm's dose-0 runs."""
    cell = dosed_rows(rows)
    if not any(dose_of(r) > 0 for r in cell):
        return None
    fig = Figure(figsize=(11, 4))
    axes = fig.subplots(1, 2)
    for arm, arm_rows in group_by(cell, "arm").items():
        colour = None
        for at, style in (("margin", "-"), ("random", "--")):
            runs = [r for r in arm_rows if flipped_at(r) == at or dose_of(r) == 0]
            for ax, column in zip(axes, ("final_accuracy", "mismatch_k3"), strict=True):
                doses, means, halves = _dose_curve(runs, column)
                if len(doses) < 2:
                    continue
                bars = ax.errorbar(doses, means, yerr=halves, linestyle=style, marker="o")
                bars[0].set(color=colour or bars[0].get_color(), label=f"{arm} ({at})")
                colour = bars[0].get_color()
    for ax, label in zip(axes, ("final held-out accuracy", "engine-vs-trainer k3"), strict=True):
        ax.set_xscale("symlog", linthresh=0.01)
        ax.set(xlabel="share of routes flipped per router call", ylabel=label)
    axes[1].set_yscale("log")
    axes[0].legend(fontsize=6)
    return _save(fig, out, "dose_response.png", "Dose-response: flipped routes")


def _plot_gate_weights(rows: list[Row], curves: dict[str, list[Row]], out: Path) -> Plot | None:
    """The residual engine-vs-trainer k3 of GRPO by replay mode (none, R3, R3 with the engine's
    gate weights) at each engine precision: means over seeds with 95% t intervals."""
    grpo = [r for r in rows if r["loss"] == "grpo" and r["mismatch"] == "none"]
    if not any(r["routing_replay"] == "r3_weights" for r in grpo):
        return None
    fig = Figure(figsize=(7, 4))
    ax = fig.subplots()
    modes = ("none", "r3", "r3_weights")
    precisions = [d for d in ENGINE_DTYPES if any(engine_of(r) == d for r in grpo)]
    for offset, mode in enumerate(modes):
        means, halves = [], []
        for precision in precisions:
            k3 = [
                r["mismatch_k3"]
                for r in grpo
                if r["routing_replay"] == mode
                and engine_of(r) == precision
                and r.get("mismatch_k3") is not None
            ]
            mean, half = _mean_and_half_width(k3)
            means.append(mean)
            halves.append(half)
        positions = [i + (offset - 1) * 0.27 for i in range(len(precisions))]
        ax.bar(positions, means, width=0.27, yerr=halves, label=f"GRPO, replay {mode}")
    ax.set_xticks(range(len(precisions)), precisions)
    ax.set_yscale("log")
    ax.set(ylabel="engine-vs-trainer k3", xlabel="engine precision")
    ax.legend(fontsize=7)
    return _save(fig, out, "gate_weight_k3.png", "Residual k3 by replay mode and precision")


def _mean_and_half_width(values: list[float]) -> tuple[float, float]:
    """The mean of `values` (nan when empty) and the half width of its 95% t interval (0 under
    two values)."""
    if not values:
        return math.nan, 0.0
    if len(values) < 2:
        return values[0], 0.0
    t = student_t_quantile(0.975, len(values) - 1)
    return statistics.fmean(values), t * statistics.stdev(values) / math.sqrt(len(values))


def _dose_curve(runs: list[Row], column: str) -> tuple[list[float], list[float], list[float]]:
    """The doses of `runs` that measured `column`, its mean over each dose's runs and the half
    width of that mean's 95% t interval (0 under two runs)."""
    doses, means, halves = [], [], []
    for dose in sorted({dose_of(r) for r in runs}):
        values = [r[column] for r in runs if dose_of(r) == dose and r.get(column) is not None]
        if not values:
            continue
        mean, half = _mean_and_half_width(values)
        doses.append(dose)
        means.append(mean)
        halves.append(half)
    return doses, means, halves


PLOTS: tuple[Callable[[list[Row], dict[str, list[Row]], Path], Plot | None], ...] = (
    _plot_drift_vs_step,
    _plot_layers,
    _plot_depth,
    _plot_curves,
    _plot_margins,
    _plot_mismatch,
    _plot_precursors,
    _plot_off_policy,
    _plot_clip,
    _plot_tails,
    _plot_survival,
    _plot_doses,
    _plot_gate_weights,
)
