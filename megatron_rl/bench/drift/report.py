"""The drift grid's report: `summary.csv`, PNG plots (matplotlib) and `report.md` with tables
(mean and spread over seeds) and the claims, every number computed from the runs' metrics.
The plots are drawn by plots.py."""

from __future__ import annotations

import statistics
from collections import Counter
from pathlib import Path
from typing import Any

from megatron_rl.bench.drift.claims import check_claims
from megatron_rl.bench.drift.claims.common import (
    REGIME_METRIC,
    STRONG_DRIFT,
    Claim,
    counted,
    group_by,
    machine_counts,
    mean_of,
)
from megatron_rl.bench.drift.claims.dose import (
    PRECISION_K3,
    calibrated_doses,
    dosed_rows,
    margin_doses,
)
from megatron_rl.bench.drift.claims.survival import at_collapse_point
from megatron_rl.bench.drift.collapse import (
    ACCURACY_DROP,
    RECOVERY_EVALS,
    REWARD_FLOOR,
    REWARD_FLOOR_STEPS,
)
from megatron_rl.bench.drift.grid import DriftGrid
from megatron_rl.bench.drift.plots import PLOTS, Plot, routers_free, survival_by_arm
from megatron_rl.bench.drift.run_files import run_metrics
from megatron_rl.bench.drift.summary import (
    STEP_PHASES,
    summarize_run,
    write_summary_csv,
)
from megatron_rl.bench.drift.survival import kaplan_meier, wilson
from megatron_rl.files.atomic import write_text_atomic

Row = dict[str, Any]

# (column, header, format) of the per-cell tables
_TABLE = (
    ("final_accuracy", "final acc", "{:.3f}"),
    ("best_accuracy", "best acc", "{:.3f}"),
    ("since_old_activated", "activated experts changed since old", "{:.2%}"),
    ("update_activated", "activated experts changed / update", "{:.2%}"),
    ("drift_token_layer", "drift token-layer", "{:.2%}"),
    ("drift_token_any", "drift token-any", "{:.2%}"),
    ("engine_routing_mismatch", "engine routing mismatch", "{:.2%}"),
    ("mismatch_k3", "mismatch k3", "{:.2e}"),
    ("log_ratio_var_share_pooled", "routing share of log w var", "{:.1%}"),
    ("near_tie", "near-ties", "{:.2%}"),
    ("clip_frac_token", "clip tokens", "{:.2%}"),
    ("clip_frac_seq", "clip seqs", "{:.2%}"),
    ("log_ratio_abs_max", "max abs log w", "{:.3f}"),
    ("log_ratio_outside_0.8_1.25", "w outside [0.8, 1.25]", "{:.3%}"),
    ("kl_k3", "KL k3", "{:.2e}"),
    ("step_s", "step s", "{:.2f}"),
)


def write_report(grid: DriftGrid, out: Path) -> Path:
    """summary.csv, the plots and report.md in `out`; returns report.md's path."""
    curves = {run.run_id: run_metrics(out, run.run_id) for run in grid.runs}
    rows = [summarize_run(grid, out, run, curves[run.run_id]) for run in grid.runs]
    write_summary_csv(rows, out / "summary.csv")
    done = [row for row in rows if row["state"] == "done"]
    plots = [plot(done, curves, out) for plot in PLOTS]
    claims = check_claims(rows, grid.claims)
    path = out / "report.md"
    write_text_atomic(path, format_report(rows, claims, [p for p in plots if p is not None]))
    return path


def format_report(rows: list[Row], claims: list[Claim], plots: list[Plot]) -> str:
    """report.md from the summary rows, the checked claims and the written plots."""
    done = [row for row in rows if row["state"] == "done"]
    crashed = [row for row in rows if row["state"] == "crashed"]
    lines = [
        "# Routing drift and stability in MoE RL (megatron-rl bench drift)",
        "",
        f"{len(rows)} runs: {len(done)} done, {len(crashed)} crashed, "
        f"{len(rows) - len(done) - len(crashed)} not run. Means over seeds, ± their standard "
        "deviation; drift, mismatch and clip fractions are per-step means over each run."
        + _ran_on(rows),
        "",
        "The regime is measured by the papers' drift metric: after each optimizer update, the "
        "share of activated experts ((token, layer, chosen expert) triples) that the old "
        "policy's routing of the same tokens did not choose (`since_old_activated`; the papers' "
        f"regime starts at {STRONG_DRIFT:.0%}, ~10% is reported for Qwen3-30B-A3B); one "
        "update's own change, before against after it, is `update_activated`. "
        + _measured_regime(done),
        "",
        "Collapse events (the same for every arm): a non-finite loss or gradient; held-out "
        f"accuracy more than {ACCURACY_DROP:.2f} below the run's best that does not recover "
        f"within {RECOVERY_EVALS} evaluations (at least one: a low last evaluation alone is "
        f"not one); mean reward <= {REWARD_FLOOR} on "
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
        lines += [
            "",
            f"## Point `{cell}`",
            "",
            _cell_setting(cell_rows),
            "",
            *_cell_table(cell_rows),
        ]
    survival = survival_table(done)
    if survival:
        lines += ["", "## Survival at the collapse point", "", *survival]
        lines += ["", "### What moved first", "", *precursor_table(done)]
    calibration = dose_calibration(done)
    if calibration:
        lines += ["", "## Flipped routes against engine precision", "", calibration]
    lines += ["", "## Where the time went", "", *time_table(rows)]
    if crashed:
        lines += ["", "## Crashed runs", "", "| run | error |", "|---|---|"]
        lines += [f"| {row['run_id']} | {row['error'].replace('|', '/')} |" for row in crashed]
    lines += ["", "## Plots", ""]
    lines += [f"### {title}\n\n![{title}]({name})\n" for title, name in plots]
    return "\n".join(lines) + "\n"


def survival_table(rows: list[Row]) -> list[str]:
    """Per arm at the collapse point (claims/survival.py): its runs, how many collapsed (the
    rate's Wilson 95% interval), the Kaplan-Meier share without a collapse at the last step a
    run reached and the steps of the collapses; [] when nothing collapsed there."""
    by_arm = survival_by_arm(rows)
    if not by_arm:
        return []
    lines = [
        "| arm | runs | collapsed | collapse rate (95%) | without a collapse at the end (95%) "
        "| collapse steps |",
        "|---|---|---|---|---|---|",
    ]
    for arm, runs in by_arm.items():
        collapsed = sorted(run.step for run in runs if run.collapsed)
        low, high = wilson(len(collapsed), len(runs))
        curve = kaplan_meier(runs)
        end = (
            f"{curve[-1].survival:.2f} [{curve[-1].low:.2f}, {curve[-1].high:.2f}]"
            if curve
            else "1"
        )
        steps = ", ".join(str(step) for step in collapsed) or "-"
        lines.append(
            f"| {arm} | {len(runs)} | {len(collapsed)} | {len(collapsed) / len(runs):.2f} "
            f"[{low:.2f}, {high:.2f}] | {end} | {steps} |"
        )
    return lines


def precursor_table(rows: list[Row]) -> list[str]:
    """Per arm at the collapse point: what moved first before its collapses (collapse.py's
    precursor rule: which metric, in how many runs, and the median steps from it to the
    collapse) and in how many of its runs without a collapse the same rule fired anyway (its
    false alarms, by metric)."""
    lines = [
        "| arm | collapsed runs: what moved first | median steps before the collapse "
        "| runs without a collapse: the rule fired in |",
        "|---|---|---|---|",
    ]
    at_point = [row for row in rows if at_collapse_point(row)]
    for arm, arm_rows in group_by(at_point, "arm").items():
        collapsed = [r for r in arm_rows if int(r["collapse_events"] or 0) > 0]
        calm = [r for r in arm_rows if int(r["collapse_events"] or 0) == 0]
        moved = Counter(r["precursor"] or "nothing" for r in collapsed)
        leads = [
            int(r["first_collapse_step"]) - int(r["precursor_step"])
            for r in collapsed
            if r["precursor"]
        ]
        fired = Counter(r["false_alarm"] for r in calm if r.get("false_alarm"))
        lines.append(
            f"| {arm} | {counted(moved) or '-'} "
            f"| {f'{statistics.median(leads):g}' if leads else '-'} "
            f"| {sum(fired.values())} of {len(calm)}"
            + (f" ({counted(fired)})" if fired else "")
            + " |"
        )
    return lines


def dose_calibration(rows: list[Row]) -> str:
    """Which dose of margin-chosen flips gives GRPO the k3 of a bfloat16 and of a float8 engine
    (claims/dose.py), or "" without a dose-response grid."""
    if not margin_doses(dosed_rows(rows)):
        return ""
    found = calibrated_doses(rows)
    parts = [
        f"{precision} ({PRECISION_K3[precision]:.1e}): "
        + ("outside the doses measured" if dose is None else f"about {dose:.3g}")
        for precision, dose in found.items()
    ]
    return (
        "The share of routes flipped at the smallest margins at which GRPO's engine-vs-trainer "
        f"k3 equals an engine precision's (log-log between the doses): {'; '.join(parts)}."
    )


# what each phase of a step is (summary.STEP_PHASES)
_PHASE_NAMES = {
    "rollout": "rollout: generation and reward scoring",
    "old_logprob": "old-policy forward",
    "train": "updates, with the routing probe's forwards",
    "weight_sync": "weight sync to the engine",
    "eval": "held-out evaluation in the steps",
}


def time_by_phase(rows: list[Row]) -> list[tuple[str, float]]:
    """(phase, seconds summed over the runs that ended) for each step phase, the rest of the
    steps, and what was not in a step: start-up, model loading, the evaluation before step 1 and
    the end (the run's `seconds` less its steps')."""
    ended = [r for r in rows if r.get("seconds") is not None and r.get("seconds_step") is not None]
    totals = [(_PHASE_NAMES[p], sum(r[f"seconds_{p}"] for r in ended)) for p in STEP_PHASES]
    in_steps = sum(r["seconds_step"] for r in ended)
    totals.append(("the rest of the steps", in_steps - sum(seconds for _, seconds in totals)))
    outside = sum(r["seconds"] for r in ended) - in_steps
    totals.append(("outside the steps: start-up, loading, first and last evaluation", outside))
    return totals


def time_table(rows: list[Row]) -> list[str]:
    totals = time_by_phase(rows)
    whole = sum(seconds for _, seconds in totals)
    if whole <= 0:
        return ["No run recorded its time."]
    return [
        "Seconds of the runs that ended, summed (with N runs at once the grid's wall time is "
        "about this over N).",
        "",
        "| phase | seconds | share |",
        "|---|---|---|",
        *(f"| {phase} | {seconds:.0f} | {seconds / whole:.1%} |" for phase, seconds in totals),
        f"| all | {whole:.0f} | 100% |",
    ]


def _ran_on(rows: list[Row]) -> str:
    """Which machines ran the runs (as their status.json records it; runs of before
    2026-12-05 record none)."""
    counts = machine_counts(rows)
    if not counts:
        return ""
    ran = ", ".join(f"{name} ({count} runs)" for name, count in counts.most_common())
    return f" Ran on: {ran}."


def _measured_regime(rows: list[Row]) -> str:
    """The metric's value at the base point, over the runs without replay, per model."""
    free = [r for r in rows if r["cell"] == "base" and routers_free(r)]
    measured = {
        model: (
            mean_of(model_rows, REGIME_METRIC),
            mean_of(model_rows, "update_activated"),
        )
        for model, model_rows in group_by(free, "model").items()
        if mean_of(model_rows, REGIME_METRIC) is not None
    }
    if not measured:
        return (
            "This grid did not measure it (no base-point run without replay had the routing probe)."
        )
    return (
        "At the base point the runs without replay reach "
        + ", ".join(
            f"{since:.2%} ({model}; {update or 0:.2%} per update alone)"
            for model, (since, update) in measured.items()
        )
        + "."
    )


def _cell_setting(rows: list[Row]) -> str:
    """One line naming the cell's base model, engine precision, updates per batch and lr."""

    def listed(column: str, default: Any = None) -> str:
        values = dict.fromkeys(str(r.get(column, default)) for r in rows)
        return ", ".join(f"`{value}`" for value in values)

    return (
        f"Model {listed('model')}, engine {listed('engine_dtype', 'float32')}, "
        f"{listed('updates_per_batch')} updates per batch, lr {listed('lr')}."
    )


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
