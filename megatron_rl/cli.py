"""`megatron-rl` command line. Each subcommand parses its arguments and calls one library entry."""

from __future__ import annotations

import argparse
import importlib
import json
import signal
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType
from typing import TYPE_CHECKING, Any

# Subcommands import what they use when they run: importing megatron-core, transformers and
# wandb takes seconds, and megatron-core's checkpoint writer starts a helper process that imports
# this (the main) module again.
from megatron_rl.parallel.dims import ParallelDims

if TYPE_CHECKING:
    from megatron_rl.parallel.distributed import LaunchEnv


def _positive(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected a positive int, got {text}")
    return value


def _fraction(text: str) -> float:
    value = float(text)
    if not 0.0 <= value <= 1.0:
        raise argparse.ArgumentTypeError(f"expected a fraction in [0, 1], got {text}")
    return value


def _exit_on_sigterm(signum: int, frame: object) -> None:
    raise SystemExit(128 + signum)


def _train(args: argparse.Namespace) -> int:
    from megatron_rl.config import load_config
    from megatron_rl.parallel.distributed import LaunchEnv
    from megatron_rl.trainer.loop import TrainingAborted, train
    from megatron_rl.trainer.recipe import Recipe

    recipe = load_config(Recipe, args.recipe, args.overrides)
    # SIGTERM (a scheduler's preemption, torchrun stopping its workers) unwinds the run like an
    # error, so that the rollout servers it started are stopped too.
    signal.signal(signal.SIGTERM, _exit_on_sigterm)
    try:
        metrics = train(recipe, resume=args.resume)
    except TrainingAborted as error:
        print(f"megatron-rl: training aborted: {error}", file=sys.stderr)
        return 3
    if LaunchEnv.from_environ().rank == 0 and "eval/accuracy" in metrics:
        print(f"held-out accuracy after step {recipe.run.steps}: {metrics['eval/accuracy']:.3f}")
    return 0


def _add_train(commands: argparse._SubParsersAction) -> None:
    parser = commands.add_parser(
        "train",
        help="run an RL recipe (one process, or every rank under torchrun / srun)",
        description="Run the RL loop of a YAML recipe; KEY=VALUE overrides any field, e.g. "
        "algo.loss=grpo rollout.group_size=8 (docs/training.md lists every field).",
    )
    parser.add_argument("recipe", help="YAML recipe, e.g. examples/moe/tiny_gspo.yaml")
    parser.add_argument("overrides", nargs="*", help="dotted KEY=VALUE overrides")
    parser.add_argument(
        "--resume", action="store_true", help="continue from RUN_DIR/checkpoints/latest if any"
    )
    parser.set_defaults(handler=_train)


def _losses(args: argparse.Namespace) -> int:
    from megatron_rl.bench.loss_table import DriftBatchSpec, format_markdown, loss_table
    from megatron_rl.files.atomic import write_text_atomic

    spec = DriftBatchSpec(seed=args.seed, routing_changed_frac=args.routing_changed_frac)
    rows = loss_table(spec)
    print(
        f"Policy losses on a synthetic batch of {spec.prompts} prompts x {spec.group_size} "
        f"responses (up to {spec.max_response_len} tokens), {spec.routing_changed_frac:.0%} of "
        f"tokens with routing-sized log-ratio shifts (std {spec.routing_changed_std}), seed "
        f"{spec.seed}:\n"
    )
    print(format_markdown(rows))
    if args.json:
        write_text_atomic(args.json, json.dumps({"spec": vars(spec), "rows": rows}, indent=2))
        print(f"\nwrote {args.json}")
    return 0


def _add_losses(commands: argparse._SubParsersAction) -> None:
    parser = commands.add_parser(
        "losses",
        help="compare every registered policy loss on one synthetic MoE-drift batch",
        description="Evaluate every registered policy loss at its default clip range on a "
        "synthetic rollout batch and print where each one clips.",
    )
    parser.add_argument("--seed", type=int, default=0, help="seed of the synthetic batch")
    parser.add_argument(
        "--routing-changed-frac",
        type=_fraction,
        default=0.1,
        help="share of tokens whose log-prob moves as if their experts changed (default 0.1)",
    )
    parser.add_argument("--json", metavar="PATH", help="also write the table as JSON to PATH")
    parser.set_defaults(handler=_losses)


@dataclass(frozen=True)
class _BenchCommand:
    """A `megatron-rl bench` subcommand: its module (with `run_benchmark`, `format_markdown`
    and `write_report`), its options, and how its arguments run the benchmark."""

    module: str
    help: str
    options: tuple[tuple[str, dict[str, Any]], ...]
    run: Callable[[ModuleType, argparse.Namespace], dict]


BENCH_COMMANDS = {
    "logprobs": _BenchCommand(
        "megatron_rl.bench.logprobs",
        "log-probs + entropy forward/backward: chunked kernel vs naive log_softmax",
        (
            ("--tokens", {"type": _positive, "default": 4096, "help": "tokens (default 4096)"}),
            (
                "--vocab",
                {
                    "type": _positive,
                    "default": 151_936,
                    "help": "vocabulary size (default Qwen3's)",
                },
            ),
            ("--dtype", {"choices": ["bfloat16", "float32"], "default": "bfloat16"}),
            ("--repeats", {"type": _positive, "default": 3, "help": "timed repeats"}),
            (
                "--chunk-tokens",
                {"type": _positive, "default": None, "help": "tokens per chunk (default: auto)"},
            ),
            (
                "--threads",
                {"type": int, "default": 0, "help": "torch threads (0: torch's default)"},
            ),
        ),
        lambda bench, args: bench.run_benchmark(
            bench.LogprobBenchSpec(
                tokens=args.tokens,
                vocab=args.vocab,
                dtype=args.dtype,
                repeats=args.repeats,
                chunk_tokens=args.chunk_tokens,
                threads=args.threads,
            )
        ),
    ),
    "convert": _BenchCommand(
        "megatron_rl.bench.convert",
        "checkpoint conversion both ways vs cp of the same bytes",
        (
            (
                "--layers",
                {"type": _positive, "default": 24, "help": "layers (24: about 2 GB in bfloat16)"},
            ),
            ("--max-shard-mib", {"type": _positive, "default": 5 * 1024}),
            (
                "--rounds",
                {
                    "type": _positive,
                    "default": 3,
                    "help": "rounds of every step (medians reported)",
                },
            ),
            (
                "--workdir",
                {"default": "runs/bench/convert-work", "help": "scratch space (removed after)"},
            ),
        ),
        lambda bench, args: bench.run_benchmark(
            bench.ConvertBenchSpec(num_layers=args.layers, max_shard_mib=args.max_shard_mib),
            Path(args.workdir),
            rounds=args.rounds,
        ),
    ),
    "replay": _BenchCommand(
        "megatron_rl.bench.replay",
        "training step with R2 routing replay vs without (time and memory)",
        (
            (
                "--layers",
                {
                    "type": _positive,
                    "nargs": "+",
                    "default": [2, 16],
                    "help": "model depths to measure",
                },
            ),
            ("--seq", {"type": _positive, "default": 256, "help": "tokens per sequence"}),
            (
                "--pairs",
                {"type": _positive, "default": 20, "help": "timed pairs of steps (one per mode)"},
            ),
        ),
        lambda bench, args: bench.run_benchmark(
            bench.ReplayBenchSpec(layers=tuple(args.layers), pairs=args.pairs, seq=args.seq)
        ),
    ),
    "sglang": _BenchCommand(
        "megatron_rl.bench.sglang",
        "SGLang weight-sync throughput vs memcpy, rollout tokens/s vs the local engine",
        (
            (
                "--recipe",
                {
                    "default": "examples/moe/tiny_gspo_sglang.yaml",
                    "help": "recipe whose model and rollout.sglang settings start the servers",
                },
            ),
            ("--tiny-only", {"action": "store_true", "help": "skip the ~1 GB synthetic model"}),
            ("--repeats", {"type": _positive, "default": 3, "help": "syncs per method"}),
            ("--prompts", {"type": _positive, "default": 32, "help": "rollout prompts"}),
            (
                "--workdir",
                {"default": "runs/bench/sglang-work", "help": "scratch space (removed after)"},
            ),
        ),
        lambda bench, args: bench.run_benchmark(
            bench.SGLangBenchSpec(
                recipe=args.recipe,
                include_synthetic=not args.tiny_only,
                repeats=args.repeats,
                rollout_prompts=args.prompts,
            ),
            Path(args.workdir),
        ),
    ),
}


def _bench(args: argparse.Namespace) -> int:
    command = BENCH_COMMANDS[args.bench]
    bench = importlib.import_module(command.module)
    report = command.run(bench, args)
    print(bench.format_markdown(report))
    json_path, md_path = bench.write_report(report, Path(args.out))
    print(f"\nwrote {json_path} and {md_path}")
    return 0


def _add_bench(commands: argparse._SubParsersAction) -> None:
    bench = commands.add_parser("bench", help="benchmarks (results as JSON and markdown)")
    benches = bench.add_subparsers(dest="bench", required=True)
    for name, command in BENCH_COMMANDS.items():
        parser = benches.add_parser(name, help=command.help)
        for flag, options in command.options:
            parser.add_argument(flag, **options)
        parser.add_argument(
            "--out", default="runs/bench", help="directory for the JSON and .md report"
        )
        parser.set_defaults(handler=_bench)


def _layout(args: argparse.Namespace) -> tuple[LaunchEnv, ParallelDims]:
    from megatron_rl.parallel.distributed import LaunchEnv

    launch = LaunchEnv.from_environ()
    dims = ParallelDims(
        world_size=launch.world_size, tp=args.tp, pp=args.pp, ep=args.ep, etp=args.etp
    )
    return launch, dims


def _convert_hf_to_mcore(args: argparse.Namespace) -> int:
    from megatron_rl.checkpoint import convert
    from megatron_rl.files.atomic import check_output_dir
    from megatron_rl.models.hf_source import inspect_hf
    from megatron_rl.parallel.distributed import init_distributed, shutdown_distributed

    source = inspect_hf(Path(args.hf), given_as="--hf")
    check_output_dir(Path(args.out), overwrite=args.overwrite)
    launch, dims = _layout(args)
    init_distributed(dims, launch)
    try:
        convert.hf_to_mcore(source, Path(args.out), dims, overwrite=args.overwrite)
    finally:
        shutdown_distributed()
    if launch.rank == 0:
        print(f"wrote {args.out} ({source.family.architecture}, {dims.describe()})")
    return 0


def _convert_mcore_to_hf(args: argparse.Namespace) -> int:
    from megatron_rl.checkpoint import convert
    from megatron_rl.checkpoint.format import read_metadata
    from megatron_rl.files.atomic import check_output_dir
    from megatron_rl.parallel.distributed import init_distributed, shutdown_distributed

    read_metadata(Path(args.ckpt), given_as="--ckpt")
    check_output_dir(Path(args.out), overwrite=args.overwrite)
    launch, dims = _layout(args)
    init_distributed(dims, launch)
    try:
        convert.mcore_to_hf(
            Path(args.ckpt),
            Path(args.out),
            dims,
            overwrite=args.overwrite,
            max_shard_bytes=args.max_shard_mib * 2**20,
        )
    finally:
        shutdown_distributed()
    if launch.rank == 0:
        print(f"wrote {args.out}")
    return 0


def _add_convert(commands: argparse._SubParsersAction) -> None:
    parser = commands.add_parser(
        "convert",
        help="Hugging Face <-> Megatron-Core checkpoints (one process, or under torchrun)",
    )
    directions = parser.add_subparsers(dest="direction", required=True)
    to_mcore = directions.add_parser(
        "hf-to-mcore", help="a Hugging Face checkpoint -> a Megatron-Core distributed checkpoint"
    )
    to_mcore.add_argument("--hf", required=True, help="Hugging Face checkpoint directory")
    to_mcore.add_argument("--out", required=True, help="megatron-rl checkpoint directory")
    to_hf = directions.add_parser(
        "mcore-to-hf", help="a megatron-rl checkpoint -> a Hugging Face checkpoint"
    )
    to_hf.add_argument("--ckpt", required=True, help="megatron-rl checkpoint directory")
    to_hf.add_argument("--out", required=True, help="Hugging Face checkpoint directory")
    to_hf.add_argument(
        "--max-shard-mib", type=_positive, default=5 * 1024, help="largest safetensors shard"
    )
    for direction, handler in ((to_mcore, _convert_hf_to_mcore), (to_hf, _convert_mcore_to_hf)):
        for dim in ("tp", "ep", "pp"):
            direction.add_argument(
                f"--{dim}", type=_positive, default=1, help=f"{dim} size (with torchrun)"
            )
        direction.add_argument("--etp", type=_positive, default=None, help="expert TP (default tp)")
        direction.add_argument("--overwrite", action="store_true", help="replace an existing --out")
        direction.set_defaults(handler=handler)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="megatron-rl", description=__doc__)
    commands = parser.add_subparsers(dest="command", required=True)
    for add in (_add_train, _add_losses, _add_bench, _add_convert):
        add(commands)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return args.handler(args)
    except ValueError as error:
        print(f"megatron-rl: error: {error}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
