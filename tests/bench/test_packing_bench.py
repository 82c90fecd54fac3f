"""`megatron-rl bench packing` at a tiny shape on CPU: the three cuts of the same rollouts hold
the same tokens, padding falls from rows to a token budget to packed (none), only the packed arm
takes the model's packed attention, and the CLI writes the report."""

from __future__ import annotations

import json
from dataclasses import replace

import pytest

from megatron_rl.bench import packing
from megatron_rl.bench.packing import PackingSpec
from megatron_rl.cli import main
from megatron_rl.models import packed_attention

TINY = PackingSpec(
    samples=16,
    shortest=6,
    longest=20,
    prompt=4,
    micro_batch_size=4,
    micro_batch_tokens=40,
    layers=1,
    hidden=32,
    heads=2,
    kv_heads=1,
    experts=4,
    topk=2,
    moe_ffn=16,
    vocab=128,
    steps=1,
    rounds=2,
)


@pytest.mark.timeout(120)
def test_the_cuts_hold_the_same_tokens_with_less_padding(monkeypatch):
    packed_forwards, positions = [], packed_attention.packed_positions

    def counted(cu_seqlens):
        packed_forwards.append(len(cu_seqlens) - 1)
        return positions(cu_seqlens)

    monkeypatch.setattr(packed_attention, "packed_positions", counted)
    report = packing.run_benchmark(TINY)
    arms = {arm["arm"]: arm for arm in report["arms"]}
    assert list(arms) == ["rows", "token budget", "packed"]
    rows, budget, packed = arms["rows"], arms["token budget"], arms["packed"]
    assert rows["padding_frac"] > budget["padding_frac"] > packed["padding_frac"] == 0
    assert packed["positions"] == report["tokens"] < budget["positions"] < rows["positions"]
    assert rows["passes"] == 4 and packed["passes"] < budget["passes"]
    assert all(len(a["round_seconds"]) == 2 and a["step_seconds"] > 0 for a in arms.values())
    assert rows["vs_rows"] == 1.0
    # the packed arm's passes (of several sequences) and only they reached packed attention:
    # 2 rounds x (warm-up + 1 step) x forward, per pass
    assert len(packed_forwards) == 2 * 2 * packed["passes"] and max(packed_forwards) > 1


@pytest.mark.timeout(120)
def test_the_cli_writes_the_report(tmp_path, monkeypatch):
    monkeypatch.setattr(packing, "PackingSpec", lambda **given: replace(TINY, **given))
    out = tmp_path / "bench"
    args = ["bench", "packing", "--rounds", "1", "--steps", "1", "--layers", "1"]
    assert main([*args, "--out", str(out)]) == 0
    report = json.loads((out / "packing.json").read_text())
    assert [a["arm"] for a in report["arms"]] == ["rows", "token budget", "packed"]
    assert "| packed |" in (out / "packing.md").read_text()


@pytest.mark.timeout(30)
def test_lengths_that_leave_no_response_are_refused():
    with pytest.raises(ValueError, match="prompt 16 < shortest 10"):
        PackingSpec(shortest=10)
