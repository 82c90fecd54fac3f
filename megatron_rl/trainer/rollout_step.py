"""The rollout half of an RL step, on the rank that holds the engine: samples, rewards (with the
overlong penalty), the groups and samples that train (zero-variance groups, dynamic sampling, the
overlong filter), and one padded batch of them. The group advantages are the learner's: with the
KL in the reward they wait for the old policy's log-probs."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import Tensor

from megatron_rl.algo import overlong_penalty, zero_variance_groups
from megatron_rl.rewards import Problem, ProblemSource, ScoringPool, Verifier
from megatron_rl.rollout.codec import PromptCodec
from megatron_rl.rollout.collect import Rollouts, collect_rollouts
from megatron_rl.rollout.config import RolloutConfig
from megatron_rl.rollout.engine import RolloutEngine, Sample, SamplingParams
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
    problems: ProblemSource,
    step: int,
    verifier: Verifier,
    *,
    rollout: RolloutConfig,
    algo: AlgoConfig,
    seed: int,
    scoring: ScoringPool | None = None,
    return_routed_experts: bool = False,
) -> tuple[RolloutBatch | None, dict[str, float]]:
    """`rollout.group_size` samples of each problem of `step` (each with the engine's routing
    when `return_routed_experts`), scored by `verifier` in the `scoring` pool's worker processes
    (without one, in this thread with no deadline); with `rollout.dynamic_sampling` further
    rounds of problems until `prompts_per_step` groups carry a gradient. Returns the batch
    (None when nothing is left to train on) and the metrics: the first round's rollout metrics
    (the policy on the step's own problems) and what was kept."""
    rounds = rollout.max_generation_rounds if rollout.dynamic_sampling else 1
    kept, metrics = _KeptGroups(rollout.group_size), {}
    for round_index in range(rounds):
        round_problems = (
            problems.train_batch(step)
            if round_index == 0
            else problems.extra_batch(step, round_index)
        )
        rollouts = _scored_rollouts(
            engine,
            codec,
            round_problems,
            verifier,
            rollout=rollout,
            scoring=scoring,
            seed=seed if round_index == 0 else (seed << 8) + round_index,
            return_routed_experts=return_routed_experts,
        )
        if round_index == 0:
            metrics = rollouts.metrics
        kept.add_round(
            rollouts,
            drop_equal=algo.drop_zero_variance_groups or rollout.dynamic_sampling,
            overlong_filter=algo.overlong_filter,
            room=rollout.prompts_per_step if rollout.dynamic_sampling else None,
        )
        if kept.groups >= rollout.prompts_per_step:
            break
    metrics |= kept.metrics(rollout)
    if not any(kept.trains):
        return None, metrics
    batch = build_rollout_batch(
        kept.samples,
        torch.stack(kept.rewards),
        group_size=rollout.group_size,
        pad_id=codec.tokenizer.pad_token_id or 0,
        newline_token_ids=codec.newline_token_ids,
        trains=kept.trains,
    )
    return batch, metrics


@dataclass
class _KeptGroups:
    """The groups a step keeps, round after round of generation, and what it left out."""

    group_size: int
    samples: list[Sample] = field(default_factory=list)
    rewards: list[Tensor] = field(default_factory=list)
    trains: list[bool] = field(default_factory=list)  # False: the response was filtered
    groups: int = 0
    rounds: int = 0
    generated: int = 0  # groups generated
    zero_variance: int = 0  # of them, groups whose rewards are all equal
    filtered: int = 0  # samples DAPO's overlong filter took out of the loss

    def add_round(
        self, rollouts: Rollouts, *, drop_equal: bool, overlong_filter: bool, room: int | None
    ) -> None:
        """Keep the groups of one round: not those whose rewards are all equal with
        `drop_equal`, and up to `room` groups in all when given (dynamic sampling)."""
        equal = zero_variance_groups(rollouts.rewards, self.group_size)
        self.rounds += 1
        self.generated += len(equal)
        self.zero_variance += int(equal.sum())
        for group in range(len(equal)):
            if room is not None and self.groups == room:
                break
            if drop_equal and bool(equal[group]):
                continue
            self.groups += 1
            for row in range(group * self.group_size, (group + 1) * self.group_size):
                sample = rollouts.samples[row]
                # DAPO's overlong filter: a truncated response carries no loss (its row and its
                # reward stay: the group's advantages count it).
                overlong = overlong_filter and sample.finish_reason == "length"
                self.filtered += overlong
                self.samples.append(sample)
                self.rewards.append(rollouts.rewards[row])
                self.trains.append(not overlong)

    def metrics(self, rollout: RolloutConfig) -> dict[str, float]:
        metrics = {
            "groups/zero_variance": float(self.zero_variance),
            "groups/zero_variance_frac": self.zero_variance / self.generated,
            "samples/overlong_filtered": float(self.filtered),
        }
        if rollout.dynamic_sampling:
            metrics |= {
                "dynamic/groups_generated": float(self.generated),
                "dynamic/groups_kept": float(self.groups),
                "dynamic/rounds": float(self.rounds),
                "dynamic/short": float(self.groups < rollout.prompts_per_step),
            }
        return metrics


def _scored_rollouts(
    engine: RolloutEngine,
    codec: PromptCodec,
    problems: list[Problem],
    verifier: Verifier,
    *,
    rollout: RolloutConfig,
    seed: int,
    scoring: ScoringPool | None,
    return_routed_experts: bool,
) -> Rollouts:
    """The samples of `problems` with their rewards, the overlong penalty added."""
    rollouts = collect_rollouts(
        engine,
        codec,
        problems,
        verifier,
        sampling_params(rollout, codec),
        group_size=rollout.group_size,
        seed=seed,
        scoring=scoring,
        return_routed_experts=return_routed_experts,
    )
    if not rollout.overlong_buffer:
        return rollouts
    lengths = torch.tensor([len(sample.response_ids) for sample in rollouts.samples])
    penalty = overlong_penalty(lengths, rollout.max_new_tokens, rollout.overlong_buffer)
    return Rollouts(
        samples=rollouts.samples,
        rewards=rollouts.rewards + penalty,
        metrics=rollouts.metrics | {"reward/overlong_penalty": float(penalty.mean())},
    )
