"""Benchmark: what fine-grained experts cost, at equal active parameters.

The training step of `bench train-step` (megatron_rl/bench/train_step.py: a random MoE, the GSPO
loss, megatron-core's model, DDP, Adam and schedule, one rank) at several expert shapes that
give each token the same active expert parameters (experts x top-k x FFN width: top-k x FFN
width fixed), each with the routed experts in grouped GEMMs (megatron_rl.models.grouped_experts,
what the trainer runs) and as megatron-core's loop over experts (SequentialMLP). Arms run in
interleaved rounds (every arm once per round), so that a slow spell of a shared machine falls
on all of them; each round's figure is the median of its timed steps, the report's the median
over rounds. Reported: each arm's step time and its ratio to the first shape's grouped step
(issue 37's target: 64 experts top-8 at most 1.5x 8 experts top-2).
"""

from __future__ import annotations

import statistics
from dataclasses import asdict, dataclass, replace
from pathlib import Path

from megatron_rl.bench import train_step
from megatron_rl.bench.report import machine, now
from megatron_rl.bench.report import write_report as report_files


@dataclass(frozen=True)
class ExpertScalingSpec:
    """The model around the experts, the expert shapes (experts, top-k) and the timing."""

    shapes: tuple[tuple[int, int], ...] = ((8, 2), (64, 8), (128, 8))
    active_ffn: int = 128  # top-k x expert FFN width, the same for every shape
    layers: int = 4
    hidden: int = 256
    heads: int = 4
    kv_heads: int = 2
    vocab: int = 2048
    seq: int = 256
    micro_batch: int = 4
    micro_batches: int = 2
    steps: int = 3  # timed steps per arm and round, after one warm-up step
    rounds: int = 3

    def __post_init__(self) -> None:
        if not self.shapes:
            raise ValueError("shapes: at least one (experts, top-k)")
        for experts, topk in self.shapes:
            if not 0 < topk <= experts:
                raise ValueError(f"shapes: top-k {topk} of {experts} experts")
            if self.active_ffn % topk:
                raise ValueError(f"active_ffn {self.active_ffn}: not a multiple of top-k {topk}")

    def arms(self) -> list[tuple[str, train_step.TrainStepSpec]]:
        """(name, step spec) of every shape, grouped then loop."""
        base = train_step.TrainStepSpec(
            layers=self.layers,
            hidden=self.hidden,
            heads=self.heads,
            kv_heads=self.kv_heads,
            vocab=self.vocab,
            seq=self.seq,
            micro_batch=self.micro_batch,
            micro_batches=self.micro_batches,
            steps=self.steps,
            dtype="float32",
            matmul_size=512,
        )
        arms = []
        for experts, topk in self.shapes:
            shape = replace(base, experts=experts, topk=topk, moe_ffn=self.active_ffn // topk)
            for grouped in (True, False):
                name = f"{experts} experts top-{topk}, {'grouped' if grouped else 'loop'}"
                arms.append((name, replace(shape, grouped_experts=grouped)))
        return arms


def run_benchmark(spec: ExpertScalingSpec) -> dict[str, object]:
    arms = spec.arms()
    rounds: dict[str, list[float]] = {name: [] for name, _ in arms}
    parameters: dict[str, int] = {}
    for _ in range(spec.rounds):
        for name, step_spec in arms:
            measured = train_step.run_benchmark(step_spec)
            rounds[name].append(statistics.median(measured["step_seconds"]))
            parameters[name] = int(measured["parameters"])
    baseline = statistics.median(rounds[arms[0][0]])
    results = []
    for name, step_spec in arms:
        step_s = statistics.median(rounds[name])
        results.append(
            {
                "arm": name,
                "experts": step_spec.experts,
                "topk": step_spec.topk,
                "moe_ffn": step_spec.moe_ffn,
                "grouped_experts": step_spec.grouped_experts,
                "parameters": parameters[name],
                "round_seconds": rounds[name],
                "step_seconds": step_s,
                "vs_first_grouped": step_s / baseline,
            }
        )
    return {
        "spec": asdict(spec),
        "tokens_per_step": spec.micro_batches * spec.micro_batch * spec.seq,
        "arms": results,
        "machine": machine(),
        "date": now(),
    }


def format_markdown(report: dict) -> str:
    spec = report["spec"]
    first = report["arms"][0]
    lines = [
        f"Training step at equal active expert parameters (top-k x FFN = {spec['active_ffn']}), "
        f"one rank, float32: {spec['layers']} layers, hidden {spec['hidden']}, vocab "
        f"{spec['vocab']}; GSPO, {report['tokens_per_step']} tokens per step "
        f"({spec['micro_batches']} micro-batches of {spec['micro_batch']} x {spec['seq']}); "
        f"median over {spec['rounds']} interleaved rounds of each round's median of "
        f"{spec['steps']} steps after one warm-up; {report['machine']['cpu']}, torch "
        f"{report['machine']['torch']}, {report['date']}.",
        "",
        f"| arm | expert FFN | parameters (M) | step (s) [rounds] | vs {first['arm']} |",
        "|---|---|---|---|---|",
    ]
    for arm in report["arms"]:
        rounds = ", ".join(f"{s:.3f}" for s in arm["round_seconds"])
        lines.append(
            f"| {arm['arm']} | {arm['moe_ffn']} | {arm['parameters'] / 1e6:.2f} | "
            f"{arm['step_seconds']:.3f} [{rounds}] | {arm['vs_first_grouped']:.2f}x |"
        )
    return "\n".join(lines)


def write_report(report: dict, out_dir: Path) -> tuple[Path, Path]:
    return report_files(report, out_dir, "expert_scaling", format_markdown)
