"""The drift report on hand-made summary rows and per-step records of a grid like the default
one (no training): the report's text, and each plot: a PNG with its data, None without it."""

from __future__ import annotations

import math

import pytest

from megatron_rl.bench.drift import plots, report
from megatron_rl.bench.drift.claims import Claim, check_claims
from megatron_rl.bench.drift.collapse import PRECURSOR_Z, collapse_events, collapse_precursor
from megatron_rl.bench.drift.summary import STEP_PHASES
from megatron_rl.moe.margins import bucket_names

pytestmark = pytest.mark.timeout(120)

PNG = b"\x89PNG"
LR = 1e-4
BF16 = "engine_dtype=bfloat16__probe_tolerance=0.2__updates_per_batch={}"
FP8 = "engine_dtype=float8_emulated__probe_tolerance=0.5"
# arm -> (loss, routing_replay, mismatch, freeze_router)
ARMS = {
    "grpo": ("grpo", "none", "none", False),
    "grpo_r2": ("grpo", "r2", "none", False),
    "grpo_r3": ("grpo", "r3", "none", False),
    "gspo": ("gspo", "none", "none", False),
    "grpo_frozen_router": ("grpo", "none", "none", True),
    "grpo_tis": ("grpo", "none", "tis", False),
    "grpo_mis_geometric": ("grpo", "none", "mis", False),
}
# cell -> (model, engine dtype, updates per batch, arms), as grid.py's DEFAULT_GRID plans them
CELLS = {
    "base": ("fine_qwen3_e128", "float32", 4, ("grpo", "grpo_r2", "gspo", "grpo_frozen_router")),
    **{
        BF16.format(n): ("fine_qwen3_e128", "bfloat16", n, ("grpo", "grpo_r2", "grpo_r3", "gspo"))
        for n in (1, 2, 4, 8)
    },
    FP8: (
        "fine_qwen3_e128",
        "float8_emulated",
        4,
        ("grpo", "grpo_r3", "grpo_tis", "grpo_mis_geometric"),
    ),
    "shape=fine_deepseek_e128": ("fine_deepseek_e128", "float32", 4, ("grpo", "grpo_r2", "gspo")),
    "shape=dense_control": ("dense_control", "float32", 4, ("grpo", "gspo")),
}
SEEDS = (1, 2)
LAYERS = 8
STEPS = 12
ENGINE_MISMATCH = {"float32": 0.0, "bfloat16": 0.03, "float8_emulated": 0.12}
ENGINE_K3 = {"float32": 0.0, "bfloat16": 2e-4, "float8_emulated": 3e-3}
COLLAPSED = "grpo--base--seed2"


def drift_of(arm: str, model: str, updates: int, seed: int) -> float | None:
    """The share of activated experts changed per update: 6% at the base point without replay,
    1 point more per update per batch, 0 with frozen routers, none for the dense model."""
    if model == "dense_control":
        return None
    if ARMS[arm][3]:
        return 0.0
    return 0.06 + 0.01 * (updates - 4) + 0.01 * (seed - 1.5) * 2


def records(run_id: str, drift: float | None, collapses: bool) -> list[dict]:
    """Per-step metrics of one run: flat with a periodic wiggle (so that no metric moves beyond
    its first steps' spread), and for a collapsing run a gradient-norm jump at step 7 and no
    reward from step 9 on."""
    out = []
    for step in range(STEPS + 1):
        wiggle = 1 + 0.01 * ((step % 5) - 2)
        record = {
            "step": step,
            "reward/mean": 0.5 * wiggle,
            "grad_norm": 1.0 * wiggle,
            "entropy/mean": 0.8 * wiggle,
            "mismatch/k3": 1e-4 * wiggle,
            "routing/drift_token_layer": 0.1 * wiggle,
        }
        if drift is not None:
            record["routing/update_activated_experts"] = drift * wiggle
            record["routing/since_old_activated_experts"] = 2 * drift * wiggle
        if step % 4 == 0:
            record["eval/accuracy"] = 0.6
        if collapses and step >= 7:
            record["grad_norm"] = 5.0
        if collapses and step >= 9:
            record["reward/mean"] = 0.0
        out.append(record)
    return out


def summary_row(arm: str, cell: str, seed: int, steps: list[dict]) -> dict:
    model, engine, updates, _ = CELLS[cell]
    loss, replay, mismatch, frozen = ARMS[arm]
    drift = drift_of(arm, model, updates, seed)
    events = collapse_events(steps)
    row = {
        "run_id": f"{arm}--{cell}--seed{seed}",
        "arm": arm,
        "cell": cell,
        "seed": seed,
        "state": "done",
        "error": "",
        "model": model,
        "engine_dtype": engine,
        "loss": loss,
        "routing_replay": replay,
        "mismatch": mismatch,
        "freeze_router": frozen,
        "updates_per_batch": updates,
        "lr": LR,
        "layers": LAYERS,
        "steps": STEPS,
        "final_accuracy": 0.6,
        "best_accuracy": 0.62,
        "collapse_events": len(events),
        "first_collapse_step": None,
        "precursor": "",
        "precursor_step": None,
        "update_activated": drift,
        "since_old_activated": None if drift is None else 2 * drift,
        "drift_token_layer": 0.1,
        "drift_token_any": 0.3,
        "engine_routing_mismatch": 0.0 if replay == "r3" else ENGINE_MISMATCH[engine],
        "mismatch_k3": ENGINE_K3[engine] / (4 if replay == "r3" else 1),
        "log_ratio_var_share_pooled": 0.6 if replay == "none" else None,
        "near_tie": 0.04,
        "clip_frac_token": 0.15 if loss == "gspo" else 0.002,
        "clip_frac_seq": 0.2 if loss == "gspo" else 0.01,
        "log_ratio_abs_max": 1.0,
        "log_ratio_outside_0.8_1.25": 0.01,
        "kl_k3": 1e-3,
        "step_s": 1.5,
    }
    if events:
        first = min(step for step, _ in events)
        precursor, precursor_step = collapse_precursor(steps, first)
        row |= {
            "first_collapse_step": first,
            "precursor": precursor,
            "precursor_step": precursor_step,
        }
    if drift is not None:
        for layer in range(LAYERS):  # later layers drift more
            row[f"update_activated_layer_{layer}"] = drift * (0.5 + layer / LAYERS)
            row[f"near_tie_layer_{layer}"] = 0.04
        for bucket, routes, rate in zip(
            bucket_names(), (100, 300, 600, 1000, 500), (0.4, 0.2, 0.05, 0.0, 0.0), strict=True
        ):
            row[f"routes_{bucket}"] = routes
            row[f"flip_rate_{bucket}"] = rate
    return row


def grid_like() -> tuple[list[dict], dict[str, list[dict]]]:
    rows, curves = [], {}
    for cell, (model, _, updates, arms) in CELLS.items():
        for arm in arms:
            for seed in SEEDS:
                run_id = f"{arm}--{cell}--seed{seed}"
                curves[run_id] = records(
                    run_id, drift_of(arm, model, updates, seed), run_id == COLLAPSED
                )
                rows.append(summary_row(arm, cell, seed, curves[run_id]))
    return rows, curves


PROBE_DRIFT = ("routing/update_activated_experts", "routing/since_old_activated_experts")


def without(rows: list[dict], *prefixes: str) -> list[dict]:
    """`rows` without the columns starting with any of `prefixes`."""
    return [{k: v for k, v in r.items() if not k.startswith(prefixes)} for r in rows]


def test_the_grid_like_data_has_one_collapsed_run_with_a_precursor():
    rows, _ = grid_like()
    collapsed = [r for r in rows if r["collapse_events"]]
    assert [r["run_id"] for r in collapsed] == [COLLAPSED]
    assert collapsed[0]["precursor"] == "grad_norm" and collapsed[0]["precursor_step"] == 7
    assert collapsed[0]["first_collapse_step"] == 11  # the third step without reward


def test_time_by_phase_sums_the_phases_over_the_runs_that_ended():
    def timed(seconds, **phases) -> dict:
        return {"seconds": seconds, "seconds_step": sum(phases.values()) + 1.0} | {
            f"seconds_{phase}": phases.get(phase, 0.0) for phase in STEP_PHASES
        }

    rows = [
        timed(20.0, rollout=4.0, old_logprob=2.0, train=8.0, weight_sync=1.0),
        timed(10.0, rollout=2.0, train=4.0, eval=1.0),
        {"seconds": None, "seconds_step": None},  # not run
    ]
    totals = dict(report.time_by_phase(rows))
    assert totals["rollout: generation and reward scoring"] == 6.0
    assert totals["updates, with the routing probe's forwards"] == 12.0
    assert totals["held-out evaluation in the steps"] == 1.0
    assert totals["the rest of the steps"] == 2.0  # a second per run outside its phases
    assert totals["outside the steps: start-up, loading, first and last evaluation"] == 6.0
    assert sum(totals.values()) == 30.0
    assert "| the rest of the steps | 2 | 6.7% |" in report.time_table(rows)
    assert report.time_table(rows[2:]) == ["No run recorded its time."]


def test_report_text_states_the_regime_the_new_columns_and_each_cells_model_and_engine():
    rows, _ = grid_like()
    text = report.format_report(rows, check_claims(rows), [("Drift vs step", "drift.png")])
    lines = text.splitlines()
    assert lines[0] == "# Routing drift and stability in MoE RL (megatron-rl bench drift)"
    assert "share of activated experts" in text and "`since_old_activated`" in text
    # base point, runs without replay (grpo, gspo; not R2, not the frozen routers): 12%, 6%
    expected = "the runs without replay reach 12.00% (fine_qwen3_e128; 6.00% per update alone)."
    assert expected in text
    for cell, (model, engine, updates, _) in CELLS.items():
        at = lines.index(f"## Point `{cell}`")
        assert lines[at + 2] == (
            f"Model `{model}`, engine `{engine}`, `{updates}` updates per batch, lr `{LR}`."
        )
    at = lines.index(f"## Point `{BF16.format(2)}`")
    header = [c.strip() for c in lines[at + 4].strip("|").split("|")]
    for title in (
        "activated experts changed / update",
        "engine routing mismatch",
        "mismatch k3",
        "routing share of log w var",
        "near-ties",
        # the old ones stay
        "final acc",
        "best acc",
        "drift token-layer",
        "drift token-any",
        "clip tokens",
        "clip seqs",
        "max abs log w",
        "w outside [0.8, 1.25]",
        "KL k3",
        "step s",
    ):
        assert title in header
    grpo = next(line for line in lines[at:] if line.startswith("| grpo |"))
    cells = dict(zip(header, (c.strip() for c in grpo.strip("|").split("|")), strict=True))
    assert cells["activated experts changed / update"] == "4.00% ± 1.41%"  # 6% - 2 updates
    assert cells["engine routing mismatch"] == "3.00% ± 0.00%"
    assert cells["mismatch k3"] == "2.00e-04 ± 0.00e+00"
    assert cells["routing share of log w var"] == "60.0% ± 0.0%"
    assert cells["near-ties"] == "4.00% ± 0.00%"
    assert "![Drift vs step](drift.png)" in text
    assert len([line for line in lines if line.split(".")[0].isdigit()]) == 21  # the claims
    assert "Ran on" not in text  # rows of runs that recorded no machine
    mixed = [r | {"machine": "cpu A" if i % 3 else "cpu B"} for i, r in enumerate(rows)]
    shown = report.format_report(mixed, check_claims(mixed), [])
    assert f"Ran on: cpu A ({len(rows) - len(rows[::3])} runs), cpu B ({len(rows[::3])} runs)." in (
        shown
    )


def test_the_report_without_the_probes_columns_still_renders():
    rows, _ = grid_like()
    old = without(
        rows,
        "update_activated",
        "since_old",
        "engine_routing",
        "mismatch_k3",
        "near_tie",
        "log_ratio_var",
    )
    old = [r | {"model": "recipe"} for r in old]
    claim = Claim(1, "a statement", "NOT TESTED", "no data", "none")
    text = report.format_report(old, [claim], [])
    assert "This grid did not measure it" in text
    assert "| grpo | 2 | 0 | 0.600 ± 0.000 | 0.620 ± 0.000 | – | – | 10.00% ± 0.00%" in text


def check_png(result, out, name: str) -> None:
    assert result is not None and result[1] == name
    assert (out / name).read_bytes()[:4] == PNG


# plot, its file, and the grid-like data with its data taken away: (rows, curves) -> (rows, curves)
CASES = {
    "drift_vs_step": (plots._plot_drift_vs_step, "drift_vs_step.png", lambda r, c: (r, {})),
    "layers": (
        plots._plot_layers,
        "drift_layers.png",
        lambda r, c: (without(r, "update_activated_layer_"), c),
    ),
    "curves": (plots._plot_curves, "curves.png", lambda r, c: (r, {})),
    "margins": (
        plots._plot_margins,
        "margins.png",
        lambda r, c: (without(r, "routes_", "flip_rate_"), c),
    ),
    "mismatch": (
        plots._plot_mismatch,
        "mismatch_precision.png",
        lambda r, c: (without(r, "engine_routing_mismatch", "mismatch_k3"), c),
    ),
    "precursors": (
        plots._plot_precursors,
        "collapse_precursors.png",
        lambda r, c: ([x | {"first_collapse_step": None} for x in r], c),
    ),
    "off_policy": (
        plots._plot_off_policy,
        "drift_off_policy.png",
        lambda r, c: ([x for x in r if x["updates_per_batch"] == 4], c),
    ),
    "clip": (plots._plot_clip, "clip_fractions.png", lambda r, c: ([], c)),
    "tails": (plots._plot_tails, "ratio_tails.png", lambda r, c: (without(r, "drift_token"), c)),
}


@pytest.mark.parametrize("case", CASES)
def test_each_plot_writes_a_png_with_its_data_and_none_without(case, tmp_path):
    plot, name, take_away = CASES[case]
    rows, curves = grid_like()
    assert plot in plots.PLOTS
    check_png(plot(rows, curves, tmp_path), tmp_path, name)
    (tmp_path / name).unlink()
    assert plot(*take_away(rows, curves), tmp_path) is None
    assert not (tmp_path / name).exists()


def test_drift_vs_step_falls_back_to_token_layer_drift(tmp_path):
    rows, curves = grid_like()
    old = {
        run: [{k: v for k, v in r.items() if k not in PROBE_DRIFT} for r in recs]
        for run, recs in curves.items()
    }
    check_png(plots._plot_drift_vs_step(rows, old, tmp_path), tmp_path, "drift_vs_step.png")
    no_drift = {
        run: [{k: v for k, v in r.items() if not k.startswith("routing/")} for r in recs]
        for run, recs in curves.items()
    }
    assert plots._plot_drift_vs_step(rows, no_drift, tmp_path) is None


def test_the_depth_plot_needs_several_depths(tmp_path):
    rows, curves = grid_like()
    assert plots._plot_depth(rows, curves, tmp_path) is None  # every model has 8 layers
    shallow = [
        r | {"cell": "layers=4", "layers": 4, "model": "layers4-experts64-topk8"}
        for r in rows
        if r["cell"] == "base"
    ]
    per_layer = [
        r | {f"drift_layer_{i}": 0.01 * (i + 1) for i in range(r["layers"])} for r in rows + shallow
    ]
    check_png(plots._plot_depth(per_layer, curves, tmp_path), tmp_path, "drift_depth.png")


def test_the_base_like_cells_share_the_base_points_updates_lr_and_engine():
    rows, _ = grid_like()
    cells = {r["cell"] for r in plots._at_base_except(rows, "layers")}
    assert cells == {"base", "shape=fine_deepseek_e128", "shape=dense_control"}
    cells = {r["cell"] for r in plots._at_base_except(rows, "updates_per_batch")}
    assert cells == {"base", "shape=fine_deepseek_e128", "shape=dense_control"}  # all float32


def test_margin_buckets_pool_flips_over_routes_per_model_over_runs_without_replay():
    buckets = bucket_names()

    def margins(arm: str, model: str, routes, rates) -> dict:
        _, replay, _, frozen = ARMS[arm]
        return {"arm": arm, "model": model, "routing_replay": replay, "freeze_router": frozen} | {
            f"{column}_{b}": value
            for b, *values in zip(buckets, routes, rates, strict=True)
            for column, value in zip(("routes", "flip_rate"), values, strict=True)
        }

    rows = [
        margins("grpo", "m", (10, 20, 30, 40, 0), (0.5, 0.25, 0.1, 0.0, None)),
        margins("gspo", "m", (30, 20, 10, 0, 0), (0.1, 0.5, 0.0, None, None)),
        # left out: replay, frozen routers
        margins("grpo_r2", "m", (1000, 0, 0, 0, 0), (1.0, None, None, None, None)),
        margins("grpo_frozen_router", "m", (1000, 0, 0, 0, 0), (1.0, None, None, None, None)),
        margins("grpo", "other", (0, 0, 5, 0, 0), (None, None, 0.2, None, None)),
    ]
    pooled = plots.margin_buckets(rows)
    assert set(pooled) == {"m", "other"}
    shares, rates = pooled["m"]
    assert shares == pytest.approx([0.25, 0.25, 0.25, 0.25, 0.0])
    assert rates[:4] == pytest.approx([8 / 40, 15 / 40, 3 / 40, 0.0]) and math.isnan(rates[4])
    shares, rates = pooled["other"]
    assert shares == [0, 0, 1, 0, 0] and math.isnan(rates[0]) and rates[2] == pytest.approx(0.2)
    assert plots.margin_buckets(rows[2:4]) == {}


def test_off_policy_groups_rows_that_differ_only_in_updates_per_batch():
    rows, _ = grid_like()
    groups = plots.off_policy_groups(rows, "update_activated")
    # the float32 base point and the float8 point run 4 updates only: not a sweep
    assert list(groups) == [("fine_qwen3_e128", "bfloat16", LR)]
    assert {r["updates_per_batch"] for r in groups["fine_qwen3_e128", "bfloat16", LR]} == {
        1,
        2,
        4,
        8,
    }
    # drift: the papers' metric where the runs recorded it, else token-layer drift
    assert plots._drift_column(rows)[0] == "since_old_activated"
    assert plots._drift_column(without(rows, "since_old"))[0] == "drift_token_layer"
    relearned = [r | {"lr": 2 * LR} if r["updates_per_batch"] == 8 else r for r in rows]
    assert {
        r["updates_per_batch"]
        for r in plots.off_policy_groups(relearned, "update_activated")[
            "fine_qwen3_e128", "bfloat16", LR
        ]
    } == {1, 2, 4}


def test_precursor_z_scores_cross_the_threshold_where_the_summary_found_the_precursor():
    rows, curves = grid_like()
    row = next(r for r in rows if r["run_id"] == COLLAPSED)
    z = plots.z_scores(curves[COLLAPSED], ("grad_norm",), row["first_collapse_step"])
    assert min(step for step, value in z.items() if abs(value) > PRECURSOR_Z) == 7
    spread = math.sqrt(sum((0.01 * d) ** 2 for d in (-1, 0, 1, 2, -2)) / 5)  # steps 1-5
    assert z[3] == pytest.approx(0.01 / spread) and z[7] == pytest.approx((5 - 1) / spread)
    # the drift metric: the papers' one where recorded, else token-layer drift; both flat
    drift = plots.z_scores(curves[COLLAPSED], ("routing/update_activated_experts", "x"), 11)
    assert drift and max(abs(v) for v in drift.values()) <= 1.5
    assert plots.z_scores(curves[COLLAPSED], ("absent",), 11) == {}
    assert plots.z_scores(curves[COLLAPSED], ("grad_norm",), 4) == {}  # no 5-step baseline


def test_the_precursor_plot_shows_at_most_six_runs(tmp_path):
    rows, curves = grid_like()
    collapsed = [
        r | {"first_collapse_step": 11, "precursor": "grad_norm", "precursor_step": 7}
        for r in rows[:7]
    ]
    title, name = plots._plot_precursors(collapsed, curves, tmp_path)
    assert "the first 6 of 7" in title
    check_png((title, name), tmp_path, "collapse_precursors.png")


def test_every_plot_runs_on_an_old_tiny_grid(tmp_path):
    """The first grid's rows: the recipe's model, a float32 engine, no routing probe."""
    rows, curves = grid_like()
    old_rows = [
        r | {"model": "recipe", "drift_layer_0": 0.1, "drift_layer_1": 0.2}
        for r in without(
            rows,
            "update_activated",
            "since_old",
            "routes_",
            "flip_rate_",
            "near_tie",
            "engine_routing",
            "mismatch_k3",
            "log_ratio_var",
        )
        if r["cell"] == "base"
    ]
    old_curves = {
        run: [{k: v for k, v in r.items() if k not in PROBE_DRIFT} for r in recs]
        for run, recs in curves.items()
    }
    old_rows = [r | {"first_collapse_step": None} for r in old_rows]
    written = {plot.__name__: plot(old_rows, old_curves, tmp_path) for plot in plots.PLOTS}
    assert {name for name, result in written.items() if result is not None} == {
        "_plot_drift_vs_step",
        "_plot_curves",
        "_plot_clip",
        "_plot_tails",
    }
    for _, name in filter(None, written.values()):
        assert (tmp_path / name).read_bytes()[:4] == PNG


def test_survival_at_the_collapse_point_is_tabled_and_drawn_once_a_run_collapsed_there(tmp_path):
    rows, curves = grid_like()
    assert report.survival_table(rows) == []  # its one collapse is at the base point
    assert plots._plot_survival(rows, curves, tmp_path) is None
    collapsed = f"grpo--{BF16.format(8)}--seed1"
    hit = [
        r | {"collapse_events": 1, "first_collapse_step": 9} if r["run_id"] == collapsed else r
        for r in rows
    ]
    table = report.survival_table(hit)
    grpo = next(line for line in table if line.startswith("| grpo |"))
    # 1 of 2 (Wilson [0.09, 0.91]); Kaplan-Meier 0.5 after step 9; its collapse step
    assert grpo.startswith("| grpo | 2 | 1 | 0.50 [0.09, 0.91] | 0.50 [") and grpo.endswith("| 9 |")
    assert next(line for line in table if line.startswith("| gspo |")).endswith("| 1 | - |")
    check_png(plots._plot_survival(hit, curves, tmp_path), tmp_path, "survival.png")
    assert plots._plot_survival in plots.PLOTS
    text = report.format_report(hit, check_claims(hit), [])
    assert "## Survival at the collapse point" in text


def test_what_moved_first_is_tabled_per_arm_with_the_rule_s_false_alarms():
    rows, _ = grid_like()
    collapsed = f"grpo--{BF16.format(8)}--seed1"
    calm = f"grpo--{BF16.format(8)}--seed2"
    moved = {
        collapsed: {"collapse_events": 1, "first_collapse_step": 9, "precursor": "mismatch"}
        | {"precursor_step": 3},
        calm: {"false_alarm": "entropy"},
    }
    hit = [r | moved.get(r["run_id"], {}) for r in rows]
    table = report.precursor_table(hit)
    # the collapse came 6 steps after the mismatch moved; the other seed never collapsed, but
    # the rule fired there on the entropy
    assert "| grpo | mismatch 1 | 6 | 1 of 1 (entropy 1) |" in table
    gspo = next(line for line in table if line.startswith("| gspo |"))
    assert gspo.startswith("| gspo | - | - | ")
    text = report.format_report(hit, check_claims(hit), [])
    assert text.index("### What moved first") > text.index("## Survival at the collapse point")


def _dosed_rows() -> list[dict]:
    """GRPO and GSPO at doses 0, 0.01, 0.1 and 0.3 of margin-chosen and random flips, 3 seeds,
    float32 engine: GRPO's k3 rises tenfold per tenfold dose, from 1e-5 at 0.01."""
    rows = []
    for arm, loss in (("grpo", "grpo"), ("gspo", "gspo")):
        for dose, at in [(0.0, "margin")] + [
            (d, a) for d in (0.01, 0.1, 0.3) for a in ("margin", "random")
        ]:
            for seed in (1, 2, 3):
                rows.append(
                    {
                        "run_id": f"{arm}--{dose}-{at}--seed{seed}",
                        "arm": arm,
                        "cell": f"{dose}-{at}",
                        "seed": seed,
                        "state": "done",
                        "model": "fine_qwen3_e128",
                        "engine_dtype": "float32",
                        "loss": loss,
                        "routing_replay": "none",
                        "mismatch": "none",
                        "flip_routes": dose,
                        "flip_routes_at": at,
                        "final_accuracy": 0.7 - dose + 0.01 * seed,
                        "mismatch_k3": 1e-3 * dose if dose else 1e-13,
                    }
                )
    return rows


def test_the_dose_response_is_drawn_and_calibrated_against_engine_precision(tmp_path):
    rows = _dosed_rows()
    check_png(plots._plot_doses(rows, {}, tmp_path), tmp_path, "dose_response.png")
    assert plots._plot_doses in plots.PLOTS
    text = report.dose_calibration(rows)
    # k3 = 1e-3 x dose: 1.1e-4 at dose 0.11, 5.6e-4 at 0.56, past the largest dose measured
    assert "bfloat16 (1.1e-04): about 0.11" in text
    assert "float8_emulated (5.6e-04): outside the doses measured" in text
    assert report.dose_calibration([r for r in rows if r["flip_routes"] == 0]) == ""
    assert plots._plot_doses([r for r in rows if r["flip_routes"] == 0], {}, tmp_path) is None


def test_the_residual_k3_by_replay_mode_and_precision_is_drawn(tmp_path):
    rows = [
        {
            "arm": f"grpo_{mode}",
            "loss": "grpo",
            "mismatch": "none",
            "routing_replay": mode,
            "engine_dtype": precision,
            "seed": seed,
            "mismatch_k3": scale * 10.0 ** -["none", "r3", "r3_weights"].index(mode) * seed,
        }
        for mode in ("none", "r3", "r3_weights")
        for precision, scale in (("float32", 1e-9), ("bfloat16", 1e-4), ("float8_emulated", 5e-4))
        for seed in (1, 2, 3)
    ]
    check_png(plots._plot_gate_weights(rows, {}, tmp_path), tmp_path, "gate_weight_k3.png")
    assert plots._plot_gate_weights in plots.PLOTS
    # without gate-weight replay runs there is nothing to draw
    plain = [r for r in rows if r["routing_replay"] != "r3_weights"]
    assert plots._plot_gate_weights(plain, {}, tmp_path) is None
