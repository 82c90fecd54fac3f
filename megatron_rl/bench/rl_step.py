"""Benchmark: the whole RL step, megatron-rl beside TRL's GRPOTrainer on the same work.

Every arm trains GSPO on the shipped tiny Qwen3-MoE (`examples/moe/tiny_qwen3_moe`) with the
same prompts (the arithmetic task's training problems of run.seed, in step order), group size,
response length and one update per generation batch, each arm in a process of its own, one
after the other on the same machine:

- megatron-rl lock-step (`examples/moe/tiny_gspo.yaml`), with `rollout.max_staleness=1` (the
  engine on the trainer's thread, or in a process of its own), with the engine's log-probs as
  the old ones (`algo.mismatch=bypass`), with token-budget micro-batches
  (`run.micro_batch_tokens`), packed within the same budget (`run.packed_sequences`), and with
  an SGLang server
  (`examples/moe/tiny_gspo_sglang.yaml`; needs .venv-sglang);
- TRL 1.16's GRPOTrainer with importance_sampling_level="sequence" (GSPO), in its own
  environment (.venv-trl, made by scripts/install_trl_bench.sh; megatron_rl/bench/peers).

Reported per arm: seconds per step (median, and the smallest and largest, over the steps after
the warm-up; megatron-rl's last step, which evaluates, is left out), response tokens per second,
the peak resident memory of the arm's process (SGLang's server, a process of its own, is not in
it), and megatron-rl's split by phase and share of padding in the trainer's micro-batches. The
compute floor of a step is its model FLOPs (the generation's forwards over every prompt and
response token, the update's forward and backward, 3x, over the same tokens;
megatron_rl.bench.train_step's count) over the matrix-product peak measured in the same run:
the time no implementation on this machine can beat.
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import tempfile
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch

from megatron_rl.bench.report import machine, now
from megatron_rl.bench.report import write_report as report_files
from megatron_rl.bench.train_step import matmul_parameters, matmul_peak
from megatron_rl.models.hf_source import inspect_hf
from megatron_rl.rewards import DataConfig, problem_source
from megatron_rl.rollout.codec import PromptCodec

REPO = Path(__file__).resolve().parents[2]
TRL_PEER = Path(__file__).resolve().parent / "peers" / "trl_grpo.py"

# arm -> (recipe, overrides beyond the common ones)
MEGATRON_ARMS: dict[str, tuple[str, tuple[str, ...]]] = {
    "megatron-rl lock-step": ("examples/moe/tiny_gspo.yaml", ()),
    "megatron-rl max_staleness=1": ("examples/moe/tiny_gspo.yaml", ("rollout.max_staleness=1",)),
    "megatron-rl max_staleness=1, engine process": (
        "examples/moe/tiny_gspo.yaml",
        ("rollout.max_staleness=1", "rollout.local_process=true"),
    ),
    "megatron-rl engine log-probs": ("examples/moe/tiny_gspo.yaml", ("algo.mismatch=bypass",)),
    # 32 rows of 64 tokens, the default micro_batch_size at about the task's sequence length
    "megatron-rl token budget": ("examples/moe/tiny_gspo.yaml", ("run.micro_batch_tokens=2048",)),
    "megatron-rl packed": (
        "examples/moe/tiny_gspo.yaml",
        ("run.micro_batch_tokens=2048", "run.packed_sequences=true"),
    ),
    "megatron-rl SGLang": ("examples/moe/tiny_gspo_sglang.yaml", ()),
}
TRL_ARM = "TRL GRPOTrainer (GSPO)"
PHASES = ("rollout", "old_logprob", "train", "weight_sync")


@dataclass(frozen=True)
class RLStepBenchSpec:
    steps: int = 12  # per arm, warm-up included
    warmup: int = 2
    prompts_per_step: int = 16
    group_size: int = 8
    max_new_tokens: int = 32
    lr: float = 2e-4
    seed: int = 0
    arms: tuple[str, ...] = field(default_factory=lambda: (*MEGATRON_ARMS, TRL_ARM))
    model: str = "examples/moe/tiny_qwen3_moe"

    def __post_init__(self) -> None:
        unknown = [arm for arm in self.arms if arm not in (*MEGATRON_ARMS, TRL_ARM)]
        if unknown:
            raise ValueError(
                f"arms: unknown {unknown}; valid: {', '.join((*MEGATRON_ARMS, TRL_ARM))}"
            )
        if not 0 <= self.warmup < self.steps - 2:
            raise ValueError(
                f"warmup: expected 0 <= warmup < steps - 2 (steps {self.steps}), got {self.warmup}"
            )


def _run_measured(command: list[str], log: Path, env: dict[str, str] | None = None) -> int:
    """Run `command` to its end (output to `log`); returns its peak resident memory in KiB."""
    with open(log, "w") as out:
        process = subprocess.Popen(command, cwd=REPO, stdout=out, stderr=subprocess.STDOUT, env=env)
        _, status, usage = os.wait4(process.pid, 0)
    code = os.waitstatus_to_exitcode(status)
    if code != 0:
        raise RuntimeError(
            f"{' '.join(command[:4])} ... exited with {code}; {log}:\n{log.read_text()[-3000:]}"
        )
    return usage.ru_maxrss


def _summary(seconds: list[float], tokens: list[float]) -> dict[str, float]:
    return {
        "step_s_median": statistics.median(seconds),
        "step_s_min": min(seconds),
        "step_s_max": max(seconds),
        "tokens_per_step": statistics.mean(tokens),
        "tokens_per_s": sum(tokens) / sum(seconds),
    }


def _megatron_arm(spec: RLStepBenchSpec, arm: str, workdir: Path) -> dict[str, object]:
    recipe, extra = MEGATRON_ARMS[arm]
    run_dir = workdir / arm.replace(" ", "_").replace("=", "")
    common = [
        f"model.hf_path={spec.model}",
        f"rollout.prompts_per_step={spec.prompts_per_step}",
        f"rollout.group_size={spec.group_size}",
        f"rollout.max_new_tokens={spec.max_new_tokens}",
        "algo.loss=gspo",
        "algo.updates_per_batch=1",
        f"optim.lr={spec.lr}",
        f"run.seed={spec.seed}",
        f"run.steps={spec.steps}",
        f"run.eval_every={spec.steps}",
        f"run.dir={run_dir}",
        "metrics.console=false",
        "checkpoint.export_hf=false",
    ]
    command = [sys.executable, "-m", "megatron_rl.cli", "train", recipe, *common, *extra]
    peak_kib = _run_measured(command, workdir / f"{run_dir.name}.log")
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    timed = [r for r in records if spec.warmup < r["step"] < spec.steps]
    seconds = [r["time/step_s"] for r in timed]
    tokens = [r["throughput/response_tokens_per_s"] * r["time/step_s"] for r in timed]
    phases = {
        phase: statistics.median(r.get(f"time/{phase}_s", 0.0) for r in timed) for phase in PHASES
    }
    padding = statistics.median(r["trainer/padding_frac"] for r in timed)
    return _summary(seconds, tokens) | {
        "peak_rss_mib": peak_kib / 1024,
        "phases": phases,
        "padding_frac": padding,
    }


def _trl_arm(spec: RLStepBenchSpec, workdir: Path) -> dict[str, object]:
    subprocess.run(["bash", str(REPO / "scripts" / "install_trl_bench.sh")], check=True)
    problems = [
        {"prompt": problem.prompt, "reference": problem.reference}
        for problem in _step_problems(spec)
    ]
    problems_path, out = workdir / "trl_problems.json", workdir / "trl_result.json"
    problems_path.write_text(json.dumps(problems))
    command = [
        str(REPO / ".venv-trl" / "bin" / "python"),
        str(TRL_PEER),
        f"--model={spec.model}",
        f"--problems={problems_path}",
        f"--steps={spec.steps}",
        f"--group-size={spec.group_size}",
        f"--max-new-tokens={spec.max_new_tokens}",
        f"--lr={spec.lr}",
        f"--seed={spec.seed}",
        f"--out={out}",
    ]
    env = dict(os.environ, HF_HUB_OFFLINE="1", TOKENIZERS_PARALLELISM="false")
    peak_kib = _run_measured(command, workdir / "trl.log", env)
    result = json.loads(out.read_text())
    seconds = result["seconds"][spec.warmup :]
    tokens = result["completion_tokens"][spec.warmup :]
    return _summary(seconds, tokens) | {
        "peak_rss_mib": peak_kib / 1024,
        "gradient_checkpointing": result["gradient_checkpointing"],
    }


def _step_problems(spec: RLStepBenchSpec) -> list:
    """The problems megatron-rl trains on, step by step (every arm gets these)."""
    source = problem_source(DataConfig(), per_step=spec.prompts_per_step, seed=spec.seed)
    return [problem for step in range(1, spec.steps + 1) for problem in source.train_batch(step)]


def _compute_floor(spec: RLStepBenchSpec, response_tokens: float) -> dict[str, float]:
    """The step's model FLOPs and the seconds they take at the measured matmul peak."""
    model = inspect_hf(REPO / spec.model, given_as="model")
    config = model.config
    model.checkpoint.close()
    codec = PromptCodec(str(REPO / spec.model), max_prompt_tokens=config.max_position_embeddings)
    problems = _step_problems(spec)
    prompt_tokens = (
        spec.group_size
        * statistics.mean(len(codec.encode_prompt(problem.prompt)) for problem in problems)
        * spec.prompts_per_step
    )
    tokens = prompt_tokens + response_tokens
    mean_length = tokens / (spec.prompts_per_step * spec.group_size)
    query = config.num_attention_heads * config.kv_channels
    # causal attention: QK^T and AV over half the sequence on average (train_step's count)
    forward = 2 * matmul_parameters(config) + 2 * config.num_layers * mean_length * query
    flops = forward * tokens + 3 * forward * tokens  # generation, then the update
    peak = matmul_peak(2048, torch.float32, torch.device("cpu"))
    return {"step_flops": flops, "matmul_peak_flops": peak, "floor_s": flops / peak}


def run_benchmark(spec: RLStepBenchSpec, workdir: Path | None = None) -> dict[str, object]:
    if workdir is not None:
        workdir.mkdir(parents=True, exist_ok=True)  # the scratch space's parent, kept
    with tempfile.TemporaryDirectory(dir=workdir) as scratch:
        arms = {
            arm: _trl_arm(spec, Path(scratch))
            if arm == TRL_ARM
            else _megatron_arm(spec, arm, Path(scratch))
            for arm in spec.arms
        }
    tokens = statistics.mean(result["tokens_per_step"] for result in arms.values())
    report: dict[str, object] = {
        "benchmark": "rl_step",
        "date": now(),
        "machine": machine(),
        "spec": asdict(spec),
        "arms": arms,
        "floor": _compute_floor(spec, tokens),
    }
    if TRL_ARM in arms:
        baseline = arms[TRL_ARM]["tokens_per_s"]
        for result in arms.values():
            result["tokens_per_s_vs_trl"] = result["tokens_per_s"] / baseline
    return report


def format_markdown(report: dict) -> str:
    spec, floor, host = report["spec"], report["floor"], report["machine"]
    lines = [
        "# RL step: megatron-rl beside TRL on the same work",
        "",
        f"{report['date']}, {host['cpu']} ({host['cores']} cores), torch {host['torch']}. "
        f"GSPO on `{spec['model']}`: {spec['prompts_per_step']} prompts x {spec['group_size']} "
        f"samples, at most {spec['max_new_tokens']} new tokens, one update per batch; "
        f"{spec['steps']} steps per arm, the first {spec['warmup']} not timed.",
        "",
        "| arm | s/step median [min, max] | response tokens/s | vs TRL | peak RSS MiB |"
        " rollout / old log-probs / train / sync s | padding |",
        "|---|---|---|---|---|---|---|",
    ]
    for arm, result in report["arms"].items():
        phases = result.get("phases")
        split = " / ".join(f"{phases[p]:.3f}" for p in PHASES) if phases else "-"
        ratio = result.get("tokens_per_s_vs_trl")
        versus = "-" if ratio is None else f"{ratio:.2f}x"
        padding = result.get("padding_frac")
        padded = "-" if padding is None else f"{padding:.0%}"
        lines.append(
            f"| {arm} | {result['step_s_median']:.3f} [{result['step_s_min']:.3f}, "
            f"{result['step_s_max']:.3f}] | {result['tokens_per_s']:.0f} | {versus} | "
            f"{result['peak_rss_mib']:.0f} | {split} | {padded} |"
        )
    lines += [
        "",
        f"Compute floor: {floor['step_flops'] / 1e9:.1f} GFLOP per step at the measured matmul "
        f"peak of {floor['matmul_peak_flops'] / 1e9:.0f} GFLOP/s = {floor['floor_s']:.3f} s.",
    ]
    return "\n".join(lines)


def write_report(report: dict, out_dir: Path) -> tuple[Path, Path]:
    return report_files(report, out_dir, "rl_step", format_markdown)
