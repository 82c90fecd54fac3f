"""The learning half of an RL step: old-policy log-probs (with the routing record or replay),
then minibatch updates of the Megatron-Core policy, and their metrics."""

from __future__ import annotations

import dataclasses
import math

import torch
import torch.distributed as dist
from megatron.core import parallel_state

from megatron_rl.algo import (
    EXTREME_RATIO_TAUS,
    PolicyLossSpec,
    engine_gap_metrics,
    group_advantages,
    kl_to_reference,
)
from megatron_rl.moe.drift import routing_bytes
from megatron_rl.parallel.collectives import host_all_reduce
from megatron_rl.parallel.stages import from_last_stage
from megatron_rl.trainer.batches import EngineRouting, RolloutBatch, micro_batches, minibatch_rows
from megatron_rl.trainer.metric_reductions import UPDATE_METRICS
from megatron_rl.trainer.metrics import StepTimer
from megatron_rl.trainer.micro_batch import PolicyMicroBatch
from megatron_rl.trainer.policy import Policy, UpdateResult
from megatron_rl.trainer.recipe import AlgoConfig
from megatron_rl.trainer.reference import ReferencePolicy
from megatron_rl.trainer.schedule import OldPolicy


def learn(
    policy: Policy,
    batch: RolloutBatch | None,
    spec: PolicyLossSpec,
    algo: AlgoConfig,
    *,
    micro_batch_size: int,
    timer: StepTimer,
    seed: int,
    reference: ReferencePolicy | None = None,
) -> dict[str, float]:
    """Old log-probs (and with `reference` the reference's), then `algo.updates_per_batch`
    optimizer steps on minibatches of `batch` (shuffled with `seed`, cut into micro-batches of
    `micro_batch_size` rows; one per row when the batch has fewer rows: `steps/updates` says how
    many); returns the step's training metrics."""
    if batch is None:  # every group had equal rewards and was dropped
        return {"steps/skipped": 0.0, "steps/no_data": 1.0, "steps/updates": 0.0}
    mode = algo.routing_replay
    rows = minibatch_rows(batch.num_rows, algo.updates_per_batch, seed=seed)
    engine_routing = _engine_routing(policy) if mode.uses_engine_routing else None
    minibatches = [
        micro_batches(
            batch,
            chunk,
            dp_rank=parallel_state.get_data_parallel_rank(),
            dp_size=parallel_state.get_data_parallel_world_size(),
            micro_batch_size=micro_batch_size,
            engine_routing=engine_routing,
        )
        for chunk in rows
    ]
    metrics: dict[str, float] = {}
    forward = algo.runs_old_policy_forward
    if forward:
        with timer.phase("old_logprob"):
            minibatches, old_metrics = _with_old_policy(policy, minibatches, algo)
        metrics |= old_metrics
    elif algo.old_policy_is_current:
        # The update's forward (detached) gives the old log-probs; the engine's ride beside
        # them (the mismatch metrics, a correction).
        minibatches = [
            [dataclasses.replace(micro, old_logp=None, engine_logp=micro.old_logp) for micro in mb]
            for mb in minibatches
        ]
    if reference is not None:
        with timer.phase("ref_logprob"):
            minibatches = _with_reference(reference, minibatches)
        if algo.kl_in_reward:
            minibatches, kl_metrics = _with_kl_in_reward(batch, minibatches, algo)
            metrics |= kl_metrics
    with timer.phase("train"):
        updates = [policy.update(minibatch, spec, mode) for minibatch in minibatches]
    if algo.uses_engine_logprobs and not forward and not updates[0].skipped:
        metrics |= _mismatch_from_first_update(updates[0])
    if mode.uses_engine_routing and not updates[0].skipped:
        metrics |= _engine_routing_mismatch(updates[0])
    return metrics | {"optim/lr": policy.learning_rate} | _update_metrics(updates)


def _with_old_policy(
    policy: Policy, minibatches: list[list[PolicyMicroBatch]], algo: AlgoConfig
) -> tuple[list[list[PolicyMicroBatch]], dict[str, float]]:
    """The minibatches as the updates see them, after the old-policy pass over all of their
    micro-batches: its entropy and recorded routing attached and, unless `algo.mismatch` is
    bypass, its log-probs as the old ones (on the last pipeline stage, which alone reads them),
    the engine's kept beside them for a mismatch correction; and the old policy's metrics."""
    keep_engine_logp = algo.correction() is not None
    every_micro_batch = [micro for minibatch in minibatches for micro in minibatch]
    computed = policy.old_policy(every_micro_batch, algo.routing_replay)
    # The old log-probs are on the last pipeline stage; rank 0 logs.
    last_stage = parallel_state.is_pipeline_last_stage()
    old = _old_policy_metrics(every_micro_batch, computed) if last_stage else {}
    metrics = from_last_stage(old)
    attached = [
        dataclasses.replace(
            micro,
            old_logp=micro.old_logp
            if algo.uses_engine_logprobs or values.logp is None
            else values.logp,
            engine_logp=micro.old_logp if keep_engine_logp else None,
            old_entropy=values.entropy,
            routing=micro.routing if values.routing is None else values.routing,
        )
        for micro, values in zip(every_micro_batch, computed, strict=True)
    ]
    # What the updates replay or compare with: recorded (R2, none) or the engine's (R3).
    records = [layer for micro in attached for layer in micro.routing or []]
    metrics["routing/record_bytes"] = float(routing_bytes(records))
    remaining = iter(attached)
    return [[next(remaining) for _ in minibatch] for minibatch in minibatches], metrics


def _with_reference(
    reference: ReferencePolicy, minibatches: list[list[PolicyMicroBatch]]
) -> list[list[PolicyMicroBatch]]:
    """The minibatches with the reference policy's log-probs attached (one forward over all of
    their micro-batches; the last pipeline stage alone has and reads them)."""
    every_micro_batch = [micro for minibatch in minibatches for micro in minibatch]
    logprobs = iter(reference.logprobs(every_micro_batch))
    return [
        [dataclasses.replace(micro, ref_logp=next(logprobs)) for micro in minibatch]
        for minibatch in minibatches
    ]


def _with_kl_in_reward(
    batch: RolloutBatch, minibatches: list[list[PolicyMicroBatch]], algo: AlgoConfig
) -> tuple[list[list[PolicyMicroBatch]], dict[str, float]]:
    """verl's KL in the reward: each sample's reward less algo.kl_coef times the sum over its
    response tokens of the per-token KL estimate of the old policy to the reference; the group
    advantages recomputed from those. On the last pipeline stage, which alone has the log-probs
    and reads advantages; the rows are spread over the data-parallel ranks, which add up their
    shares (each row lies in one micro-batch of one rank)."""
    local: dict[str, float] = {}
    if parallel_state.is_pipeline_last_stage():
        if batch.group_size is None:
            raise ValueError("algo.kl_in_reward: the rollout batch's rows are not whole groups")
        kl_rows = torch.zeros(batch.num_rows, dtype=torch.float64)
        every_micro_batch = [micro for minibatch in minibatches for micro in minibatch]
        for micro in every_micro_batch:
            kl = kl_to_reference(
                micro.old_logp, micro.ref_logp, micro.loss_mask, algo.kl_estimator
            ).sum(dim=1)
            real = micro.row_ids >= 0
            kl_rows.index_add_(0, micro.row_ids[real], kl[real].double())
        group = parallel_state.get_data_parallel_group(with_context_parallel=True)
        if dist.get_world_size(group) > 1:
            kl_rows = host_all_reduce(kl_rows, group=group)
        shaped = batch.rewards.double() - algo.kl_coef * kl_rows
        advantages = group_advantages(
            shaped, batch.group_size, std_normalize=algo.std_normalize
        ).advantages.to(torch.float32)
        minibatches = [
            [
                dataclasses.replace(
                    micro,
                    advantages=torch.where(
                        micro.row_ids < 0, 0.0, advantages[micro.row_ids.clamp(min=0)]
                    ),
                )
                for micro in minibatch
            ]
            for minibatch in minibatches
        ]
        local = {
            "kl/reward_ref": float(kl_rows.mean()),
            "reward/kl_penalty": float(-algo.kl_coef * kl_rows.mean()),
        }
    return minibatches, from_last_stage(local)


def _update_metrics(updates: list[UpdateResult]) -> dict[str, float]:
    """The step's updates in one set of metrics, each by its declared reduction over every
    update, the skipped ones included: a non-finite loss or gradient norm shows as NaN or inf
    (null in metrics.jsonl). Skipped updates (no optimizer step) are counted, and why."""
    metrics = {
        "loss/policy": UPDATE_METRICS.combine("loss/policy", [u.loss for u in updates]),
        "grad_norm": UPDATE_METRICS.combine("grad_norm", [u.grad_norm for u in updates]),
        "steps/updates": float(len(updates)),
        "steps/skipped": float(any(u.skipped for u in updates)),
        "steps/skipped_updates": float(sum(u.skipped for u in updates)),
        "steps/nonfinite_loss_updates": float(sum(not math.isfinite(u.loss) for u in updates)),
        "steps/nonfinite_grad_norm_updates": float(
            sum(not math.isfinite(u.grad_norm) for u in updates)
        ),
    }
    for key in sorted({k for u in updates for k in u.metrics}):
        values = [u.metrics[key] for u in updates if key in u.metrics]
        metrics[key] = UPDATE_METRICS.combine(key, values)
    return metrics


def _old_policy_metrics(
    every_micro_batch: list[PolicyMicroBatch], computed: list[OldPolicy]
) -> dict[str, float]:
    """Entropy of the old policy and the engine/trainer mismatch (engine_gap_metrics), over
    response tokens (this rank's share; equal shares make it representative). The micro-batches
    still carry the engine's log-probs as `old_logp`."""
    masks = torch.cat([m.loss_mask.flatten() for m in every_micro_batch])
    if masks.sum() == 0 or computed[0].entropy is None:
        return {}
    entropy = torch.cat([values.entropy.flatten() for values in computed])[masks]
    trainer = torch.cat([values.logp.flatten() for values in computed])
    engine = torch.cat([m.old_logp.flatten() for m in every_micro_batch])
    gap = engine_gap_metrics(trainer, engine, masks)
    return {"entropy/mean": float(entropy.mean())} | {key: float(v) for key, v in gap.items()}


def _mismatch_from_first_update(first: UpdateResult) -> dict[str, float]:
    """With the engine's log-probs as old log-probs and no trainer forward, the first update's
    ratios (before any optimizer step) compare the trainer with the engine: its `kl/k3` and
    `log_ratio/*` are the mismatch, on that minibatch."""
    names = {"kl/k3": "mismatch/k3", "log_ratio/abs_max": "mismatch/abs_max"} | {
        f"log_ratio/frac_tau{tau}": f"mismatch/frac_tau{tau}" for tau in EXTREME_RATIO_TAUS
    }
    return {
        ours: first.metrics[theirs] for theirs, ours in names.items() if theirs in first.metrics
    }


def _engine_routing_mismatch(first: UpdateResult) -> dict[str, float]:
    """Under R3 the first update's drift (before any optimizer step, from the engine's routing)
    is how far the trainer's routers disagree with the engine's: `routing/engine_mismatch_*`."""
    return {
        f"routing/engine_mismatch_{unit}": first.metrics[f"routing/drift_{unit}"]
        for unit in ("token_layer", "token_any")
        if f"routing/drift_{unit}" in first.metrics
    }


def _engine_routing(policy: Policy) -> EngineRouting:
    config = policy.config
    sequence_parallel = policy.model.config.sequence_parallel
    return EngineRouting(
        num_layers=config.num_layers,
        moe_layers=tuple(config.moe_layers),
        stage_layers=tuple(policy.replay.layer_numbers),
        topk=config.router_topk,
        sp_rank=parallel_state.get_tensor_model_parallel_rank() if sequence_parallel else 0,
        sp_size=parallel_state.get_tensor_model_parallel_world_size() if sequence_parallel else 1,
    )
