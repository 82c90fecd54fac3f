"""Benchmark: a training step with R2 routing replay against the same step without it.

A step is what GRPO + R2 does per batch: the old-policy forward over all micro-batches (with R2 it
records the routing), then forward + backward of the policy loss (with R2 replaying it). Each
model depth runs in a fresh process holding both modes' models (same weights), whose steps
alternate in pairs, first one mode first and then the other, so that the shared machine's drift
hits both alike. Reported: median step time of each mode; the overhead as the median over pairs
of (R2 / none - 1), with a bootstrap 95% interval; the peak of the bytes torch allocates during
one (profiled, untimed) step, counted allocation by allocation, whose difference between the
modes is the memory replay costs, next to the bytes the recorded routing holds (layers x tokens x
topk x 8 bytes, for all micro-batches of the step).
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

from megatron_rl.bench.report import allocation_peak, machine, median_interval, now
from megatron_rl.bench.report import write_report as report_files
from megatron_rl.models.config import MoEModelConfig
from megatron_rl.moe.replay_mode import RoutingReplayMode

NONE, R2 = RoutingReplayMode.NONE, RoutingReplayMode.R2
MODES = (NONE, R2)


@dataclass(frozen=True)
class ReplayBenchSpec:
    layers: tuple[int, ...] = (2, 16)
    micro_batches: int = 4
    batch: int = 4
    seq: int = 256
    pairs: int = 20


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


def _arms(config: MoEModelConfig) -> tuple[dict, dict]:
    """Per mode, the DDP-wrapped model (the same weights in both; only R2's built for replay)
    and its routing replay (None without)."""
    from megatron_rl.models.build import build_gpt_moe
    from megatron_rl.moe.replay import RoutingReplay
    from megatron_rl.parallel.dims import ParallelDims
    from megatron_rl.trainer.optimizer import wrap_for_training

    dims = ParallelDims(world_size=1)
    models = {mode: build_gpt_moe(config, dims, routing_replay=mode.replays) for mode in MODES}
    models[R2].load_state_dict(models[NONE].state_dict())
    # one rank and no optimizer: the plain DDP buffers suffice
    ddps = {m: wrap_for_training(model, distributed_optimizer=False) for m, model in models.items()}
    return ddps, {NONE: None, R2: RoutingReplay(models[R2])}


def _micro_batches(spec: ReplayBenchSpec, vocab_size: int) -> list:
    from megatron_rl.trainer.micro_batch import PolicyMicroBatch

    gen = torch.Generator().manual_seed(0)
    shape = (spec.batch, spec.seq)
    return [
        PolicyMicroBatch(
            tokens=torch.randint(0, vocab_size, shape, generator=gen),
            loss_mask=torch.ones(shape, dtype=torch.bool),
            old_logp=torch.full(shape, -7.0),
            advantages=torch.randn(spec.batch, generator=gen),
        )
        for _ in range(spec.micro_batches)
    ]


def run_depth(layers: int, spec: ReplayBenchSpec) -> dict[str, object]:
    """Both modes on one model depth, in this process: two models with the same weights, one
    built for replay, stepped in alternating order (ABBA) so that drift hits both alike."""
    from megatron_rl.moe.drift import routing_bytes
    from megatron_rl.parallel.dims import ParallelDims
    from megatron_rl.parallel.distributed import LaunchEnv, init_distributed
    from megatron_rl.trainer.schedule import (
        PolicyLossSpec,
        old_policy_pass,
        policy_forward_backward,
    )

    init_distributed(ParallelDims(world_size=1), LaunchEnv.from_environ({}))
    config = bench_model(layers)
    ddps, replays = _arms(config)
    batches, loss = (
        _micro_batches(spec, config.vocab_size),
        PolicyLossSpec.of("grpo", clip_low=0.2, clip_high=0.27),
    )
    recorded: dict = {}  # per mode, the micro-batches with the routing its last old pass recorded

    def old_pass(mode: RoutingReplayMode) -> None:
        recorded.pop(mode, None)
        computed = old_policy_pass(ddps[mode], batches, replay=replays[mode], record_routing=True)
        pairs = zip(batches, computed, strict=True)
        recorded[mode] = [replace(batch, routing=old.routing) for batch, old in pairs]

    def train_pass(mode: RoutingReplayMode) -> None:
        ddps[mode].zero_grad_buffer()
        policy_forward_backward(ddps[mode], recorded[mode], loss, replay=replays[mode])

    def step(mode: RoutingReplayMode) -> float:
        start = time.perf_counter()
        old_pass(mode)
        train_pass(mode)
        return time.perf_counter() - start

    result: dict[str, object] = {}
    for mode in MODES:
        step(mode)  # warm-up
        # Counted allocation by allocation: what the old pass leaves allocated (R2: its routing
        # record), and the step's peak, which is the old pass's or the training pass's on top.
        old_peak, kept = allocation_peak(lambda mode=mode: old_pass(mode))
        train_peak, _ = allocation_peak(lambda mode=mode: train_pass(mode))
        result[f"allocated_peak_bytes_{mode}"] = max(old_peak, kept + train_peak)
        result[f"kept_after_old_pass_bytes_{mode}"] = kept
    result["routing_bytes"] = routing_bytes([t for b in recorded[R2] for t in b.routing])
    seconds: dict[str, list[float]] = {str(mode): [] for mode in MODES}
    for pair in range(spec.pairs):
        for mode in MODES if pair % 2 == 0 else MODES[::-1]:
            seconds[mode].append(step(mode))
    result["seconds"] = seconds
    return result


def run_benchmark(spec: ReplayBenchSpec) -> dict[str, object]:
    runs = {}
    for layers in spec.layers:
        command = [
            sys.executable,
            "-m",
            "megatron_rl.bench.replay",
            "--layers",
            str(layers),
            "--spec",
            json.dumps(asdict(spec)),
        ]
        done = subprocess.run(command, capture_output=True, text=True)
        if done.returncode != 0:
            raise RuntimeError(f"replay bench, {layers} layers, failed:\n{done.stderr[-3000:]}")
        runs[str(layers)] = json.loads(done.stdout.strip().splitlines()[-1])
    summary = {}
    for layers, run in runs.items():
        none, r2 = (run["seconds"][mode] for mode in MODES)
        overheads = [b / a - 1 for a, b in zip(none, r2, strict=True)]
        low, high = median_interval(overheads)
        summary[layers] = {
            "tokens_per_step": spec.micro_batches * spec.batch * spec.seq,
            "seconds_none": statistics.median(none),
            "seconds_r2": statistics.median(r2),
            "time_overhead": statistics.median(overheads),
            "time_overhead_low": low,
            "time_overhead_high": high,
            "allocated_peak_bytes_none": run["allocated_peak_bytes_none"],
            "allocated_peak_bytes_r2": run["allocated_peak_bytes_r2"],
            "allocated_overhead_bytes": run["allocated_peak_bytes_r2"]
            - run["allocated_peak_bytes_none"],
            "kept_overhead_bytes": run["kept_after_old_pass_bytes_r2"]
            - run["kept_after_old_pass_bytes_none"],
            "routing_bytes": run["routing_bytes"],
        }
    return {
        "spec": asdict(spec),
        "summary": summary,
        "runs": runs,
        "machine": machine(),
        "date": now(),
    }


def format_markdown(report: dict) -> str:
    spec = report["spec"]
    lines = [
        f"Training step (old-policy forward + GRPO forward/backward), {spec['micro_batches']} "
        f"micro-batches of {spec['batch']} x {spec['seq']} tokens; {spec['pairs']} pairs of steps "
        f"(one per mode, alternating order), medians, the overhead's 95% interval by bootstrap; "
        f"{report['machine']['cpu']}, {report['machine']['cores']} cores, {report['date']}.",
        "",
        "| layers | step, no replay (s) | step, R2 (s) | time overhead (95% interval) | held from "
        "old pass to update, R2 - none (MiB) | recorded routing (MiB) | peak allocated, no "
        "replay / R2 (MiB) |",
        "|---|---|---|---|---|---|---|",
    ]
    mib = 2**20
    for layers, row in report["summary"].items():
        lines.append(
            f"| {layers} | {row['seconds_none']:.3f} | {row['seconds_r2']:.3f} | "
            f"{100 * row['time_overhead']:+.1f}% ({100 * row['time_overhead_low']:+.1f}% to "
            f"{100 * row['time_overhead_high']:+.1f}%) | {row['kept_overhead_bytes'] / mib:.4f} | "
            f"{row['routing_bytes'] / mib:.4f} | {row['allocated_peak_bytes_none'] / mib:.2f} / "
            f"{row['allocated_peak_bytes_r2'] / mib:.2f} |"
        )
    return "\n".join(lines)


def write_report(report: dict, out_dir: Path) -> tuple[Path, Path]:
    return report_files(report, out_dir, "replay", format_markdown)


def _worker_main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--layers", type=int, required=True)
    parser.add_argument("--spec", required=True)
    args = parser.parse_args()
    fields = json.loads(args.spec)
    spec = replace(ReplayBenchSpec(), **fields | {"layers": tuple(fields["layers"])})
    from megatron_rl.parallel.distributed import shutdown_distributed

    try:
        result = run_depth(args.layers, spec)
    finally:
        shutdown_distributed()  # a process group left alive can abort the interpreter's exit
    print(json.dumps(result))


if __name__ == "__main__":
    _worker_main()
