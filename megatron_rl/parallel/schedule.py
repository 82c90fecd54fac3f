"""The policy loss inside Megatron-Core's forward-backward schedule.

Only the last pipeline stage computes the loss. Its loss function returns megatron-core's
"per-token loss" triple: the unnormalised loss sum, its denominator (sequences or tokens, see
`megatron_rl.algo.aggregation`) and the metrics. With `calculate_per_token_loss` on, megatron-core
sums the denominators over micro-batches and data-parallel ranks and divides the gradients by the
total in `finalize_model_grads`: gradient accumulation and DP give the gradient of the full batch.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass, field, fields
from functools import partial
from typing import Any, Protocol

import torch
import torch.distributed as dist
from megatron.core import parallel_state
from megatron.core.distributed import finalize_model_grads
from megatron.core.packed_seq_params import PackedSeqParams
from megatron.core.pipeline_parallel import get_forward_backward_func
from torch import Tensor

from megatron_rl.algo import DEFAULT_LOSS_AGG, compute_policy_loss, policy_loss_denominator
from megatron_rl.parallel.distributed import host_all_reduce
from megatron_rl.parallel.logprobs import vocab_parallel_logprobs
from megatron_rl.parallel.packing import packed_positions, packed_targets, unpack


@dataclass
class PolicyMicroBatch:
    """One micro-batch of rollouts, padded `[b, S]` or packed `[1, total]` (THD).

    Position t of every per-token tensor refers to the token predicted at t, i.e. the token that
    follows t in its sequence. Padded: rows are sequences, padded to a common length S; put the
    padding after each sequence (right padding): the model attends causally with no padding
    mask, so padding before a sequence would be attended to by its tokens. Packed:
    sequences lie back to back in one row and `cu_seqlens` `[N + 1]` holds their offsets; the
    last token of each sequence has no successor and must be outside `loss_mask`.

    Attributes:
        tokens: `[b, S]` (or `[1, total]`) prompt + response token ids (padding: any valid id).
        loss_mask: like tokens, bool, true where the predicted token is a response token.
        old_logp: like tokens, old-policy log-prob of the predicted token.
        advantages: `[b]` (or `[N]`) per-sequence advantages; per-token ones like tokens.
        segment_ids: like tokens, SSPO segment ids within each sequence, or None.
        old_entropy: like tokens, old-policy entropy, or None.
        cu_seqlens: `[N + 1]` offsets of the packed sequences, or None when padded.
        routing: per MoE layer of this rank's stage, the `[tokens, topk]` experts to replay
            (R2: recorded by a forward with `record_routing`; R3: from the rollout engine).
    """

    tokens: Tensor
    loss_mask: Tensor
    old_logp: Tensor
    advantages: Tensor
    segment_ids: Tensor | None = None
    old_entropy: Tensor | None = None
    cu_seqlens: Tensor | None = None
    routing: list[Tensor] | None = None

    def to(self, device: torch.device) -> PolicyMicroBatch:
        """This micro-batch with every tensor on `device`; itself when they are already there."""
        if self.tokens.device == device:
            return self
        moved = {item.name: _on_device(getattr(self, item.name), device) for item in fields(self)}
        return PolicyMicroBatch(**moved)

    def targets(self) -> Tensor:
        """The next token at each position (a sequence's last position repeats its own token)."""
        if self.cu_seqlens is not None:
            return packed_targets(self.tokens[0], self.cu_seqlens)[None]
        return torch.cat([self.tokens[:, 1:], self.tokens[:, -1:]], dim=1)

    def position_ids(self) -> Tensor:
        if self.cu_seqlens is not None:
            return packed_positions(self.cu_seqlens)[1][None]
        batch, seq = self.tokens.shape
        return torch.arange(seq, device=self.tokens.device).expand(batch, seq)

    def packed_seq_params(self) -> PackedSeqParams | None:
        """Megatron-core's THD attention parameters (Transformer Engine attention only)."""
        if self.cu_seqlens is None:
            return None
        cu_seqlens = self.cu_seqlens.to(torch.int32)
        max_len = int((cu_seqlens[1:] - cu_seqlens[:-1]).max())
        return PackedSeqParams(
            qkv_format="thd",
            cu_seqlens_q=cu_seqlens,
            cu_seqlens_kv=cu_seqlens,
            max_seqlen_q=max_len,
            max_seqlen_kv=max_len,
        )

    def row_mask(self) -> Tensor:
        """`loss_mask` with one row per sequence (unpacked when packed)."""
        if self.cu_seqlens is None:
            return self.loss_mask
        return unpack(self.loss_mask[0], self.cu_seqlens, fill=False)

    def as_rows(self, logp: Tensor) -> tuple[Tensor, ...]:
        """(logp, old_logp, loss_mask, segment_ids, old_entropy) as `[rows, length]` tensors:
        unchanged when padded, unpacked into one row per sequence when packed."""
        fields = (logp, self.old_logp, self.loss_mask, self.segment_ids, self.old_entropy)
        if self.cu_seqlens is None:
            return fields
        last = self.cu_seqlens[1:] - 1
        if bool(self.loss_mask[0, last].any()):
            raise ValueError(
                "loss_mask: true on the last token of a packed sequence, which predicts nothing"
            )
        return tuple(
            None if field is None else unpack(field[0], self.cu_seqlens, fill=0) for field in fields
        )


def _on_device(value: Tensor | list[Tensor] | None, device: torch.device) -> Any:
    if value is None:
        return None
    if isinstance(value, list):
        return [tensor.to(device) for tensor in value]
    return value.to(device)


class RoutingControl(Protocol):
    """What the schedule needs from routing replay (`megatron_rl.moe.replay.RoutingReplay`)."""

    def record(self) -> None: ...

    def collect(self) -> list[Tensor]: ...

    def replay(self, routing: list[Tensor], num_tokens: int) -> None: ...

    def replay_backward_from(self, output: Tensor) -> None: ...

    def finish(self) -> int: ...


# (the micro-batch the caller holds, its copy on the model's device) -> the schedule's loss
# function of the model's output
MakeLossFunc = Callable[[PolicyMicroBatch, PolicyMicroBatch], Callable[[Tensor], Any]]


@dataclass(frozen=True)
class PolicyLossSpec:
    """Which policy loss, its clip range and its options (see `compute_policy_loss`)."""

    name: str
    clip_low: float
    clip_high: float
    options: dict[str, Any] = field(default_factory=dict)


def policy_loss_func(
    micro_batch: PolicyMicroBatch, spec: PolicyLossSpec, logits: Tensor
) -> tuple[Tensor, Tensor, dict[str, Tensor]]:
    """The last stage's loss function: logits `[b, S, V/tp]` -> (loss sum, denominator, metrics)."""
    token = vocab_parallel_logprobs(
        logits,
        micro_batch.targets(),
        group=parallel_state.get_tensor_model_parallel_group(),
    )
    logp, old_logp, loss_mask, segment_ids, old_entropy = micro_batch.as_rows(token.logp)
    options = {key: value for key, value in spec.options.items() if key != "loss_denominator"}
    loss_sum, metrics = compute_policy_loss(
        spec.name,
        logp,
        old_logp,
        micro_batch.advantages,
        loss_mask,
        clip_low=spec.clip_low,
        clip_high=spec.clip_high,
        segment_ids=segment_ids,
        old_entropy=old_entropy,
        loss_denominator=1,
        **options,
    )
    entropy_sum = torch.where(micro_batch.loss_mask, token.entropy.detach(), 0.0).sum()
    metrics = metrics | {"loss/sum": loss_sum.detach(), "entropy/sum": entropy_sum}
    return loss_sum, _denominator(loss_mask, spec).round().to(torch.int), metrics


def _denominator(loss_mask: Tensor, spec: PolicyLossSpec) -> Tensor:
    return policy_loss_denominator(
        loss_mask,
        loss_agg=spec.options.get("loss_agg", DEFAULT_LOSS_AGG),
        max_response_len=spec.options.get("max_response_len"),
    )


def _router_tokens(micro_batch: PolicyMicroBatch, model: torch.nn.Module) -> int:
    """Tokens each router of this rank sees: the sequence-parallel slice of the micro-batch."""
    config = model.config
    split = config.tensor_model_parallel_size if config.sequence_parallel else 1
    return micro_batch.tokens.numel() // (split * config.context_parallel_size)


def _forward_step(
    make_loss_func: MakeLossFunc,
    replay: RoutingControl | None,
    record_routing: bool,
    device: torch.device,
    data_iterator: Iterator[PolicyMicroBatch],
    model: torch.nn.Module,
) -> tuple[Tensor, Any]:
    # Rollouts stay in host memory; each micro-batch visits the model's device for its step.
    held = next(data_iterator)
    micro_batch = held.to(device)
    if replay is not None:
        if record_routing:
            replay.record()
        elif micro_batch.routing is None:
            raise ValueError(
                "routing: routing replay is on but this micro-batch carries no routing record "
                "(R2: record it in the old-policy forward; R3: the engine must return it)"
            )
        else:
            replay.replay(micro_batch.routing, _router_tokens(micro_batch, model))
    output = model(
        micro_batch.tokens,
        micro_batch.position_ids(),
        attention_mask=None,
        packed_seq_params=micro_batch.packed_seq_params(),
    )
    if replay is not None:
        if record_routing:
            held.routing = replay.collect()
        else:
            replay.replay_backward_from(output)
    return output, make_loss_func(held, micro_batch)


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
    forward_only: bool = False,
    replay: RoutingControl | None = None,
    record_routing: bool = False,
) -> StepResult:
    """Run megatron-core's schedule (1F1B under PP) over `micro_batches` with the policy loss.

    `model` is this rank's DDP-wrapped model chunk. Gradients end up in the parameters'
    `main_grad`, already divided by the global denominator (with the distributed optimizer, fully
    reduced only on this rank's shard); the optimizer step is the caller's.
    With `replay`, each micro-batch's `routing` is forced (or, with `record_routing`, recorded
    into it: the old-policy pass of R2).
    """
    results = _run_schedule(
        model,
        micro_batches,
        lambda held, micro_batch: partial(policy_loss_func, micro_batch, spec),
        forward_only=forward_only,
        replay=replay,
        record_routing=record_routing,
    )
    return _global_loss(micro_batches, spec, results)


def _run_schedule(
    model: torch.nn.Module,
    micro_batches: list[PolicyMicroBatch],
    make_loss_func: MakeLossFunc,
    *,
    forward_only: bool,
    replay: RoutingControl | None,
    record_routing: bool,
) -> list[dict[str, Tensor]]:
    if not micro_batches:
        raise ValueError("micro_batches: expected at least one micro-batch")
    shapes = {tuple(mb.tokens.shape) for mb in micro_batches}
    if len(shapes) != 1:
        raise ValueError(f"micro_batches: all need one shape [b, S] for the schedule, got {shapes}")
    batch, seq = shapes.pop()
    config = model.config
    config.finalize_model_grads_func = finalize_model_grads
    config.no_sync_func = getattr(model, "no_sync", None)
    results = get_forward_backward_func()(
        forward_step_func=partial(
            _forward_step, make_loss_func, replay, record_routing, _model_device(model)
        ),
        data_iterator=iter(micro_batches),
        model=[model],
        num_microbatches=len(micro_batches),
        seq_length=seq,
        micro_batch_size=batch,
        forward_only=forward_only,
    )
    if replay is not None and not record_routing:
        replay.finish()
    return results


def _model_device(model: torch.nn.Module) -> torch.device:
    return next(model.parameters()).device


def _store_logprobs(
    held: PolicyMicroBatch, micro_batch: PolicyMicroBatch, logits: Tensor
) -> tuple[Tensor, Tensor, dict[str, Tensor]]:
    """A loss function that keeps the token log-probs and entropy instead, in the micro-batch
    the caller holds (`micro_batch` is its copy on the model's device)."""
    token = vocab_parallel_logprobs(
        logits.detach(),
        micro_batch.targets(),
        group=parallel_state.get_tensor_model_parallel_group(),
    )
    held.old_logp = token.logp.to(held.tokens.device)
    held.old_entropy = token.entropy.to(held.tokens.device)
    zero = torch.zeros((), dtype=torch.float32, device=logits.device)
    return zero, torch.ones((), dtype=torch.int), {}


def policy_logprobs(
    model: torch.nn.Module,
    micro_batches: list[PolicyMicroBatch],
    *,
    replay: RoutingControl | None = None,
    record_routing: bool = False,
) -> None:
    """The old-policy pass: a forward over `micro_batches` that sets each one's `old_logp` and
    `old_entropy` (on the last pipeline stage; other stages never read them) and, with
    `record_routing`, its `routing` (R2)."""
    with torch.no_grad():
        _run_schedule(
            model,
            micro_batches,
            lambda held, micro_batch: partial(_store_logprobs, held, micro_batch),
            forward_only=True,
            replay=replay,
            record_routing=record_routing,
        )


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
