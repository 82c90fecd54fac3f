"""Worker for the distributed-optimizer test: the same model, weights and batches trained by
megatron-core's plain optimizer and by its distributed optimizer, in one layout on 2 gloo ranks."""

from __future__ import annotations

from dataclasses import replace

import torch
from megatron.core.optimizer import MegatronOptimizer

from megatron_rl.algo import PolicyLossSpec
from megatron_rl.models.build import build_gpt_moe
from megatron_rl.parallel.dims import ParallelDims
from megatron_rl.parallel.distributed import LaunchEnv, init_distributed, set_model_parallel
from megatron_rl.trainer.optimizer import build_optimizer, wrap_for_training
from megatron_rl.trainer.optimizer_config import OptimConfig
from megatron_rl.trainer.schedule import policy_forward_backward
from tests.parallel.invariance import TINY_MOE, micro_batches

STEPS = 3
SPEC = PolicyLossSpec.of("gspo", clip_low=3e-2, clip_high=4e-2)


def main_weights(optimizer: MegatronOptimizer) -> list[torch.Tensor]:
    """The weights Adam updates on this rank: its shard's fp32 copies with the distributed
    optimizer, the parameters themselves with the plain one."""
    return [
        weight
        for inner in optimizer.chained_optimizers
        for group in inner.optimizer.param_groups
        for weight in group["params"]
    ]


def _train(dims: ParallelDims, dtype: str, distributed: bool, batches: list) -> dict:
    set_model_parallel(dims)  # re-seeds: both runs start from the same weights
    model = build_gpt_moe(replace(TINY_MOE, dtype=dtype), dims)
    initial = {n: p.detach().clone() for n, p in model.named_parameters()}
    model = wrap_for_training(model, distributed_optimizer=distributed)
    optimizer = build_optimizer(model, OptimConfig(lr=1e-4))
    losses, grad_norms = [], []
    for _ in range(STEPS):
        model.zero_grad_buffer()
        optimizer.zero_grad()
        losses.append(float(policy_forward_backward(model, batches, SPEC).loss))
        updated, grad_norm, _ = optimizer.step()
        assert updated
        grad_norms.append(float(grad_norm))
    return {
        "optimizers": sorted({type(inner).__name__ for inner in optimizer.chained_optimizers}),
        "losses": losses,
        "grad_norms": grad_norms,
        "initial_weights": initial,
        "weights": {n: p.detach().clone() for n, p in model.module.named_parameters()},
        "state_numel": sum(weight.numel() for weight in main_weights(optimizer)),
        "share_numel": sum(p.numel() // _copies(p, dims) for p in model.module.parameters()),
    }


def _copies(param: torch.nn.Parameter, dims: ParallelDims) -> int:
    """How many ranks hold this weight: its data-parallel group (expert weights, marked
    allreduce=False, are reduced over the expert data-parallel group instead)."""
    return dims.dp * dims.cp if getattr(param, "allreduce", True) else dims.edp


def plain_and_distributed(launch: LaunchEnv, layout: dict[str, int], dtype: str) -> dict:
    """Both optimizers' losses, gradient norms and final weights on this rank, and how many
    weights each keeps Adam state for here."""
    dims = ParallelDims(world_size=launch.world_size, **layout)
    init_distributed(dims, launch)
    batches = micro_batches(count=2 * dims.dp)[launch.rank % dims.dp :: dims.dp]
    plain = _train(dims, dtype, False, batches)
    distributed = _train(dims, dtype, True, batches)
    return {
        "optimizers": (plain["optimizers"], distributed["optimizers"]),
        "losses": (plain["losses"], distributed["losses"]),
        "grad_norms": (plain["grad_norms"], distributed["grad_norms"]),
        "state_numel": (plain["state_numel"], distributed["state_numel"]),
        "share_numel": plain["share_numel"],
        "worst_weight_diff": max(
            float((plain["weights"][n].float() - distributed["weights"][n].float()).abs().max())
            for n in plain["weights"]
        ),
        "moved": max(
            float((plain["weights"][n].float() - first.float()).abs().max())
            for n, first in plain["initial_weights"].items()
        ),
    }
