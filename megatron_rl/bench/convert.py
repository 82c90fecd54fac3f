"""Benchmark: checkpoint conversion in both directions against `cp` of the same bytes.

A synthetic Qwen3-MoE-shaped Hugging Face checkpoint (random bfloat16 weights, about 2 GB by
default) is written first. Then, in one run, each step a fresh process started with nothing left
to flush: three copies of it (see COPIES), then `megatron-rl convert hf-to-mcore` and
`megatron-rl convert mcore-to-hf`, with the peak resident memory of each. Targets: each
conversion takes at most 3x the copy time, with peak memory below 2x the largest safetensors
shard.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from megatron_rl.bench.report import machine, now
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


def _cli() -> str:
    """The `megatron-rl` console script of this environment: the command users run."""
    script = Path(sys.executable).with_name("megatron-rl")
    if not script.is_file():
        raise RuntimeError(f"{script} not found; install megatron-rl into this environment")
    return str(script)


def _timed(command: list[str]) -> dict[str, float]:
    """Wall time and peak resident memory (of its largest process) of `command`, started after
    everything earlier was flushed to the disk, so that a step pays only for its own writes."""
    subprocess.run(["sync"], check=True)
    with tempfile.TemporaryFile() as stderr:
        start = time.perf_counter()
        child = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=stderr)
        _, status, usage = os.wait4(child.pid, 0)
        seconds = time.perf_counter() - start
        child.returncode = os.waitstatus_to_exitcode(status)
        if child.returncode != 0:
            stderr.seek(0)
            tail = stderr.read().decode(errors="replace")[-3000:]
            raise RuntimeError(f"{command[:4]} failed ({child.returncode}):\n{tail}")
    return {"seconds": seconds, "peak_rss_kib": usage.ru_maxrss}  # Linux: KiB


# The copies the conversions are compared with. cp (coreutils 9) copies inside the kernel
# (copy_file_range); a converter reads and writes the bytes through user space, as
# `cp --reflink=never` does. Megatron-core's checkpoint writer and mcore-to-hf fsync their
# files, so each copy is also timed until it is on the disk.
COPIES = {
    "cp": "cp -r '{src}' '{dst}'",
    "cp+sync": "cp -r '{src}' '{dst}' && sync",
    "cp-user+sync": "cp -r --reflink=never '{src}' '{dst}' && sync",
}
COPY_LABELS = {
    "cp": "cp -r",
    "cp+sync": "cp -r && sync",
    "cp-user+sync": "cp -r --reflink=never && sync",
}
CONVERSIONS = ("hf-to-mcore", "mcore-to-hf")


def run_benchmark(spec: ConvertBenchSpec, workdir: Path) -> dict[str, object]:
    if workdir.exists():
        shutil.rmtree(workdir)
    hf_dir = workdir / "hf"
    weight_bytes = write_synthetic_checkpoint(spec, hf_dir)
    largest_shard = max(p.stat().st_size for p in hf_dir.glob("*.safetensors"))
    steps = {}
    for name, template in COPIES.items():
        target = workdir / f"copy-{name}"
        steps[name] = _timed(["sh", "-c", template.format(src=hf_dir, dst=target)])
        shutil.rmtree(target)
    cli = _cli()
    steps["hf-to-mcore"] = _timed(
        [cli, "convert", "hf-to-mcore", "--hf", str(hf_dir), "--out", str(workdir / "mcore")]
    )
    steps["mcore-to-hf"] = _timed(
        [
            cli,
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
    report = {
        "spec": asdict(spec),
        "weight_bytes": weight_bytes,
        "largest_shard_bytes": largest_shard,
        "steps": steps,
        "time_vs": {
            copy: {k: steps[k]["seconds"] / steps[copy]["seconds"] for k in CONVERSIONS}
            for copy in COPIES
        },
        "peak_vs_largest_shard": {
            k: steps[k]["peak_rss_kib"] * 1024 / largest_shard for k in CONVERSIONS
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
        "| step | time (s) | "
        + " | ".join(f"x ({COPY_LABELS[c]})" for c in COPIES)
        + " | peak RSS (GiB) | x largest shard |",
        "|---|---|" + "---|" * len(COPIES) + "---|---|",
    ]
    for copy in COPIES:
        ratios = " | ".join("1.00" if c == copy else "" for c in COPIES)
        lines.append(f"| {COPY_LABELS[copy]} | {steps[copy]['seconds']:.1f} | {ratios} | | |")
    for step in CONVERSIONS:
        ratios = [f"{report['time_vs'][c][step]:.2f}" for c in COPIES]
        lines.append(
            f"| {step} | {steps[step]['seconds']:.1f} | "
            + " | ".join(ratios)
            + f" | {steps[step]['peak_rss_kib'] / 2**20:.2f} | "
            f"{report['peak_vs_largest_shard'][step]:.2f} |"
        )
    return "\n".join(lines)


def write_report(report: dict, out_dir: Path) -> tuple[Path, Path]:
    return report_files(report, out_dir, "convert", format_markdown)
