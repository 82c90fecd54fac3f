"""Benchmark: checkpoint conversion in both directions against `cp` of the same bytes.

A synthetic Qwen3-MoE-shaped Hugging Face checkpoint (random bfloat16 weights, about 2 GB by
default) is written first. Then, in one run: `cp -r` of it (the baseline; also `cp -r && sync`,
since megatron-core's checkpoint writer fsyncs what it writes), `convert hf-to-mcore`,
`convert mcore-to-hf`, each in a fresh process whose peak resident memory (VmHWM) is read at its
end. Targets: each conversion takes at most 3x the copy time, with peak memory below 2x the
largest safetensors shard.
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from megatron_rl.bench.report import machine, now, resident_kib
from megatron_rl.bench.report import write_report as report_files
from megatron_rl.checkpoint.hf_files import TensorSpec, write_safetensors_shards
from megatron_rl.models.config import MoEModelConfig
from megatron_rl.models.families import qwen3_moe
from megatron_rl.models.families.base import bind_rules
from megatron_rl.models.hf_weights import expected_hf_shapes


@dataclass(frozen=True)
class ConvertBenchSpec:
    num_layers: int = 24
    hidden_size: int = 1024
    num_experts: int = 32
    moe_ffn_hidden_size: int = 384
    vocab_size: int = 32_000
    max_shard_mib: int = 5 * 1024  # Hugging Face's usual 5 GB shards


def synthetic_config(spec: ConvertBenchSpec) -> MoEModelConfig:
    return MoEModelConfig(
        num_layers=spec.num_layers,
        hidden_size=spec.hidden_size,
        num_attention_heads=16,
        num_query_groups=4,
        head_dim=64,
        ffn_hidden_size=4 * spec.hidden_size,
        moe_ffn_hidden_size=spec.moe_ffn_hidden_size,
        num_experts=spec.num_experts,
        router_topk=4,
        qk_layernorm=True,
        vocab_size=spec.vocab_size,
        dtype="bfloat16",
    )


def write_synthetic_checkpoint(spec: ConvertBenchSpec, directory: Path) -> int:
    """A random Hugging Face checkpoint of the spec's shape; returns its weight bytes."""
    config = synthetic_config(spec)
    directory.mkdir(parents=True)
    gen = torch.Generator().manual_seed(0)

    specs = [
        TensorSpec(name, hf_shape, torch.bfloat16)
        for rule in bind_rules(qwen3_moe.FAMILY, config).values()
        for name, hf_shape in zip(
            rule.hf,
            expected_hf_shapes(rule, _megatron_shape(rule.megatron, config), config),
            strict=True,
        )
    ]
    tensors = (
        (s.name, (torch.randn(s.shape, generator=gen) * 0.02).to(torch.bfloat16)) for s in specs
    )
    write_safetensors_shards(directory, specs, tensors, max_shard_bytes=spec.max_shard_mib * 2**20)
    hf_config = qwen3_moe.FAMILY.config_to_hf(config)
    (directory / "config.json").write_text(json.dumps(hf_config, indent=2))
    return sum(p.stat().st_size for p in directory.glob("*.safetensors"))


def _megatron_shape(name: str, config: MoEModelConfig) -> tuple[int, ...]:
    hidden, head = config.hidden_size, config.kv_channels
    if name.endswith("linear_qkv.weight"):
        return ((config.num_attention_heads + 2 * config.num_query_groups) * head, hidden)
    if name.endswith("linear_proj.weight"):
        return (hidden, config.num_attention_heads * head)
    if name.endswith("layernorm.weight") and "self_attention" in name:
        return (head,)
    if name.endswith("norm.weight"):
        return (hidden,)
    if name.endswith("router.weight"):
        return (config.num_experts, hidden)
    if name.endswith("linear_fc1.weight"):
        return (2 * config.moe_ffn_hidden_size, hidden)
    if name.endswith("linear_fc2.weight"):
        return (hidden, config.moe_ffn_hidden_size)
    return (config.vocab_size, hidden)  # embedding, output layer


def _timed(command: list[str]) -> dict[str, float]:
    start = time.perf_counter()
    done = subprocess.run(command, capture_output=True, text=True)
    seconds = time.perf_counter() - start
    if done.returncode != 0:
        raise RuntimeError(f"{command[:4]} failed:\n{done.stderr[-3000:]}")
    report = {"seconds": seconds}
    last = done.stdout.strip().splitlines()[-1] if done.stdout.strip() else ""
    if last.startswith("{"):
        report |= json.loads(last)
    return report


def run_benchmark(spec: ConvertBenchSpec, workdir: Path) -> dict[str, object]:
    if workdir.exists():
        shutil.rmtree(workdir)
    hf_dir = workdir / "hf"
    weight_bytes = write_synthetic_checkpoint(spec, hf_dir)
    largest_shard = max(p.stat().st_size for p in hf_dir.glob("*.safetensors"))
    subprocess.run(["sync"], check=True)  # start every timing with nothing left to flush
    steps = {"cp": _timed(["cp", "-r", str(hf_dir), str(workdir / "hf-copy")])}
    # megatron-core's checkpoint writer fsyncs its files, cp does not: a durable copy too
    steps["cp+sync"] = _timed(["sh", "-c", f"cp -r '{hf_dir}' '{workdir / 'hf-copy-2'}' && sync"])
    subprocess.run(["sync"], check=True)
    me = [sys.executable, "-m", "megatron_rl.bench.convert", "--step"]
    steps["hf-to-mcore"] = _timed(
        [*me, "convert", "hf-to-mcore", "--hf", str(hf_dir), "--out", str(workdir / "mcore")]
    )
    steps["mcore-to-hf"] = _timed(
        [
            *me,
            "convert",
            "mcore-to-hf",
            "--ckpt",
            str(workdir / "mcore"),
            "--out",
            str(workdir / "hf-back"),
            "--max-shard-mib",
            str(spec.max_shard_mib),
        ]
    )
    copy = steps["cp"]["seconds"]
    report = {
        "spec": asdict(spec),
        "weight_bytes": weight_bytes,
        "largest_shard_bytes": largest_shard,
        "steps": steps,
        "time_vs_copy": {k: steps[k]["seconds"] / copy for k in ("hf-to-mcore", "mcore-to-hf")},
        "time_vs_durable_copy": {
            k: steps[k]["seconds"] / steps["cp+sync"]["seconds"]
            for k in ("hf-to-mcore", "mcore-to-hf")
        },
        "peak_vs_largest_shard": {
            k: steps[k]["peak_rss_kib"] * 1024 / largest_shard
            for k in ("hf-to-mcore", "mcore-to-hf")
        },
        "machine": machine(),
        "date": now(),
    }
    shutil.rmtree(workdir)
    return report


def format_markdown(report: dict) -> str:
    steps = report["steps"]
    lines = [
        f"Synthetic Qwen3-MoE checkpoint, {report['weight_bytes'] / 2**30:.2f} GiB of bfloat16 "
        f"weights, largest shard {report['largest_shard_bytes'] / 2**30:.2f} GiB; "
        f"{report['machine']['cpu']}, {report['machine']['cores']} cores, {report['date']}.",
        "",
        "| step | time (s) | x cp | x (cp + sync) | peak RSS (GiB) | x largest shard |",
        "|---|---|---|---|---|---|",
        f"| cp -r | {steps['cp']['seconds']:.1f} | 1.00 | | | |",
        f"| cp -r && sync | {steps['cp+sync']['seconds']:.1f} | | 1.00 | | |",
    ]
    for step in ("hf-to-mcore", "mcore-to-hf"):
        peak = steps[step]["peak_rss_kib"] / 2**20
        lines.append(
            f"| {step} | {steps[step]['seconds']:.1f} | {report['time_vs_copy'][step]:.2f} | "
            f"{report['time_vs_durable_copy'][step]:.2f} | {peak:.2f} | "
            f"{report['peak_vs_largest_shard'][step]:.2f} |"
        )
    return "\n".join(lines)


def write_report(report: dict, out_dir: Path) -> tuple[Path, Path]:
    return report_files(report, out_dir, "convert", format_markdown)


def _step_main() -> None:
    """Run one CLI command in this process, then print its peak resident memory."""
    parser = argparse.ArgumentParser()
    parser.add_argument("--step", nargs=argparse.REMAINDER, required=True)
    args = parser.parse_args()
    from megatron_rl.cli import main

    code = main(args.step)
    if code != 0:
        sys.exit(code)
    print(json.dumps({"peak_rss_kib": resident_kib("VmHWM")}))


if __name__ == "__main__":
    _step_main()
