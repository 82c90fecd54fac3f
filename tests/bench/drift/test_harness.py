"""`megatron-rl bench drift` end to end on a tiny grid (real training runs of the tiny recipe),
resume, a crashing arm, and the bad inputs refused before any run starts."""

from __future__ import annotations

import csv
import json
import re
import signal
import subprocess
import sys

import pytest
import torch
import yaml
from safetensors.torch import save_file

from megatron_rl.bench.drift import (
    pack_drift_benchmark,
    prepare_drift_benchmark,
    report_drift_benchmark,
    run_drift_benchmark,
)
from megatron_rl.bench.drift.grid import (
    DEFAULT_GRID,
    QUICK_GRID,
    REGIME_LR,
    GridError,
    load_grid,
)
from megatron_rl.bench.drift.runner import check_model_build, check_results_dir
from megatron_rl.bench.report import cpu_model
from megatron_rl.moe.margins import bucket_names
from tests.trainer.run_cli import RECIPE, SHORT_RUN

TINY = {
    "seeds": [1],
    "set": dict(item.split("=", 1) for item in SHORT_RUN)
    | {"run.eval_every": 1, "metrics.routing_probe": True},
    "arms": {
        "grpo_r2": None,
        "gspo": None,
        # valid as a recipe, fails when the run starts: 2 TP ranks in a 1-process run
        "broken": {"algo.loss": "gspo", "parallel.tp": 2},
    },
    "sweeps": [],
}


def write_grid(tmp_path, grid: dict, name: str = "grid.yaml"):
    path = tmp_path / name
    path.write_text(yaml.safe_dump(grid))
    return path


def test_tiny_grid_end_to_end_then_resume(tmp_path, capsys):
    grid_file, out = write_grid(tmp_path, TINY), tmp_path / "results"
    models = tmp_path / "models"
    report = run_drift_benchmark(str(RECIPE), str(grid_file), out, jobs=2, models_dir=models)
    printed = capsys.readouterr().out
    assert "[3/3]" in printed and "ETA" in printed
    assert "broken--base--seed1: CRASHED" in printed
    rows = {row["arm"]: row for row in csv.DictReader((out / "summary.csv").open())}
    assert rows["grpo_r2"]["state"] == rows["gspo"]["state"] == "done"
    assert rows["broken"]["state"] == "crashed" and "parallel" in rows["broken"]["error"]
    for arm in ("grpo_r2", "gspo"):
        assert int(rows[arm]["steps"]) == 2 and 0 <= float(rows[arm]["final_accuracy"]) <= 1
        assert float(rows[arm]["drift_token_layer"]) >= 0
        # the run's time by phase: its steps within its whole, training in its steps
        assert 0 < float(rows[arm]["seconds_train"]) < float(rows[arm]["seconds_step"])
        assert float(rows[arm]["seconds_step"]) < float(rows[arm]["seconds"])
        assert (out / "runs" / f"{arm}--base--seed1" / "recipe.yaml").is_file()
    assert float(rows["grpo_r2"]["replay_miss_max"]) == 0.0
    # each run records its machine (the grid may be resumed on another); the report names them
    machine = cpu_model()
    assert {row["machine"] for row in rows.values()} == {machine}
    assert f"Ran on: {machine} (3 runs)." in report.read_text()
    assert "| updates, with the routing probe's forwards | " in report.read_text()
    for arm in ("grpo_r2", "gspo"):  # the routing probe's columns
        row = rows[arm]
        assert 0 <= float(row["update_activated"]) <= float(row["update_token_layer"]) <= 1
        # the float32 engine routes exactly as the trainer: the zero-mismatch oracle
        assert float(row["engine_routing_mismatch"]) == 0.0
        assert float(row["engine_routing_mismatch_activated"]) == 0.0
        assert float(row["router_weight_change"]) > 0
        assert float(row["margin_median"]) > 0
        buckets = bucket_names()
        routes = sum(float(row[f"routes_{b}"]) for b in buckets)
        assert routes > 0
        # per layer (the tiny model's MoE layers 0-3): each layer's routes, summing to the whole
        per_layer = [sum(float(row[f"routes_layer_{i}_{b}"]) for b in buckets) for i in range(4)]
        assert sum(per_layer) == routes and min(per_layer) > 0
        assert "update_activated_layer_3" in row and "near_tie_layer_0" in row
        # after the last of the step's updates the weights have moved furthest from the old ones
        assert float(row["since_old_last_activated"]) >= 0
        # no collapse: the precursor rule's false alarm is measured (2 steps: no baseline, none)
        assert row["collapse_events"] == "0" and row["false_alarm"] == ""
    for arm in ("grpo_r2", "gspo"):
        steps = [
            json.loads(line)
            for line in (out / "runs" / f"{arm}--base--seed1" / "metrics.jsonl").open()
        ]
        last = [r["routing/since_old_last_activated_experts"] for r in steps if r["step"] > 0]
        assert float(rows[arm]["since_old_last_activated"]) == pytest.approx(sum(last) / len(last))
    # routing's share of the log-ratio variance, pooled over the run's steps
    steps = [
        json.loads(line) for line in (out / "runs" / "gspo--base--seed1" / "metrics.jsonl").open()
    ]
    held = sum(r["routing/log_ratio_var_held"] for r in steps if "routing/log_ratio_var_held" in r)
    free = sum(r["routing/log_ratio_var_free"] for r in steps if "routing/log_ratio_var_free" in r)
    assert free > 0
    assert float(rows["gspo"]["log_ratio_var_share_pooled"]) == pytest.approx(1 - held / free)
    assert rows["gspo"]["log_ratio_var_share_median"] != ""
    # the recipe's own choice of old log-probs, not the retired use_engine_logprobs
    assert rows["gspo"]["mismatch"] == "none" and "use_engine_logprobs" not in rows["gspo"]
    text = report.read_text()
    assert "## Claims" in text and "## Crashed runs" in text
    claims = [line for line in text.splitlines() if line.split(".")[0].isdigit()]
    assert [int(line.split(".")[0]) for line in claims] == list(range(1, 22))
    assert all(any(v in line for v in ("PASS", "FAIL", "NOT TESTED")) for line in claims)
    for plot in ("drift_vs_step.png", "curves.png", "clip_fractions.png", "ratio_tails.png"):
        assert (out / plot).read_bytes()[:4] == b"\x89PNG"

    # Again: nothing finished runs again; on request the crashed run does.
    done = out / "runs" / "gspo--base--seed1" / "metrics.jsonl"
    before = done.stat().st_mtime_ns
    run_drift_benchmark(str(RECIPE), str(grid_file), out, jobs=2, models_dir=models)
    assert "3 of 3 runs already ended; running 0" in capsys.readouterr().out
    run_drift_benchmark(
        str(RECIPE), str(grid_file), out, jobs=2, models_dir=models, rerun_crashed=True
    )
    assert "running 1" in capsys.readouterr().out
    assert done.stat().st_mtime_ns == before

    # Another grid in the same results directory is refused, naming the difference.
    other = write_grid(tmp_path, TINY | {"seeds": [1, 2]}, "other.yaml")
    with pytest.raises(GridError, match=r"another grid or recipe \(seeds"):
        check_results_dir(out, load_grid(str(RECIPE), str(other)))

    # Packed: the runs' files in one archive, from which the report is the same to the byte.
    summary, report_text = (out / "summary.csv").read_text(), report.read_text()
    with pytest.raises(GridError, match=r"another grid or recipe \(seeds"):
        pack_drift_benchmark(str(RECIPE), str(other), out)
    archive, _ = pack_drift_benchmark(str(RECIPE), str(grid_file), out)
    assert archive == out / "runs.tar.xz" and not (out / "runs").exists()
    assert (out / "summary.csv").read_text() == summary and report.read_text() == report_text
    with pytest.raises(GridError, match=r"packed into runs\.tar\.xz, so the grid is complete"):
        run_drift_benchmark(str(RECIPE), str(grid_file), out, jobs=1, models_dir=models)


def test_a_grid_that_stops_at_collapse_stops_the_run_at_its_first_event(tmp_path, capsys):
    # a learning rate that breaks the tiny model within a few steps; 40 steps if never stopped
    grid = {
        "seeds": [1],
        "set": TINY["set"] | {"run.steps": 40, "optim.lr": 0.05},
        "arms": {"gspo": None},
        "sweeps": [],
        "stop_at_collapse": True,
    }
    out = tmp_path / "results"
    run_drift_benchmark(
        str(RECIPE), str(write_grid(tmp_path, grid)), out, jobs=1, models_dir=tmp_path / "m"
    )
    assert re.search(r"gspo--base--seed1: stopped: collapse at step \d+", capsys.readouterr().out)
    row = next(csv.DictReader((out / "summary.csv").open()))
    assert row["state"] == "done" and row["stopped"].startswith("collapse at step ")
    first, kind = int(row["first_collapse_step"]), row["collapses"].split("@")[0]
    assert row["stopped"] == f"collapse at step {first} ({kind})"
    # stopped after the event was confirmed (a fall: by the two evaluations after it, one a
    # step) and long before the 40 steps
    assert first + (2 if kind == "accuracy" else 0) <= int(row["steps"]) < 40


def test_a_job_array_runs_one_run_per_task_then_reports(tmp_path, capsys):
    """--prepare, --run-index I (a job array's task), --report-only, as docs/drift.md runs them
    on SLURM; the run is the crashing arm's, which ends in seconds."""
    grid_file, out, models = write_grid(tmp_path, TINY), tmp_path / "results", tmp_path / "models"
    args = (str(RECIPE), str(grid_file), out)
    run_ids = prepare_drift_benchmark(*args, models_dir=models)
    assert run_ids == [run.run_id for run in load_grid(str(RECIPE), str(grid_file)).runs]
    broken = run_ids.index("broken--base--seed1")
    assert len(run_ids) == 3 and not (out / "runs").exists()
    assert run_drift_benchmark(*args, jobs=1, models_dir=models, only=broken) is None
    assert "[1/1] broken--base--seed1: CRASHED" in capsys.readouterr().out
    assert [path.name for path in (out / "runs").iterdir()] == ["broken--base--seed1"]
    with pytest.raises(GridError, match=r"--run-index: 3 is not a run of this grid \(0 .. 2\)"):
        run_drift_benchmark(*args, jobs=1, models_dir=models, only=3)
    report = report_drift_benchmark(*args).read_text()
    assert "3 runs: 0 done, 1 crashed, 2 not run." in report
    # A run on a base model of another shape needs --prepare first (which builds it).
    deep = {"name": "depth", "field": "base_model.layers", "values": [2], "arms": ["broken"]}
    deep_grid = write_grid(tmp_path, TINY | {"sweeps": [deep]}, "deep.yaml")
    deep_ids = [run.run_id for run in load_grid(str(RECIPE), str(deep_grid)).runs]
    number = deep_ids.index("broken--layers=2--seed1")
    message = rf"--run-index {number} \(broken--layers=2--seed1\): its base .* --prepare first"
    with pytest.raises(GridError, match=message):
        run_drift_benchmark(
            str(RECIPE), str(deep_grid), tmp_path / "deep", jobs=1, models_dir=models, only=number
        )


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"arms": {"grpo_r4": None}}, r"arms.grpo_r4: unknown arm; built-in arms: grpo, "),
        ({"arms": {"x": {"algo.loss": "ppo"}}}, r"arm x, point base: algo.loss: unknown loss"),
        (
            {"sweeps": [{"name": "s", "field": "optim.learning_rate", "values": [1]}]},
            r"sweep field optim.learning_rate: optim.learning_rate is not a recipe field "
            r"\(valid here: .*lr",
        ),
        (
            {"sweeps": [{"name": "s", "field": "algo.updates_per_batch", "values": ["many"]}]},
            r"point updates_per_batch=many: algo.updates_per_batch: expected an int",
        ),
        (
            {"sweeps": [{"name": "s", "field": "base_model.layers", "values": [0]}]},
            r"base_model.layers expects an integer >= 1",
        ),
        ({"sweeps": [{"name": "s", "values": [1]}]}, r"give either field and values, or points"),
        (
            {"sweeps": [{"name": "s", "field": "optim.lr", "values": [1e-4], "arms": ["sspo"]}]},
            r"'sspo' is not an arm of the grid",
        ),
        (
            {"sweeps": [{"name": "s", "field": "base_model.shape", "values": ["huge_moe"]}]},
            r"base_model.shape expects one of the tiny-model script's shapes \(.*fine_qwen3",
        ),
        (
            {
                "set": {"base_model.shape": "fine_qwen3"},
                "sweeps": [{"name": "s", "field": "base_model.layers", "values": [2]}],
            },
            r"base_model.shape: a named shape fixes layers, experts and topk",
        ),
        ({"base_arms": ["grpo"]}, r"base_arms: 'grpo' is not an arm of the grid"),
        ({"seeds": []}, r"seeds: expected a non-empty list of integers"),
        ({"jobs": 2}, r"grid: unknown key 'jobs'"),
        ({"stop_at_collapse": "yes"}, r"stop_at_collapse: expected true or false, got 'yes'"),
        (
            {"claims": [22, 99]},
            r"claims: expected a list of claim numbers 1 \.\. 28, got \[22, 99\]",
        ),
    ],
)
def test_bad_grids_are_refused_naming_the_field(tmp_path, change, message):
    grid = {"seeds": [1], "arms": {"gspo": None}} | change
    with pytest.raises(GridError, match=message):
        load_grid(str(RECIPE), str(write_grid(tmp_path, grid)))


def test_cli_refuses_zero_jobs_and_a_foreign_directory(tmp_path):
    command = [sys.executable, "-m", "megatron_rl.cli", "bench", "drift", str(RECIPE)]
    zero = subprocess.run([*command, "--jobs", "0"], capture_output=True, text=True, timeout=120)
    assert zero.returncode == 2 and "--jobs: expected a positive int, got 0" in zero.stderr
    foreign = tmp_path / "results"
    foreign.mkdir()
    (foreign / "notes.txt").write_text("mine")
    grid = write_grid(tmp_path, {"seeds": [1], "arms": {"gspo": None}})
    refused = subprocess.run(
        [*command, "--grid", str(grid), "--out", str(foreign)],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert refused.returncode == 2
    assert "not empty and not a drift results directory" in refused.stderr
    assert sorted(p.name for p in foreign.iterdir()) == ["notes.txt"]


def test_a_results_directory_refuses_another_build_of_its_base_model(tmp_path):
    out, model = tmp_path / "results", tmp_path / "models" / "fine_qwen3_e128"
    out.mkdir()
    model.mkdir(parents=True)
    weights = {"router.weight": torch.arange(6, dtype=torch.float32).reshape(2, 3)}
    save_file(weights, model / "model.safetensors")
    check_model_build(out, model)  # the first run records the build
    recorded = (out / "models.json").read_text()
    assert "fine_qwen3_e128" in recorded
    check_model_build(out, model)  # the same build resumes
    # a rebuild that rounded one weight differently
    weights["router.weight"][1, 2] = torch.nextafter(torch.tensor(5.0), torch.tensor(6.0))
    save_file(weights, model / "model.safetensors")
    with pytest.raises(GridError, match=r"--models-dir: .*another build of fine_qwen3_e128"):
        check_model_build(out, model)
    assert (out / "models.json").read_text() == recorded


def test_default_grid_plans_the_papers_regime():
    grid = load_grid(str(RECIPE), None)
    base = [run for run in grid.runs if run.cell == "base"]
    assert {run.arm for run in base} == set(DEFAULT_GRID["base_arms"])
    assert all(run.shape == {"shape": "fine_qwen3_e128"} for run in base)
    assert all(run.recipe.metrics.routing_probe for run in grid.runs)
    # nothing extends a grid's run: none saves a final checkpoint (the same numbers, tests/trainer)
    assert not any(run.recipe.checkpoint.save_last for run in grid.runs)
    assert {run.recipe.optim.lr for run in grid.runs} == {REGIME_LR}

    def engine(run):
        return run.recipe.rollout.engine_dtype

    bf16 = [run for run in grid.runs if engine(run) == "bfloat16"]
    assert {run.recipe.algo.updates_per_batch for run in bf16} == {1, 2, 4, 8}
    assert {run.arm for run in bf16} == {"grpo", "grpo_r2", "grpo_r3", "gspo"}
    fp8 = {run.arm for run in grid.runs if engine(run) == "float8_emulated"}
    corrections = {"grpo_tis", "grpo_mis_geometric", "grpo_tis_mis_geometric"}
    assert fp8 == {"grpo", "grpo_r2", "grpo_r3", "gspo"} | corrections
    combined = next(r for r in grid.runs if r.arm == "grpo_tis_mis_geometric").recipe.algo
    assert combined.correction().mask.level == "geometric" and combined.mismatch == "tis"
    # both geometric bands are the mismatch studies' narrow one: MIS's default [0, 2] never acts
    mis = next(r for r in grid.runs if r.arm == "grpo_mis_geometric").recipe.algo.correction()
    for band in (mis, combined.correction().mask):
        assert (band.lower, band.upper) == (0.999, 1.001)
    plain_tis = next(r for r in grid.runs if r.arm == "grpo_tis").recipe.algo.correction()
    assert plain_tis.mask is None and plain_tis.upper == 2.0
    # R3 and the corrections never run at the float32 engine, where they change nothing
    assert not any(
        engine(r) == "float32" and r.arm in fp8 - {"grpo", "grpo_r2", "gspo"} for r in grid.runs
    )
    models = {run.shape["shape"] for run in grid.runs}
    assert models == {"fine_qwen3_e128", "fine_deepseek_e128", "dense_control"}
    dense = {run.arm for run in grid.runs if run.shape == {"shape": "dense_control"}}
    assert dense == {"grpo", "gspo"}
    assert all(
        len({r.seed for r in grid.runs if r.cell == c}) == 3 for c in {r.cell for r in grid.runs}
    )
    assert len(grid.runs) == 24 + 48 + 21 + 9 + 6
    quick = load_grid(str(RECIPE), QUICK_GRID)
    assert len(quick.runs) == 22 and {run.seed for run in quick.runs} == {1}
    assert {run.recipe.run.steps for run in quick.runs} == {12}


def test_the_first_grid_file_plans_the_checked_in_report():
    grid = load_grid(str(RECIPE), str(RECIPE.parent / "tiny_drift.yaml"))
    cells = {run.cell for run in grid.runs}
    assert {"base", "updates_per_batch=1", "updates_per_batch=8", "layers=2", "layers=8"} <= cells
    assert "updates_per_batch=4" not in cells and "layers=4" not in cells  # the base point
    assert {run.arm for run in grid.runs if run.cell == "base"} == set(grid.arms)
    deep = [r for r in grid.runs if r.cell == "layers=8"]
    assert all(r.shape == {"layers": 8, "experts": 8, "topk": 2} for r in deep)
    assert len(grid.runs) == 84  # docs/benchmarks/drift-tiny/report.md


def test_the_collapse_point_grid_plans_twelve_paired_seeds_there_and_stops_at_collapse():
    grid = load_grid(str(RECIPE), str(RECIPE.parent / "collapse_point_drift.yaml"))
    assert len(grid.runs) == 5 * 12 and {run.cell for run in grid.runs} == {"base"}
    assert {run.arm for run in grid.runs} == {"grpo", "grpo_r2", "grpo_r3", "gspo", "gspo_r2"}
    for run in grid.runs:
        assert run.recipe.algo.updates_per_batch == 8 and run.recipe.run.steps == 60
        assert run.recipe.rollout.engine_dtype == "bfloat16"
        assert run.shape == {"shape": "fine_qwen3_e128"}
    assert grid.stop_at_collapse and grid.claims == (15, 22, 23, 24)
    # the claims it reads do not identify the grid; stopping at a collapse does
    assert "claims" not in grid.identity() and grid.identity()["stop_at_collapse"] is True
    assert "stop_at_collapse" not in load_grid(str(RECIPE), None).identity()


def test_the_dose_response_grid_flips_each_dose_both_ways_beside_dose_zero():
    grid = load_grid(str(RECIPE), str(RECIPE.parent / "route_flips_drift.yaml"))
    assert len(grid.runs) == 4 * 9 * 3 and grid.claims == (25, 26, 27)
    doses = {(r.recipe.rollout.flip_routes, r.recipe.rollout.flip_routes_at) for r in grid.runs}
    assert doses == {(0.0, "margin")} | {
        (d, at) for d in (0.01, 0.03, 0.1, 0.3) for at in ("margin", "random")
    }
    assert {r.recipe.rollout.engine_dtype for r in grid.runs} == {"float32"}
    assert all(r.recipe.metrics.routing_probe for r in grid.runs)


def test_the_gate_weight_grid_runs_each_replay_mode_at_each_engine_precision():
    grid = load_grid(str(RECIPE), str(RECIPE.parent / "gate_weight_replay_drift.yaml"))
    assert len(grid.runs) == 3 * 3 * 4 and grid.claims == (28,)
    modes = {(r.recipe.algo.routing_replay.value, r.recipe.rollout.engine_dtype) for r in grid.runs}
    assert modes == {
        (mode, dtype)
        for mode in ("none", "r3", "r3_weights")
        for dtype in ("float32", "bfloat16", "float8_emulated")
    }
    assert {r.recipe.algo.loss for r in grid.runs} == {"grpo"}


def test_the_quick_subset_covers_every_claim_of_the_decisive_experiments():
    grid = load_grid(str(RECIPE), str(RECIPE.parent / "decisive_quick_drift.yaml"))
    assert len(grid.runs) == 42 and grid.claims == (15, *range(22, 29))
    at_collapse_point = [r for r in grid.runs if r.recipe.algo.updates_per_batch == 8]
    assert {r.arm for r in at_collapse_point} == {"grpo", "grpo_r2", "grpo_r3", "gspo", "gspo_r2"}
    assert {r.recipe.rollout.engine_dtype for r in at_collapse_point} == {"bfloat16"}
    doses = {(r.recipe.rollout.flip_routes, r.recipe.rollout.flip_routes_at) for r in grid.runs}
    assert doses == {(0.0, "margin"), (0.3, "margin"), (0.3, "random")}
    weights = {r.recipe.rollout.engine_dtype for r in grid.runs if r.arm == "grpo_r3_weights"}
    assert weights == {"bfloat16", "float8_emulated"}


def test_cluster_example_grid_and_recipe_are_valid():
    from megatron_rl.config import load_config
    from megatron_rl.trainer.recipe import Recipe

    examples = RECIPE.parent
    recipe = load_config(Recipe, examples / "qwen3_30b_a3b_gspo.yaml")
    assert (recipe.parallel.pp, recipe.parallel.ep) == (2, 8)
    # The grid itself, planned over the tiny recipe (the 30B checkpoint is not here).
    grid = load_grid(str(RECIPE), str(examples / "qwen3_30b_a3b_drift.yaml"))
    assert len(grid.runs) == 84
    assert grid.launcher[0] == "srun"
    # Moonlight-16B-A3B: the sigmoid router's grid, on one node, its bias updates kept in RL
    recipe = load_config(Recipe, examples / "moonlight_16b_a3b_gspo.yaml")
    assert recipe.model.trust_remote_code and recipe.parallel.ep == 8
    moonlight = load_grid(str(RECIPE), str(examples / "moonlight_16b_a3b_drift.yaml"))
    assert [run.arm for run in moonlight.runs] == [run.arm for run in grid.runs]
    assert {run.recipe.model.router_bias_update_rate for run in moonlight.runs} == {1e-3}
    assert "--nnodes=1" in moonlight.launcher


def test_sigterm_stops_the_runs_in_flight(tmp_path):
    import time

    import psutil

    grid = TINY | {"arms": {"gspo": None}, "set": TINY["set"] | {"run.steps": 200}}
    command = [sys.executable, "-m", "megatron_rl.cli", "bench", "drift", str(RECIPE)]
    command += ["--grid", str(write_grid(tmp_path, grid)), "--out", str(tmp_path / "results")]
    harness = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    try:
        children: list[psutil.Process] = []
        deadline = time.monotonic() + 120
        while not children and time.monotonic() < deadline:
            time.sleep(0.5)
            children = psutil.Process(harness.pid).children(recursive=True)
        assert children, "the harness started no run"
        harness.send_signal(signal.SIGTERM)
        assert harness.wait(timeout=60) == 128 + signal.SIGTERM
        _, alive = psutil.wait_procs(children, timeout=10)
        assert not alive, [p.pid for p in alive]
    finally:
        if harness.poll() is None:
            harness.kill()
            harness.wait()
