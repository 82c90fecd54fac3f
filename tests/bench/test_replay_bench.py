"""The replay benchmark runs both modes in a fresh process per depth and reports per depth.
(A smoke test at a tiny size: the figures come from `megatron-rl bench replay`.)"""

from __future__ import annotations

import pytest

from megatron_rl.bench import replay as replay_bench


@pytest.mark.extended  # a reduced run: about a minute
def test_bench_replay_runs_and_reports(tmp_path):
    # 256 tokens per row: the recorded routing (32 KiB) is well above the few KiB by which what
    # a pass leaves allocated varies between runs (one CI run measured -4 KiB at 16 tokens)
    spec = replay_bench.ReplayBenchSpec(layers=(2,), micro_batches=2, batch=2, seq=256, pairs=3)
    report = replay_bench.run_benchmark(spec)
    row = report["summary"]["2"]
    assert row["seconds_none"] > 0 and row["seconds_r2"] > 0
    assert all(len(report["runs"]["2"]["seconds"][mode]) == 3 for mode in ("none", "r2"))
    assert row["time_overhead_low"] <= row["time_overhead"] <= row["time_overhead_high"]
    # recorded routing of a step: layers x tokens x topk x 8 bytes
    assert row["routing_bytes"] == 2 * (2 * 2 * 256) * 2 * 8
    json_path, md_path = replay_bench.write_report(report, tmp_path)
    assert json_path.is_file() and "| 2 |" in md_path.read_text()
    # Counted allocation by allocation: from the old pass to the update replay holds at most the
    # recorded indices; the step's peak grows by at most them and, while a micro-batch is
    # replayed, one micro-batch's indices more (the replayed pass's transient: 16 KiB here, as
    # in the trainer before the benchmark's old pass became the trainer's own, which revealed it).
    assert 0 < row["kept_overhead_bytes"] <= row["routing_bytes"]
    one_micro_batch = row["routing_bytes"] // spec.micro_batches
    assert 0 <= row["allocated_overhead_bytes"] <= row["routing_bytes"] + one_micro_batch


def test_median_interval_brackets_the_median_and_narrows_with_more_values():
    import random
    import statistics

    from megatron_rl.bench.report import median_interval

    draw = random.Random(1)
    few = [draw.gauss(0.03, 0.05) for _ in range(10)]
    many = [draw.gauss(0.03, 0.05) for _ in range(400)]
    low, high = median_interval(few)
    assert low <= statistics.median(few) <= high
    low_many, high_many = median_interval(many)
    assert high_many - low_many < (high - low) / 2
    assert low_many < 0.03 < high_many
    assert median_interval(many) == (low_many, high_many)  # seeded: reports reproduce


def test_allocation_peak_counts_torch_allocations():
    import torch

    from megatron_rl.bench.report import allocation_peak

    def run():
        first = torch.ones(1024, 1024)  # 4 MiB
        second = first * 2  # 4 MiB more, then the first is freed
        del first
        return second, torch.ones(256, 1024)  # 1 MiB

    peak, net = allocation_peak(run)
    assert peak >= 8 * 2**20 and peak < 8 * 2**20 + 4096
    assert net < 0.01 * 2**20  # everything run() returned was freed when it returned
