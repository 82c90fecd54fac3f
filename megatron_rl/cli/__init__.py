"""`megatron-rl` command line. Each subcommand parses its arguments and calls one library entry."""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

# Subcommands import what they use when they run: importing megatron-core, transformers and
# wandb takes seconds, and megatron-core's checkpoint writer starts a helper process that imports
# this (the main) module again. What is imported here is light (the standard library and these
# modules): `main` acts on signals and on its launcher before anything heavier is imported.
from megatron_rl.cli.arguments import fraction, positive_int
from megatron_rl.process.children import end_with_parent
from megatron_rl.process.stop import StopSignals, keep_early_signals, release_early_signals

if TYPE_CHECKING:
    from megatron_rl.parallel.dims import ParallelDims
    from megatron_rl.parallel.distributed import LaunchEnv

# torchrun sets it in its workers' environment (torch.distributed.elastic).
TORCHRUN_WORKER = "TORCHELASTIC_RUN_ID"


def _train(args: argparse.Namespace) -> int:
    started = time.monotonic()
    from megatron_rl.config import load_config
    from megatron_rl.trainer.recipe import Recipe
    from megatron_rl.trainer.run_dir import refuse_earlier_run

    # The recipe and the run directory are checked before megatron-core is imported: a
    # mistake shows in a moment.
    recipe = load_config(Recipe, args.recipe, args.overrides)
    run_dir = _make_run_dir(Path(recipe.run.dir))
    if not args.resume:
        refuse_earlier_run(run_dir)
    from megatron_rl.parallel.distributed import LaunchEnv
    from megatron_rl.trainer.loop import RunStopped, TrainingAborted, train
    from megatron_rl.trainer.run_summary import summarize_run

    launch = LaunchEnv.from_environ()
    args.known_warnings.log_to(run_dir / "warnings.log", prefix=f"[rank {launch.rank}] ")
    with StopSignals(graceful=recipe.checkpoint.save_signal_numbers()) as stop:
        try:
            train(recipe, resume=args.resume, stop=stop)
        except TrainingAborted as error:
            print(f"megatron-rl: training aborted: {error}", file=sys.stderr)
            return 3
        except RunStopped:  # reported by rank 0 (train)
            return stop.exit_code
    if stop.immediate:  # a stop signal's exit that Python swallowed
        return stop.exit_code
    if launch.rank == 0:
        summary = summarize_run(recipe, time.monotonic() - started, args.known_warnings.kept)
        print("\n".join(summary.lines()))
    return 0


def _make_run_dir(run_dir: Path) -> Path:
    try:
        run_dir.mkdir(parents=True, exist_ok=True)
    except FileExistsError:
        raise ValueError(f"run.dir {run_dir}: exists and is not a directory") from None
    except NotADirectoryError:
        raise ValueError(f"run.dir {run_dir}: a parent of it is not a directory") from None
    except OSError as error:
        raise ValueError(f"run.dir {run_dir}: cannot be created ({error.strerror})") from None
    return run_dir


def _add_train(commands: argparse._SubParsersAction) -> None:
    parser = commands.add_parser(
        "train",
        help="run an RL recipe (one process, or every rank under torchrun / srun)",
        description="Run the RL loop of a YAML recipe; KEY=VALUE overrides any field, e.g. "
        "algo.loss=grpo rollout.group_size=8 (docs/recipe.md lists every field).",
    )
    parser.add_argument("recipe", help="YAML recipe, e.g. examples/moe/tiny_gspo.yaml")
    parser.add_argument(
        "overrides", nargs="*", default=[], help="dotted KEY=VALUE overrides (also after options)"
    )
    parser.add_argument(
        "--resume", action="store_true", help="continue from RUN_DIR/checkpoints/latest if any"
    )
    _add_verbose(parser)
    parser.set_defaults(handler=_train)


def _add_verbose(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--verbose",
        action="store_true",
        help="also show the known, harmless warnings of megatron-core and torch "
        "(megatron_rl/cli/known_warnings.py; train keeps them in RUN_DIR/warnings.log)",
    )


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
        type=fraction,
        default=0.1,
        help="share of tokens whose log-prob moves as if their experts changed (default 0.1)",
    )
    parser.add_argument("--json", metavar="PATH", help="also write the table as JSON to PATH")
    parser.set_defaults(handler=_losses)


def _layout(args: argparse.Namespace) -> tuple[LaunchEnv, ParallelDims]:
    from megatron_rl.parallel.dims import ParallelDims
    from megatron_rl.parallel.distributed import LaunchEnv

    launch = LaunchEnv.from_environ()
    dims = ParallelDims(
        world_size=launch.world_size, tp=args.tp, pp=args.pp, ep=args.ep, etp=args.etp
    )
    return launch, dims


def _stoppable(convert: Callable[[argparse.Namespace], int]) -> Callable[[argparse.Namespace], int]:
    """`convert` under the stop signals' handlers: SIGTERM and Ctrl-C end it within the bound,
    its output's staging removed (megatron_rl.process.stop)."""

    def run(args: argparse.Namespace) -> int:
        with StopSignals():
            return convert(args)

    return run


def _convert_hf_to_mcore(args: argparse.Namespace) -> int:
    from megatron_rl.checkpoint import convert
    from megatron_rl.files.atomic import check_output_dir
    from megatron_rl.models.hf_source import inspect_hf
    from megatron_rl.parallel.distributed import init_distributed, shutdown_distributed

    source = inspect_hf(Path(args.hf), given_as="--hf")
    check_output_dir(Path(args.out), overwrite=args.overwrite)
    launch, dims = _layout(args)
    if launch.rank == 0:
        _note_staging_left_beside(Path(args.out))
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
    from megatron_rl.files.checksums import MANIFEST
    from megatron_rl.parallel.distributed import init_distributed, shutdown_distributed

    read_metadata(Path(args.ckpt), given_as="--ckpt")
    check_output_dir(Path(args.out), overwrite=args.overwrite)
    launch, dims = _layout(args)
    if launch.rank == 0:
        _note_staging_left_beside(Path(args.out))
        if not (Path(args.ckpt) / MANIFEST).is_file():
            print(
                f"megatron-rl: note: --ckpt {args.ckpt} was saved without checksums (by an "
                "earlier version); only its files' lengths are checked",
                file=sys.stderr,
            )
    init_distributed(dims, launch)
    try:
        copied = convert.mcore_to_hf(
            Path(args.ckpt),
            Path(args.out),
            dims,
            overwrite=args.overwrite,
            max_shard_bytes=args.max_shard_mib * 2**20,
        )
    finally:
        shutdown_distributed()
    if launch.rank == 0:
        print(f"wrote {args.out} ({len(copied)} tensors copied file to file, unchanged)")
    return 0


def _note_staging_left_beside(out: Path) -> None:
    from megatron_rl.files.atomic import directory_size, retired_copies, staging_left_beside

    for retired in retired_copies(out):
        print(
            f"megatron-rl: note: {retired} ({directory_size(retired) / 2**20:.0f} MiB) was left "
            f"by an interrupted --overwrite of {out}; it is removed once the new one is written",
            file=sys.stderr,
        )
    for staging, size in staging_left_beside(out):
        print(
            f"megatron-rl: note: {staging} ({size / 2**20:.0f} MiB) was left by an interrupted "
            "conversion or export; remove it unless one is writing it now",
            file=sys.stderr,
        )


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
        "--max-shard-mib", type=positive_int, default=5 * 1024, help="largest safetensors shard"
    )
    for direction, handler in (
        (to_mcore, _stoppable(_convert_hf_to_mcore)),
        (to_hf, _stoppable(_convert_mcore_to_hf)),
    ):
        for dim in ("tp", "ep", "pp"):
            direction.add_argument(
                f"--{dim}", type=positive_int, default=1, help=f"{dim} size (with torchrun)"
            )
        direction.add_argument(
            "--etp", type=positive_int, default=None, help="expert TP (default tp)"
        )
        direction.add_argument("--overwrite", action="store_true", help="replace an existing --out")
        _add_verbose(direction)
        direction.set_defaults(handler=handler)


def build_parser() -> argparse.ArgumentParser:
    from megatron_rl.cli.bench import add_bench
    from megatron_rl.cli.launch import add_launch, add_plan

    parser = argparse.ArgumentParser(prog="megatron-rl", description=__doc__)
    commands = parser.add_subparsers(dest="command", required=True)
    for add in (_add_train, _add_losses, add_bench, _add_convert, add_launch, add_plan):
        add(commands)
    return parser


def main(argv: list[str] | None = None) -> int:
    # First: a graceful signal that the launcher left to this rank is kept from now on, and a
    # rank of torchrun ends when torchrun does, however it ends (docs/slurm.md).
    keep_early_signals()
    if TORCHRUN_WORKER in os.environ:
        end_with_parent()
    args = _parse(build_parser(), argv)
    if args.handler is not _train:  # the one command with a graceful stop
        release_early_signals()
    # Before the subcommand imports megatron-core, which warns at import.
    from megatron_rl.cli.known_warnings import WarningRouter

    args.known_warnings = WarningRouter(verbose=getattr(args, "verbose", False))
    args.known_warnings.install()
    from megatron_rl.rollout.sglang.http import SGLangError

    try:
        return args.handler(args)
    except ValueError as error:  # the command line, a recipe, an input file
        print(f"megatron-rl: error: {error}", file=sys.stderr)
        return 2
    except (OSError, SGLangError) as error:  # the machine: a disk, a server
        print(f"megatron-rl: error: {_one_line(error)}", file=sys.stderr)
        return 1


def _parse(parser: argparse.ArgumentParser, argv: list[str] | None) -> argparse.Namespace:
    """The command line; KEY=VALUE overrides written after an option (`train R --resume
    a.b=c`) are overrides too (argparse ends a list of positionals at the first option)."""
    args, unknown = parser.parse_known_args(argv)
    if unknown:
        takes_overrides = isinstance(getattr(args, "overrides", None), list)
        if takes_overrides and all("=" in item and not item.startswith("-") for item in unknown):
            args.overrides = [*args.overrides, *unknown]  # not the shared default list
        else:
            hint = " (overrides are dotted KEY=VALUE)" if takes_overrides else ""
            parser.error(f"unrecognized arguments: {' '.join(unknown)}{hint}")
    return args


def _one_line(error: Exception) -> str:
    if isinstance(error, OSError) and error.strerror:
        where = error.filename if error.filename is not None else type(error).__name__
        if error.filename2 is not None:  # a copy or a rename: from -> to
            where = f"{where} -> {error.filename2}"
        return f"{where}: {error.strerror}"
    return str(error)
