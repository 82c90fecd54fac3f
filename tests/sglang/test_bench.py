"""`megatron-rl bench sglang`, reduced to the tiny model and one repeat (the full run, with the
~1 GB synthetic model, is for docs/benchmarks/sglang.md)."""

from __future__ import annotations

import pytest

from megatron_rl.bench import sglang as sglang_bench
from megatron_rl.rollout.sglang import SYNC_METHODS
from tests.sglang.conftest import REPO, tiny_tensor_shapes
from tests.trainer.run_cli import SGLANG_RECIPE


@pytest.mark.extended  # over a minute and a half; the full run is docs/benchmarks/sglang.md's
def test_the_benchmark_measures_every_method_beside_its_baseline(tmp_path, monkeypatch):
    monkeypatch.chdir(REPO)  # the recipe's interpreter and shim paths are relative to the repo
    spec = sglang_bench.SGLangBenchSpec(
        recipe=str(SGLANG_RECIPE),
        include_synthetic=False,
        repeats=1,
        rollout_prompts=4,
        rollout_rounds=1,
    )
    report = sglang_bench.run_benchmark(spec, tmp_path / "work")
    assert not (tmp_path / "work").exists()
    tiny = report["weight_sync"]["tiny"]
    assert tiny["tensors"] == len(tiny_tensor_shapes())
    assert 5e6 < tiny["bytes"] < 6e6  # the tiny model's float32 weights (5.6 MB)
    assert tiny["memcpy_bytes_per_s"] > 0
    for method in SYNC_METHODS:
        assert tiny[method]["bytes_per_s"] == tiny["bytes"] / tiny[method]["seconds"]
    rollout = report["rollout"]
    assert rollout["local"]["tokens"] > 0 and rollout["sglang"]["tokens"] > 0
    markdown = sglang_bench.format_markdown(report)
    assert markdown.count("| tiny |") == 1 + len(SYNC_METHODS) and "| sglang |" in markdown
