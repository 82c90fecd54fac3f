"""The log-prob benchmark runs both variants in fresh processes and writes JSON and markdown.
(A smoke test at a tiny size: the figures themselves come from `megatron-rl bench logprobs`.)"""

from __future__ import annotations

import json

from megatron_rl.cli import main


def test_bench_logprobs_writes_json_and_markdown(tmp_path, capsys):
    out = tmp_path / "bench"
    args = ["bench", "logprobs", "--tokens", "64", "--vocab", "3000", "--repeats", "1"]
    assert main([*args, "--chunk-tokens", "8", "--out", str(out)]) == 0
    report = json.loads((out / "logprobs.json").read_text())
    assert report["spec"]["tokens"] == 64 and report["spec"]["chunk_tokens"] == 8
    for variant in ("naive", "chunked"):
        result = report["results"][variant]
        assert result["seconds_median"] > 0 and len(result["seconds_all"]) == 1
        assert result["logits_mib"] == 64 * 3000 * 2 / 2**20
        assert 0 < result["floor_seconds"] < result["seconds_median"]
    assert report["machine"]["cores"] >= 1 and report["date"]
    table = (out / "logprobs.md").read_text()
    assert "| naive |" in table and "| chunked |" in table
    assert "| chunked |" in capsys.readouterr().out
