"""One rollout batch: sample groups from the engine, score them, and measure them."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import Tensor

from megatron_rl.rewards import Problem, ScoringPool, Verifier, score_responses
from megatron_rl.rollout.codec import PromptCodec
from megatron_rl.rollout.engine import RolloutEngine, Sample, SamplingParams


@dataclass(frozen=True)
class Rollouts:
    """Prompt-major samples (`group_size` per problem) with their rewards `[B]`."""

    samples: list[Sample]
    rewards: Tensor
    metrics: dict[str, float]


def collect_rollouts(
    engine: RolloutEngine,
    codec: PromptCodec,
    problems: Sequence[Problem],
    verifier: Verifier,
    params: SamplingParams,
    *,
    group_size: int,
    seed: int,
    scoring: ScoringPool | None = None,
    return_routed_experts: bool = False,
) -> Rollouts:
    """Generate `group_size` responses per problem and score each with `verifier`, in the
    `scoring` pool's worker processes (without one, in this thread with no deadline)."""
    groups = engine.generate(
        [codec.encode_prompt(problem.prompt, origin=problem.origin) for problem in problems],
        params,
        n=group_size,
        seed=seed,
        return_routed_experts=return_routed_experts,
    )
    if len(groups) != len(problems) or any(len(group) != group_size for group in groups):
        raise RuntimeError(
            f"engine: asked for {len(problems)} x {group_size} samples, got "
            f"{[len(group) for group in groups]}"
        )
    samples = [sample for group in groups for sample in group]
    repeated = [problem for problem in problems for _ in range(group_size)]
    scores = score_responses(
        verifier,
        [problem.prompt for problem in repeated],
        [codec.decode(sample.response_ids) for sample in samples],
        [problem.reference for problem in repeated],
        scoring,
    )
    rewards = torch.tensor(scores.rewards, dtype=torch.float32)
    lengths = torch.tensor([len(sample.response_ids) for sample in samples], dtype=torch.float32)
    metrics = {
        "reward/mean": float(rewards.mean()),
        "reward/std": float(rewards.std()) if rewards.numel() > 1 else 0.0,
        "reward/failures": float(scores.failures),
        "reward/timeouts": float(scores.timeouts),
        "response/length_mean": float(lengths.mean()),
        "response/length_max": float(lengths.max()),
        "response/empty": float((lengths == 0).sum()),
        "response/truncated_frac": sum(s.finish_reason == "length" for s in samples) / len(samples),
    }
    return Rollouts(samples=samples, rewards=rewards, metrics=metrics)
