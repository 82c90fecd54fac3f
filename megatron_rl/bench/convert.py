"""Benchmark: checkpoint conversion in both directions against `cp` of the same bytes.

A synthetic Qwen3-MoE-shaped Hugging Face checkpoint (random bfloat16 weights, about 2 GB by
default) is written first. Then, in one run, each step a fresh process started with nothing left
to flush and what it reads out of the page cache: three copies of it (see COPIES), then
`megatron-rl convert hf-to-mcore` and
`megatron-rl convert mcore-to-hf`, with the peak resident memory of each. At two sizes or more
(`--layers 24 96`: about 2 and 8 GB) the time of each step is also fitted over the size: the
fixed cost (start-up, megatron-core's own save) and the cost per byte. Targets: each
conversion's cost per byte at most 3x `cp` + `sync`'s, with peak memory below 2x the largest
safetensors shard.
"""

from __future__ import annotations

import json
import os
import shlex
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, replace
from pathlib import Path

import torch

from megatron_rl.bench.report import machine, now
from megatron_rl.bench.report import write_report as report_files
from megatron_rl.files.readahead import drop_cached
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


def _timed(
    command: list[str], pythonpath: Path | None = None, reads: Path | None = None
) -> dict[str, float]:
    """Wall time and peak resident memory (of its largest process) of `command`, started after
    everything earlier was flushed to the disk, so that a step pays only for its own writes, and
    with the files of the directory it `reads` out of the page cache; with `pythonpath`, the
    megatron_rl package is imported from that checkout."""
    subprocess.run(["sync"], check=True)
    if reads is not None:
        # as a checkpoint written hours before: otherwise a step would read from memory or from
        # the disk by what the steps before it happened to read (pages read twice stay, those
        # written once go first), and steps could not be compared
        drop_cached(path for path in reads.rglob("*") if path.is_file())
    env = None if pythonpath is None else {**os.environ, "PYTHONPATH": str(pythonpath)}
    with tempfile.TemporaryFile() as stderr:
        done = subprocess.run(
            [sys.executable, "-S", "-c", _MEASURE, *command],
            stdout=subprocess.PIPE,
            stderr=stderr,
            text=True,
            check=True,
            env=env,
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
# The suffix of a baseline checkout's conversion steps (`--baseline`).
BASELINE = " (baseline)"
KEY_FORMAT_LABELS = {
    1: "each expert weight one tensor of layers x experts slices",
    2: "a key per layer and expert",
}
# What every conversion pays before it touches a tensor: the interpreter and the imports
# (megatron-core, torch) of the conversion code.
STARTUP = "start-up"
STARTUP_IMPORTS = "import megatron_rl.checkpoint.convert, megatron_rl.parallel.distributed"


def _round(
    spec: ConvertBenchSpec, workdir: Path, hf_dir: Path, baseline: Path | None, first: bool
) -> dict[str, dict[str, float]]:
    """Every step once, in a fixed order; outputs are removed after each step that needs none.
    With a `baseline` checkout its conversions run beside this one's, each direction of the two
    back to back, the baseline's `first` or second (alternate it between rounds)."""
    steps = {}
    for name, template in COPIES.items():
        target = workdir / f"copy-{name}"
        copy = template.format(src=shlex.quote(str(hf_dir)), dst=shlex.quote(str(target)))
        steps[name] = _timed(["sh", "-c", copy], reads=hf_dir)
        shutil.rmtree(target)
    steps[STARTUP] = _timed([sys.executable, "-c", STARTUP_IMPORTS])
    cli, mcore, hf_back = _cli(), workdir / "mcore", workdir / "hf-back"
    checkouts = [("", None)] if baseline is None else [("", None), (BASELINE, baseline)]
    if first:
        checkouts.reverse()
    conversions = {  # each direction: its command, what it reads, its output
        "hf-to-mcore": (
            [cli, "convert", "hf-to-mcore", "--hf", hf_dir, "--out", mcore],
            hf_dir,
            mcore,
        ),
        "mcore-to-hf": (
            [
                cli,
                "convert",
                "mcore-to-hf",
                "--ckpt",
                mcore,
                "--out",
                hf_back,
                "--max-shard-mib",
                spec.max_shard_mib,
            ],
            mcore,
            hf_back,
        ),
    }
    for direction, (command, source, output) in conversions.items():
        for label, checkout in checkouts:
            shutil.rmtree(output, ignore_errors=True)
            steps[direction + label] = _timed(
                [str(arg) for arg in command], pythonpath=checkout, reads=source
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


def _conversions(steps: dict) -> list[str]:
    """The conversion steps measured: this checkout's, then a baseline's."""
    return [
        name + label for label in ("", BASELINE) for name in CONVERSIONS if name + label in steps
    ]


def _measure_size(
    spec: ConvertBenchSpec, workdir: Path, rounds: int, baseline: Path | None
) -> dict[str, object]:
    """`rounds` rounds of every step on a checkpoint of `spec`'s shape; each step's median time
    and its highest peak memory."""
    hf_dir = workdir / "hf"
    weight_bytes = write_synthetic_checkpoint(spec, hf_dir)
    largest_shard = max(p.stat().st_size for p in hf_dir.glob("*.safetensors"))
    runs = [_round(spec, workdir, hf_dir, baseline, first=i % 2 == 0) for i in range(rounds)]
    shutil.rmtree(hf_dir)
    steps = {
        name: {
            "seconds": statistics.median(run[name]["seconds"] for run in runs),
            "runs_seconds": [run[name]["seconds"] for run in runs],
            "peak_rss_kib": max(run[name]["peak_rss_kib"] for run in runs),
        }
        for name in runs[0]
    }
    return {
        "num_layers": spec.num_layers,
        "weight_bytes": weight_bytes,
        "largest_shard_bytes": largest_shard,
        "steps": steps,
        "time_vs": {
            copy: {k: steps[k]["seconds"] / steps[copy]["seconds"] for k in _conversions(steps)}
            for copy in COPIES
        },
        "peak_vs_largest_shard": {
            k: steps[k]["peak_rss_kib"] * 1024 / largest_shard for k in _conversions(steps)
        },
    }


def fit_marginal_cost(sizes: list[dict]) -> dict[str, dict[str, float]]:
    """Per copy and conversion, the least-squares line of its time over the checkpoint's size:
    the fixed cost (`intercept_s`) and the cost per GiB (`slope_s_per_gib`), from two sizes or
    more."""
    if len({size["weight_bytes"] for size in sizes}) < 2:
        raise ValueError("sizes: the fit needs checkpoints of two sizes or more")
    gib = [size["weight_bytes"] / 2**30 for size in sizes]
    mean_gib = statistics.fmean(gib)
    fit = {}
    for step in (*COPIES, *_conversions(sizes[0]["steps"])):
        seconds = [size["steps"][step]["seconds"] for size in sizes]
        mean_s = statistics.fmean(seconds)
        slope = sum((g - mean_gib) * (t - mean_s) for g, t in zip(gib, seconds, strict=True)) / sum(
            (g - mean_gib) ** 2 for g in gib
        )
        fit[step] = {"slope_s_per_gib": slope, "intercept_s": mean_s - slope * mean_gib}
    return fit


def run_benchmark(
    spec: ConvertBenchSpec,
    workdir: Path,
    rounds: int = 3,
    layer_counts: tuple[int, ...] = (),
    baseline: Path | None = None,
) -> dict[str, object]:
    """Every step at `spec`'s size, or at each of `layer_counts` layers (two or more: also the
    fit of time over size); with `baseline` (another checkout's root) also its conversions, in
    the same rounds. The report's top-level figures are the largest size's."""
    if baseline is not None and not (baseline / "megatron_rl" / "__init__.py").is_file():
        raise ValueError(f"--baseline {baseline}: not a megatron-rl checkout (no megatron_rl/)")
    if workdir.exists():
        shutil.rmtree(workdir)
    counts = sorted(layer_counts) or [spec.num_layers]
    sizes = [
        _measure_size(
            replace(spec, num_layers=count), workdir / f"layers-{count}", rounds, baseline
        )
        for count in counts
    ]
    report = {
        "spec": asdict(spec),
        "rounds": rounds,
        **sizes[-1],
        "sizes": sizes,
        "checkpoint_keys": time_checkpoint_keys(
            spec.keys_layers, spec.keys_experts, workdir / "keys"
        ),
        "machine": machine(),
        "date": now(),
    }
    if baseline is not None:
        report["baseline"] = {"path": str(baseline), "commit": _commit(baseline)}
    if len(sizes) > 1:
        report.update(fit_report(sizes))
    shutil.rmtree(workdir)
    return report


def fit_report(sizes: list[dict]) -> dict[str, dict]:
    """The report's fit of time over size (`fit_marginal_cost`) and each slope against each
    copy's."""
    fit = fit_marginal_cost(sizes)
    slope_vs = {
        copy: {
            k: fit[k]["slope_s_per_gib"] / fit[copy]["slope_s_per_gib"] for k in _conversions(fit)
        }
        for copy in COPIES
    }
    return {"fit": fit, "slope_vs": slope_vs}


def _commit(checkout: Path) -> str | None:
    """The commit `checkout` is at, when it is a git checkout."""
    done = subprocess.run(
        ["git", "-C", str(checkout), "rev-parse", "--short", "HEAD"],
        capture_output=True,
        text=True,
    )
    return done.stdout.strip() if done.returncode == 0 else None


def format_markdown(report: dict) -> str:
    lines = [
        f"Synthetic Qwen3-MoE checkpoints of bfloat16 weights; {report['machine']['cpu']}, "
        f"{report['machine']['cores']} cores, {report['date']}. Median of {report['rounds']} "
        "rounds; peak memory is the highest of them.",
    ]
    if "baseline" in report:
        baseline = report["baseline"]
        lines.append(
            f"Steps marked{BASELINE}: the conversions of the checkout {baseline['path']} "
            f"(commit {baseline['commit']}), in the same rounds."
        )
    for size in report.get("sizes", [report]):
        lines += ["", *_size_table(size)]
    if "fit" in report:
        lines += ["", *_fit_table(report)]
    lines += _keys_table(report["spec"], report)
    return "\n".join(lines)


def _size_table(size: dict) -> list[str]:
    steps = size["steps"]
    lines = [
        f"{size['weight_bytes'] / 2**30:.2f} GiB, largest shard "
        f"{size['largest_shard_bytes'] / 2**30:.2f} GiB:",
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
    for step in _conversions(steps):
        ratios = [f"{size['time_vs'][c][step]:.2f}" for c in COPIES]
        lines.append(
            f"| {step} | {steps[step]['seconds']:.1f} | "
            + " | ".join(ratios)
            + f" | {steps[step]['peak_rss_kib'] / 2**20:.2f} | "
            f"{size['peak_vs_largest_shard'][step]:.2f} |"
        )
    return lines


# Qwen3-30B-A3B in bfloat16: about 61 GB of weights (30.5 B parameters).
PROJECTED_BYTES = 61 * 10**9


def _fit_table(report: dict) -> list[str]:
    fit, gib = report["fit"], PROJECTED_BYTES / 2**30
    lines = [
        "Time over size, least squares over the sizes above: the fixed cost, the cost per GiB, "
        f"that slope against each copy's, and the line at {PROJECTED_BYTES / 1e9:.0f} GB "
        "(Qwen3-30B-A3B in bfloat16):",
        "",
        "| step | fixed (s) | s per GiB | "
        + " | ".join(f"slope x ({COPY_LABELS[c]})" for c in COPIES)
        + f" | at {PROJECTED_BYTES / 1e9:.0f} GB (s) |",
        "|---|---|---|" + "---|" * len(COPIES) + "---|",
    ]
    for step in (*COPIES, *_conversions(fit)):
        line = fit[step]
        ratios = (
            [f"{report['slope_vs'][c][step]:.2f}" for c in COPIES]
            if step not in COPIES
            else ["1.00" if c == step else "" for c in COPIES]
        )
        label = COPY_LABELS.get(step, step)
        projected = line["intercept_s"] + line["slope_s_per_gib"] * gib
        lines.append(
            f"| {label} | {line['intercept_s']:.1f} | {line['slope_s_per_gib']:.2f} | "
            + " | ".join(ratios)
            + f" | {projected:.0f} |"
        )
    return lines


def _keys_table(spec: dict, report: dict) -> list[str]:
    lines = [
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
    return lines


def write_report(report: dict, out_dir: Path) -> tuple[Path, Path]:
    return report_files(report, out_dir, "convert", format_markdown)
