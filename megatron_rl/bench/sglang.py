"""Benchmark: SGLang weight sync and rollout speed, each beside its baseline in the same run.

Weight sync: for each model (the shipped tiny model, and a synthetic Qwen3-MoE-shaped one of
about 1 GB), one SGLang server started from the recipe's `rollout.sglang` settings; the model's
own tensors are pushed into it by each method, several times, and the median push is compared
with a plain in-memory copy of the same tensors into preallocated ones (`Tensor.copy_`).
Rollouts: tokens per second of the same sampling requests (held-out prompts of the arithmetic
task, n samples each) on the SGLang server and on the in-process engine.
"""

from __future__ import annotations

import dataclasses
import shutil
import statistics
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from megatron_rl.bench.convert import ConvertBenchSpec, write_synthetic_checkpoint
from megatron_rl.bench.report import machine, now
from megatron_rl.bench.report import write_report as report_files
from megatron_rl.config import load_config
from megatron_rl.files.hf_checkpoint import HFCheckpoint, read_config
from megatron_rl.rewards import ArithmeticTask
from megatron_rl.rollout.codec import PromptCodec
from megatron_rl.rollout.engine import RolloutEngine, SamplingParams
from megatron_rl.rollout.local import LocalEngine
from megatron_rl.rollout.sglang import SYNC_METHODS, ServerGroup, SGLangEngine, make_weight_sync
from megatron_rl.rollout.sglang.api_key import run_key
from megatron_rl.trainer.recipe import Recipe


@dataclass(frozen=True)
class SGLangBenchSpec:
    recipe: str = "examples/moe/tiny_gspo_sglang.yaml"
    synthetic_layers: int = 12  # ~1 GB of bfloat16 weights at the convert benchmark's widths
    # The synthetic model's server needs room for its weights beside the recipe's tiny budget.
    synthetic_mem_fraction: float = 0.25
    include_synthetic: bool = True
    repeats: int = 3
    rollout_prompts: int = 32
    rollout_rounds: int = 2
    bucket_mib: int = 512


def _buckets(hf_dir: Path, bucket_bytes: int) -> list[list[tuple[str, torch.Tensor]]]:
    """The checkpoint's tensors in memory, in buckets of at most `bucket_bytes`."""
    checkpoint = HFCheckpoint(hf_dir)
    buckets, current, size = [], [], 0
    for name in sorted(checkpoint.names()):
        tensor = checkpoint.tensor(name).clone()
        nbytes = tensor.numel() * tensor.element_size()
        if current and size + nbytes > bucket_bytes:
            buckets.append(current)
            current, size = [], 0
        current.append((name, tensor))
        size += nbytes
    checkpoint.close()
    return buckets + ([current] if current else [])


def _memcpy_seconds(buckets: list[list[tuple[str, torch.Tensor]]], repeats: int) -> float:
    targets = [[torch.empty_like(t) for _, t in bucket] for bucket in buckets]
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        for bucket, outs in zip(buckets, targets, strict=True):
            for (_, tensor), out in zip(bucket, outs, strict=True):
                out.copy_(tensor)
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def _sync_model(
    spec: SGLangBenchSpec, servers: ServerGroup, hf_dir: Path, workdir: Path
) -> dict[str, object]:
    """Push the model's own tensors into the running `servers` by each method."""
    checkpoint = HFCheckpoint(hf_dir)
    shapes = {name: checkpoint.shape(name) for name in checkpoint.names()}
    checkpoint.close()
    buckets = _buckets(hf_dir, spec.bucket_mib * 2**20)
    total = sum(t.numel() * t.element_size() for bucket in buckets for _, t in bucket)
    memcpy = _memcpy_seconds(buckets, spec.repeats)
    result: dict[str, object] = {
        "bytes": total,
        "tensors": len(shapes),
        "memcpy_s": memcpy,
        "memcpy_bytes_per_s": total / memcpy,
    }
    for method in SYNC_METHODS:
        sync = make_weight_sync(method, tp_sizes=[1], directory=workdir / "weights", hf_dir=hf_dir)
        engine = SGLangEngine(servers.urls, sync, managed=servers, tensor_shapes=shapes)
        times = []
        try:
            for version in range(spec.repeats):
                start = time.perf_counter()
                engine.update_weights(buckets, version)
                times.append(time.perf_counter() - start)
        finally:
            engine.close()
        seconds = statistics.median(times)
        result[method] = {
            "seconds": seconds,
            "bytes_per_s": total / seconds,
            "x_memcpy_time": seconds / memcpy,
            "all_s": times,
        }
    return result


def _tokens_per_s(
    engine: RolloutEngine, prompts: list[list[int]], params: SamplingParams, n: int, rounds: int
) -> dict[str, float]:
    best = None
    for round_index in range(rounds):
        start = time.perf_counter()
        groups = engine.generate(prompts, params, n=n, seed=round_index)
        seconds = time.perf_counter() - start
        tokens = sum(len(sample.response_ids) for group in groups for sample in group)
        if best is None or tokens / seconds > best["tokens_per_s"]:
            best = {"seconds": seconds, "tokens": tokens, "tokens_per_s": tokens / seconds}
    return best


def _rollout_speed(
    spec: SGLangBenchSpec, recipe: Recipe, servers: ServerGroup, workdir: Path
) -> dict:
    """The same requests on the running `servers` (the recipe's model) and the local engine."""
    hf_dir = recipe.model.hf_path
    context = read_config(Path(hf_dir)).get("max_position_embeddings", 4096)
    codec = PromptCodec(hf_dir, max_prompt_tokens=context - recipe.rollout.max_new_tokens)
    problems = ArithmeticTask().problems("eval", spec.rollout_prompts, seed=0)
    prompts = [codec.encode_prompt(problem.prompt, origin=problem.origin) for problem in problems]
    params = SamplingParams(
        temperature=recipe.rollout.temperature,
        max_new_tokens=recipe.rollout.max_new_tokens,
        stop_token_ids=codec.stop_token_ids,
    )
    n = recipe.rollout.group_size
    local = LocalEngine.from_pretrained(hf_dir, max_batch_size=recipe.rollout.max_batch_size)
    result = {"prompts": len(prompts), "n": n, "max_new_tokens": params.max_new_tokens}
    result["local"] = _tokens_per_s(local, prompts, params, n, spec.rollout_rounds)
    engine = SGLangEngine(
        servers.urls,
        make_weight_sync("disk", tp_sizes=[1], directory=workdir, hf_dir=hf_dir),
        managed=servers,
    )
    result["sglang"] = _tokens_per_s(engine, prompts, params, n, spec.rollout_rounds)
    result["sglang_vs_local"] = result["sglang"]["tokens_per_s"] / result["local"]["tokens_per_s"]
    return result


def run_benchmark(spec: SGLangBenchSpec, workdir: Path) -> dict[str, object]:
    """Every measurement of the module docstring; `workdir` is scratch space (removed at the
    end; kept, with the servers' logs, when a step fails)."""
    recipe = load_config(Recipe, spec.recipe)
    if workdir.exists():
        shutil.rmtree(workdir)
    workdir.mkdir(parents=True)
    # A port of its own, beside a run of the same recipe.
    config = dataclasses.replace(
        recipe.rollout.sglang, base_port=recipe.rollout.sglang.base_port + 50
    )
    models = {"tiny": Path(recipe.model.hf_path)}
    if spec.include_synthetic:
        synthetic = workdir / "synthetic_hf"
        write_synthetic_checkpoint(ConvertBenchSpec(num_layers=spec.synthetic_layers), synthetic)
        models["synthetic"] = synthetic
    api_key = run_key(workdir)
    sync, rollout = {}, {}
    for name, hf_dir in models.items():
        if name == "synthetic":
            config = dataclasses.replace(config, mem_fraction_static=spec.synthetic_mem_fraction)
        # Server logs stay in `workdir` (kept when a step fails) until the end.
        with ServerGroup(
            config, str(hf_dir), workdir / name / "logs", api_key=api_key, seed=recipe.run.seed
        ) as servers:
            sync[name] = _sync_model(spec, servers, hf_dir, workdir / name)
            if name == "tiny":  # its own weights again: the recipe's model as shipped
                rollout = _rollout_speed(spec, recipe, servers, workdir / "rollout")
    shutil.rmtree(workdir)
    return {
        "spec": asdict(spec),
        "weight_sync": sync,
        "rollout": rollout,
        "machine": machine(),
        "date": now(),
    }


def format_markdown(report: dict) -> str:
    lines = [
        f"SGLang {report['spec']['recipe']} settings; {report['machine']['cpu']}, "
        f"{report['machine']['cores']} cores, {report['date']}.",
        "",
        "| model | bytes | method | median time (s) | throughput (MB/s) | x memcpy time |",
        "|---|---|---|---|---|---|",
    ]
    for model, result in report["weight_sync"].items():
        size = f"{result['bytes'] / 1e6:.1f} MB"
        lines.append(
            f"| {model} | {size} | in-memory copy | {result['memcpy_s']:.4f} | "
            f"{result['memcpy_bytes_per_s'] / 1e6:.0f} | 1.00 |"
        )
        for method in SYNC_METHODS:
            entry = result[method]
            lines.append(
                f"| {model} | {size} | {method} | {entry['seconds']:.3f} | "
                f"{entry['bytes_per_s'] / 1e6:.0f} | {entry['x_memcpy_time']:.0f} |"
            )
    rollout = report["rollout"]
    lines += [
        "",
        f"Rollouts: {rollout['prompts']} prompts x n={rollout['n']}, up to "
        f"{rollout['max_new_tokens']} new tokens, best of {report['spec']['rollout_rounds']}.",
        "",
        "| engine | response tokens | time (s) | tokens/s |",
        "|---|---|---|---|",
    ]
    for engine in ("local", "sglang"):
        entry = rollout[engine]
        lines.append(
            f"| {engine} | {entry['tokens']} | {entry['seconds']:.2f} | "
            f"{entry['tokens_per_s']:.0f} |"
        )
    lines.append(f"\nSGLang / local tokens/s: {rollout['sglang_vs_local']:.2f}")
    return "\n".join(lines)


def write_report(report: dict, out_dir: Path) -> tuple[Path, Path]:
    return report_files(report, out_dir, "sglang", format_markdown)
