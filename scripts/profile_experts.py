"""Where the time of `megatron-rl bench experts`' grouped arms goes (docs/training.md, "Fine-grained
experts: grouped GEMMs"; results in docs/benchmarks/grouped_experts.md): three training steps of the
8-experts and the 64-experts arm under torch.profiler, the ops by self CPU time; then one layer's
expert product alone at 64 experts (the weights stacked, grouped_mm forward and backward), to tell
the stack's share of `aten::cat`.

    python scripts/profile_experts.py
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch.profiler import ProfilerActivity, profile

from megatron_rl.bench.expert_scaling import ExpertScalingSpec
from megatron_rl.bench.train_step import TrainStepSpec, training_step

ARMS = ("8 experts top-2, grouped", "64 experts top-8, grouped")


def profile_steps(spec: TrainStepSpec, steps: int = 3) -> str:
    """The op table of `steps` training steps of `spec`'s model after two warm-up steps."""
    with training_step(spec) as (step, _):
        step()
        step()
        with profile(activities=[ProfilerActivity.CPU]) as profiled:
            for _ in range(steps):
                step()
    return profiled.key_averages().table(sort_by="self_cpu_time_total", row_limit=12)


def profile_expert_product(spec: TrainStepSpec) -> str:
    """The op table of one fc1 product of `spec`'s experts over one micro-batch's routed tokens
    (as many per expert), forward and backward, as GroupedSequentialMLP runs it."""
    rows = spec.micro_batch * spec.seq * spec.topk
    gen = torch.Generator().manual_seed(0)
    tokens = torch.randn(rows, spec.hidden, generator=gen, requires_grad=True)
    weights = [
        torch.randn(2 * spec.moe_ffn, spec.hidden, generator=gen, requires_grad=True)
        for _ in range(spec.experts)
    ]
    ends = (torch.arange(1, spec.experts + 1) * (rows // spec.experts)).to(torch.int32)
    grad = torch.randn(rows, 2 * spec.moe_ffn, generator=gen)

    def product() -> None:
        out = F.grouped_mm(tokens, torch.stack(weights).transpose(1, 2), offs=ends)
        out.backward(grad)

    product()
    with profile(activities=[ProfilerActivity.CPU]) as profiled:
        product()
    return profiled.key_averages().table(sort_by="self_cpu_time_total", row_limit=6)


def main() -> None:
    arms = dict(ExpertScalingSpec().arms())
    for name in ARMS:
        print(f"== {name}: 3 steps\n{profile_steps(arms[name])}")
    print(f"== {ARMS[1]}: one expert product\n{profile_expert_product(arms[ARMS[1]])}")


if __name__ == "__main__":
    main()
