"""Run `megatron-rl train` in a subprocess (one process, or 2 ranks under torchrun) and read
its metrics; every process started here is stopped by its PID, with the processes it started
when the run does not end by itself (`tests.processes.run_bounded`)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

from tests.processes import free_port, run_bounded

REPO = Path(__file__).resolve().parents[2]
TINY_MODEL = REPO / "examples" / "moe" / "tiny_qwen3_moe"
RECIPE = REPO / "examples" / "moe" / "tiny_gspo.yaml"
# The CPU SGLang recipe: the trainer starts a real SGLang server of its own (tests/sglang).
SGLANG_RECIPE = REPO / "examples" / "moe" / "tiny_gspo_sglang.yaml"

# A few small steps of the main recipe: 8 prompts x 4 samples, 2 updates per step.
SHORT_RUN = [
    f"model.hf_path={TINY_MODEL}",
    "rollout.prompts_per_step=8",
    "rollout.group_size=4",
    "rollout.max_new_tokens=40",
    "algo.updates_per_batch=2",
    "data.eval_problems=8",
    "run.steps=2",
    "run.eval_every=2",
    "run.micro_batch_size=8",
    "checkpoint.save_every=0",
    "checkpoint.export_hf=false",
    "metrics.console=false",
]
# Three steps with a checkpoint after each: a run stopped after one of them can be resumed.
RESUMED_RUN = ["run.steps=3", "checkpoint.save_every=1", "run.eval_every=2"]
# Metrics that measure the machine, not the run.
TIMING = ("time/", "throughput/")


def train_command(
    run_dir: Path,
    overrides: list[str],
    nproc: int,
    resume: bool,
    module: str = "megatron_rl.cli",
    recipe: Path = RECIPE,
) -> list[str]:
    train = ["train", str(recipe), *SHORT_RUN, f"run.dir={run_dir}", *overrides]
    if resume:
        train.append("--resume")
    if nproc == 1:
        return [sys.executable, "-m", module, *train]
    return [
        sys.executable,
        "-m",
        "torch.distributed.run",
        f"--nproc_per_node={nproc}",
        f"--master_port={free_port()}",
        "-m",
        "megatron_rl.cli",
        *train,
    ]


def train_cli_each(runs: list[tuple[Path, list[str]]]) -> list[subprocess.CompletedProcess]:
    """`megatron-rl train` on one process for each `(run_dir, overrides)`, one after the other in
    one interpreter (`tests.trainer.each_command`): for runs that fail before training, whose
    time would be the imports'."""
    # each command's arguments, less `python -m megatron_rl.cli`
    commands = [train_command(run_dir, overrides, 1, False)[3:] for run_dir, overrides in runs]
    with tempfile.TemporaryDirectory() as scratch, tempfile.TemporaryFile("w+") as output:
        results = Path(scratch) / "results.json"
        done = run_bounded(
            [sys.executable, "-m", "tests.trainer.each_command", str(results)]
            + [json.dumps(command) for command in commands],
            cwd=REPO,
            env=train_environment(),
            stdout=output,
            stderr=output,
            timeout=300,
        )
        output.seek(0)
        assert done.returncode == 0, output.read()[-3000:]
        return [
            subprocess.CompletedProcess(command, result["returncode"], "", result["stderr"])
            for command, result in zip(commands, json.loads(results.read_text()), strict=True)
        ]


def train_environment(extra: dict[str, str] | None = None) -> dict[str, str]:
    # Warnings stay on: the CLI keeps the known ones off the console (megatron_rl/cli).
    env = dict(os.environ, OMP_NUM_THREADS="1") | (extra or {})
    env.pop("PYTHONWARNINGS", None)
    for name in ("RANK", "WORLD_SIZE", "WANDB_API_KEY"):
        env.pop(name, None)
    return env


def train_cli(
    run_dir: Path,
    overrides: list[str] = (),
    *,
    nproc: int = 1,
    resume: bool = False,
    timeout: float = 300,
    module: str = "megatron_rl.cli",
    extra_env: dict[str, str] | None = None,
    recipe: Path = RECIPE,
) -> subprocess.CompletedProcess:
    """`megatron-rl train` (or `module`'s main, same arguments) on the short run of `recipe`
    (the main one unless given) + overrides."""
    # Output goes to files, not pipes: a helper the run leaves behind that outlives it (torch's
    # shared-memory manager lives while an SGLang server holds tensors the run shared) would
    # hold a pipe open and keep a reader of it waiting for its end.
    with tempfile.TemporaryFile("w+") as stdout, tempfile.TemporaryFile("w+") as stderr:
        process = run_bounded(
            train_command(run_dir, list(overrides), nproc, resume, module, recipe),
            cwd=REPO,
            env=train_environment(extra_env),
            stdout=stdout,
            stderr=stderr,
            timeout=timeout,
        )
        stdout.seek(0)
        stderr.seek(0)
        process.stdout, process.stderr = stdout.read(), stderr.read()
    return process


def finished_run_metrics(
    result: subprocess.CompletedProcess, run_dir: Path
) -> dict[int, dict[str, float]]:
    """The metrics of a short run (steps 0-2) that must have ended well."""
    assert result.returncode == 0, result.stderr[-3000:]
    metrics = read_metrics(run_dir)
    assert sorted(metrics) == [0, 1, 2]
    return metrics


def read_metrics(run_dir: Path) -> dict[int, dict[str, float]]:
    lines = (run_dir / "metrics.jsonl").read_text().splitlines()
    records = [json.loads(line) for line in lines]
    by_step = {record["step"]: record for record in records}
    assert len(by_step) == len(records), "a step was logged twice"
    return by_step


def check_repeats(
    whole: dict, run_dir: Path, resumed_steps: tuple[int, ...], *, near: tuple[str, ...] = ()
) -> None:
    """`run_dir`'s metrics are `whole`'s, each step logged once, and equal to the last bit
    (timings aside) for `resumed_steps`; those whose names start with one of `near` within
    1e-6."""
    actual = read_metrics(run_dir)
    assert sorted(actual) == sorted(whole)
    for step in resumed_steps:
        keys = {key for key in whole[step] if not key.startswith(TIMING)}
        assert keys == {key for key in actual[step] if not key.startswith(TIMING)}
        for key in keys:
            if key.startswith(near):
                assert abs(actual[step][key] - whole[step][key]) <= 1e-6, (step, key)
            else:
                assert actual[step][key] == whole[step][key], (step, key)
