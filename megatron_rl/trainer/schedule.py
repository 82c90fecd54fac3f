"""Megatron-Core's forward-backward schedule (1F1B under PP) over the trainer's micro-batches:
the old-policy pass, which returns what it computed, and the policy loss.

Only the last pipeline stage computes the loss. Its loss function returns megatron-core's
"per-token loss" triple: the unnormalised loss sum, its denominator (sequences or tokens, see
`megatron_rl.algo.aggregation`) and the metrics. With `calculate_per_token_loss` on, megatron-core
sums the denominators over micro-batches and data-parallel ranks and divides the gradients by the
total in `finalize_model_grads`: gradient accumulation and DP give the gradient of the full batch.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from functools import partial
from typing import Any

import torch
import torch.distributed as dist
from megatron.core import parallel_state
from megatron.core.distributed import finalize_model_grads
from megatron.core.pipeline_parallel import get_forward_backward_func
from torch import Tensor

from megatron_rl.algo import (
    PolicyLossSpec,
    engine_gap_metrics,
    policy_loss,
    policy_loss_denominator,
)
from megatron_rl.moe.replay import RoutingReplay
from megatron_rl.parallel.collectives import host_all_reduce
from megatron_rl.parallel.logprobs import vocab_parallel_logprobs
from megatron_rl.trainer.micro_batch import PolicyMicroBatch

# (index of the micro-batch, the micro-batch the caller holds, its copy on the model's device) ->
# the schedule's loss function of the model's output
MakeLossFunc = Callable[[int, PolicyMicroBatch, PolicyMicroBatch], Callable[[Tensor], Any]]


def policy_loss_func(
    micro_batch: PolicyMicroBatch, spec: PolicyLossSpec, logits: Tensor
) -> tuple[Tensor, Tensor, dict[str, Tensor]]:
    """The last stage's loss function: logits `[b, S, V/tp]` -> (loss sum, denominator, metrics)."""
    token = vocab_parallel_logprobs(
        logits,
        micro_batch.targets(),
        group=parallel_state.get_tensor_model_parallel_group(),
    )
    rows = micro_batch.as_rows(token.logp, token.entropy)
    if not bool(rows.loss_mask.any()):
        # Only rows without a loss token (filler rows, empty or overlong-filtered responses):
        # nothing to add, a zero that keeps the graph, and no metrics to average in.
        zero = (token.logp * 0.0).sum()
        return zero, torch.zeros((), dtype=torch.int), {"loss/sum": zero.detach()}
    if micro_batch.advantages is None:
        raise ValueError("advantages: the micro-batch has none (the learner attaches them)")
    loss_sum, metrics = policy_loss(
        spec,
        rows.logp,
        rows.old_logp,
        micro_batch.advantages,
        rows.loss_mask,
        segment_ids=rows.segment_ids,
        old_entropy=rows.old_entropy,
        engine_logp=rows.engine_logp,
        entropy=rows.entropy,
        ref_logp=rows.ref_logp,
        loss_denominator=1,
    )
    entropy_sum = torch.where(micro_batch.loss_mask, token.entropy.detach(), 0.0).sum()
    metrics = metrics | {"loss/sum": loss_sum.detach(), "entropy/sum": entropy_sum}
    if micro_batch.old_logp is None and rows.engine_logp is not None:
        # The old policy is this forward: what the old-policy pass would have reported.
        metrics |= engine_gap_metrics(rows.old_logp, rows.engine_logp, rows.loss_mask)
        metrics["entropy/mean"] = rows.old_entropy[rows.loss_mask].mean()
    return loss_sum, _denominator(rows.loss_mask, spec).round().to(torch.int), metrics


def _denominator(loss_mask: Tensor, spec: PolicyLossSpec) -> Tensor:
    return policy_loss_denominator(
        loss_mask, loss_agg=spec.options.loss_agg, max_response_len=spec.options.max_response_len
    )


def _sequence_split(model: torch.nn.Module) -> int:
    """The ranks that share each sequence's tokens at the routers (sequence and context
    parallelism): each router of this rank sees 1 / this of a micro-batch's tokens."""
    config = model.config
    split = config.tensor_model_parallel_size if config.sequence_parallel else 1
    return split * config.context_parallel_size


def _router_tokens(micro_batch: PolicyMicroBatch, model: torch.nn.Module) -> int:
    """Tokens each router of this rank sees: the sequence-parallel slice of the micro-batch."""
    return micro_batch.tokens.numel() // _sequence_split(model)


def _router_padding(micro_batch: PolicyMicroBatch, model: torch.nn.Module) -> Tensor | None:
    """The `padding_mask` for the model's forward (`PolicyMicroBatch.router_padding`), `[b, S]`
    on the first pipeline stage, which scatters it for sequence parallelism itself. Later
    stages get this rank's sequence-parallel share `[b, S / tp]`: megatron-core 0.16.1 hands
    their routers the mask as given (`GPTModel._preprocess` scatters it on the first stage
    only)."""
    padding = micro_batch.router_padding()
    config = model.config
    if padding is None or parallel_state.is_pipeline_first_stage() or not config.sequence_parallel:
        return padding
    share = padding.shape[1] // config.tensor_model_parallel_size
    start = parallel_state.get_tensor_model_parallel_rank() * share
    return padding[:, start : start + share]


def _forward_step(
    make_loss_func: MakeLossFunc,
    replay: RoutingReplay | None,
    recorded: list[list[Tensor] | None] | None,
    device: torch.device,
    data_iterator: Iterator[tuple[int, PolicyMicroBatch]],
    model: torch.nn.Module,
) -> tuple[Tensor, Any]:
    # Rollouts stay in host memory; each micro-batch visits the model's device for its step.
    index, held = next(data_iterator)
    micro_batch = held.to(device)
    if replay is not None:
        if recorded is not None:
            replay.record()
        elif micro_batch.routing is None:
            raise ValueError(
                "routing: routing replay is on but this micro-batch carries no routing record "
                "(R2: record it in the old-policy forward; R3: the engine must return it)"
            )
        else:
            tokens = _router_tokens(micro_batch, model)
            replay.replay(micro_batch.routing, tokens, micro_batch.gate_weights)
    output = model(
        micro_batch.tokens,
        micro_batch.position_ids(),
        attention_mask=None,
        packed_seq_params=micro_batch.packed_seq_params(),
        padding_mask=_router_padding(micro_batch, model),
    )
    if replay is not None:
        if recorded is not None:
            recorded[index] = replay.collect()
        else:
            replay.replay_backward_from(output)
    return output, make_loss_func(index, held, micro_batch)


@dataclass(frozen=True)
class StepResult:
    """Loss of the whole batch (all micro-batches and DP ranks) and per-micro-batch metrics."""

    loss: Tensor  # [] global loss, on every rank of the last pipeline stage; nan elsewhere
    denominator: Tensor  # [] global denominator
    metrics: list[dict[str, Tensor]]  # this rank's micro-batches (last stage only)


def policy_forward_backward(
    model: torch.nn.Module,
    micro_batches: list[PolicyMicroBatch],
    spec: PolicyLossSpec,
    *,
    replay: RoutingReplay | None = None,
) -> StepResult:
    """Run megatron-core's schedule (1F1B under PP) over `micro_batches` with the policy loss.

    `model` is this rank's DDP-wrapped model chunk. Gradients end up in the parameters'
    `main_grad`, already divided by the global denominator (with the distributed optimizer, fully
    reduced only on this rank's shard); the optimizer step is the caller's.
    With `replay`, each micro-batch's `routing` is forced. A model built with a load-balancing
    loss (`moe_aux_loss_coeff` c > 0) adds c times each micro-batch's switch loss over its
    non-padding tokens, weighted by their share of the update's (`_aux_loss_weight`).
    """
    with _aux_loss_weight(model, micro_batches, spec):
        results = _run_schedule(
            model,
            micro_batches,
            lambda index, held, micro_batch: partial(policy_loss_func, micro_batch, spec),
            forward_only=False,
            replay=replay,
        )
    return _global_loss(micro_batches, spec, results)


@contextmanager
def _aux_loss_weight(
    model: torch.nn.Module, micro_batches: list[PolicyMicroBatch], spec: PolicyLossSpec
) -> Iterator[None]:
    """Within it, the routers weigh their load-balancing loss so that the update's objective is
    the policy loss + c x sum_i (n_i / N) x L_i, whatever the loss denominator: L_i the switch
    loss of micro-batch i over its n_i non-padding tokens (`router_token_count`), N the sum of
    the n_i over the update's micro-batches and DP ranks, c the coefficient the model was built
    with. Every token the routers balance weighs the same; micro-batches alike in padding give
    the mean of their switch losses. Padding stays out (`router_padding`): on a right-padded
    batch it is tokens the model never trains on, copies of the pad token's embedding (which a
    model trained with transformers keeps at zero, where the first layer's RMSNorm multiplies
    its gradient by 1 / sqrt(eps)).

    With `calculate_per_token_loss`, megatron-core 0.16.1 backs micro-batch i's aux loss with
    gradient coeff x n_i / s (`TopKRouter.attach_and_log_load_balancing_loss`: the loss times
    the non-padding tokens this rank's router saw, s ranks sharing each sequence,
    `_sequence_split`; `MoEAuxLossAutoScaler`'s scale is 1, set by `forward_step_calc_loss`
    after every forward) and `finalize_model_grads` then divides every gradient by the global
    denominator D (tokens or sequences, `_denominator`). The routers read the coefficient from
    the shared TransformerConfig at each forward (and each recomputed one), so for the schedule
    it is set to c x D x s / N and restored after: D and N are known before the update starts,
    and the value is the same for every micro-batch, as recomputation under 1F1B needs. (The
    autoscaler's scale, read in each backward, is no place for it: the schedule sets it to 1
    after every forward.) With sequence parallelism the ranks' shares of n_i are taken equal.
    D = 0 (no loss token anywhere): megatron-core does not divide, so D counts as 1.
    """
    config = model.config
    coeff = config.moe_aux_loss_coeff
    if not coeff:
        yield
        return
    totals = torch.tensor(
        [
            sum(_loss_func_denominator(mb, spec) for mb in micro_batches),
            sum(mb.router_token_count() for mb in micro_batches),
        ],
        dtype=torch.float64,
    )
    group = parallel_state.get_data_parallel_group(with_context_parallel=True)
    if dist.get_world_size(group) > 1:
        totals = host_all_reduce(totals, group=group)
    denominator, tokens = float(totals[0]) or 1.0, float(totals[1])
    config.moe_aux_loss_coeff = coeff * denominator * _sequence_split(model) / tokens
    try:
        yield
    finally:
        config.moe_aux_loss_coeff = coeff


def _loss_func_denominator(micro_batch: PolicyMicroBatch, spec: PolicyLossSpec) -> int:
    """The denominator `policy_loss_func` returns for `micro_batch` (the one
    `finalize_model_grads` sums)."""
    if not bool(micro_batch.loss_mask.any()):
        return 0
    return int(_denominator(micro_batch.row_mask(), spec).round())


def _run_schedule(
    model: torch.nn.Module,
    micro_batches: list[PolicyMicroBatch],
    make_loss_func: MakeLossFunc,
    *,
    forward_only: bool,
    replay: RoutingReplay | None,
    recorded: list[list[Tensor] | None] | None = None,
) -> list[dict[str, Tensor]]:
    """The schedule over `micro_batches`; with `replay` and `recorded`, the routing of micro-batch
    i is recorded into `recorded[i]` instead of replayed. Micro-batches of different shapes
    (token-budget micro-batches) make the pipeline stages send each activation's shape before
    it (megatron-core's `variable_seq_lengths`)."""
    if not micro_batches:
        raise ValueError("micro_batches: expected at least one micro-batch")
    shapes = {tuple(mb.tokens.shape) for mb in micro_batches}
    batch, seq = max(shapes)
    config = model.config
    config.finalize_model_grads_func = finalize_model_grads
    config.no_sync_func = getattr(model, "no_sync", None)
    config.variable_seq_lengths = len(shapes) > 1
    results = get_forward_backward_func()(
        forward_step_func=partial(
            _forward_step, make_loss_func, replay, recorded, _model_device(model)
        ),
        data_iterator=iter(enumerate(micro_batches)),
        model=[model],
        num_microbatches=len(micro_batches),
        seq_length=seq,
        micro_batch_size=batch,
        forward_only=forward_only,
    )
    if replay is not None and recorded is None:
        replay.finish()
    return results


def _model_device(model: torch.nn.Module) -> torch.device:
    return next(model.parameters()).device


@dataclass(frozen=True)
class OldPolicy:
    """What the old-policy pass computed for one micro-batch, on the micro-batch's device.

    Attributes:
        logp: like the micro-batch's tokens, the log-prob of each predicted token; None off the
            last pipeline stage, which alone computes it.
        entropy: like `logp`, the token entropy.
        routing: per MoE layer of this rank's stage, the `[tokens, topk]` experts the routers
            chose, when the pass recorded them (else None).
    """

    logp: Tensor | None
    entropy: Tensor | None
    routing: list[Tensor] | None


def _keep_logprobs(
    into: list[tuple[Tensor, Tensor] | None],
    index: int,
    held: PolicyMicroBatch,
    micro_batch: PolicyMicroBatch,
    logits: Tensor,
) -> tuple[Tensor, Tensor, dict[str, Tensor]]:
    """A loss function that keeps the token log-probs and entropy of micro-batch `index` in
    `into[index]`, on the device of the micro-batch the caller holds (`micro_batch` is its copy
    on the model's device), and returns a zero loss."""
    token = vocab_parallel_logprobs(
        logits.detach(),
        micro_batch.targets(),
        group=parallel_state.get_tensor_model_parallel_group(),
    )
    host = held.tokens.device
    into[index] = (token.logp.to(host), token.entropy.to(host))
    zero = torch.zeros((), dtype=torch.float32, device=logits.device)
    return zero, torch.ones((), dtype=torch.int), {}


def old_policy_pass(
    model: torch.nn.Module,
    micro_batches: list[PolicyMicroBatch],
    *,
    replay: RoutingReplay | None = None,
    record_routing: bool = False,
) -> list[OldPolicy]:
    """A forward over `micro_batches` with the current weights: each one's log-probs and
    entropy and, with `replay` and `record_routing`, the routing its routers chose (R2, and the
    drift metrics). With `replay` alone, the micro-batches' own `routing` is forced (R3)."""
    values: list[tuple[Tensor, Tensor] | None] = [None] * len(micro_batches)
    recorded = [None] * len(micro_batches) if replay is not None and record_routing else None
    with torch.no_grad():
        _run_schedule(
            model,
            micro_batches,
            lambda index, held, micro_batch: partial(
                _keep_logprobs, values, index, held, micro_batch
            ),
            forward_only=True,
            replay=replay,
            recorded=recorded,
        )
    return [
        OldPolicy(
            logp=None if value is None else value[0],
            entropy=None if value is None else value[1],
            routing=None if recorded is None else recorded[index],
        )
        for index, value in enumerate(values)
    ]


def _global_loss(
    micro_batches: list[PolicyMicroBatch], spec: PolicyLossSpec, metrics: list[dict[str, Tensor]]
) -> StepResult:
    local_denominator = sum(_denominator(mb.row_mask(), spec) for mb in micro_batches)
    totals = torch.zeros(2, dtype=torch.float64)
    totals[1] = local_denominator
    if parallel_state.is_pipeline_last_stage():
        totals[0] = sum(float(m["loss/sum"]) for m in metrics)
    group = parallel_state.get_data_parallel_group(with_context_parallel=True)
    if dist.get_world_size(group) > 1:
        totals = host_all_reduce(totals, group=group)
    loss = totals[0] / totals[1]
    if not parallel_state.is_pipeline_last_stage():
        loss = torch.tensor(float("nan"), dtype=torch.float64)
    return StepResult(loss=loss, denominator=totals[1], metrics=metrics)
