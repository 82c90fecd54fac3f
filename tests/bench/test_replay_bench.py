"""The replay benchmark runs both modes in fresh processes and reports per depth.
(A smoke test at a tiny size: the figures come from `megatron-rl bench replay`.)"""

from __future__ import annotations

from megatron_rl.bench import replay as replay_bench


def test_bench_replay_runs_and_reports(tmp_path):
    spec = replay_bench.ReplayBenchSpec(
        layers=(2,), micro_batches=2, batch=2, seq=16, steps=1, rounds=1
    )
    report = replay_bench.run_benchmark(spec)
    row = report["summary"]["2"]
    assert row["seconds_none"] > 0 and row["seconds_r2"] > 0
    # recorded routing of a step: layers x tokens x topk x 8 bytes
    assert row["routing_bytes"] == 2 * (2 * 2 * 16) * 2 * 8
    json_path, md_path = replay_bench.write_report(report, tmp_path)
    assert json_path.is_file() and "| 2 |" in md_path.read_text()
