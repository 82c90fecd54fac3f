"""`megatron-rl bench train-step` at a tiny shape on CPU (the figures come from a GPU run,
scripts/gpu_bench.sh): it trains, reports throughput and MFU against the matmul peak it
measured, and its FLOP formula's matmul part equals torch's FLOP counter on the built model."""

from __future__ import annotations

import json

import torch
from torch.utils.flop_counter import FlopCounterMode

from megatron_rl.bench.train_step import TrainStepSpec, matmul_parameters
from megatron_rl.cli import main
from megatron_rl.models.build import build_gpt_moe
from megatron_rl.models.grouped_experts import GroupedSequentialMLP
from megatron_rl.parallel.dims import ParallelDims
from megatron_rl.parallel.distributed import LaunchEnv, init_distributed, shutdown_distributed

TINY = TrainStepSpec(
    layers=2,
    hidden=64,
    heads=4,
    kv_heads=2,
    experts=4,
    topk=2,
    moe_ffn=32,
    vocab=512,
    seq=16,
    micro_batch=2,
    micro_batches=2,
    steps=2,
    dtype="float32",
    matmul_size=256,
)


def test_matmul_flops_per_token_equal_torchs_count(monkeypatch):
    # torch 2.13's FlopCounterMode counts no flops for grouped_mm: the experts run as
    # megatron-core's loop here (the same matmuls, tests/models/test_grouped_experts.py).
    monkeypatch.setattr(GroupedSequentialMLP, "_groups", lambda self: False)
    model = TINY.model()
    init_distributed(ParallelDims(world_size=1), LaunchEnv.from_environ({}))
    try:
        gpt = build_gpt_moe(model, ParallelDims(world_size=1))
        tokens = torch.randint(0, TINY.vocab, (TINY.micro_batch, TINY.seq))
        positions = torch.arange(TINY.seq).expand(TINY.micro_batch, -1)
        with FlopCounterMode(display=False) as counter, torch.no_grad():
            gpt(tokens, positions, attention_mask=None)
    finally:
        shutdown_distributed()
    counted = counter.get_total_flops()
    # The local attention computes the whole QK^T and AV (causal masking after): 2 x 2 x seq x q
    # per token and layer, where the formula counts the causal half.
    query = model.num_attention_heads * model.kv_channels
    attention = 4 * model.num_layers * TINY.seq * query * TINY.micro_batch * TINY.seq
    assert counted - attention == 2 * matmul_parameters(model) * TINY.micro_batch * TINY.seq


def test_the_benchmark_trains_and_reports_mfu(tmp_path, capsys):
    out = tmp_path / "bench"
    args = ["bench", "train-step", "--layers", "2", "--hidden", "64", "--heads", "4"]
    args += ["--kv-heads", "2", "--experts", "4", "--topk", "2", "--moe-ffn", "32"]
    args += ["--vocab", "512", "--seq", "16", "--micro-batch", "2", "--micro-batches", "2"]
    args += ["--steps", "2", "--dtype", "float32", "--matmul-size", "256", "--out", str(out)]
    assert main(args) == 0
    report = json.loads((out / "train_step.json").read_text())
    assert report["device"] == "cpu" and len(report["step_seconds"]) == 2
    assert report["tokens_per_step"] == 2 * 2 * 16
    assert report["tokens_per_second"] > 0 and report["matmul_peak_flops"] > 0
    assert 0 < report["mfu"] < 1
    assert "| MFU |" in (out / "train_step.md").read_text() and "MFU" in capsys.readouterr().out
