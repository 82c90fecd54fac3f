"""Benchmark: a training step with R2 routing replay against the same step without it.

A step is what GRPO + R2 does per batch: the old-policy forward over all micro-batches (with R2 it
records the routing), then forward + backward of the policy loss (with R2 replaying it). Each
(model, mode) runs in a fresh process; which mode runs first alternates over rounds, so that the
shared machine's drift hits both. Reported: median step time; the peak of the bytes torch
allocates during one (profiled, untimed) step, counted allocation by allocation, whose difference
between the modes is the memory replay costs, next to the bytes the recorded routing holds
(layers x tokens x topk x 8 bytes, for all micro-batches of the step); and, for reference, peak
resident memory during the timed steps above the resident size before them.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from dataclasses import asdict, dataclass, replace
from pathlib import Path

import torch

from megatron_rl.bench.report import allocation_peak, machine, now, reset_peak, resident_kib
from megatron_rl.bench.report import write_report as report_files
from megatron_rl.models.config import MoEModelConfig

MODES = ("none", "r2")


@dataclass(frozen=True)
class ReplayBenchSpec:
    layers: tuple[int, ...] = (2, 16)
    micro_batches: int = 4
    batch: int = 4
    seq: int = 256
    steps: int = 5
    rounds: int = 2


def bench_model(layers: int) -> MoEModelConfig:
    return MoEModelConfig(
        num_layers=layers,
        hidden_size=128,
        num_attention_heads=4,
        num_query_groups=2,
        head_dim=32,
        ffn_hidden_size=256,
        moe_ffn_hidden_size=128,
        num_experts=8,
        router_topk=2,
        vocab_size=1024,
    )


def run_mode(layers: int, mode: str, spec: ReplayBenchSpec) -> dict[str, float]:
    """Timed steps of one (model, mode) in this process."""
    from megatron_rl.models.build import build_gpt_moe, wrap_for_training
    from megatron_rl.moe.drift import routing_bytes
    from megatron_rl.moe.replay import RoutingReplay
    from megatron_rl.parallel.dims import ParallelDims
    from megatron_rl.parallel.distributed import LaunchEnv, init_distributed
    from megatron_rl.parallel.schedule import (
        PolicyLossSpec,
        PolicyMicroBatch,
        policy_forward_backward,
    )

    dims = ParallelDims(world_size=1)
    init_distributed(dims, LaunchEnv.from_environ({}))
    config = bench_model(layers)
    model = build_gpt_moe(config, dims, routing_replay=mode == "r2")
    ddp = wrap_for_training(model)
    replay = RoutingReplay(model) if mode == "r2" else None
    gen = torch.Generator().manual_seed(0)
    shape = (spec.batch, spec.seq)
    batches = [
        PolicyMicroBatch(
            tokens=torch.randint(0, config.vocab_size, shape, generator=gen),
            loss_mask=torch.ones(shape, dtype=torch.bool),
            old_logp=torch.full(shape, -7.0),
            advantages=torch.randn(spec.batch, generator=gen),
        )
        for _ in range(spec.micro_batches)
    ]
    loss = PolicyLossSpec("grpo", 0.2, 0.27)
    held = 0

    def clear() -> None:
        for batch in batches:
            batch.routing = None

    def old_pass() -> None:
        nonlocal held
        policy_forward_backward(
            ddp, batches, loss, forward_only=True, replay=replay, record_routing=True
        )
        if replay is not None:
            held = routing_bytes([t for b in batches for t in b.routing])

    def train_pass() -> None:
        ddp.zero_grad_buffer()
        policy_forward_backward(ddp, batches, loss, replay=replay)

    def step() -> None:
        clear()
        old_pass()
        train_pass()

    step()
    # Counted allocation by allocation: what the old pass leaves allocated (R2: its routing
    # record), and the step's peak, which is the old pass's or the training pass's on top of it.
    clear()
    old_peak, kept = allocation_peak(old_pass)
    train_peak, _ = allocation_peak(train_pass)
    baseline = resident_kib("VmRSS")
    reset_peak()
    seconds = []
    for _ in range(spec.steps):
        start = time.perf_counter()
        step()
        seconds.append(time.perf_counter() - start)
    return {
        "seconds_median": statistics.median(seconds),
        "peak_extra_kib": resident_kib("VmHWM") - baseline,
        "allocated_peak_bytes": max(old_peak, kept + train_peak),
        "kept_after_old_pass_bytes": kept,
        "routing_bytes": held,
    }


def run_benchmark(spec: ReplayBenchSpec) -> dict[str, object]:
    results: dict[str, dict[str, list]] = {}
    for round_index in range(spec.rounds):
        # alternate which mode runs first, so that drift over time does not favour one
        order = MODES if round_index % 2 == 0 else MODES[::-1]
        for layers in spec.layers:
            for mode in order:
                command = [
                    sys.executable,
                    "-m",
                    "megatron_rl.bench.replay",
                    "--layers",
                    str(layers),
                    "--mode",
                    mode,
                    "--spec",
                    json.dumps(asdict(spec)),
                ]
                done = subprocess.run(command, capture_output=True, text=True)
                if done.returncode != 0:
                    raise RuntimeError(
                        f"replay bench {layers}/{mode} failed:\n{done.stderr[-3000:]}"
                    )
                row = json.loads(done.stdout.strip().splitlines()[-1])
                results.setdefault(f"{layers}/{mode}", {}).setdefault("runs", []).append(row)
    summary = {}
    for layers in spec.layers:
        base, r2 = (results[f"{layers}/{mode}"]["runs"] for mode in MODES)
        base_time = statistics.median(r["seconds_median"] for r in base)
        r2_time = statistics.median(r["seconds_median"] for r in r2)
        summary[str(layers)] = {
            "tokens_per_step": spec.micro_batches * spec.batch * spec.seq,
            "seconds_none": base_time,
            "seconds_r2": r2_time,
            "time_overhead": r2_time / base_time - 1,
            "peak_extra_kib_none": statistics.median(r["peak_extra_kib"] for r in base),
            "peak_extra_kib_r2": statistics.median(r["peak_extra_kib"] for r in r2),
            "allocated_peak_bytes_none": base[0]["allocated_peak_bytes"],
            "allocated_peak_bytes_r2": r2[0]["allocated_peak_bytes"],
            "allocated_overhead_bytes": r2[0]["allocated_peak_bytes"]
            - base[0]["allocated_peak_bytes"],
            "kept_overhead_bytes": r2[0]["kept_after_old_pass_bytes"]
            - base[0]["kept_after_old_pass_bytes"],
            "routing_bytes": r2[0]["routing_bytes"],
        }
    return {
        "spec": asdict(spec),
        "summary": summary,
        "runs": results,
        "machine": machine(),
        "date": now(),
    }


def format_markdown(report: dict) -> str:
    spec = report["spec"]
    lines = [
        f"Training step (old-policy forward + GRPO forward/backward), {spec['micro_batches']} "
        f"micro-batches of {spec['batch']} x {spec['seq']} tokens, median of {spec['steps']} steps "
        f"x {spec['rounds']} rounds; {report['machine']['cpu']}, {report['machine']['cores']} "
        f"cores, {report['date']}.",
        "",
        "| layers | step, no replay (s) | step, R2 (s) | time overhead | held from old pass to "
        "update, R2 - none (MiB) | recorded routing (MiB) | peak allocated, no replay / R2 (MiB) "
        "| peak RSS above start, no replay / R2 (MiB) |",
        "|---|---|---|---|---|---|---|---|",
    ]
    mib = 2**20
    for layers, row in report["summary"].items():
        lines.append(
            f"| {layers} | {row['seconds_none']:.3f} | {row['seconds_r2']:.3f} | "
            f"{100 * row['time_overhead']:+.1f}% | {row['kept_overhead_bytes'] / mib:.4f} | "
            f"{row['routing_bytes'] / mib:.4f} | {row['allocated_peak_bytes_none'] / mib:.2f} / "
            f"{row['allocated_peak_bytes_r2'] / mib:.2f} | "
            f"{row['peak_extra_kib_none'] / 1024:.1f} / {row['peak_extra_kib_r2'] / 1024:.1f} |"
        )
    return "\n".join(lines)


def write_report(report: dict, out_dir: Path) -> tuple[Path, Path]:
    return report_files(report, out_dir, "replay", format_markdown)


def _worker_main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--layers", type=int, required=True)
    parser.add_argument("--mode", choices=MODES, required=True)
    parser.add_argument("--spec", required=True)
    args = parser.parse_args()
    fields = json.loads(args.spec)
    spec = replace(ReplayBenchSpec(), **fields | {"layers": tuple(fields["layers"])})
    from megatron_rl.parallel.distributed import shutdown_distributed

    try:
        result = run_mode(args.layers, args.mode, spec)
    finally:
        shutdown_distributed()  # a process group left alive can abort the interpreter's exit
    print(json.dumps(result))


if __name__ == "__main__":
    _worker_main()
