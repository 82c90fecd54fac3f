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
import shlex
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from megatron_rl.bench.report import machine, now
from megatron_rl.bench.report import write_report as report_files
from megatron_rl.files.safetensors_shards import TensorSpec, write_safetensors_shards
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
    # the model of the checkpoint-key measurement (Qwen3-30B-A3B's layers and experts)
    keys_layers: int = 48
    keys_experts: int = 128


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


# Runs a command; prints its wall time and the peak resident memory (KiB) of its largest
# process. A small process of its own, because a child's peak starts at the peak of the process
# that forked it (exec keeps the high-water mark of the forked copy), and this benchmark's own
# process is hundreds of MB.
_MEASURE = """
import resource, subprocess, sys, time
start = time.perf_counter()
code = subprocess.run(sys.argv[1:], stdout=subprocess.DEVNULL).returncode
seconds = time.perf_counter() - start
print(code, seconds, resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss)
"""


def _timed(command: list[str]) -> dict[str, float]:
    """Wall time and peak resident memory (of its largest process) of `command`, started after
    everything earlier was flushed to the disk, so that a step pays only for its own writes."""
    subprocess.run(["sync"], check=True)
    with tempfile.TemporaryFile() as stderr:
        done = subprocess.run(
            [sys.executable, "-S", "-c", _MEASURE, *command],
            stdout=subprocess.PIPE,
            stderr=stderr,
            text=True,
            check=True,
        )
        code, seconds, peak_kib = done.stdout.split()
        if int(code) != 0:
            stderr.seek(0)
            tail = stderr.read().decode(errors="replace")[-3000:]
            raise RuntimeError(f"{command[:4]} failed ({code}):\n{tail}")
    return {"seconds": float(seconds), "peak_rss_kib": int(peak_kib)}


# The copies the conversions are compared with. cp (coreutils 9) copies inside the kernel
# (copy_file_range); a converter reads and writes the bytes through user space, as
# `cp --reflink=never` does. Megatron-core's checkpoint writer and mcore-to-hf fsync their
# files, so each copy is also timed until it is on the disk.
COPIES = {
    "cp": "cp -r {src} {dst}",
    "cp+sync": "cp -r {src} {dst} && sync",
    "cp-user+sync": "cp -r --reflink=never {src} {dst} && sync",
}
COPY_LABELS = {
    "cp": "cp -r",
    "cp+sync": "cp -r && sync",
    "cp-user+sync": "cp -r --reflink=never && sync",
}
CONVERSIONS = ("hf-to-mcore", "mcore-to-hf")
KEY_FORMAT_LABELS = {
    1: "each expert weight one tensor of layers x experts slices",
    2: "a key per layer and expert",
}
# What every conversion pays before it touches a tensor: the interpreter and the imports
# (megatron-core, torch) of the conversion code.
STARTUP = "start-up"
STARTUP_IMPORTS = "import megatron_rl.checkpoint.convert, megatron_rl.parallel.distributed"


def _round(spec: ConvertBenchSpec, workdir: Path, hf_dir: Path) -> dict[str, dict[str, float]]:
    """Every step once, in a fixed order; outputs are removed after each step that needs none."""
    steps = {}
    for name, template in COPIES.items():
        target = workdir / f"copy-{name}"
        copy = template.format(src=shlex.quote(str(hf_dir)), dst=shlex.quote(str(target)))
        steps[name] = _timed(["sh", "-c", copy])
        shutil.rmtree(target)
    steps[STARTUP] = _timed([sys.executable, "-c", STARTUP_IMPORTS])
    cli, mcore, hf_back = _cli(), workdir / "mcore", workdir / "hf-back"
    steps["hf-to-mcore"] = _timed(
        [cli, "convert", "hf-to-mcore", "--hf", str(hf_dir), "--out", str(mcore)]
    )
    steps["mcore-to-hf"] = _timed(
        [
            cli,
            "convert",
            "mcore-to-hf",
            "--ckpt",
            str(mcore),
            "--out",
            str(hf_back),
            "--max-shard-mib",
            str(spec.max_shard_mib),
        ]
    )
    shutil.rmtree(mcore)
    shutil.rmtree(hf_back)
    return steps


def time_checkpoint_keys(layers: int, experts: int, workdir: Path) -> dict[str, dict[str, float]]:
    """Seconds to save and to load, with megatron-core's dist_checkpointing on one process, a
    narrow model (hidden 64) of `layers` x `experts` experts keyed as each checkpoint format:
    the checkpoint's bookkeeping, which grows with the number of expert weights, apart from
    the bytes (a few MB here). Keyed by format version (as text, as in the JSON report)."""
    from megatron.core import dist_checkpointing

    from megatron_rl.checkpoint.format import SHARDED_KEYS, model_sharded_state_dict
    from megatron_rl.models.build import build_gpt_moe
    from megatron_rl.parallel.dims import ParallelDims
    from megatron_rl.parallel.distributed import LaunchEnv, init_distributed, shutdown_distributed

    shape = ConvertBenchSpec(
        num_layers=layers,
        hidden_size=64,
        num_experts=experts,
        moe_ffn_hidden_size=32,
        vocab_size=256,
    )
    dims = ParallelDims(world_size=1)
    init_distributed(dims, LaunchEnv.from_environ())
    try:
        model = build_gpt_moe(synthetic_config(shape), dims, initialize=False)
        # the first save starts megatron-core's result-queue process: not part of either format
        (workdir / "warm-up").mkdir(parents=True)
        dist_checkpointing.save(model_sharded_state_dict(model), str(workdir / "warm-up"))
        times = {}
        for version in SHARDED_KEYS:
            directory = workdir / f"format-{version}"
            directory.mkdir()
            start = time.perf_counter()
            dist_checkpointing.save(model_sharded_state_dict(model, version), str(directory))
            saved = time.perf_counter()
            wanted = model_sharded_state_dict(model, version)
            model.load_state_dict(dist_checkpointing.load(wanted, str(directory)))
            times[str(version)] = {
                "save_seconds": saved - start,
                "load_seconds": time.perf_counter() - saved,
            }
    finally:
        shutdown_distributed()
    return times


def run_benchmark(spec: ConvertBenchSpec, workdir: Path, rounds: int = 3) -> dict[str, object]:
    """`rounds` rounds of every step; each step's median time and its highest peak memory."""
    if workdir.exists():
        shutil.rmtree(workdir)
    hf_dir = workdir / "hf"
    weight_bytes = write_synthetic_checkpoint(spec, hf_dir)
    largest_shard = max(p.stat().st_size for p in hf_dir.glob("*.safetensors"))
    runs = [_round(spec, workdir, hf_dir) for _ in range(rounds)]
    steps = {
        name: {
            "seconds": statistics.median(run[name]["seconds"] for run in runs),
            "runs_seconds": [run[name]["seconds"] for run in runs],
            "peak_rss_kib": max(run[name]["peak_rss_kib"] for run in runs),
        }
        for name in runs[0]
    }
    report = {
        "spec": asdict(spec),
        "rounds": rounds,
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
        "checkpoint_keys": time_checkpoint_keys(
            spec.keys_layers, spec.keys_experts, workdir / "keys"
        ),
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
        f"{report['machine']['cpu']}, {report['machine']['cores']} cores, {report['date']}. "
        f"Median of {report['rounds']} rounds; peak memory is the highest of them.",
        "",
        "| step | time (s) | "
        + " | ".join(f"x ({COPY_LABELS[c]})" for c in COPIES)
        + " | peak RSS (GiB) | x largest shard |",
        "|---|---|" + "---|" * len(COPIES) + "---|---|",
    ]
    for copy in COPIES:
        ratios = " | ".join("1.00" if c == copy else "" for c in COPIES)
        lines.append(f"| {COPY_LABELS[copy]} | {steps[copy]['seconds']:.1f} | {ratios} | | |")
    blanks = " | ".join("" for _ in COPIES)
    lines.append(
        f"| {STARTUP} (`python -c '{STARTUP_IMPORTS}'`) | {steps[STARTUP]['seconds']:.1f} | "
        f"{blanks} | | |"
    )
    for step in CONVERSIONS:
        ratios = [f"{report['time_vs'][c][step]:.2f}" for c in COPIES]
        lines.append(
            f"| {step} | {steps[step]['seconds']:.1f} | "
            + " | ".join(ratios)
            + f" | {steps[step]['peak_rss_kib'] / 2**20:.2f} | "
            f"{report['peak_vs_largest_shard'][step]:.2f} |"
        )
    spec = report["spec"]
    lines += [
        "",
        f"Checkpoint bookkeeping: save and load of a narrow model (hidden 64) with "
        f"{spec['keys_layers']} layers x {spec['keys_experts']} experts, one process.",
        "",
        "| checkpoint format | save (s) | load (s) |",
        "|---|---|---|",
    ]
    for version, label in KEY_FORMAT_LABELS.items():
        times = report["checkpoint_keys"][str(version)]
        lines.append(
            f"| {version}: {label} | {times['save_seconds']:.1f} | {times['load_seconds']:.1f} |"
        )
    return "\n".join(lines)


def write_report(report: dict, out_dir: Path) -> tuple[Path, Path]:
    return report_files(report, out_dir, "convert", format_markdown)
