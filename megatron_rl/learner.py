"""The learning half of an RL step: old-policy log-probs (with the routing record or replay),
then minibatch updates of the Megatron-Core policy, and their metrics."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Literal

import torch
from megatron.core import parallel_state
from torch import Tensor

from megatron_rl.algo import EXTREME_RATIO_TAUS, extreme_token_frac
from megatron_rl.metrics import StepTimer
from megatron_rl.models.policy import Policy, UpdateResult, metric_reduction
from megatron_rl.moe.drift import routing_bytes
from megatron_rl.parallel.schedule import PolicyLossSpec, PolicyMicroBatch
from megatron_rl.parallel.stages import from_last_stage
from megatron_rl.rollout.batch import EngineRouting, RolloutBatch, micro_batches, minibatch_rows


@dataclass(frozen=True, kw_only=True)
class LearnSettings:
    """What the learning step needs from the recipe (megatron_rl.config: algo, run)."""

    updates_per_batch: int = 4
    micro_batch_size: int = 32
    routing_replay: Literal["none", "r2", "r3"] = "none"
    use_engine_logprobs: bool = False


def learn(
    policy: Policy,
    batch: RolloutBatch | None,
    spec: PolicyLossSpec,
    settings: LearnSettings,
    timer: StepTimer,
    *,
    seed: int,
) -> dict[str, float]:
    """Old log-probs, then `settings.updates_per_batch` optimizer steps on minibatches of
    `batch` (shuffled with `seed`); returns the step's training metrics."""
    if batch is None:  # every group had equal rewards and was dropped
        return {"steps/skipped": 0.0, "steps/no_data": 1.0}
    rows = minibatch_rows(batch.num_rows, settings.updates_per_batch, seed=seed)
    engine_routing = _engine_routing(policy) if settings.routing_replay == "r3" else None
    minibatches = [
        micro_batches(
            batch,
            chunk,
            dp_rank=parallel_state.get_data_parallel_rank(),
            dp_size=parallel_state.get_data_parallel_world_size(),
            micro_batch_size=settings.micro_batch_size,
            engine_routing=engine_routing,
        )
        for chunk in rows
    ]
    every_micro_batch = [micro for minibatch in minibatches for micro in minibatch]
    metrics: dict[str, float] = {}
    with timer.phase("old_logprob"):
        needs_forward = not settings.use_engine_logprobs or spec.name == "sspo"
        if needs_forward:
            engine_logp = [micro.old_logp for micro in every_micro_batch]
            # R3 replays the engine's routing; otherwise the old routing is recorded (R2 replays
            # it, and it is what the drift metrics compare the updated routers with).
            routing = "replay" if settings.routing_replay == "r3" else "record"
            policy.old_logprobs(every_micro_batch, routing=routing)
            # The old log-probs are on the last pipeline stage; rank 0 logs.
            last_stage = parallel_state.is_pipeline_last_stage()
            old = _old_policy_metrics(every_micro_batch, engine_logp) if last_stage else {}
            metrics |= from_last_stage(old)
            records = [layer for micro in every_micro_batch for layer in micro.routing or []]
            metrics["routing/record_bytes"] = float(routing_bytes(records))
            if settings.use_engine_logprobs:
                for micro, logp in zip(every_micro_batch, engine_logp, strict=True):
                    micro.old_logp = logp
    with timer.phase("train"):
        updates = [
            policy.update(minibatch, spec, replay=settings.routing_replay != "none")
            for minibatch in minibatches
        ]
    if not needs_forward and not updates[0].skipped:
        metrics |= _mismatch_from_first_update(updates[0])
    return metrics | {"optim/lr": policy.learning_rate} | _update_metrics(updates)


def _update_metrics(updates: list[UpdateResult]) -> dict[str, float]:
    """The step's updates in one set of metrics: means, and extremes for `*max` / `*min`;
    skipped (non-finite) updates are counted and left out."""
    good = [u for u in updates if not u.skipped]
    metrics = {
        "loss/policy": _mean([u.loss for u in good]),
        "grad_norm": _mean([u.grad_norm for u in good]),
        "steps/skipped": float(len(good) < len(updates)),
        "steps/skipped_updates": float(len(updates) - len(good)),
    }
    for key in sorted({k for u in good for k in u.metrics}):
        values = [u.metrics[key] for u in good if key in u.metrics]
        combine = {"max": max, "min": min, "mean": _mean}[metric_reduction(key)]
        metrics[key] = combine(values)
    return metrics


def _old_policy_metrics(
    every_micro_batch: list[PolicyMicroBatch], engine_logp: list[Tensor]
) -> dict[str, float]:
    """Entropy of the old policy and the engine/trainer mismatch (k3 KL(engine || trainer), the
    largest |log-ratio| and F(tau), the share of tokens whose probabilities differ by more than
    tau times), over response tokens (this rank's share; equal shares make it representative)."""
    masks = torch.cat([m.loss_mask.flatten() for m in every_micro_batch])
    if masks.sum() == 0 or every_micro_batch[0].old_entropy is None:
        return {}
    entropy = torch.cat([m.old_entropy.flatten() for m in every_micro_batch])[masks]
    trainer = torch.cat([m.old_logp.flatten() for m in every_micro_batch])[masks].double()
    engine = torch.cat([e.flatten() for e in engine_logp])[masks].double()
    delta = trainer - engine
    everywhere = torch.ones_like(delta, dtype=torch.bool)
    return {
        "entropy/mean": float(entropy.mean()),
        "mismatch/k3": float((torch.expm1(delta) - delta).mean()),
        "mismatch/abs_max": float(delta.abs().max()),
    } | {
        f"mismatch/frac_tau{tau}": float(extreme_token_frac(delta, everywhere, tau))
        for tau in EXTREME_RATIO_TAUS
    }


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


def _engine_routing(policy: Policy) -> EngineRouting:
    config = policy.config
    replay = policy.replay
    first = parallel_state.get_pipeline_model_parallel_rank() * replay.num_layers
    sequence_parallel = policy.model.config.sequence_parallel
    return EngineRouting(
        num_layers=config.num_layers,
        topk=config.router_topk,
        layers=range(first, first + replay.num_layers),
        sp_rank=parallel_state.get_tensor_model_parallel_rank() if sequence_parallel else 0,
        sp_size=parallel_state.get_tensor_model_parallel_world_size() if sequence_parallel else 1,
    )


def _mean(values: list[float]) -> float:
    return sum(values) / len(values) if values else math.nan
