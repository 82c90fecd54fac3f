"""The drift grid's report: `summary.csv`, PNG plots (matplotlib) and `report.md` with tables
(mean and spread over seeds) and the claims, every number computed from the runs' metrics."""

from __future__ import annotations

import statistics
from collections import defaultdict
from collections.abc import Callable
from pathlib import Path
from typing import Any

# The object-oriented API without pyplot: figures drawn straight to files, no display backend.
from matplotlib.figure import Figure

from megatron_rl.bench.drift.claims import Claim, check_claims, group_by
from megatron_rl.bench.drift.grid import DriftGrid
from megatron_rl.bench.drift.runner import run_dir
from megatron_rl.bench.drift.summary import (
    ACCURACY_DROP,
    RECOVERY_EVALS,
    REWARD_FLOOR,
    REWARD_FLOOR_STEPS,
    read_metrics,
    summarize_run,
    write_summary_csv,
)
from megatron_rl.files.atomic import write_text_atomic

Row = dict[str, Any]
Series = dict[int, float]

# (column, header, format) of the per-cell tables
_TABLE = (
    ("final_accuracy", "final acc", "{:.3f}"),
    ("best_accuracy", "best acc", "{:.3f}"),
    ("drift_token_layer", "drift token-layer", "{:.2%}"),
    ("drift_token_any", "drift token-any", "{:.2%}"),
    ("clip_frac_token", "clip tokens", "{:.2%}"),
    ("clip_frac_seq", "clip seqs", "{:.2%}"),
    ("log_ratio_abs_max", "max abs log w", "{:.3f}"),
    ("log_ratio_outside_0.8_1.25", "w outside [0.8, 1.25]", "{:.3%}"),
    ("kl_k3", "KL k3", "{:.2e}"),
    ("step_s", "step s", "{:.2f}"),
)


def write_report(grid: DriftGrid, out: Path) -> Path:
    """summary.csv, the plots and report.md in `out`; returns report.md's path."""
    curves = {run.run_id: read_metrics(run_dir(out, run) / "metrics.jsonl") for run in grid.runs}
    rows = [summarize_run(grid, out, run, curves[run.run_id]) for run in grid.runs]
    write_summary_csv(rows, out / "summary.csv")
    done = [row for row in rows if row["state"] == "done"]
    plots = [plot(done, curves, out) for plot in _PLOTS]
    claims = check_claims(rows)
    path = out / "report.md"
    write_text_atomic(path, format_report(rows, claims, [p for p in plots if p is not None]))
    return path


def format_report(rows: list[Row], claims: list[Claim], plots: list[tuple[str, str]]) -> str:
    done = [row for row in rows if row["state"] == "done"]
    crashed = [row for row in rows if row["state"] == "crashed"]
    lines = [
        "# Routing drift: GRPO + replay vs GSPO (megatron-rl bench drift)",
        "",
        f"{len(rows)} runs: {len(done)} done, {len(crashed)} crashed, "
        f"{len(rows) - len(done) - len(crashed)} not run. Means over seeds, ± their standard "
        "deviation; drift and clip fractions are per-step means over each run.",
        "",
        "Collapse events (the same for every arm): a non-finite loss or gradient; held-out "
        f"accuracy more than {ACCURACY_DROP:.2f} below the run's best that does not recover "
        f"within {RECOVERY_EVALS} evaluations; mean reward <= {REWARD_FLOOR} on "
        f"{REWARD_FLOOR_STEPS} consecutive steps.",
        "",
        "## Claims",
        "",
    ]
    for claim in claims:
        lines += [
            f"{claim.number}. **{claim.verdict}**: {claim.statement}",
            f"   {claim.evidence}. Regime: {claim.regime}.",
        ]
    for cell, cell_rows in group_by(done, "cell").items():
        lines += ["", f"## Point `{cell}`", "", *_cell_table(cell_rows)]
    if crashed:
        lines += ["", "## Crashed runs", "", "| run | error |", "|---|---|"]
        lines += [f"| {row['run_id']} | {row['error'].replace('|', '/')} |" for row in crashed]
    lines += ["", "## Plots", ""]
    lines += [f"### {title}\n\n![{title}]({name})\n" for title, name in plots]
    return "\n".join(lines) + "\n"


def _cell_table(rows: list[Row]) -> list[str]:
    header = ["arm", "runs", "collapses", *(title for _, title, _ in _TABLE)]
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    for arm, arm_rows in group_by(rows, "arm").items():
        cells = [arm, str(len(arm_rows)), str(sum(r["collapse_events"] for r in arm_rows))]
        for column, _, form in _TABLE:
            values = [r[column] for r in arm_rows if r.get(column) is not None]
            if not values:
                cells.append("–")
                continue
            mean = form.format(statistics.fmean(values))
            spread = form.format(statistics.stdev(values)) if len(values) > 1 else ""
            cells.append(f"{mean} ± {spread}" if spread else mean)
        lines.append("| " + " | ".join(cells) + " |")
    return lines


def _series(records: list[Row], key: str) -> Series:
    return {r["step"]: r[key] for r in records if r.get(key) is not None}


def _band(ax: Any, runs: list[Series], label: str) -> None:
    """Mean over runs per step, with the range of the runs as a band."""
    steps = sorted({step for run in runs for step in run})
    values = [[run[s] for run in runs if s in run] for s in steps]
    if not steps:
        return
    mean = [statistics.fmean(v) for v in values]
    (line,) = ax.plot(steps, mean, label=label)
    ax.fill_between(
        steps, [min(v) for v in values], [max(v) for v in values], alpha=0.2, color=line.get_color()
    )


def _at_base_except(rows: list[Row], *varied: str) -> list[Row]:
    """Rows equal to the base point in updates, learning rate and depth, except `varied`."""
    base = [r for r in rows if r["cell"] == "base"]
    fixed = [c for c in ("updates_per_batch", "lr", "layers") if c not in varied]
    values = {tuple(r[c] for c in fixed) for r in base}
    return [r for r in rows if tuple(r[c] for c in fixed) in values]


def _save(fig: Any, out: Path, name: str, title: str) -> tuple[str, str]:
    fig.tight_layout()
    fig.savefig(out / name, dpi=90)
    return title, name


def _plot_drift_vs_step(
    rows: list[Row], curves: dict[str, list[Row]], out: Path
) -> tuple[str, str] | None:
    base = [r for r in rows if r["cell"] == "base" and r.get("drift_token_layer") is not None]
    if not base:
        return None
    fig = Figure(figsize=(7, 4))
    ax = fig.subplots()
    for arm, arm_rows in group_by(base, "arm").items():
        _band(
            ax, [_series(curves[r["run_id"]], "routing/drift_token_layer") for r in arm_rows], arm
        )
    ax.set(xlabel="step", ylabel="token-layer drift", title="Routing drift per step (base point)")
    ax.legend(fontsize=7)
    return _save(fig, out, "drift_vs_step.png", "Drift vs step per arm")


def _plot_depth(rows: list[Row], curves: dict[str, list[Row]], out: Path) -> tuple[str, str] | None:
    free = [
        r
        for r in _at_base_except(rows, "layers")
        if r["routing_replay"] == "none" and r.get("drift_token_layer") is not None
    ]
    depths = sorted({r["layers"] for r in free})
    if not free:
        return None
    fig = Figure(figsize=(10, 4))
    per_layer, by_depth = fig.subplots(1, 2)
    for depth in depths:
        at = [r for r in free if r["layers"] == depth]
        means = [
            statistics.fmean(
                r[f"drift_layer_{i}"] for r in at if r.get(f"drift_layer_{i}") is not None
            )
            for i in range(depth)
        ]
        per_layer.plot(range(depth), means, marker="o", label=f"{depth} layers")
    per_layer.set(
        xlabel="layer", ylabel="share of tokens re-routed", title="Drift per layer (no replay)"
    )
    per_layer.legend(fontsize=7)
    for column in ("drift_token_any", "drift_token_layer"):
        by_depth.plot(
            depths,
            [statistics.fmean(r[column] for r in free if r["layers"] == d) for d in depths],
            marker="o",
            label=column,
        )
    by_depth.set(xlabel="layers", ylabel="drift", title="Drift vs depth (no replay)")
    by_depth.legend(fontsize=7)
    return _save(fig, out, "drift_depth.png", "Drift per layer and vs depth")


def _plot_off_policy(
    rows: list[Row], curves: dict[str, list[Row]], out: Path
) -> tuple[str, str] | None:
    swept = [
        r
        for r in _at_base_except(rows, "updates_per_batch")
        if r.get("drift_token_layer") is not None
    ]
    if len({r["updates_per_batch"] for r in swept}) < 2:
        return None
    fig = Figure(figsize=(7, 4))
    ax = fig.subplots()
    for arm, arm_rows in group_by(swept, "arm").items():
        degrees = sorted({r["updates_per_batch"] for r in arm_rows})
        ax.plot(
            degrees,
            [
                statistics.fmean(
                    r["drift_token_layer"] for r in arm_rows if r["updates_per_batch"] == d
                )
                for d in degrees
            ],
            marker="o",
            label=arm,
        )
    ax.set(
        xlabel="updates per rollout batch",
        ylabel="token-layer drift",
        xscale="log",
        title="Drift vs off-policy degree",
    )
    ax.legend(fontsize=7)
    return _save(fig, out, "drift_off_policy.png", "Drift vs off-policy degree")


def _plot_curves(
    rows: list[Row], curves: dict[str, list[Row]], out: Path
) -> tuple[str, str] | None:
    base = [r for r in rows if r["cell"] == "base"]
    if not base:
        return None
    fig = Figure(figsize=(11, 4))
    axes = fig.subplots(1, 2)
    for ax, key, title in (
        (axes[0], "reward/mean", "Sampled reward"),
        (axes[1], "eval/accuracy", "Held-out accuracy"),
    ):
        for arm, arm_rows in group_by(base, "arm").items():
            _band(ax, [_series(curves[r["run_id"]], key) for r in arm_rows], arm)
        ax.set(xlabel="step", title=f"{title} (base point; band: range over seeds)")
        ax.legend(fontsize=7)
    return _save(fig, out, "curves.png", "Reward and held-out accuracy")


def _bars(
    out: Path, rows: list[Row], columns: tuple[tuple[str, str], ...], name: str, title: str
) -> tuple[str, str] | None:
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


def _plot_clip(rows: list[Row], curves: dict[str, list[Row]], out: Path) -> tuple[str, str] | None:
    base = [r for r in rows if r["cell"] == "base"]
    columns = (
        ("clip_frac_token", "clipped tokens (base point)"),
        ("clip_frac_seq", "clipped sequences (base point)"),
    )
    return _bars(out, base, columns, "clip_fractions.png", "Clip fractions")


def _plot_tails(rows: list[Row], curves: dict[str, list[Row]], out: Path) -> tuple[str, str] | None:
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


_PLOTS: tuple[Callable[[list[Row], dict[str, list[Row]], Path], tuple[str, str] | None], ...] = (
    _plot_drift_vs_step,
    _plot_depth,
    _plot_off_policy,
    _plot_curves,
    _plot_clip,
    _plot_tails,
)
