"""Worker for the CP=2 loss-level test: each rank holds half of every sequence."""

from __future__ import annotations

import torch.distributed as dist
from megatron.core import parallel_state

from megatron_rl.algo import compute_policy_loss
from megatron_rl.parallel.context import shard_mask, shard_sum
from megatron_rl.parallel.dims import ParallelDims
from megatron_rl.parallel.distributed import LaunchEnv, init_distributed
from tests.algo.batches import fresh_logp, random_batch

CLIP = {"gspo": (0.03, 0.04), "grpo": (0.1, 0.12), "sspo": (0.01, 0.01), "gmpo": (0.1, 0.1)}


def loss_level_invariance(launch: LaunchEnv, loss_agg: str) -> dict:
    init_distributed(ParallelDims(world_size=launch.world_size, cp=launch.world_size), launch)
    group = parallel_state.get_context_parallel_group()
    cp_size, cp_rank = dist.get_world_size(group), dist.get_rank(group)
    batch = random_batch(6, 16, seed=4, drift=0.1, padding="left")
    options = {"loss_agg": loss_agg}
    if loss_agg == "seq-mean-token-sum-norm":
        options["max_response_len"] = 16
    report = {}
    for name, (clip_low, clip_high) in CLIP.items():
        full_logp = fresh_logp(batch)
        full, _ = compute_policy_loss(
            name,
            full_logp,
            batch.old_logp,
            batch.advantages,
            batch.mask,
            clip_low=clip_low,
            clip_high=clip_high,
            **batch.kwargs(),
            **options,
        )
        full.backward()

        local_mask = shard_mask(batch.mask, cp_size, cp_rank)
        logp = fresh_logp(batch)
        local, _ = compute_policy_loss(
            name,
            logp,
            batch.old_logp,
            batch.advantages,
            local_mask,
            clip_low=clip_low,
            clip_high=clip_high,
            **batch.kwargs(),
            **options,
            shard_sum=shard_sum(group),
        )
        local.backward()
        total = local.detach().clone()
        dist.all_reduce(total, group=group)
        grad = logp.grad.clone()
        dist.all_reduce(grad, group=group)
        report[name] = {
            "full": float(full),
            "sum_of_shards": float(total),
            "grad_error": float((grad - full_logp.grad).abs().max()),
            "grad_scale": float(full_logp.grad.abs().max()),
            "local_tokens": int(local_mask.sum()),
            "all_tokens": int(batch.mask.sum()),
            "local_grad_outside_shard": float(logp.grad[~local_mask].abs().max()),
        }
    return report
