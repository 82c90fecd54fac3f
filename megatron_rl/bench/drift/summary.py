"""One summary row per run of a drift grid, from its `metrics.jsonl` and `status.json`, with its
collapse events and their precursor (collapse.py), computed the same way for every arm.
"""

from __future__ import annotations

import csv
import io
import statistics
from pathlib import Path
from typing import Any

from megatron_rl.bench.drift import base_models
from megatron_rl.bench.drift.collapse import collapse_events, collapse_precursor
from megatron_rl.bench.drift.grid import DriftGrid, PlannedRun
from megatron_rl.bench.drift.runner import CRASHED, read_status
from megatron_rl.files.atomic import write_text_atomic
from megatron_rl.moe.margins import bucket_names

# the phases a trainer step times (trainer/loop.py, `time/<phase>_s`), in their order: summary.csv
# sums each over the run's steps (`seconds_<phase>`, beside `seconds_step` and the run's
# `seconds`), so that a grid's time can be told by phase
STEP_PHASES = ("rollout", "old_logprob", "train", "weight_sync", "eval")

# summary column -> the per-step metric it averages over the run's steps
STEP_MEANS = {
    "drift_token_layer": "routing/drift_token_layer",
    "drift_token_any": "routing/drift_token_any",
    "drift_jaccard": "routing/drift_jaccard",
    "drift_activated": "routing/drift_activated_experts",
    # metrics.routing_probe: what one update changed, on the same micro-batch before and after
    "update_activated": "routing/update_activated_experts",
    "update_token_layer": "routing/update_token_layer",
    "update_token_any": "routing/update_token_any",
    # the papers' reading: after each update, the share of activated experts the old policy
    # (its recorded routing) did not choose
    "since_old_activated": "routing/since_old_activated_experts",
    "since_old_token_layer": "routing/since_old_token_layer",
    # the same after the step's last update only (the one above averages over its updates)
    "since_old_last_activated": "routing/since_old_last_activated_experts",
    "margin_median": "routing/margin_median",
    "near_tie": "routing/margin_near_tie",
    "log_ratio_var_share": "routing/log_ratio_var_share",
    "log_ratio_abs_share": "routing/log_ratio_abs_share",
    "log_ratio_var_free": "routing/log_ratio_var_free",
    "log_ratio_var_held": "routing/log_ratio_var_held",
    "router_weight_change": "routing/router_weight_change",
    "router_weight_change_rel": "routing/router_weight_change_rel",
    "replay_miss_max": "routing/replay_miss_token_layer",
    "engine_routing_mismatch": "routing/engine_mismatch_token_layer",
    "engine_routing_mismatch_activated": "routing/engine_mismatch_activated_experts",
    "engine_routing_mismatch_token_any": "routing/engine_mismatch_token_any",
    "entropy": "entropy/mean",
    "clip_frac_token": "clip_frac/token",
    "clip_frac_seq": "clip_frac/seq",
    "log_ratio_std": "log_ratio/std",
    "log_ratio_abs_max": "log_ratio/abs_max",
    "log_ratio_outside_0.8_1.25": "log_ratio/frac_tau1.25",
    "kl_k3": "kl/k3",
    "mismatch_k3": "mismatch/k3",
    # how often a mismatch correction acts: the share of response tokens whose weight TIS
    # truncated, and the share that MIS's band masked (0 at every step: the arm is plain GRPO)
    "tis_truncated_frac": "mismatch/truncated_token_frac",
    "mis_masked_frac": "mismatch/masked_token_frac",
    "reward_mean": "reward/mean",
    "grad_norm": "grad_norm",
    "step_s": "time/step_s",
    "rollout_s": "time/rollout_s",
    "old_logprob_s": "time/old_logprob_s",
    "train_s": "time/train_s",
    "record_bytes": "routing/record_bytes",
}
# columns taken as the maximum over steps instead of the mean
_STEP_MAXIMA = ("replay_miss_max",)


def summarize_run(
    grid: DriftGrid, out: Path, run: PlannedRun, records: list[dict[str, Any]]
) -> dict[str, Any]:
    """The summary row of `run` from its per-step `records` (its metrics.jsonl) and status: its
    arm, point, seed, state, accuracy, collapses, means."""
    recipe = run.recipe
    status = read_status(out, run) or {"state": "not run", "error": "", "seconds": None}
    steps = [r for r in records if r["step"] > 0]
    accuracies = [r["eval/accuracy"] for r in records if r.get("eval/accuracy") is not None]
    events = collapse_events(records)
    if status["state"] == CRASHED and "non-finite" in status.get("error", ""):
        events.append((steps[-1]["step"] if steps else 0, "nonfinite"))
    row: dict[str, Any] = {
        "run_id": run.run_id,
        "arm": run.arm,
        "cell": run.cell,
        **run.point,
        "seed": run.seed,
        "loss": recipe.algo.loss,
        "routing_replay": recipe.algo.routing_replay.value,
        "mismatch": recipe.algo.mismatch_name,
        "updates_per_batch": recipe.algo.updates_per_batch,
        "lr": recipe.optim.lr,
        "freeze_router": recipe.optim.freeze_router,
        "engine_dtype": recipe.rollout.engine_dtype,
        "flip_routes": recipe.rollout.flip_routes,
        "flip_routes_at": recipe.rollout.flip_routes_at,
        "model": model_name(grid, run),
        "layers": (run.shape or grid.base_shape).get("layers"),
        "state": status["state"],
        "error": status.get("error", ""),
        "stopped": status.get("stopped", ""),  # e.g. at its first collapse (stop_at_collapse)
        "seconds": status.get("seconds"),
        "machine": status.get("machine", ""),  # not recorded before 2026-12-05
        "steps": len(steps),
        "initial_accuracy": accuracies[0] if accuracies else None,
        "final_accuracy": accuracies[-1] if accuracies else None,
        "best_accuracy": max(accuracies) if accuracies else None,
        "collapse_events": len(events),
        "collapses": " ".join(f"{kind}@{step}" for step, kind in events),
        "first_collapse_step": None,
        "precursor": "",
        "precursor_step": None,
        "false_alarm": None,
    }
    if not events:
        last_step = max((r["step"] for r in steps), default=0)
        row["false_alarm"] = collapse_precursor(records, last_step + 1)[0]
    else:
        first_collapse = min(step for step, _ in events)
        precursor, precursor_step = collapse_precursor(records, first_collapse)
        row |= {
            "first_collapse_step": first_collapse,
            "precursor": precursor,
            "precursor_step": precursor_step,
        }
    for column, key in STEP_MEANS.items():
        values = [r[key] for r in steps if r.get(key) is not None]
        combine = max if column in _STEP_MAXIMA else statistics.fmean
        row[column] = combine(values) if values else None
    row["learn_s_per_1k_tokens"] = _learn_seconds_per_1k_tokens(steps)
    for phase in (*STEP_PHASES, "step"):  # seconds summed over the run's steps
        row[f"seconds_{phase}"] = sum(r.get(f"time/{phase}_s") or 0.0 for r in steps)
    row |= _pooled_routing_share(steps)
    for column, prefix in PER_LAYER_MEANS.items():
        row |= _per_layer_means(steps, prefix, column)
    if any("routing/margin_median" in r for r in steps):  # the run had metrics.routing_probe
        row |= _flips_by_margin(steps, "")
        prefix = "routing/margin_routes_layer_"
        layers = {k[len(prefix) :].split("_")[0] for r in steps for k in r if k.startswith(prefix)}
        for layer in sorted(layers, key=int):
            row |= _flips_by_margin(steps, f"layer_{layer}_")
    return row


def _flips_by_margin(steps: list[dict[str, Any]], layer: str) -> dict[str, float | None]:
    """Per margin bucket b, over the run: `routes_<layer>b` the routes probed, `flip_rate_<layer>b`
    the share of them the update flipped (flips summed over routes summed; None: no routes), of
    all layers (`layer` "") or of one (`layer` "layer_<i>_")."""
    columns: dict[str, float | None] = {}
    for bucket in bucket_names():
        routes = sum(r.get(f"routing/margin_routes_{layer}{bucket}") or 0 for r in steps)
        flips = sum(r.get(f"routing/margin_flips_{layer}{bucket}") or 0 for r in steps)
        columns[f"routes_{layer}{bucket}"] = routes
        columns[f"flip_rate_{layer}{bucket}"] = flips / routes if routes else None
    return columns


def _pooled_routing_share(steps: list[dict[str, Any]]) -> dict[str, float | None]:
    """Routing's share of the log-ratio variance over the run: pooled, 1 - sum of the steps'
    held variances / sum of their free ones (the steps that logged both), and the median of
    the steps' own shares (moe/drift.py's `routing_share_of_log_ratio`)."""
    pairs = [
        (r["routing/log_ratio_var_held"], r["routing/log_ratio_var_free"])
        for r in steps
        if r.get("routing/log_ratio_var_held") is not None
        and r.get("routing/log_ratio_var_free") is not None
    ]
    free = sum(free for _, free in pairs)
    shares = [
        r["routing/log_ratio_var_share"]
        for r in steps
        if r.get("routing/log_ratio_var_share") is not None
    ]
    return {
        "log_ratio_var_share_pooled": 1 - sum(held for held, _ in pairs) / free
        if free > 0
        else None,
        "log_ratio_var_share_median": statistics.median(shares) if shares else None,
    }


# summary column prefix -> the per-step metric prefix of each layer's value (`..._<layer>`)
PER_LAYER_MEANS = {
    "drift_layer_": "routing/drift_layer_",
    "update_activated_layer_": "routing/update_activated_layer_",
    "near_tie_layer_": "routing/margin_near_tie_layer_",
}


def _per_layer_means(steps: list[dict[str, Any]], prefix: str, column: str) -> dict[str, float]:
    """`column<i>`: the mean over steps of metric `prefix<i>`, for every layer i that has it."""
    layers = sorted({int(key[len(prefix) :]) for r in steps for key in r if key.startswith(prefix)})
    means = {}
    for layer in layers:
        values = [r[f"{prefix}{layer}"] for r in steps if r.get(f"{prefix}{layer}") is not None]
        if values:
            means[f"{column}{layer}"] = statistics.fmean(values)
    return means


def model_name(grid: DriftGrid, run: PlannedRun) -> str:
    """The run's base model: a named shape (`fine_qwen3`, ...), a variant of the recipe's model
    (`layers8-experts8-topk2`), or `recipe` for the recipe's own."""
    return "recipe" if run.shape is None else base_models.shape_name(run.shape)


def _learn_seconds_per_1k_tokens(steps: list[dict[str, Any]]) -> float | None:
    """The old-policy pass and the updates, per 1000 response tokens trained on (the phases
    replay touches, normalised for the runs' different response lengths)."""
    values = []
    for r in steps:
        tokens = (r.get("throughput/response_tokens_per_s") or 0) * (r.get("time/step_s") or 0)
        if tokens > 0 and r.get("time/train_s") is not None:
            values.append(1000 * (r["time/train_s"] + (r.get("time/old_logprob_s") or 0)) / tokens)
    return statistics.fmean(values) if values else None


def write_summary_csv(rows: list[dict[str, Any]], path: Path) -> None:
    """`summary.csv`: one row per run, the union of the rows' columns (empty where absent)."""
    columns = list(dict.fromkeys(key for row in rows for key in row))
    buffer = io.StringIO()
    writer = csv.DictWriter(buffer, fieldnames=columns, restval="")
    writer.writeheader()
    for row in rows:
        writer.writerow({key: "" if value is None else value for key, value in row.items()})
    write_text_atomic(path, buffer.getvalue())
