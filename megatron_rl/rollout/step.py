"""The rollout half of an RL step: samples, rewards, group advantages, one padded batch, and
the same batch on every rank."""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist

from megatron_rl.algo import group_advantages
from megatron_rl.rewards import Problem, Verifier
from megatron_rl.rollout.batch import RolloutBatch, build_rollout_batch
from megatron_rl.rollout.codec import PromptCodec
from megatron_rl.rollout.collect import collect_rollouts
from megatron_rl.rollout.engine import RolloutEngine, SamplingParams


@dataclass(frozen=True, kw_only=True)
class RolloutSettings:
    """What a rollout step needs from the recipe (megatron_rl.config: rollout, algo, data)."""

    group_size: int
    std_normalize: bool = True
    drop_zero_variance_groups: bool = False
    reward_timeout_s: float = 5.0
    routed_experts: bool = False  # ask the engine for its routing (R3)


def rollout_step(
    engine: RolloutEngine | None,
    codec: PromptCodec,
    problems: list[Problem],
    verifier: Verifier,
    params: SamplingParams,
    settings: RolloutSettings,
    *,
    seed: int,
) -> tuple[RolloutBatch | None, dict[str, float]]:
    """Rank 0 (the rank with the engine) samples, scores and computes advantages; every rank
    gets the batch (None when nothing is left to train on) and the rollout metrics."""
    payload: list = [None, None]
    if engine is not None:
        rollouts = collect_rollouts(
            engine,
            codec,
            problems,
            verifier,
            params,
            group_size=settings.group_size,
            seed=seed,
            reward_timeout_s=settings.reward_timeout_s,
            return_routed_experts=settings.routed_experts,
        )
        groups = group_advantages(
            rollouts.rewards, settings.group_size, std_normalize=settings.std_normalize
        )
        keep = torch.ones_like(groups.zero_variance)
        if settings.drop_zero_variance_groups:
            keep = ~groups.zero_variance
        metrics = rollouts.metrics | {
            "groups/zero_variance": float(groups.num_zero_variance_groups),
            "groups/zero_variance_frac": float(groups.num_zero_variance_groups) / len(problems),
        }
        rows = keep.nonzero()[:, 0].tolist()
        batch = None
        if rows:
            batch = build_rollout_batch(
                [rollouts.samples[row] for row in rows],
                groups.advantages[rows],
                pad_id=codec.tokenizer.pad_token_id or 0,
                newline_token_ids=codec.newline_token_ids,
            )
        payload = [batch, metrics]
    if dist.get_world_size() > 1:
        dist.broadcast_object_list(payload, src=0)
    return payload[0], payload[1]
