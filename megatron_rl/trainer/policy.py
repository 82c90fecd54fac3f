"""The trainable policy on this rank: a Megatron-Core MoE model chunk loaded from a Hugging Face
checkpoint, megatron-core's DDP, optimizer and learning-rate scheduler, and routing replay."""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, replace
from pathlib import Path

import torch
import torch.distributed as dist
from megatron.core import parallel_state
from megatron.core.transformer.moe.router import TopKRouter
from torch import Tensor

from megatron_rl.algo.reductions import Reduction
from megatron_rl.config import ConfigError
from megatron_rl.models.build import build_gpt_moe
from megatron_rl.models.config import ModelConfig, MoEModelConfig
from megatron_rl.models.families import ModelFamily
from megatron_rl.models.hf_source import inspect_hf
from megatron_rl.models.hf_weights import HFWeightStream, load_hf_weights, stream_hf_weights
from megatron_rl.moe.drift import changed_routes, routing_drift, routing_share_of_log_ratio
from megatron_rl.moe.engine_routing import router_token_mask
from megatron_rl.moe.margins import margin_metrics
from megatron_rl.moe.replay import ObservedRouting, RoutingReplay
from megatron_rl.moe.replay_mode import RoutingReplayMode
from megatron_rl.parallel.collectives import host_all_reduce, union_over_ranks
from megatron_rl.parallel.dims import ParallelDims
from megatron_rl.parallel.stages import from_last_stage, join_stages
from megatron_rl.trainer.metric_reductions import (
    UPDATE_METRICS,
    routing_metric_name,
    update_change_name,
)
from megatron_rl.trainer.micro_batch import PolicyMicroBatch, router_rows
from megatron_rl.trainer.optimizer import (
    OptimConfig,
    build_optimizer,
    build_scheduler,
    step_if_finite,
    wrap_for_training,
)
from megatron_rl.trainer.schedule import (
    OldPolicy,
    PolicyLossSpec,
    old_policy_pass,
    policy_forward_backward,
)

# `routing_drift` measures reported as `routing/engine_mismatch_<unit>`: the engine's routing
# against the trainer's at the same weights.
ENGINE_MISMATCH_UNITS = ("token_layer", "token_any", "activated_experts")

# Rows of a micro-batch the routing probe forwards again after an update (two forwards each):
# enough tokens for shares of a few percent, a quarter of the harness's micro-batches.
PROBE_ROWS = 8

# Per-micro-batch sums used for the loss itself; the update reports the loss instead.
_NOT_AVERAGED = ("loss/sum", "entropy/sum", "loss/denominator")


@dataclass(frozen=True)
class UpdateResult:
    """One optimizer step: the global loss, the gradient norm and the loss metrics over
    micro-batches and data-parallel ranks, each by its declared reduction (`UPDATE_METRICS`)."""

    loss: float
    grad_norm: float
    skipped: bool  # the loss or the gradient was not finite: no step was taken
    metrics: dict[str, float]


class Policy:
    """This rank's share of the policy (its pipeline stage, TP and EP shards).

    `routing_replay` builds the routers with megatron-core's RouterReplay, which recording,
    replaying and the drift metrics need; without it they always route freely.
    """

    def __init__(
        self,
        model: ModelConfig,
        dims: ParallelDims,
        optim: OptimConfig,
        *,
        routing_replay: bool = True,
    ) -> None:
        self.hf_dir = Path(model.hf_path)
        self.dims = dims
        self.family, self.config, chunk = load_model_chunk(
            model, dims, routing_replay=routing_replay
        )
        self.replay = RoutingReplay(chunk) if routing_replay else None
        if optim.freeze_router:
            # before the DDP wrapper and the optimizer, which take the trainable weights only
            for router in _routers(chunk):
                router.weight.requires_grad_(False)
        # With no data-parallel copies the distributed optimizer has nothing to shard and takes
        # the plain optimizer's steps, with parameter gathers on top.
        distributed = optim.distributed_optimizer and dims.replicates_weights
        self.model = wrap_for_training(chunk, distributed_optimizer=distributed)
        self.optimizer = build_optimizer(self.model, optim)
        self.scheduler = build_scheduler(self.optimizer, optim)

    def _replay_for(self, mode: RoutingReplayMode, what: str) -> RoutingReplay | None:
        if self.replay is None and mode.replays:
            raise ValueError(f"{what} with routing replay {mode}: build the Policy with it")
        return self.replay

    def old_policy(
        self, micro_batches: list[PolicyMicroBatch], mode: RoutingReplayMode
    ) -> list[OldPolicy]:
        """The old policy's log-probs and entropy of each micro-batch (a forward of the current
        weights), and the routing it chose wherever `mode` records it (R2, and for the drift
        metrics); under R3 the micro-batches' own (the engine's) routing is forced instead."""
        replay = self._replay_for(mode, "the old-policy pass")
        return old_policy_pass(
            self.model, micro_batches, replay=replay, record_routing=mode.records_old_routing
        )

    def engine_routing_mismatch(
        self, micro_batches: list[PolicyMicroBatch], computed: list[OldPolicy]
    ) -> dict[str, float]:
        """How far the routing the old-policy pass recorded (`computed`) is from the engine's
        that `micro_batches` carry, at the same weights: `routing/engine_mismatch_<unit>` for
        each of ENGINE_MISMATCH_UNITS, the mean over this rank's micro-batches."""
        each = [
            _replay_drift(
                micro,
                ObservedRouting(old.routing, old.routing, []),
                self._router_token_mask(micro),
                replaying=False,
                layer_numbers=self.config.moe_layers,
            )
            for micro, old in zip(micro_batches, computed, strict=True)
        ]
        count = len(each)
        return {
            f"routing/engine_mismatch_{unit}": sum(m[f"routing/drift_{unit}"] for m in each) / count
            for unit in ENGINE_MISMATCH_UNITS
        }

    def update(
        self,
        micro_batches: list[PolicyMicroBatch],
        spec: PolicyLossSpec,
        mode: RoutingReplayMode,
        *,
        probe_routing: bool = False,
    ) -> UpdateResult:
        """One optimizer step on the minibatch made of `micro_batches` (all DP ranks together),
        replaying their `routing` when `mode` replays. When they carry routing (recorded or
        replayed) the metrics include how far the routers' free choice has drifted from it,
        and under replay how often the forward used other experts than the replayed ones; with
        `probe_routing`, what the update changed (`_probe_after_update`).

        A non-finite loss or gradient norm skips the step (`step_if_finite`: the weights and the
        optimizer's state stay as they are) and says so in `skipped`; the loss, the gradient
        norm and the metrics keep their non-finite values.
        """
        self.model.zero_grad_buffer()
        self.optimizer.zero_grad()
        replaying = self._replay_for(mode, "an update") if mode.replays else None
        watch = None
        if self.replay is not None and micro_batches[-1].routing is not None:
            watch = self.replay.observe_routing()
        result = policy_forward_backward(self.model, micro_batches, spec, replay=replaying)
        drift, before = {}, None
        if watch is not None:
            before = watch()
            drift = _replay_drift(
                micro_batches[-1],
                before,
                self._router_token_mask(micro_batches[-1]),
                replaying=replaying is not None,
                layer_numbers=self.config.moe_layers,
            )
        loss, metrics = from_last_stage((float(result.loss), _average_metrics(result.metrics)))
        step = step_if_finite(self.optimizer, loss=loss)
        if step.taken:
            self.scheduler.step(increment=1)
            if probe_routing and before is not None:
                drift |= self._probe_after_update(micro_batches[-1], before)
        return UpdateResult(
            loss=loss, grad_norm=step.grad_norm, skipped=not step.taken, metrics=metrics | drift
        )

    def _probe_after_update(
        self, micro_batch: PolicyMicroBatch, before: ObservedRouting
    ) -> dict[str, float]:
        """What one update changed, on the same tokens (the first PROBE_ROWS rows of this rank's
        last micro-batch of the minibatch) forwarded again with the updated weights twice:
        routing freely, and with their `routing` (the old policy's, or the engine's under R3)
        replayed:

        - `routing/update_*`: `routing_drift` from the routing chosen before the update to the
          routing chosen after it (`routing/update_activated_experts`: the share of activated
          experts one update changed; `routing/update_layer_<i>` is per layer);
        - `routing/since_old_*`: `routing_drift` from the micro-batch's `routing` (the old
          policy's; under R3 the engine's) to the routing chosen after the update: the papers'
          "after each update, the experts the new policy activates that the old one did not";
        - `routing/margin_*`: the top-k margins before the update (`margin_metrics`), with the
          routes that flipped in the update counted per margin bucket;
        - `routing/log_ratio_*_share`: routing's share of the token log-ratios against the old
          log-probs (`routing_share_of_log_ratio`), when the micro-batch carries them.
        """
        replay = self._replay_for(RoutingReplayMode.R2, "the routing probe")
        batch = micro_batch.tokens.shape[0]
        micro_batch = micro_batch.first_rows(PROBE_ROWS)
        count = micro_batch.tokens.shape[0]
        before = ObservedRouting(
            *([router_rows(layer, batch, count) for layer in part] for part in before)
        )
        free = old_policy_pass(self.model, [micro_batch], replay=replay, record_routing=True)[0]
        held = old_policy_pass(self.model, [micro_batch], replay=replay)[0]
        device = before.free[0].device
        chosen_before = join_stages(torch.stack(before.free, 1), dim=1)
        chosen_after = join_stages(torch.stack(free.routing, 1).to(device), dim=1)
        margins = join_stages(torch.stack(before.margins, 1), dim=1)
        mask = self._router_token_mask(micro_batch).to(device)
        _check_mask_fits(mask, chosen_before)
        layers = self.config.moe_layers
        change = routing_drift(chosen_before, chosen_after, mask, layers)
        old = join_stages(torch.stack(micro_batch.routing, 1).to(device), dim=1)
        since_old = routing_drift(old.to(chosen_after.dtype), chosen_after, mask, layers)
        flipped = changed_routes(chosen_before, chosen_after)
        metrics = {update_change_name(key): value for key, value in change.items()}
        metrics |= {update_change_name(key, "since_old"): v for key, v in since_old.items()}
        metrics |= {
            routing_metric_name(key): value
            for key, value in margin_metrics(margins, flipped, mask, layers).items()
        }
        share = None
        if parallel_state.is_pipeline_last_stage() and micro_batch.old_logp is not None:
            share = routing_share_of_log_ratio(
                free.logp, held.logp, micro_batch.old_logp, micro_batch.loss_mask
            )
        metrics |= from_last_stage(share) or {}
        return {key: float(value) for key, value in metrics.items()}

    def _router_token_mask(self, micro_batch: PolicyMicroBatch) -> Tensor:
        """The micro-batch's loss mask `[tokens]` in the order this rank's routers see its
        tokens: position, then row, over this rank's slice under sequence parallelism."""
        if not self.model.config.sequence_parallel:
            return router_token_mask(micro_batch.loss_mask)
        return router_token_mask(
            micro_batch.loss_mask,
            sp_rank=parallel_state.get_tensor_model_parallel_rank(),
            sp_size=parallel_state.get_tensor_model_parallel_world_size(),
        )

    def router_weights(self) -> list[Tensor]:
        """A copy of this rank's routers' weights (its pipeline stage's MoE layers)."""
        return [router.weight.detach().clone() for router in _routers(self.model.module)]

    def router_change(self, before: list[Tensor]) -> dict[str, float]:
        """How far the routers moved since `before` (`router_weights`), over every pipeline
        stage: `routing/router_weight_change` the Frobenius norm of the change of all router
        weights together, `routing/router_weight_change_rel` that over the norm of `before`."""
        squares = torch.zeros(2, dtype=torch.float64)
        for router, old in zip(_routers(self.model.module), before, strict=True):
            squares[0] += (router.weight.detach() - old).double().square().sum().cpu()
            squares[1] += old.double().square().sum().cpu()
        group = parallel_state.get_pipeline_model_parallel_group()
        if dist.get_world_size(group) > 1:
            squares = host_all_reduce(squares, group=group)
        change, norm = squares.sqrt().tolist()
        return {
            "routing/router_weight_change": change,
            "routing/router_weight_change_rel": change / norm if norm > 0 else 0.0,
        }

    @property
    def learning_rate(self) -> float:
        return float(self.optimizer.param_groups[0]["lr"])

    def sequence_logprobs(self, sequences: list[list[int]]) -> list[Tensor]:
        """Per sequence, `[len - 1]` float32 log-probs of its tokens 1.. under the current
        weights, returned on every rank (a collective: every rank passes the same sequences)."""
        micro_batches = []
        for sequence in sequences:
            # Right padding to a multiple of 8 (sequence parallelism splits the sequence over
            # TP ranks); under causal attention it cannot change the real tokens' log-probs.
            width = -(-len(sequence) // 8) * 8
            tokens = torch.zeros(1, width, dtype=torch.long)
            tokens[0, : len(sequence)] = torch.tensor(sequence)
            mask = torch.zeros(1, width, dtype=torch.bool)
            mask[0, : len(sequence) - 1] = True
            micro_batches.append(PolicyMicroBatch(tokens=tokens, loss_mask=mask))
        # The routers choose freely: the probe compares weights, not a recorded routing.
        computed = old_policy_pass(self.model, micro_batches)
        # Only the last pipeline stage has log-probs; every rank of it holds the same ones.
        values = None
        if parallel_state.is_pipeline_last_stage():
            values = [
                old.logp[0, : len(seq) - 1].float().cpu()
                for old, seq in zip(computed, sequences, strict=True)
            ]
        return from_last_stage(values)

    def weight_stream(self, *, bucket_bytes: int = 512 * 2**20) -> HFWeightStream:
        """The current weights as Hugging Face tensors on global rank 0 (a collective)."""
        return stream_hf_weights(
            self.model.module, self.family, self.config, bucket_bytes=bucket_bytes
        )


def load_model_chunk(
    model: ModelConfig, dims: ParallelDims, *, routing_replay: bool
) -> tuple[ModelFamily, MoEModelConfig, torch.nn.Module]:
    """This rank's chunk of the Megatron-Core model of `model.hf_path`, its weights loaded, with
    the family and config it was built from (`routing_replay`: routers built with
    megatron-core's RouterReplay). The recipe's load-balancing options (`model.aux_loss_coeff`,
    `model.router_bias_update_rate`) are the built model's."""
    source = inspect_hf(Path(model.hf_path), given_as="model.hf_path")
    if model.router_bias_update_rate > 0 and not source.config.router_expert_bias:
        raise ConfigError(
            f"model.router_bias_update_rate: needs a sigmoid router with an expert bias "
            f"(DeepSeek-V3's e_score_correction_bias); the routers of {model.hf_path} have none"
        )
    config = replace(
        source.config,
        moe_aux_loss_coeff=model.aux_loss_coeff,
        router_bias_update_rate=model.router_bias_update_rate,
    )
    chunk = build_gpt_moe(
        config,
        dims,
        dispatcher=model.dispatcher,
        recompute=model.recompute,
        initialize=False,
        routing_replay=routing_replay,
    )
    load_hf_weights(chunk, source.family, config, source.checkpoint.tensor, source.checkpoint.shape)
    source.checkpoint.close()
    return source.family, config, chunk


def _routers(model: torch.nn.Module) -> list[TopKRouter]:
    """The MoE routers of `model` (this rank's chunk), in layer order."""
    return [module for module in model.modules() if isinstance(module, TopKRouter)]


def _check_mask_fits(mask: Tensor, routing: Tensor) -> None:
    """Raise unless the router-order loss mask `[tokens]` has a value per routed token of
    `routing` `[tokens, ...]`: a silent fallback to every token would count prompt and padding
    tokens in the drift metrics."""
    if mask.numel() != len(routing):
        raise ValueError(
            f"routing drift: the loss mask gives {mask.numel()} tokens in the routers' order, "
            f"the routers routed {len(routing)}"
        )


def _replay_drift(
    micro_batch: PolicyMicroBatch,
    observed: ObservedRouting,
    router_mask: Tensor,
    *,
    replaying: bool,
    layer_numbers: Sequence[int],
) -> dict[str, float]:
    """How far the routing the current weights would choose has drifted from the recorded or
    replayed one (the old policy's, R2, or the engine's, R3), and when `replaying`, the share of
    (token, layer) pairs where the forward used other experts than the replayed ones
    (`routing/replay_miss_token_layer`; 0 when replay works): this rank's last micro-batch,
    every MoE layer (all pipeline stages; `layer_numbers` are their model layers), response
    tokens (`router_mask` `[tokens]`, in the routers' order: `Policy._router_token_mask`)."""
    device = observed.free[0].device  # the model's (R3's replayed routing comes from the host)
    replayed = join_stages(torch.stack(micro_batch.routing, 1).to(device), dim=1)
    mask = router_mask.to(device)
    _check_mask_fits(mask, replayed)

    def drift_from_replayed(routing: list[Tensor]) -> dict[str, Tensor]:
        chosen = join_stages(torch.stack(routing, 1).to(replayed.dtype), dim=1)
        return routing_drift(replayed, chosen, mask, layer_numbers)

    metrics = {
        routing_metric_name(key): float(value)
        for key, value in drift_from_replayed(observed.free).items()
    }
    if replaying:
        miss = drift_from_replayed(observed.used)["drift/token_layer"]
        metrics["routing/replay_miss_token_layer"] = float(miss)
    return metrics


def _average_metrics(per_micro_batch: list[dict[str, Tensor]]) -> dict[str, float]:
    """Loss metrics over micro-batches and data-parallel ranks, each by its declared reduction
    (`UPDATE_METRICS`; a micro-batch without loss tokens has none and counts for none); empty
    off the last stage. A NaN in any micro-batch makes the metric NaN. Every rank of the group
    must know the keys: they are those of the loss, whichever micro-batch has them."""
    keys = sorted({k for m in per_micro_batch for k in m if k not in _NOT_AVERAGED})
    if not parallel_state.is_pipeline_last_stage():
        return {}
    group = parallel_state.get_data_parallel_group(with_context_parallel=True)
    if dist.get_world_size(group) > 1:
        keys = union_over_ranks(keys, group)
    if not keys:
        return {}
    values = torch.tensor(
        [[float(m.get(key, math.nan)) for key in keys] for m in per_micro_batch],
        dtype=torch.float64,
    )
    present = torch.tensor([[key in m for key in keys] for m in per_micro_batch])
    nan = values.isnan() & present
    values = torch.where(present & ~nan, values, 0.0)
    inf = torch.tensor(math.inf, dtype=torch.float64)
    counts = torch.stack([values.sum(0), present.sum(0), nan.sum(0)]).to(torch.float64)
    largest = torch.where(present & ~nan, values, -inf).max(0).values
    smallest = torch.where(present & ~nan, values, inf).min(0).values
    if dist.get_world_size(group) > 1:
        counts = host_all_reduce(counts, group=group)
        largest = host_all_reduce(largest, op=dist.ReduceOp.MAX, group=group)
        smallest = host_all_reduce(smallest, op=dist.ReduceOp.MIN, group=group)
    total, count, nans = counts
    combined = {
        Reduction.MEAN: total / count,
        Reduction.SUM: total,
        Reduction.MAX: largest,
        Reduction.MIN: smallest,
    }
    return {
        key: math.nan if nans[index] > 0 else float(combined[UPDATE_METRICS.of(key)][index])
        for index, key in enumerate(keys)
    }
