"""`megatron-rl launch slurm`: render a recipe's SLURM batch script and submit it."""

from __future__ import annotations

import argparse
import subprocess
import sys
from pathlib import Path

from megatron_rl.cli.arguments import positive_int

SCRIPT_NAME = "train.sbatch"


def _slurm(args: argparse.Namespace) -> int:
    from megatron_rl.config import load_config
    from megatron_rl.files.atomic import write_text_atomic
    from megatron_rl.launch.slurm import SlurmJob, check_layout, render_train_script
    from megatron_rl.trainer.recipe import Recipe
    from megatron_rl.trainer.run_dir import refuse_earlier_run

    recipe_path = Path(args.recipe).resolve()
    recipe = load_config(Recipe, recipe_path, args.overrides)
    workdir = Path.cwd()
    job = SlurmJob(
        nodes=args.nodes,
        gpus_per_node=args.gpus_per_node,
        rollout_nodes=args.rollout_nodes,
        partition=args.partition,
        account=args.account,
        time_limit=args.time,
        signal_before_s=args.signal_before,
        device=args.device,
        master_port=args.master_port,
        python=args.python,
        workdir=str(workdir),
        resume=args.resume,
    )
    run_dir = workdir / recipe.run.dir
    log_dir = run_dir / "slurm"
    script = render_train_script(recipe_path, args.overrides, recipe, job, log_dir=log_dir)
    if args.dry_run:
        print(script, end="")
        return 0
    check_layout(recipe, job, model_must_exist=True)
    if not args.resume and run_dir.is_dir():
        refuse_earlier_run(run_dir)
    path = write_text_atomic(log_dir / SCRIPT_NAME, script)  # SLURM opens --output in log_dir
    submitted = subprocess.run(
        ["sbatch", "--parsable", str(path)], capture_output=True, text=True, check=False
    )
    if submitted.returncode != 0:
        print(f"megatron-rl: sbatch {path} failed: {submitted.stderr.strip()}", file=sys.stderr)
        return 1
    job_id = submitted.stdout.strip().split(";")[0]
    print(f"submitted job {job_id} ({path}); logs in {log_dir}")
    return 0


def add_launch(commands: argparse._SubParsersAction) -> None:
    launch = commands.add_parser("launch", help="run a recipe on a cluster (SLURM)")
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
    parser.add_argument("--nodes", type=positive_int, required=True, help="nodes that train")
    parser.add_argument(
        "--gpus-per-node", type=positive_int, default=8, help="trainer ranks per node (8)"
    )
    parser.add_argument(
        "--rollout-nodes",
        type=int,
        default=0,
        help="further nodes that only run SGLang servers (rollout.backend=sglang; default 0)",
    )
    parser.add_argument("--partition", help="SLURM partition (default: the cluster's)")
    parser.add_argument("--account", help="SLURM account (default: yours)")
    parser.add_argument("--time", help="time limit, [D-]HH:MM:SS (default: the partition's)")
    parser.add_argument(
        "--signal-before",
        type=positive_int,
        default=900,
        metavar="SECONDS",
        help="tell the trainer to checkpoint and stop this long before the time limit (900)",
    )
    parser.add_argument(
        "--device", choices=("cuda", "cpu"), default="cuda", help="GPUs (cuda) or CPU processes"
    )
    parser.add_argument(
        "--master-port", type=int, default=29500, help="trainer rendezvous port (29500)"
    )
    parser.add_argument(
        "--python",
        default=sys.executable,
        help="interpreter with megatron-rl, seen by every node (default: this one)",
    )
    parser.add_argument(
        "--resume",
        action="store_true",
        help="continue the run in run.dir (a fresh job refuses an earlier run's directory)",
    )
    parser.add_argument("--dry-run", action="store_true", help="print the script; submit nothing")
    parser.set_defaults(handler=_slurm)
