"""The rollout half of an RL step, on the rank that holds the engine: samples, rewards, group
advantages, and one padded batch to train on."""

from __future__ import annotations

import torch

from megatron_rl.algo import group_advantages
from megatron_rl.rewards import DataConfig, Problem, Verifier
from megatron_rl.rollout.codec import PromptCodec
from megatron_rl.rollout.collect import collect_rollouts
from megatron_rl.rollout.config import RolloutConfig
from megatron_rl.rollout.engine import RolloutEngine, SamplingParams
from megatron_rl.trainer.batches import RolloutBatch, build_rollout_batch
from megatron_rl.trainer.recipe import AlgoConfig


def sampling_params(rollout: RolloutConfig, codec: PromptCodec) -> SamplingParams:
    """How the engine samples training responses."""
    return SamplingParams(
        temperature=rollout.temperature,
        top_p=rollout.top_p,
        max_new_tokens=rollout.max_new_tokens,
        stop_token_ids=codec.stop_token_ids,
    )


def rollout_step(
    engine: RolloutEngine,
    codec: PromptCodec,
    problems: list[Problem],
    verifier: Verifier,
    *,
    rollout: RolloutConfig,
    algo: AlgoConfig,
    data: DataConfig,
    seed: int,
) -> tuple[RolloutBatch | None, dict[str, float]]:
    """`rollout.group_size` samples of each problem, scored by `verifier`, with their group
    advantages; returns the batch (None when nothing is left to train on) and the metrics."""
    rollouts = collect_rollouts(
        engine,
        codec,
        problems,
        verifier,
        sampling_params(rollout, codec),
        group_size=rollout.group_size,
        seed=seed,
        reward_timeout_s=data.reward_timeout_s,
        return_routed_experts=algo.routing_replay.uses_engine_routing,
    )
    groups = group_advantages(
        rollouts.rewards, rollout.group_size, std_normalize=algo.std_normalize
    )
    keep = torch.ones_like(groups.zero_variance)
    if algo.drop_zero_variance_groups:
        keep = ~groups.zero_variance
    metrics = rollouts.metrics | {
        "groups/zero_variance": float(groups.num_zero_variance_groups),
        "groups/zero_variance_frac": float(groups.num_zero_variance_groups) / len(problems),
    }
    rows = keep.nonzero()[:, 0].tolist()
    if not rows:
        return None, metrics
    batch = build_rollout_batch(
        [rollouts.samples[row] for row in rows],
        groups.advantages[rows],
        pad_id=codec.tokenizer.pad_token_id or 0,
        newline_token_ids=codec.newline_token_ids,
    )
    return batch, metrics
