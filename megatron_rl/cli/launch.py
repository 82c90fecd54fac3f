"""`megatron-rl launch slurm` (render a recipe's SLURM batch script and submit it),
`megatron-rl launch slurm-convert` (a conversion as a SLURM job) and `megatron-rl plan` (what
the recipe's layout holds on each GPU of a cluster)."""

from __future__ import annotations

import argparse
import subprocess
import sys
from pathlib import Path
from typing import TYPE_CHECKING

from megatron_rl.cli.arguments import positive_float, positive_int

if TYPE_CHECKING:
    from megatron_rl.launch.slurm import SlurmJob

SCRIPT_NAME = "train.sbatch"


def _job(args: argparse.Namespace, **options: object) -> SlurmJob:
    from megatron_rl.launch.slurm import SlurmJob

    return SlurmJob(
        nodes=args.nodes,
        gpus_per_node=args.gpus_per_node,
        partition=args.partition,
        account=args.account,
        time_limit=args.time,
        device=args.device,
        master_port=args.master_port,
        python=args.python,
        workdir=str(Path.cwd()),
        network_interface=args.network_interface,
        **options,
    )


def _submit(script: str, path: Path, log_dir: Path) -> int:
    """Write `script` to `path` and submit it; the job's logs go to `log_dir`."""
    from megatron_rl.files.atomic import write_text_atomic

    log_dir.mkdir(parents=True, exist_ok=True)  # SLURM opens --output there
    write_text_atomic(path, script)
    submitted = subprocess.run(
        ["sbatch", "--parsable", str(path)], capture_output=True, text=True, check=False
    )
    if submitted.returncode != 0:
        print(f"megatron-rl: sbatch {path} failed: {submitted.stderr.strip()}", file=sys.stderr)
        return 1
    job_id = submitted.stdout.strip().split(";")[0]
    print(f"submitted job {job_id} ({path}); logs in {log_dir}")
    return 0


def _slurm(args: argparse.Namespace) -> int:
    from megatron_rl.config import load_config
    from megatron_rl.launch.slurm import check_layout, render_train_script
    from megatron_rl.trainer.recipe import Recipe
    from megatron_rl.trainer.run_dir import refuse_earlier_run

    recipe_path = Path(args.recipe).resolve()
    recipe = load_config(Recipe, recipe_path, args.overrides)
    job = _job(
        args,
        rollout_nodes=args.rollout_nodes,
        signal_before_s=args.signal_before,
        resume=args.resume,
    )
    run_dir = Path.cwd() / recipe.run.dir
    log_dir = run_dir / "slurm"
    script = render_train_script(recipe_path, args.overrides, recipe, job, log_dir=log_dir)
    if args.dry_run:
        print(script, end="")
        return 0
    check_layout(recipe, job, model_must_exist=True)
    if not args.resume and run_dir.is_dir():
        refuse_earlier_run(run_dir)
    return _submit(script, log_dir / SCRIPT_NAME, log_dir)


def _slurm_convert(args: argparse.Namespace) -> int:
    from megatron_rl.checkpoint.format import read_metadata
    from megatron_rl.cli import build_parser
    from megatron_rl.files.atomic import check_output_dir
    from megatron_rl.launch.slurm import render_command_script
    from megatron_rl.models.hf_source import inspect_hf
    from megatron_rl.parallel.dims import ParallelDims

    command = args.command[1:] if args.command[:1] == ["--"] else args.command
    # The conversion's own arguments, checked as `megatron-rl convert` will check them.
    convert = build_parser().parse_args(["convert", *command])
    job = _job(args)
    dims = ParallelDims(
        world_size=args.nodes * args.gpus_per_node,
        tp=convert.tp,
        pp=convert.pp,
        ep=convert.ep,
        etp=convert.etp,
    )
    out = Path(convert.out).resolve()
    log_dir = Path(args.log_dir).resolve()
    name = f"convert-{out.name}"
    script = render_command_script(
        ["convert", *command], job, dims=dims, name=name, log_dir=log_dir
    )
    if args.dry_run:
        print(script, end="")
        return 0
    if convert.direction == "hf-to-mcore":
        inspect_hf(Path(convert.hf), given_as="--hf")
    else:
        read_metadata(Path(convert.ckpt), given_as="--ckpt")
    check_output_dir(out, overwrite=convert.overwrite)
    return _submit(script, log_dir / f"{name}.sbatch", log_dir)


def _add_job_options(parser: argparse.ArgumentParser) -> None:
    """The options every SLURM job takes: nodes, GPUs, partition, account, time, ..."""
    parser.add_argument(
        "--nodes", type=positive_int, required=True, help="nodes that run the ranks (that train)"
    )
    parser.add_argument(
        "--gpus-per-node", type=positive_int, default=8, help="ranks per node, one per GPU (8)"
    )
    parser.add_argument("--partition", help="SLURM partition (default: the cluster's)")
    parser.add_argument("--account", help="SLURM account (default: yours)")
    parser.add_argument("--time", help="time limit, [D-]HH:MM:SS (default: the partition's)")
    parser.add_argument(
        "--device", choices=("cuda", "cpu"), default="cuda", help="GPUs (cuda) or CPU processes"
    )
    parser.add_argument("--master-port", type=int, default=29500, help="rendezvous port (29500)")
    parser.add_argument(
        "--network-interface",
        metavar="IFNAME",
        help="the cluster fabric's interface (e.g. ib0): NCCL and gloo bootstrap there "
        "(default: each chooses)",
    )
    parser.add_argument(
        "--python",
        default=sys.executable,
        help="interpreter with megatron-rl, seen by every node (default: this one)",
    )
    parser.add_argument("--dry-run", action="store_true", help="print the script; submit nothing")


def add_launch(commands: argparse._SubParsersAction) -> None:
    launch = commands.add_parser("launch", help="run a recipe or a conversion on SLURM")
    schedulers = launch.add_subparsers(dest="scheduler", required=True)
    parser = schedulers.add_parser(
        "slurm",
        help="render a recipe's sbatch script and submit it (docs/slurm.md)",
        description="Check the recipe against the cluster (layout over nodes x GPUs), render its "
        "batch script into RUN_DIR/slurm/ and submit it with sbatch. Preempted or timed-out jobs "
        "checkpoint, requeue themselves and resume.",
    )
    parser.add_argument("recipe", help="YAML recipe, e.g. examples/moe/qwen3_30b_a3b_gspo.yaml")
    parser.add_argument("overrides", nargs="*", default=[], help="dotted KEY=VALUE overrides")
    _add_job_options(parser)
    parser.add_argument(
        "--rollout-nodes",
        type=int,
        default=0,
        help="further nodes that only run SGLang servers (rollout.backend=sglang; default 0)",
    )
    parser.add_argument(
        "--signal-before",
        type=positive_int,
        default=900,
        metavar="SECONDS",
        help="tell the trainer to checkpoint and stop this long before the time limit (900)",
    )
    parser.add_argument(
        "--resume",
        action="store_true",
        help="continue the run in run.dir (a fresh job refuses an earlier run's directory)",
    )
    parser.set_defaults(handler=_slurm)
    convert = schedulers.add_parser(
        "slurm-convert",
        help="a checkpoint conversion as a SLURM job (docs/slurm.md, Conversions)",
        description="Render and submit a job that runs `megatron-rl convert ...` under torchrun "
        "on the nodes asked for, e.g. `launch slurm-convert --nodes 1 -- hf-to-mcore --hf HF "
        "--out CKPT --ep 8`. The conversion's arguments are checked first.",
    )
    _add_job_options(convert)
    convert.add_argument(
        "--log-dir", default="slurm-logs", help="where the job's logs go (./slurm-logs)"
    )
    convert.add_argument(
        "command", nargs=argparse.REMAINDER, help="-- and the arguments of `megatron-rl convert`"
    )
    convert.set_defaults(handler=_slurm_convert)


def _plan(args: argparse.Namespace) -> int:
    from megatron_rl.config import load_config
    from megatron_rl.launch.plan import Cluster, format_plan, load_model, make_plan
    from megatron_rl.trainer.recipe import Recipe

    recipe = load_config(Recipe, args.recipe, args.overrides)
    model = load_model(recipe, Path(args.model_config) if args.model_config else None)
    cluster = Cluster(
        nodes=args.nodes,
        gpus_per_node=args.gpus_per_node,
        gpu_memory_gib=args.gpu_memory_gb,
        reserve_gib=args.reserve_gb,
        prompt_tokens=args.prompt_tokens,
        rollout_nodes=args.rollout_nodes,
    )
    plan = make_plan(recipe, model, cluster)
    print(format_plan(plan), end="")
    return 0 if plan.fits else 1


def add_plan(commands: argparse._SubParsersAction) -> None:
    parser = commands.add_parser(
        "plan",
        help="check a recipe's layout for a cluster and what each GPU holds (no GPU needed)",
        description="Validate the recipe's layout for NODES x GPUS and print, per pipeline stage, "
        "the parameters, gradients, optimizer state, activations, logits and routing record of a "
        "rank, whether it fits and the largest micro-batch that does (docs/slurm.md, Planning). "
        "Exit status 1 when it does not fit, 2 when the layout cannot split the model.",
    )
    parser.add_argument("recipe", help="YAML recipe, e.g. examples/moe/qwen3_30b_a3b_gspo.yaml")
    parser.add_argument("overrides", nargs="*", default=[], help="dotted KEY=VALUE overrides")
    parser.add_argument("--nodes", type=positive_int, required=True, help="nodes that train")
    parser.add_argument("--gpus-per-node", type=positive_int, default=8, help="GPUs per node (8)")
    parser.add_argument(
        "--gpu-memory-gb", type=positive_float, default=80.0, help="memory per GPU, GiB (80)"
    )
    parser.add_argument(
        "--reserve-gb",
        type=float,
        default=4.0,
        help="GiB per GPU kept for the CUDA context, NCCL and fragmentation (4)",
    )
    parser.add_argument(
        "--prompt-tokens",
        type=positive_int,
        default=1024,
        help="longest prompt in tokens (the response is rollout.max_new_tokens; default 1024)",
    )
    parser.add_argument(
        "--rollout-nodes",
        type=int,
        default=0,
        help="rollout nodes of the job (then no SGLang server shares the trainer's GPUs)",
    )
    parser.add_argument(
        "--model-config",
        help="the model's config.json (any name), instead of model.hf_path's",
    )
    parser.set_defaults(handler=_plan)
