"""The conversion benchmark runs end to end on a small synthetic model, with a baseline
checkout's conversions beside this one's, and reports its figures, and with a second size their
fit over the size (a smoke test: the figures themselves come from `megatron-rl bench convert`);
the fit is the line through the sizes."""

from __future__ import annotations

import copy
from pathlib import Path

import pytest

from megatron_rl.bench import convert as convert_bench

REPO = Path(__file__).resolve().parents[2]
# this checkout's conversions, then the baseline's (this checkout again, imported by its path)
STEPS = (
    *convert_bench.CONVERSIONS,
    *(s + convert_bench.BASELINE for s in convert_bench.CONVERSIONS),
)


@pytest.mark.extended  # a reduced run of both directions and the baseline: over 40 s
def test_bench_convert_runs_and_reports(tmp_path):
    spec = convert_bench.ConvertBenchSpec(
        num_layers=1,
        hidden_size=64,
        num_experts=4,
        moe_ffn_hidden_size=32,
        vocab_size=256,
        keys_layers=2,
        keys_experts=4,
    )
    report = convert_bench.run_benchmark(spec, tmp_path / "work", rounds=1, baseline=REPO)
    assert not (tmp_path / "work").exists()  # scratch space removed
    assert [size["num_layers"] for size in report["sizes"]] == [1]
    assert report["weight_bytes"] == report["sizes"][0]["weight_bytes"] > 0
    assert report["largest_shard_bytes"] == report["weight_bytes"]
    assert "fit" not in report  # one size
    for step in (*convert_bench.COPIES, convert_bench.STARTUP, *STEPS):
        assert len(report["steps"][step]["runs_seconds"]) == 1
        assert min(report["steps"][step]["runs_seconds"]) <= report["steps"][step]["seconds"]
        assert report["steps"][step]["seconds"] <= max(report["steps"][step]["runs_seconds"])
    for step in STEPS:
        # the converting process's own peak (torch and megatron-core alone take over 128 MiB)
        assert report["steps"][step]["peak_rss_kib"] > 128 * 1024
        assert set(report["time_vs"]) == set(convert_bench.COPIES)
    for step in convert_bench.COPIES:
        # cp's own memory, not this (large) test process's, whose peak a forked child inherits
        assert report["steps"][step]["peak_rss_kib"] < 64 * 1024
    assert set(report["checkpoint_keys"]) == {"1", "2"}
    for times in report["checkpoint_keys"].values():
        assert times["save_seconds"] > 0 and times["load_seconds"] > 0
    assert report["baseline"]["path"] == str(REPO)

    # A second size, as if measured: every step twice as long at twice the bytes. The report
    # with the fit of the two, as `--layers A B` writes it.
    larger = copy.deepcopy(report["sizes"][0])
    larger["num_layers"], larger["weight_bytes"] = 2, 2 * larger["weight_bytes"]
    for step in larger["steps"].values():
        step["seconds"] *= 2
    report = {**report, **larger, "sizes": [report["sizes"][0], larger]}
    report.update(convert_bench.fit_report(report["sizes"]))
    assert set(report["fit"]) == {*convert_bench.COPIES, *STEPS}
    for step in STEPS:
        assert report["slope_vs"]["cp+sync"][step] == (
            report["fit"][step]["slope_s_per_gib"] / report["fit"]["cp+sync"]["slope_s_per_gib"]
        )
    json_path, md_path = convert_bench.write_report(report, tmp_path / "out")
    assert json_path.is_file() and "| hf-to-mcore |" in md_path.read_text()
    assert "| 2: a key per layer and expert |" in md_path.read_text()
    assert "| hf-to-mcore | " in md_path.read_text() and "s per GiB" in md_path.read_text()
    assert "| mcore-to-hf (baseline) | " in md_path.read_text()


def test_a_baseline_that_is_no_checkout_is_refused(tmp_path):
    with pytest.raises(ValueError, match=r"--baseline .*: not a megatron-rl checkout"):
        convert_bench.run_benchmark(convert_bench.ConvertBenchSpec(), tmp_path, baseline=tmp_path)


def _size(gib: float, seconds: dict[str, float]) -> dict:
    return {"weight_bytes": gib * 2**30, "steps": {k: {"seconds": v} for k, v in seconds.items()}}


def test_the_fit_is_the_line_through_the_sizes():
    steps = (*convert_bench.COPIES, *convert_bench.CONVERSIONS)
    # time = fixed + per_gib * size, exactly, at 2, 4 and 8 GiB
    lines = {step: (1.0 + i, 0.5 * (i + 1)) for i, step in enumerate(steps)}
    sizes = [
        _size(gib, {step: fixed + per_gib * gib for step, (fixed, per_gib) in lines.items()})
        for gib in (2.0, 4.0, 8.0)
    ]
    fit = convert_bench.fit_marginal_cost(sizes)
    for step, (fixed, per_gib) in lines.items():
        assert fit[step]["intercept_s"] == pytest.approx(fixed)
        assert fit[step]["slope_s_per_gib"] == pytest.approx(per_gib)
    with pytest.raises(ValueError, match="sizes: the fit needs checkpoints of two sizes or more"):
        convert_bench.fit_marginal_cost(sizes[:1] * 2)
