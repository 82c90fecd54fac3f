"""The learning half of an RL step: old-policy log-probs (with the routing record or replay),
then minibatch updates of the Megatron-Core policy, and their metrics."""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import replace

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
from megatron_rl.trainer.metric_reductions import UPDATE_METRICS, update_change_name
from megatron_rl.trainer.metrics import StepTimer
from megatron_rl.trainer.micro_batch import PolicyMicroBatch
from megatron_rl.trainer.policy import ENGINE_MISMATCH_UNITS, Policy, UpdateResult
from megatron_rl.trainer.recipe import AlgoConfig, OldLogProbs
from megatron_rl.trainer.reference import ReferencePolicy
from megatron_rl.trainer.schedule import OldPolicy


def learn(
    policy: Policy,
    batch: RolloutBatch | None,
    spec: PolicyLossSpec,
    algo: AlgoConfig,
    *,
    micro_batch_size: int,
    micro_batch_tokens: int | None = None,
    packed: bool = False,
    timer: StepTimer,
    seed: int,
    reference: ReferencePolicy | None = None,
    probe_routing: bool = False,
) -> dict[str, float]:
    """The learning half of a step: the micro-batches of `batch`'s training rows (shuffled with
    `seed`, cut into `algo.updates_per_batch` minibatches, or one per row when there are fewer
    rows: `steps/updates` says how many; each minibatch into micro-batches of `micro_batch_size`
    rows, or with `micro_batch_tokens` of rows of like length within that token budget,
    `packed` back to back in one row, `megatron_rl.trainer.batches.micro_batches`), their old
    log-probs (`algo.old_logprobs`) and with `reference` the reference's, the group advantages,
    then one optimizer step per minibatch. Returns the step's training metrics.

    `probe_routing` (metrics.routing_probe) adds what each update changed in the routing
    (`Policy.update`), how far the routers moved over the step, and for every arm how far the
    engine's routing is from the trainer's (the batch's samples carry the engine's routing)."""
    if batch is None:  # every group had equal rewards and was dropped
        return {"steps/skipped": 0.0, "steps/no_data": 1.0, "steps/updates": 0.0}
    with_engine_routing = algo.routing_replay.uses_engine_routing or probe_routing
    minibatches = _minibatches(
        policy,
        batch,
        algo,
        micro_batch_size=micro_batch_size,
        micro_batch_tokens=micro_batch_tokens,
        packed=packed,
        seed=seed,
        with_engine_routing=with_engine_routing,
    )
    metrics: dict[str, float] = {"trainer/padding_frac": _padding_share(minibatches)}
    source = algo.old_logprobs
    if algo.runs_old_policy_forward:
        with timer.phase("old_logprob"):
            minibatches, old_metrics = _with_old_policy(
                policy, minibatches, algo, logp_are_old=source is OldLogProbs.OLD_POLICY_FORWARD
            )
        metrics |= old_metrics
    if source is OldLogProbs.ENGINE:
        minibatches = _each(minibatches, lambda micro: replace(micro, old_logp=micro.engine_logp))
    # OldLogProbs.UPDATE_FORWARD: old_logp stays None, the update's own forward stands in.
    kl_rows = None
    if reference is not None:
        with timer.phase("ref_logprob"):
            minibatches = _with_reference(reference, minibatches)
        if algo.kl_in_reward:
            kl_rows, kl_metrics = _kl_per_row(batch, minibatches, algo)
            metrics |= kl_metrics
    minibatches = _with_advantages(minibatches, step_advantages(batch, algo, kl_rows))
    mode = algo.routing_replay
    routers_before = policy.router_weights() if probe_routing else None
    with timer.phase("train"):
        updates = [
            policy.update(minibatch, spec, mode, probe_routing=probe_routing)
            for minibatch in minibatches
        ]
    if routers_before is not None:
        metrics |= policy.router_change(routers_before)
        metrics |= _since_old_after_the_last_update(updates[-1])
    first = updates[0]  # before any optimizer step: it compares with the engine
    if source is OldLogProbs.ENGINE and not algo.runs_old_policy_forward and not first.skipped:
        metrics |= _mismatch_from_first_update(first)
    # The updates compare with the engine's routing where no old-policy forward recorded its own.
    updates_see_engine_routing = mode.uses_engine_routing or not algo.runs_old_policy_forward
    if with_engine_routing and updates_see_engine_routing and not first.skipped:
        metrics |= _engine_routing_mismatch(first)
    return metrics | {"optim/lr": policy.learning_rate} | _update_metrics(updates)


def step_advantages(
    batch: RolloutBatch, algo: AlgoConfig, kl_rows: torch.Tensor | None = None
) -> torch.Tensor:
    """`[B]` float32 group advantages of `batch`'s rows from its rewards, the one place they
    are computed; with the KL in the reward (`kl_rows` `[B]`, each sample's summed per-token KL
    of the old policy to the reference) from the rewards less algo.kl_coef times it (verl's
    KL in the reward)."""
    rewards = batch.rewards.double()
    if kl_rows is not None:
        rewards = rewards - algo.kl_coef * kl_rows
    shaped = group_advantages(rewards, batch.group_size, std_normalize=algo.std_normalize)
    return shaped.advantages.to(torch.float32)


def _minibatches(
    policy: Policy,
    batch: RolloutBatch,
    algo: AlgoConfig,
    *,
    micro_batch_size: int,
    micro_batch_tokens: int | None,
    packed: bool,
    seed: int,
    with_engine_routing: bool,
) -> list[list[PolicyMicroBatch]]:
    """This rank's micro-batches of each minibatch of `batch`'s training rows (rows whose
    responses were all filtered carry nothing and join none), `with_engine_routing`: carrying
    the engine's routing (R3 replays it; the old-policy forward's record replaces it else)."""
    gate_weights = algo.routing_replay.replays_gate_weights
    engine_routing = _engine_routing(policy, gate_weights) if with_engine_routing else None
    # sequence parallelism splits each micro-batch's width over the TP ranks
    sequence_parallel = policy.model.config.sequence_parallel
    return [
        micro_batches(
            batch,
            chunk,
            dp_rank=parallel_state.get_data_parallel_rank(),
            dp_size=parallel_state.get_data_parallel_world_size(),
            micro_batch_size=micro_batch_size,
            micro_batch_tokens=micro_batch_tokens,
            width_multiple=parallel_state.get_tensor_model_parallel_world_size()
            if sequence_parallel
            else 1,
            packed=packed,
            engine_routing=engine_routing,
        )
        for chunk in minibatch_rows(batch.training_rows(), algo.updates_per_batch, seed=seed)
    ]


def _padding_share(minibatches: list[list[PolicyMicroBatch]]) -> float:
    """The share of the token positions this rank's micro-batches hold that are padding (each
    runs through every forward and backward of the step)."""
    every = [micro for minibatch in minibatches for micro in minibatch]
    masks = [micro.padding_mask for micro in every if micro.padding_mask is not None]
    return sum(int(mask.sum()) for mask in masks) / sum(micro.tokens.numel() for micro in every)


def _each(
    minibatches: list[list[PolicyMicroBatch]],
    change: Callable[[PolicyMicroBatch], PolicyMicroBatch],
) -> list[list[PolicyMicroBatch]]:
    return [[change(micro) for micro in minibatch] for minibatch in minibatches]


def _with_advantages(
    minibatches: list[list[PolicyMicroBatch]], advantages: torch.Tensor
) -> list[list[PolicyMicroBatch]]:
    """Each micro-batch with its rows' `advantages` (`[B]`; 0 for filler rows)."""
    return _each(minibatches, lambda micro: micro.with_row_advantages(advantages))


def _with_old_policy(
    policy: Policy,
    minibatches: list[list[PolicyMicroBatch]],
    algo: AlgoConfig,
    *,
    logp_are_old: bool,
) -> tuple[list[list[PolicyMicroBatch]], dict[str, float]]:
    """The minibatches after the old-policy pass over all of their micro-batches: its entropy
    and recorded routing attached and, when `logp_are_old`, its log-probs as the old ones (on
    the last pipeline stage, which alone reads them); and the old policy's metrics."""
    every_micro_batch = [micro for minibatch in minibatches for micro in minibatch]
    computed = policy.old_policy(every_micro_batch, algo.routing_replay)
    # The old log-probs are on the last pipeline stage; rank 0 logs.
    last_stage = parallel_state.is_pipeline_last_stage()
    old = _old_policy_metrics(every_micro_batch, computed) if last_stage else {}
    metrics = from_last_stage(old)
    if every_micro_batch[0].routing is not None and computed[0].routing is not None:
        # The engine's routing, which the old policy's record replaces: how far they differ.
        metrics |= policy.engine_routing_mismatch(every_micro_batch, computed)
    attached = [
        replace(
            micro,
            old_logp=values.logp if logp_are_old else None,
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
        [replace(micro, ref_logp=next(logprobs)) for micro in minibatch]
        for minibatch in minibatches
    ]


def _kl_per_row(
    batch: RolloutBatch, minibatches: list[list[PolicyMicroBatch]], algo: AlgoConfig
) -> tuple[torch.Tensor, dict[str, float]]:
    """`[B]` each sample's summed per-token KL estimate of the old policy to the reference,
    for verl's KL in the reward, on every rank: the last pipeline stage, which alone has the
    log-probs, computes it (the rows are spread over the data-parallel ranks, which add up
    their shares: each row lies in one micro-batch of one rank); and its metrics."""
    kl_rows = None
    if parallel_state.is_pipeline_last_stage():
        kl_rows = torch.zeros(batch.num_rows, dtype=torch.float64)
        for micro in (micro for minibatch in minibatches for micro in minibatch):
            kl = kl_to_reference(
                micro.old_logp, micro.ref_logp, micro.loss_mask, algo.kl_estimator
            ).sum(dim=1)
            real = micro.row_ids >= 0
            kl_rows.index_add_(0, micro.row_ids[real], kl[real].double())
        group = parallel_state.get_data_parallel_group(with_context_parallel=True)
        if dist.get_world_size(group) > 1:
            kl_rows = host_all_reduce(kl_rows, group=group)
    kl_rows = from_last_stage(kl_rows)
    metrics = {
        "kl/reward_ref": float(kl_rows.mean()),
        "reward/kl_penalty": float(-algo.kl_coef * kl_rows.mean()),
    }
    return kl_rows, metrics


def _since_old_after_the_last_update(last: UpdateResult) -> dict[str, float]:
    """The routing probe's share of activated experts the old policy did not choose, after the
    step's last update (`routing/since_old_last_activated_experts`): the step's
    `routing/since_old_activated_experts` averages over its updates, the first of which has
    moved the weights once."""
    since_old = update_change_name("drift/activated_experts", "since_old")
    if since_old not in last.metrics:
        return {}
    return {
        update_change_name("drift/activated_experts", "since_old_last"): last.metrics[since_old]
    }


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
    response tokens (this rank's share; equal shares make it representative)."""
    masks = torch.cat([m.loss_mask.flatten() for m in every_micro_batch])
    if masks.sum() == 0 or computed[0].entropy is None:
        return {}
    entropy = torch.cat([values.entropy.flatten() for values in computed])[masks]
    trainer = torch.cat([values.logp.flatten() for values in computed])
    engine = torch.cat([m.engine_logp.flatten() for m in every_micro_batch])
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
    """Where the updates compare with the engine's routing (R3, or no old-policy forward), the
    first update's drift (before any optimizer step) is how far the trainer's routers disagree
    with the engine's: `routing/engine_mismatch_*`."""
    return {
        f"routing/engine_mismatch_{unit}": first.metrics[f"routing/drift_{unit}"]
        for unit in ENGINE_MISMATCH_UNITS
        if f"routing/drift_{unit}" in first.metrics
    }


def _engine_routing(policy: Policy, gate_weights: bool) -> EngineRouting:
    config = policy.config
    sequence_parallel = policy.model.config.sequence_parallel
    return EngineRouting(
        num_layers=config.num_layers,
        moe_layers=tuple(config.moe_layers),
        stage_layers=tuple(policy.replay.layer_numbers),
        topk=config.router_topk,
        sp_rank=parallel_state.get_tensor_model_parallel_rank() if sequence_parallel else 0,
        sp_size=parallel_state.get_tensor_model_parallel_world_size() if sequence_parallel else 1,
        gate_weights=gate_weights,
    )
