"""Benchmark: log-probs + entropy, forward and backward, chunked kernel vs. the naive way.

Naive: `torch.log_softmax(logits.float(), -1)`, gather the target, entropy from the full
probabilities; autograd keeps the float32 copy and the log-softmax output. Ours:
`vocab_parallel_logprobs` (one rank here, so no reductions), which keeps only the logits and walks
the tokens in chunks. Each variant runs in a fresh process, so that its peak resident memory
(the kernel's high-water mark, VmHWM) is its own; memory is reported above the process's resident
size once the logits exist, so it includes the logits' gradient, which both variants produce.
Time is the median of the timed repeats after one warm-up. On CUDA (`device="cuda"`) memory is
torch's allocation peak above the logits instead, and each variant is also set against the
memory-bandwidth floor: the logits read in the forward, read again in the backward and their
gradient written (3 x the logits' bytes) at the copy bandwidth measured in the same process.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from megatron_rl.bench.report import machine, now, reset_peak, resident_kib
from megatron_rl.bench.report import write_report as report_files
from megatron_rl.parallel.logprobs import vocab_parallel_logprobs

VARIANTS = ("naive", "chunked")


@dataclass(frozen=True)
class LogprobBenchSpec:
    tokens: int = 4096
    vocab: int = 151_936  # Qwen3's vocabulary
    dtype: str = "bfloat16"
    repeats: int = 3
    chunk_tokens: int | None = None  # None: the kernel's default for the device
    threads: int = 0  # 0: torch's default
    device: str = "cpu"  # or "cuda"


def _naive(logits: torch.Tensor, targets: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    log_probs = torch.log_softmax(logits.float(), dim=-1)
    logp = log_probs.gather(-1, targets[:, None]).squeeze(-1)
    entropy = -(log_probs.exp() * log_probs).sum(-1)
    return logp, entropy


def run_variant(variant: str, spec: LogprobBenchSpec) -> dict[str, float]:
    """Time and peak memory of one variant in this process."""
    if spec.threads:
        torch.set_num_threads(spec.threads)
    device = torch.device(spec.device)
    gen = torch.Generator().manual_seed(0)
    dtype = {"bfloat16": torch.bfloat16, "float32": torch.float32}[spec.dtype]
    logits = (torch.randn(spec.tokens, spec.vocab, generator=gen) * 2).to(device, dtype)
    logits.requires_grad_(True)
    targets = torch.randint(0, spec.vocab, (spec.tokens,), generator=gen).to(device)
    weights = torch.randn(2, spec.tokens, generator=gen).to(device)
    cuda = device.type == "cuda"

    def step(logits: torch.Tensor, targets: torch.Tensor, weights: torch.Tensor) -> None:
        if variant == "naive":
            logp, entropy = _naive(logits, targets)
        else:
            logp, entropy = vocab_parallel_logprobs(logits, targets, chunk_tokens=spec.chunk_tokens)
        (weights[0] * logp + weights[1] * entropy).sum().backward()
        logits.grad = None

    # A small call first loads kernels and thread pools, which are not the variant's memory.
    small = logits[:8, :64].detach().clone().requires_grad_(True)
    step(small, targets[:8] % 64, weights[:, :8])
    if cuda:
        torch.cuda.synchronize(device)
        torch.cuda.reset_peak_memory_stats(device)
        baseline = torch.cuda.memory_allocated(device) / 1024
    else:
        baseline = resident_kib("VmRSS")
        reset_peak()
    step(logits, targets, weights)  # warm-up (in the memory window: allocators keep memory)
    seconds = []
    for _ in range(spec.repeats):
        if cuda:
            torch.cuda.synchronize(device)
        start = time.perf_counter()
        step(logits, targets, weights)
        if cuda:
            torch.cuda.synchronize(device)
        seconds.append(time.perf_counter() - start)
    peak = torch.cuda.max_memory_allocated(device) / 1024 if cuda else resident_kib("VmHWM")
    logits_bytes = logits.numel() * logits.element_size()
    return {
        "seconds_median": statistics.median(seconds),
        "seconds_all": seconds,
        "peak_extra_mib": (peak - baseline) / 1024,
        "logits_mib": logits_bytes / 2**20,
        "floor_seconds": 3 * logits_bytes / copy_bandwidth(logits.detach(), cuda),
    }


def copy_bandwidth(tensor: torch.Tensor, cuda: bool, repeats: int = 5) -> float:
    """Bytes per second a copy of `tensor` moves (read and written), the best of `repeats`."""
    target = torch.empty_like(tensor)
    best = float("inf")
    for _ in range(repeats + 1):  # the first warms up
        if cuda:
            torch.cuda.synchronize(tensor.device)
        start = time.perf_counter()
        target.copy_(tensor)
        if cuda:
            torch.cuda.synchronize(tensor.device)
        best = min(best, time.perf_counter() - start)
    return 2 * tensor.numel() * tensor.element_size() / best


def run_benchmark(spec: LogprobBenchSpec) -> dict[str, object]:
    """Both variants, each in a fresh process; returns the figures and the machine."""
    results = {}
    for variant in VARIANTS:
        command = [
            sys.executable,
            "-m",
            "megatron_rl.bench.logprobs",
            "--variant",
            variant,
            "--spec",
            json.dumps(asdict(spec)),
        ]
        done = subprocess.run(command, capture_output=True, text=True)
        if done.returncode != 0:
            raise RuntimeError(f"benchmark variant {variant!r} failed:\n{done.stderr[-3000:]}")
        results[variant] = json.loads(done.stdout.strip().splitlines()[-1])
    naive, chunked = results["naive"], results["chunked"]
    return {
        "spec": asdict(spec),
        "results": results,
        "memory_ratio": naive["peak_extra_mib"] / max(chunked["peak_extra_mib"], 1e-9),
        "time_ratio": chunked["seconds_median"] / naive["seconds_median"],
        "machine": machine() | {"threads": spec.threads or torch.get_num_threads()},
        "date": now(),
    }


def format_markdown(report: dict) -> str:
    spec, results = report["spec"], report["results"]
    lines = [
        f"Log-probs + entropy, forward + backward, {spec['tokens']} tokens x vocab "
        f"{spec['vocab']} ({spec['dtype']} logits, {results['naive']['logits_mib']:.0f} MiB), "
        f"median of {spec['repeats']}, chunk {spec['chunk_tokens'] or 'default'} tokens; "
        f"{report['machine']['cpu']}, {report['machine']['cores']} cores, torch "
        f"{report['machine']['torch']}, {report['date']}.",
        "",
        "| variant | time (s) | x the memory-bandwidth floor | peak memory above logits (MiB) |",
        "|---|---|---|---|",
    ]
    for variant in VARIANTS:
        row = results[variant]
        lines.append(
            f"| {variant} | {row['seconds_median']:.4f} | "
            f"{row['seconds_median'] / row['floor_seconds']:.1f} | {row['peak_extra_mib']:.0f} |"
        )
    lines += [
        "",
        f"Peak memory: naive / chunked = {report['memory_ratio']:.2f}x; "
        f"time: chunked / naive = {report['time_ratio']:.2f}x. The floor: 3 x the logits' bytes "
        f"(read, read again, gradient written) at the copy bandwidth on {spec['device']} "
        f"({results['chunked']['floor_seconds'] * 1e3:.2f} ms).",
    ]
    return "\n".join(lines)


def write_report(report: dict, out_dir: Path) -> tuple[Path, Path]:
    return report_files(report, out_dir, "logprobs", format_markdown)


def _worker_main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--variant", choices=VARIANTS, required=True)
    parser.add_argument("--spec", required=True)
    args = parser.parse_args()
    spec = LogprobBenchSpec(**json.loads(args.spec))
    print(json.dumps(run_variant(args.variant, spec)))


if __name__ == "__main__":
    _worker_main()
