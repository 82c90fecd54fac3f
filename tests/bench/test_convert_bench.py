"""The conversion benchmark runs end to end on a small synthetic model and reports its figures.
(A smoke test: the figures themselves come from `megatron-rl bench convert`.)"""

from __future__ import annotations

from megatron_rl.bench import convert as convert_bench


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
    report = convert_bench.run_benchmark(spec, tmp_path / "work", rounds=1)
    assert not (tmp_path / "work").exists()  # scratch space removed
    assert report["weight_bytes"] > 0 and report["largest_shard_bytes"] == report["weight_bytes"]
    for step in (*convert_bench.COPIES, convert_bench.STARTUP, *convert_bench.CONVERSIONS):
        assert len(report["steps"][step]["runs_seconds"]) == 1
        assert min(report["steps"][step]["runs_seconds"]) <= report["steps"][step]["seconds"]
        assert report["steps"][step]["seconds"] <= max(report["steps"][step]["runs_seconds"])
    for step in convert_bench.CONVERSIONS:
        # the converting process's own peak (torch and megatron-core alone take over 128 MiB)
        assert report["steps"][step]["peak_rss_kib"] > 128 * 1024
        assert set(report["time_vs"]) == set(convert_bench.COPIES)
    for step in convert_bench.COPIES:
        # cp's own memory, not this (large) test process's, whose peak a forked child inherits
        assert report["steps"][step]["peak_rss_kib"] < 64 * 1024
    assert set(report["checkpoint_keys"]) == {"1", "2"}
    for times in report["checkpoint_keys"].values():
        assert times["save_seconds"] > 0 and times["load_seconds"] > 0
    json_path, md_path = convert_bench.write_report(report, tmp_path / "out")
    assert json_path.is_file() and "| hf-to-mcore |" in md_path.read_text()
    assert "| 2: a key per layer and expert |" in md_path.read_text()
