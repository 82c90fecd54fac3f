"""`megatron-rl bench ...`: one table of benchmark subcommands. Each benchmark module has
`run_benchmark`, `format_markdown` and `write_report`; an entry says which module, its options,
and how they become the module's spec."""

from __future__ import annotations

import argparse
import importlib
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType
from typing import Any

from megatron_rl.cli.arguments import positive_int
from megatron_rl.config import ConfigError
from megatron_rl.process.stop import StopSignals


@dataclass(frozen=True)
class _BenchCommand:
    """A `megatron-rl bench` subcommand: its module (with `run_benchmark`, `format_markdown`
    and `write_report`), its options, and how its arguments run the benchmark."""

    module: str
    help: str
    options: tuple[tuple[str, dict[str, Any]], ...]
    run: Callable[[ModuleType, argparse.Namespace], dict]


# The sizes of `bench train-step`; unset ones keep TrainStepSpec's defaults (a ~3 B-parameter
# MoE for one GPU: megatron_rl/bench/train_step.py), which that module, importing megatron-core,
# is not loaded to read here.
_TRAIN_STEP_SIZES = (
    ("layers", "layers"),
    ("hidden", "hidden size"),
    ("heads", "attention heads"),
    ("kv-heads", "key/value heads"),
    ("experts", "routed experts"),
    ("topk", "experts per token"),
    ("moe-ffn", "expert FFN width"),
    ("vocab", "vocabulary size"),
    ("seq", "tokens per sequence"),
    ("micro-batch", "sequences per micro-batch"),
    ("micro-batches", "micro-batches per optimizer step"),
    ("steps", "timed optimizer steps (after one warm-up)"),
    ("matmul-size", "size of the square product that measures the peak"),
)


def _train_step_spec(bench: ModuleType, args: argparse.Namespace) -> object:
    given = {
        name.replace("-", "_"): getattr(args, name.replace("-", "_"))
        for name, _ in _TRAIN_STEP_SIZES
    }
    given |= {"dtype": args.dtype, "recompute": args.recompute}
    return bench.TrainStepSpec(**{key: value for key, value in given.items() if value is not None})


BENCH_COMMANDS = {
    "logprobs": _BenchCommand(
        "megatron_rl.bench.logprobs",
        "log-probs + entropy forward/backward: chunked kernel vs naive log_softmax",
        (
            ("--tokens", {"type": positive_int, "default": 4096, "help": "tokens (default 4096)"}),
            (
                "--vocab",
                {
                    "type": positive_int,
                    "default": 151_936,
                    "help": "vocabulary size (default Qwen3's)",
                },
            ),
            ("--dtype", {"choices": ["bfloat16", "float32"], "default": "bfloat16"}),
            ("--repeats", {"type": positive_int, "default": 3, "help": "timed repeats"}),
            (
                "--chunk-tokens",
                {"type": positive_int, "default": None, "help": "tokens per chunk (default: auto)"},
            ),
            (
                "--threads",
                {"type": int, "default": 0, "help": "torch threads (0: torch's default)"},
            ),
            ("--device", {"choices": ["cpu", "cuda"], "default": "cpu"}),
        ),
        lambda bench, args: bench.run_benchmark(
            bench.LogprobBenchSpec(
                tokens=args.tokens,
                vocab=args.vocab,
                dtype=args.dtype,
                repeats=args.repeats,
                chunk_tokens=args.chunk_tokens,
                threads=args.threads,
                device=args.device,
            )
        ),
    ),
    "convert": _BenchCommand(
        "megatron_rl.bench.convert",
        "checkpoint conversion both ways vs cp of the same bytes",
        (
            (
                "--layers",
                {
                    "type": positive_int,
                    "nargs": "+",
                    "default": [24],
                    "help": "layers (24: about 2 GB in bfloat16); two counts or more (24 96) "
                    "also fit time over size",
                },
            ),
            ("--max-shard-mib", {"type": positive_int, "default": 5 * 1024}),
            (
                "--rounds",
                {
                    "type": positive_int,
                    "default": 3,
                    "help": "rounds of every step (medians reported)",
                },
            ),
            (
                "--workdir",
                {"default": "runs/bench/convert-work", "help": "scratch space (removed after)"},
            ),
            (
                "--baseline",
                {
                    "type": Path,
                    "default": None,
                    "help": "another megatron-rl checkout (e.g. a git worktree of an earlier "
                    "commit) whose conversions run in the same rounds",
                },
            ),
        ),
        lambda bench, args: bench.run_benchmark(
            bench.ConvertBenchSpec(num_layers=args.layers[0], max_shard_mib=args.max_shard_mib),
            Path(args.workdir),
            rounds=args.rounds,
            layer_counts=tuple(args.layers),
            baseline=args.baseline,
        ),
    ),
    "replay": _BenchCommand(
        "megatron_rl.bench.replay",
        "training step with R2 routing replay vs without (time and memory)",
        (
            (
                "--layers",
                {
                    "type": positive_int,
                    "nargs": "+",
                    "default": [2, 16],
                    "help": "model depths to measure",
                },
            ),
            ("--seq", {"type": positive_int, "default": 256, "help": "tokens per sequence"}),
            (
                "--pairs",
                {
                    "type": positive_int,
                    "default": 20,
                    "help": "timed pairs of steps (one per mode)",
                },
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
            ("--repeats", {"type": positive_int, "default": 3, "help": "syncs per method"}),
            ("--prompts", {"type": positive_int, "default": 32, "help": "rollout prompts"}),
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
    "step": _BenchCommand(
        "megatron_rl.bench.rl_step",
        "the whole RL step: megatron-rl (lock-step, async, engine log-probs, SGLang) beside TRL",
        (
            ("--steps", {"type": positive_int, "default": 12, "help": "steps per arm"}),
            ("--warmup", {"type": int, "default": 2, "help": "first steps not timed"}),
            (
                "--arms",
                {
                    "nargs": "+",
                    "default": None,
                    "help": "arms to run (default: all; names as in the report)",
                },
            ),
            ("--workdir", {"default": "runs/bench", "help": "scratch space (removed after)"}),
        ),
        lambda bench, args: bench.run_benchmark(
            bench.RLStepBenchSpec(
                steps=args.steps,
                warmup=args.warmup,
                **({"arms": tuple(args.arms)} if args.arms else {}),
            ),
            Path(args.workdir),
        ),
    ),
    "experts": _BenchCommand(
        "megatron_rl.bench.expert_scaling",
        "training step at 8, 64 and 128 experts with equal active parameters, grouped vs loop",
        (
            ("--rounds", {"type": positive_int, "default": 3, "help": "interleaved rounds"}),
            ("--steps", {"type": positive_int, "default": 3, "help": "timed steps per round"}),
            ("--seq", {"type": positive_int, "default": 256, "help": "tokens per sequence"}),
            ("--layers", {"type": positive_int, "default": 4, "help": "layers"}),
        ),
        lambda bench, args: bench.run_benchmark(
            bench.ExpertScalingSpec(
                rounds=args.rounds, steps=args.steps, seq=args.seq, layers=args.layers
            )
        ),
    ),
    "packing": _BenchCommand(
        "megatron_rl.bench.packing",
        "training step over rollouts of unlike lengths: rows, a token budget, packed (THD)",
        (
            ("--rounds", {"type": positive_int, "default": 3, "help": "interleaved rounds"}),
            ("--steps", {"type": positive_int, "default": 3, "help": "timed steps per round"}),
            ("--layers", {"type": positive_int, "default": 4, "help": "layers"}),
        ),
        lambda bench, args: bench.run_benchmark(
            bench.PackingSpec(rounds=args.rounds, steps=args.steps, layers=args.layers)
        ),
    ),
    "train-step": _BenchCommand(
        "megatron_rl.bench.train_step",
        "training step of a random MoE on one rank: tokens/s and MFU against the matmul peak",
        (
            *(
                (f"--{name}", {"type": positive_int, "default": None, "help": what})
                for name, what in _TRAIN_STEP_SIZES
            ),
            ("--dtype", {"choices": ["bfloat16", "float32"], "default": None}),
            ("--recompute", {"action": "store_true", "default": None}),
        ),
        lambda bench, args: bench.run_benchmark(_train_step_spec(bench, args)),
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


def _drift(args: argparse.Namespace) -> int:
    from megatron_rl.bench import drift

    out, models_dir = Path(args.out), Path(args.models_dir)
    if args.quick and args.grid is not None:
        raise ConfigError("--quick: it is a grid of its own; leave out --grid")
    grid = drift.QUICK_GRID if args.quick else args.grid
    if args.report_only:
        print(f"wrote {drift.report_drift_benchmark(args.recipe, grid, out, args.overrides)}")
        return 0
    if args.pack:
        archive, report = drift.pack_drift_benchmark(args.recipe, grid, out, args.overrides)
        print(f"wrote {archive} and {report}")
        return 0
    with StopSignals():  # SIGTERM and Ctrl-C stop the runs in flight on the way out
        if args.prepare:
            run_ids = drift.prepare_drift_benchmark(
                args.recipe, grid, out, models_dir=models_dir, overrides=args.overrides
            )
            for number, run_id in enumerate(run_ids):
                print(f"{number:4d}  {run_id}")
            print(f"{len(run_ids)} runs: sbatch --array=0-{len(run_ids) - 1} (docs/drift.md)")
            return 0
        report = drift.run_drift_benchmark(
            args.recipe,
            grid,
            out,
            jobs=args.jobs,
            models_dir=models_dir,
            rerun_crashed=args.rerun_crashed,
            overrides=args.overrides,
            only=args.run_index,
        )
    if report is not None:
        print(f"wrote {report}")
    return 0


def _add_drift(benches: argparse._SubParsersAction) -> None:
    parser = benches.add_parser(
        "drift",
        help="routing drift and stability: GRPO + replay vs GSPO and the others, over a grid",
        description="Run a grid of arms x sweep points x seeds of RECIPE (resumable) and write "
        "summary.csv, plots and report.md with the claims checked (docs/drift.md).",
    )
    parser.add_argument("recipe", help="base recipe, e.g. examples/moe/tiny_gspo.yaml")
    parser.add_argument(
        "overrides", nargs="*", default=[], help="dotted KEY=VALUE overrides of the recipe"
    )
    parser.add_argument("--grid", default=None, help="grid file (default: the built-in grid)")
    parser.add_argument(
        "--quick",
        action="store_true",
        help="the built-in grid's quick subset: one seed, 12 steps, every claim "
        "(~15 min with --jobs 2 on 2 cores)",
    )
    parser.add_argument("--out", default="runs/bench/drift", help="results directory")
    parser.add_argument("--jobs", type=positive_int, default=1, help="runs at once (1 thread each)")
    parser.add_argument(
        "--models-dir",
        default="runs/bench/drift-models",
        help="cache of the base models of other shapes",
    )
    parser.add_argument(
        "--rerun-crashed", action="store_true", help="run crashed runs again (done ones never)"
    )
    # A job array of the grid (docs/drift.md): prepare once, one run per task, then the report.
    array = parser.add_mutually_exclusive_group()
    array.add_argument(
        "--prepare",
        action="store_true",
        help="claim --out and build the base models; list the runs by number, run none",
    )
    array.add_argument(
        "--run-index",
        type=int,
        metavar="I",
        help="run only run I of the list (a job array task: $SLURM_ARRAY_TASK_ID); no report",
    )
    array.add_argument(
        "--report-only", action="store_true", help="write the report of the runs that ended"
    )
    array.add_argument(
        "--pack",
        action="store_true",
        help="once every run has ended: their files into runs.tar.xz in place of runs/ (the "
        "report reads it; nothing more runs into the grid), then the report",
    )
    parser.set_defaults(handler=_drift)


def add_bench(commands: argparse._SubParsersAction) -> None:
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
    _add_drift(benches)
