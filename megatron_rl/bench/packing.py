"""Benchmark: what padding costs the training step, and what token budgets and packing save.

One update over the same rollouts (128 samples whose prompt + response lengths are drawn
uniformly from 30 to 130 tokens, the spread of RL responses that end early or run long) cut into
micro-batches by the trainer's own `micro_batches` three ways: rows (`run.micro_batch_size` rows
per pass, every pass as wide as the longest sample), a token budget (`run.micro_batch_tokens`:
rows of like length, each pass as wide as its longest row) and packed within the same budget
(`run.packed_sequences`: rows back to back, THD). Each runs the step of `bench train-step`
(megatron_rl/bench/train_step.py: a random MoE, GSPO, megatron-core's model, DDP, Adam and
schedule, one rank). Arms run in interleaved rounds (each arm once per round), so that a slow
spell of a shared machine falls on all of them; each round's figure is the median of its timed
steps, the report's the median over rounds. Reported per arm: the step time and its ratio to
the rows', the positions the passes hold and the share of them that is padding (issue 37's
target: at most 10%).
"""

from __future__ import annotations

import statistics
from dataclasses import asdict, dataclass, replace
from pathlib import Path

import torch

from megatron_rl.bench import train_step
from megatron_rl.bench.report import machine, now
from megatron_rl.bench.report import write_report as report_files
from megatron_rl.rollout.engine import Sample
from megatron_rl.trainer.batches import RolloutBatch, build_rollout_batch, micro_batches
from megatron_rl.trainer.micro_batch import PolicyMicroBatch

# arm -> (micro_batch_tokens is the spec's budget, packed)
ARMS = {"rows": (False, False), "token budget": (True, False), "packed": (True, True)}


@dataclass(frozen=True)
class PackingSpec:
    """The rollouts, their cuts, the model and the timing."""

    samples: int = 128
    shortest: int = 30  # prompt + response tokens
    longest: int = 130
    prompt: int = 16
    micro_batch_size: int = 16  # rows per pass (the rows arm); the budget's bound on rows
    micro_batch_tokens: int = 2048  # the budget of the other arms
    layers: int = 4
    hidden: int = 256
    heads: int = 4
    kv_heads: int = 2
    experts: int = 8
    topk: int = 2
    moe_ffn: int = 64
    vocab: int = 2048
    steps: int = 3  # timed steps per arm and round, after one warm-up step
    rounds: int = 3
    seed: int = 0

    def __post_init__(self) -> None:
        if not self.prompt < self.shortest <= self.longest:
            raise ValueError(
                f"lengths: expected prompt {self.prompt} < shortest {self.shortest} <= longest "
                f"{self.longest}"
            )

    def step_spec(self) -> train_step.TrainStepSpec:
        return train_step.TrainStepSpec(
            layers=self.layers,
            hidden=self.hidden,
            heads=self.heads,
            kv_heads=self.kv_heads,
            experts=self.experts,
            topk=self.topk,
            moe_ffn=self.moe_ffn,
            vocab=self.vocab,
            seq=self.longest,
            steps=self.steps,
            dtype="float32",
            matmul_size=512,
        )


def rollouts(spec: PackingSpec) -> RolloutBatch:
    """`spec.samples` seeded samples of random tokens, lengths uniform in [shortest, longest]."""
    gen = torch.Generator().manual_seed(spec.seed)
    lengths = torch.randint(spec.shortest, spec.longest + 1, (spec.samples,), generator=gen)
    samples = []
    for length in lengths.tolist():
        tokens = torch.randint(2, spec.vocab, (length,), generator=gen).tolist()
        response = length - spec.prompt
        samples.append(
            Sample(
                prompt_ids=tuple(tokens[: spec.prompt]),
                response_ids=tuple(tokens[spec.prompt :]),
                logprobs=-torch.rand(response, generator=gen) - 7.0,
                finish_reason="stop",
            )
        )
    rewards = torch.randint(0, 2, (spec.samples,), generator=gen).float()
    return build_rollout_batch(samples, rewards, group_size=8, pad_id=0, newline_token_ids=[1])


def cut(spec: PackingSpec, batch: RolloutBatch, arm: str) -> list[PolicyMicroBatch]:
    """`batch`'s rows cut as `arm` cuts them, with advantages and the engine's log-probs as the
    old ones."""
    budgeted, packed = ARMS[arm]
    advantages = torch.linspace(-1.0, 1.0, batch.num_rows)
    return [
        replace(micro.with_row_advantages(advantages), old_logp=micro.engine_logp)
        for micro in micro_batches(
            batch,
            list(range(batch.num_rows)),
            dp_rank=0,
            dp_size=1,
            micro_batch_size=spec.micro_batch_size,
            micro_batch_tokens=spec.micro_batch_tokens if budgeted else None,
            packed=packed,
        )
    ]


def run_benchmark(spec: PackingSpec) -> dict[str, object]:
    batch = rollouts(spec)
    cuts = {arm: cut(spec, batch, arm) for arm in ARMS}
    rounds: dict[str, list[float]] = {arm: [] for arm in ARMS}
    for _ in range(spec.rounds):
        for arm, passes in cuts.items():
            with train_step.training_step(spec.step_spec(), passes) as (step, model):
                device = next(model.parameters()).device
                seconds = train_step.timed_steps(step, device, spec.steps)
            rounds[arm].append(statistics.median(seconds))
    baseline = statistics.median(rounds["rows"])
    results = []
    for arm, passes in cuts.items():
        positions = sum(micro.tokens.numel() for micro in passes)
        padding = sum(int(micro.padding_mask.sum()) for micro in passes)
        step_s = statistics.median(rounds[arm])
        results.append(
            {
                "arm": arm,
                "passes": len(passes),
                "positions": positions,
                "padding_frac": padding / positions,
                "round_seconds": rounds[arm],
                "step_seconds": step_s,
                "vs_rows": step_s / baseline,
            }
        )
    return {
        "spec": asdict(spec),
        "tokens": int(batch.lengths.sum()),
        "arms": results,
        "machine": machine(),
        "date": now(),
    }


def format_markdown(report: dict) -> str:
    spec = report["spec"]
    lines = [
        f"One update over {spec['samples']} samples of {spec['shortest']}-{spec['longest']} "
        f"tokens ({report['tokens']} tokens), one rank, float32: {spec['layers']} layers, "
        f"hidden {spec['hidden']}, {spec['experts']} experts top-{spec['topk']}, vocab "
        f"{spec['vocab']}; rows: {spec['micro_batch_size']} per pass; token budget and packed: "
        f"{spec['micro_batch_tokens']} tokens per pass; median over {spec['rounds']} "
        f"interleaved rounds of each round's median of {spec['steps']} steps after one "
        f"warm-up; {report['machine']['cpu']}, torch {report['machine']['torch']}, "
        f"{report['date']}.",
        "",
        "| arm | passes | positions | padding | step (s) [rounds] | vs rows |",
        "|---|---|---|---|---|---|",
    ]
    for arm in report["arms"]:
        rounds = ", ".join(f"{s:.3f}" for s in arm["round_seconds"])
        lines.append(
            f"| {arm['arm']} | {arm['passes']} | {arm['positions']} | "
            f"{arm['padding_frac']:.1%} | {arm['step_seconds']:.3f} [{rounds}] | "
            f"{arm['vs_rows']:.2f}x |"
        )
    return "\n".join(lines)


def write_report(report: dict, out_dir: Path) -> tuple[Path, Path]:
    return report_files(report, out_dir, "packing", format_markdown)
