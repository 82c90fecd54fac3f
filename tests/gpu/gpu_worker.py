"""Worker for the GPU tests: one rank on CUDA with NCCL."""

from __future__ import annotations

from dataclasses import replace

import torch

from megatron_rl.algo import PolicyLossSpec
from megatron_rl.models.build import build_gpt_moe, transformer_engine_available
from megatron_rl.parallel.collectives import backend
from megatron_rl.parallel.dims import ParallelDims
from megatron_rl.parallel.distributed import LaunchEnv, init_distributed
from megatron_rl.trainer.micro_batch import PolicyMicroBatch
from megatron_rl.trainer.optimizer import build_optimizer, wrap_for_training
from megatron_rl.trainer.optimizer_config import OptimConfig
from megatron_rl.trainer.schedule import policy_forward_backward
from tests.parallel.invariance import TINY_MOE


def _batch() -> PolicyMicroBatch:
    gen = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, TINY_MOE.vocab_size, (2, 32), generator=gen)
    mask = torch.zeros(2, 32, dtype=torch.bool)
    mask[:, 8:31] = True
    return PolicyMicroBatch(
        tokens=tokens.cuda(),
        loss_mask=mask.cuda(),
        old_logp=torch.full((2, 32), -4.8).cuda(),
        advantages=torch.tensor([1.0, -1.0]).cuda(),
    )


def bf16_step(launch: LaunchEnv) -> dict:
    """TE spec when TE imports (local spec otherwise), bf16, NCCL, distributed optimizer."""
    dims = ParallelDims(world_size=1)
    init_distributed(dims, launch)
    model = wrap_for_training(
        build_gpt_moe(replace(TINY_MOE, dtype="bfloat16"), dims), distributed_optimizer=True
    )
    optimizer = build_optimizer(model, OptimConfig(lr=1e-3))
    before = {n: p.detach().clone() for n, p in model.module.named_parameters()}
    step = policy_forward_backward(
        model, [_batch()], PolicyLossSpec.of("gspo", clip_low=3e-4, clip_high=4e-4)
    )
    updated, grad_norm, _ = optimizer.step()
    changed = sum(not torch.equal(p, before[n]) for n, p in model.module.named_parameters())
    return {
        "backend": backend(),
        "te": transformer_engine_available(),
        "loss": float(step.loss),
        "updated": bool(updated),
        "grad_norm": float(grad_norm),
        "changed": changed,
        "distributed_optimizer": model.ddp_config.use_distributed_optimizer,
    }


def reference_offload(launch: LaunchEnv, hf_dir: str) -> dict:
    """The reference policy kept in host memory between forwards gives the log-probs of the one
    kept on the GPU, and is back on the host after each forward."""
    from megatron_rl.models.config import ModelConfig
    from megatron_rl.trainer.reference import ReferencePolicy

    dims = ParallelDims(world_size=1)
    init_distributed(dims, launch)
    on_gpu = ReferencePolicy(ModelConfig(hf_path=hf_dir), dims)
    offloaded = ReferencePolicy(ModelConfig(hf_path=hf_dir), dims, offload=True)
    devices_before = {p.device.type for p in offloaded.model.parameters()}
    gen = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, 16, (2, 24), generator=gen)
    mask = torch.zeros(2, 24, dtype=torch.bool)
    mask[:, 4:23] = True
    batch = PolicyMicroBatch(
        tokens=tokens, loss_mask=mask, old_logp=torch.zeros(2, 24), advantages=torch.zeros(2)
    )
    (expected,) = on_gpu.logprobs([batch])
    (got,) = offloaded.logprobs([batch])
    return {
        "devices_before": sorted(devices_before),
        "devices_after": sorted({p.device.type for p in offloaded.model.parameters()}),
        "gpu_device": next(on_gpu.model.parameters()).device.type,
        "max_difference": float((expected - got).abs().max()),
    }
