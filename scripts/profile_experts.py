"""Where the time of `megatron-rl bench experts`' grouped arms goes: three training steps of the
8-experts and the 64-experts arm under torch.profiler, the ops by self CPU time (docs/training.md,
"Fine-grained experts: grouped GEMMs").

    python scripts/profile_experts.py
"""

from __future__ import annotations

import torch
from torch.profiler import ProfilerActivity, profile

from megatron_rl.algo import PolicyLossSpec
from megatron_rl.bench.expert_scaling import ExpertScalingSpec
from megatron_rl.bench.train_step import TrainStepSpec, _rollouts
from megatron_rl.models.build import build_gpt_moe
from megatron_rl.parallel.dims import ParallelDims
from megatron_rl.parallel.distributed import LaunchEnv, init_distributed, shutdown_distributed
from megatron_rl.trainer.optimizer import build_optimizer, wrap_for_training
from megatron_rl.trainer.optimizer_config import OptimConfig
from megatron_rl.trainer.schedule import policy_forward_backward

ARMS = ("8 experts top-2, grouped", "64 experts top-8, grouped")


def profile_steps(spec: TrainStepSpec, steps: int = 3) -> str:
    """The op table of `steps` training steps of `spec`'s model after two warm-up steps."""
    dims = ParallelDims(world_size=1)
    init_distributed(dims, LaunchEnv.from_environ({}))
    try:
        model = wrap_for_training(build_gpt_moe(spec.model(), dims), distributed_optimizer=False)
        optimizer = build_optimizer(model, OptimConfig(lr=1e-6))
        loss = PolicyLossSpec.of("gspo", clip_low=3e-4, clip_high=4e-4, check_finite=False)
        batches = _rollouts(spec, torch.device("cpu"))

        def step() -> None:
            model.zero_grad_buffer()
            optimizer.zero_grad()
            policy_forward_backward(model, batches, loss)
            optimizer.step()

        step()
        step()
        with profile(activities=[ProfilerActivity.CPU]) as profiled:
            for _ in range(steps):
                step()
    finally:
        shutdown_distributed()
    return profiled.key_averages().table(sort_by="self_cpu_time_total", row_limit=12)


def main() -> None:
    arms = dict(ExpertScalingSpec().arms())
    for name in ARMS:
        print(f"== {name}: 3 steps\n{profile_steps(arms[name])}")


if __name__ == "__main__":
    main()
