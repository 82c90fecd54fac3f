"""`megatron-rl bench experts` at a tiny shape on CPU: every shape runs grouped and as the loop
(grouped_mm called only by the grouped arms), interleaved rounds are kept, equal active
parameters hold, and a shape that cannot give them is refused."""

from __future__ import annotations

import json
from dataclasses import replace

import pytest
import torch.nn.functional as F

from megatron_rl.bench import expert_scaling
from megatron_rl.bench.expert_scaling import ExpertScalingSpec
from megatron_rl.cli import main
from megatron_rl.models import grouped_experts

TINY = ExpertScalingSpec(
    shapes=((2, 2), (8, 4)),
    active_ffn=16,
    layers=1,
    hidden=32,
    heads=2,
    kv_heads=1,
    vocab=128,
    seq=8,
    micro_batch=2,
    micro_batches=1,
    steps=1,
    rounds=2,
)


def test_every_shape_runs_grouped_and_as_the_loop(monkeypatch):
    calls, grouped_mm = [], F.grouped_mm

    def counted_grouped_mm(*args, **kwargs):
        calls.append(kwargs["offs"].numel())
        return grouped_mm(*args, **kwargs)

    monkeypatch.setattr(grouped_experts.F, "grouped_mm", counted_grouped_mm)
    report = expert_scaling.run_benchmark(TINY)
    arms = report["arms"]
    assert [(a["experts"], a["grouped_experts"]) for a in arms] == [
        (2, True),
        (2, False),
        (8, True),
        (8, False),
    ]
    assert all(a["topk"] * a["moe_ffn"] == 16 for a in arms)
    assert all(len(a["round_seconds"]) == 2 and a["step_seconds"] > 0 for a in arms)
    assert arms[0]["vs_first_grouped"] == 1.0
    assert arms[2]["parameters"] > arms[0]["parameters"] == arms[1]["parameters"]
    # only the grouped arms' experts (2 and 8 per layer) went through grouped_mm
    assert set(calls) == {2, 8}
    assert report["tokens_per_step"] == 16


def test_the_cli_writes_the_report(tmp_path, monkeypatch):
    # one shape: each arm's process groups keep their descriptors open (gloo) until the end
    one_shape = replace(TINY, shapes=((8, 4),))
    monkeypatch.setattr(
        expert_scaling, "ExpertScalingSpec", lambda **given: replace(one_shape, **given)
    )
    out = tmp_path / "bench"
    args = ["bench", "experts", "--rounds", "1", "--steps", "1", "--seq", "8", "--layers", "1"]
    assert main([*args, "--out", str(out)]) == 0
    report = json.loads((out / "expert_scaling.json").read_text())
    assert len(report["arms"]) == 2 and report["spec"]["rounds"] == 1
    table = (out / "expert_scaling.md").read_text()
    assert "| 8 experts top-4, loop | 4 |" in table


@pytest.mark.parametrize(
    ("shapes", "active_ffn", "match"),
    [((), 32, "at least one"), (((4, 8),), 32, "top-k 8 of 4"), (((8, 3),), 32, "multiple")],
)
def test_shapes_without_equal_active_parameters_are_refused(shapes, active_ffn, match):
    with pytest.raises(ValueError, match=match):
        ExpertScalingSpec(shapes=shapes, active_ffn=active_ffn)
