"""Rollout samples -> the trainer's micro-batches.

A rollout batch is prompt-major (the `group_size` samples of prompt g are rows
g*group_size ...). Every sample becomes one right-padded row `[S]` of prompt + response tokens;
position t is true in `loss_mask` where it predicts a response token (see
`megatron_rl.trainer.micro_batch.PolicyMicroBatch`). The batch is split into minibatches (one
optimizer step each), each minibatch over the data-parallel ranks, and each rank's share into
micro-batches, as many on every rank (expert-parallel ranks must run the same number of
forwards): short shares are filled with empty rows (no loss tokens, zero advantage, all
padding), which change neither the loss nor its gradient. By rows, every micro-batch has the
batch's shape; with a token budget, rows of like length share a micro-batch cut to their width,
so little of the trainer's work is padding (the schedule takes micro-batches of different
shapes). The loss is the same either way: its denominator is the whole minibatch's.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import Tensor

from megatron_rl.algo import subsentence_segment_ids
from megatron_rl.moe.engine_routing import (
    engine_layer_columns,
    place_engine_gate_weights,
    place_engine_routing,
    router_order,
)
from megatron_rl.rollout.engine import Sample
from megatron_rl.trainer.micro_batch import PolicyMicroBatch


@dataclass(frozen=True)
class RolloutBatch:
    """All samples of one RL step as padded tensors.

    Attributes:
        tokens: `[B, S]` prompt + response ids, right-padded with `pad_id`.
        loss_mask: `[B, S]` bool, true at positions that predict a response token.
        engine_logp: `[B, S]` the engine's log-prob of the predicted token on the mask, else 0.
        segment_ids: `[B, S]` SSPO segment ids of the predicted tokens (-1 off the mask).
        samples: the samples, in row order (their engine routing is used for R3).
        rewards: `[B]` the rewards, from which the learner takes the group advantages.
        group_size: rows [g * group_size, (g + 1) * group_size) are group g.
    """

    tokens: Tensor
    loss_mask: Tensor
    engine_logp: Tensor
    segment_ids: Tensor
    samples: tuple[Sample, ...]
    rewards: Tensor
    group_size: int

    @property
    def num_rows(self) -> int:
        return self.tokens.shape[0]

    @property
    def lengths(self) -> Tensor:
        """`[B]` each row's prompt + response tokens (the rest of its width is padding)."""
        return torch.tensor([len(s.prompt_ids) + len(s.response_ids) for s in self.samples])

    @property
    def padding_mask(self) -> Tensor:
        """`[B, S]` bool, true at the padding after each row's prompt + response."""
        return torch.arange(self.tokens.shape[1]) >= self.lengths[:, None]

    def training_rows(self) -> list[int]:
        """The rows with loss tokens (a filtered response's row has none)."""
        return self.loss_mask.any(dim=1).nonzero().flatten().tolist()


def build_rollout_batch(
    samples: Sequence[Sample],
    rewards: Tensor,
    *,
    group_size: int,
    pad_id: int,
    newline_token_ids: Sequence[int],
    trains: Sequence[bool] | None = None,
) -> RolloutBatch:
    """Pad `samples`, whole groups of `group_size` rows, with their `[B]` rewards into a
    RolloutBatch; a sample whose `trains` entry is false keeps its row but no loss token."""
    if len(samples) != rewards.numel():
        raise ValueError(f"rewards: {rewards.numel()} values for {len(samples)} samples")
    if not samples:
        raise ValueError("samples: an empty rollout batch")
    if group_size < 1 or len(samples) % group_size:
        raise ValueError(f"group_size: {len(samples)} samples are not groups of {group_size}")
    width = max(len(s.prompt_ids) + len(s.response_ids) for s in samples)
    tokens = torch.full((len(samples), width), pad_id, dtype=torch.long)
    loss_mask = torch.zeros(len(samples), width, dtype=torch.bool)
    engine_logp = torch.zeros(len(samples), width, dtype=torch.float32)
    for row, sample in enumerate(samples):
        prompt, response = len(sample.prompt_ids), len(sample.response_ids)
        tokens[row, : prompt + response] = torch.tensor(sample.prompt_ids + sample.response_ids)
        # Position t predicts token t + 1: the response is predicted from prompt - 1 on.
        loss_mask[row, prompt - 1 : prompt + response - 1] = trains is None or trains[row]
        engine_logp[row, prompt - 1 : prompt + response - 1] = sample.logprobs.float()
    predicted = torch.cat([tokens[:, 1:], tokens[:, -1:]], dim=1)
    segments = subsentence_segment_ids(predicted, loss_mask, newline_token_ids)
    return RolloutBatch(
        tokens=tokens,
        loss_mask=loss_mask,
        engine_logp=engine_logp,
        segment_ids=segments,
        samples=tuple(samples),
        rewards=rewards.to(torch.float32),
        group_size=group_size,
    )


@dataclass(frozen=True)
class EngineRouting:
    """Where this rank's routers sit, to turn engine routing (R3) into replay targets."""

    num_layers: int  # layers of the whole model, dense ones included
    moe_layers: tuple[int, ...]  # the model's MoE layers (from 0)
    stage_layers: tuple[int, ...]  # this pipeline stage's MoE layers, in the model's numbering
    topk: int
    sp_rank: int = 0
    sp_size: int = 1
    gate_weights: bool = False  # the engine's gate weights too (gate-weight replay)


def minibatch_rows(rows: Sequence[int], num_minibatches: int, seed: int) -> list[list[int]]:
    """A seeded shuffle of `rows`, cut into `num_minibatches` near-equal minibatches, or into
    one minibatch per row when there are fewer rows (a step that kept few of its samples: dynamic
    sampling, zero-variance groups dropped, responses filtered)."""
    if not rows or num_minibatches < 1:
        raise ValueError(f"minibatch_rows: {num_minibatches} minibatches from {len(rows)} rows")
    order = torch.randperm(len(rows), generator=torch.Generator().manual_seed(seed))
    shuffled = torch.tensor(rows)[order]
    return [chunk.tolist() for chunk in shuffled.tensor_split(min(num_minibatches, len(rows)))]


def micro_batches(
    batch: RolloutBatch,
    rows: Sequence[int],
    *,
    dp_rank: int,
    dp_size: int,
    micro_batch_size: int,
    micro_batch_tokens: int | None = None,
    width_multiple: int = 1,
    packed: bool = False,
    engine_routing: EngineRouting | None = None,
) -> list[PolicyMicroBatch]:
    """This DP rank's micro-batches of the minibatch `rows` (rows dp_rank, dp_rank + dp_size, ...
    of it), as many on every rank.

    Without `micro_batch_tokens`: micro-batches of up to `micro_batch_size` rows in `rows`'
    order, all of the batch's width, short shares filled with empty rows. With it (a token
    budget): the share's rows longest first, each micro-batch as many of them as fit in
    `micro_batch_tokens` tokens (rows x width) and `micro_batch_size` rows, cut to the width of
    its longest row rounded up to `width_multiple` (a row wider than the budget alone); a rank
    with fewer micro-batches than another adds micro-batches of one empty row.

    `packed`: each micro-batch's rows back to back in one row (THD, `cu_seqlens`), no padding
    but the tail that rounds its tokens up to `width_multiple` (an empty sequence of its own).
    With a token budget the rows, longest first, go to the first micro-batch whose tokens they
    fit, `micro_batch_tokens` tokens counted without padding and `micro_batch_size` ignored."""
    lengths = batch.lengths
    if micro_batch_tokens is None:
        chunks = _row_chunks(rows, dp_rank, dp_size, micro_batch_size)
        widths = [
            _packed_width(chunk, lengths, width_multiple) if packed else batch.tokens.shape[1]
            for chunk in chunks
        ]
    else:
        plan = _packed_chunks if packed else _token_budget_chunks
        plans = [
            plan(rows[rank::dp_size], lengths, micro_batch_size, micro_batch_tokens, width_multiple)
            for rank in range(dp_size)
        ]
        count = max(len(chunks) for chunks, _ in plans)
        chunks, widths = plans[dp_rank]
        chunks = chunks + [[-1]] * (count - len(chunks))
        widths = widths + [width_multiple] * (count - len(widths))
    if packed:
        return [
            _packed_micro_batch(batch, chunk, width, lengths, engine_routing)
            for chunk, width in zip(chunks, widths, strict=True)
        ]
    padding = batch.padding_mask
    return [
        _micro_batch(batch, chunk, width, padding, engine_routing)
        for chunk, width in zip(chunks, widths, strict=True)
    ]


def _row_chunks(rows: Sequence[int], dp_rank: int, dp_size: int, size: int) -> list[list[int]]:
    """This rank's share of `rows` in chunks of equal count on every rank, as few empty rows
    (-1) as the count allows."""
    share = list(rows[dp_rank::dp_size])
    per_rank = math.ceil(len(rows) / dp_size)
    count = math.ceil(per_rank / size)
    size = math.ceil(per_rank / count)
    share += [-1] * (count * size - len(share))
    return [share[start : start + size] for start in range(0, len(share), size)]


def _token_budget_chunks(
    share: Sequence[int], lengths: Tensor, max_rows: int, budget: int, width_multiple: int
) -> tuple[list[list[int]], list[int]]:
    """`share`'s rows longest first in chunks of at most `max_rows` rows and `budget` tokens at
    the chunk's width (its first row's length rounded up to `width_multiple`), and the widths."""
    order = sorted(share, key=lambda row: (-int(lengths[row]), row))
    chunks: list[list[int]] = []
    widths: list[int] = []
    for row in order:
        if chunks and len(chunks[-1]) < max_rows and (len(chunks[-1]) + 1) * widths[-1] <= budget:
            chunks[-1].append(row)
            continue
        chunks.append([row])
        widths.append(-(-int(lengths[row]) // width_multiple) * width_multiple)
    return chunks, widths


def _packed_chunks(
    share: Sequence[int], lengths: Tensor, max_rows: int, budget: int, width_multiple: int
) -> tuple[list[list[int]], list[int]]:
    """`share`'s rows longest first, each into the first chunk it fits in `budget` tokens (first
    fit decreasing; a longer row alone), and each chunk's packed width (`_packed_width`).
    `max_rows` is not a bound: a packed micro-batch is one row."""
    del max_rows
    order = sorted(share, key=lambda row: (-int(lengths[row]), row))
    chunks: list[list[int]] = []
    totals: list[int] = []
    for row in order:
        length = int(lengths[row])
        fits = next((i for i, total in enumerate(totals) if total + length <= budget), None)
        if fits is None:
            chunks.append([row])
            totals.append(length)
        else:
            chunks[fits].append(row)
            totals[fits] += length
    return chunks, [_packed_width(chunk, lengths, width_multiple) for chunk in chunks]


def _packed_width(chunk: Sequence[int], lengths: Tensor, width_multiple: int) -> int:
    """The tokens of `chunk`'s rows (-1: none) rounded up to `width_multiple`, at least one."""
    total = max(sum(int(lengths[row]) for row in chunk if row >= 0), 1)
    return -(-total // width_multiple) * width_multiple


def _packed_micro_batch(
    batch: RolloutBatch,
    chunk: list[int],
    width: int,
    lengths: Tensor,
    engine_routing: EngineRouting | None,
) -> PolicyMicroBatch:
    """The rows `chunk` (-1: none) of `batch` back to back in one row `[1, width]`; the tokens
    past theirs form one empty sequence (row id -1, all padding)."""
    real = [row for row in chunk if row >= 0]
    sizes = [int(lengths[row]) for row in real]
    tail = width - sum(sizes)
    offsets = torch.tensor([0, *sizes, *([tail] if tail else [])]).cumsum(0)

    def packed(values: Tensor, fill: int | float | bool) -> Tensor:
        parts = [values[row, :size] for row, size in zip(real, sizes, strict=True)]
        return torch.cat([*parts, values.new_full((tail,), fill)])[None]

    padding = torch.zeros(1, width, dtype=torch.bool)
    padding[0, width - tail :] = True
    return PolicyMicroBatch(
        tokens=packed(batch.tokens, 0),
        loss_mask=packed(batch.loss_mask, False),
        old_logp=None,
        engine_logp=packed(batch.engine_logp, 0.0),
        segment_ids=packed(batch.segment_ids, -1),
        row_ids=torch.tensor(real + [-1] * bool(tail)),
        padding_mask=padding,
        cu_seqlens=offsets,
        **_replay_targets(
            batch,
            [
                (0, start, row)
                for start, row in zip(offsets[: len(real)].tolist(), real, strict=True)
            ],
            (1, width),
            engine_routing,
        ),
    )


def _micro_batch(
    batch: RolloutBatch,
    chunk: list[int],
    width: int,
    padding: Tensor,
    engine_routing: EngineRouting | None,
) -> PolicyMicroBatch:
    """The rows `chunk` (-1: an empty row) of `batch`, their first `width` positions."""
    real = torch.tensor([max(row, 0) for row in chunk])
    empty = torch.tensor([row < 0 for row in chunk])

    def rows_of(values: Tensor, fill: int | float | bool) -> Tensor:
        taken = values[real][:, :width]
        if taken.shape[1] < width:  # a width rounded up past the batch's
            extra = taken.new_full((taken.shape[0], width - taken.shape[1]), fill)
            taken = torch.cat([taken, extra], dim=1)
        return taken

    tokens = rows_of(batch.tokens, 0)
    return PolicyMicroBatch(
        tokens=tokens,
        loss_mask=rows_of(batch.loss_mask, False) & ~empty[:, None],
        old_logp=None,
        engine_logp=rows_of(batch.engine_logp, 0.0),
        segment_ids=torch.where(empty[:, None], -1, rows_of(batch.segment_ids, -1)),
        row_ids=torch.tensor(chunk),
        padding_mask=rows_of(padding, True) | empty[:, None],
        **_replay_targets(
            batch,
            [(i, 0, row) for i, row in enumerate(chunk) if row >= 0],
            tuple(tokens.shape),
            engine_routing,
        ),
    )


def _replay_targets(
    batch: RolloutBatch,
    placed: list[tuple[int, int, int]],
    shape: tuple[int, int],
    engine_routing: EngineRouting | None,
) -> dict[str, list[Tensor] | None]:
    """The engine's routing (R3) of the rollout rows `placed` as (micro-batch row, first
    column, rollout row) in a micro-batch of `shape`, per MoE layer of this rank's stage, as the
    micro-batch's `routing` and, when `engine_routing` asks, `gate_weights`; none without
    `engine_routing`. A filler micro-batch (no row) gets experts 0..topk-1 everywhere, as any
    unrouted position, and the trainer's own gate weights (NaN)."""
    if engine_routing is None:
        return {}
    order = {"sp_rank": engine_routing.sp_rank, "sp_size": engine_routing.sp_size}
    layers, topk = len(engine_routing.stage_layers), engine_routing.topk
    if not placed:
        filler = torch.arange(topk).expand(*shape, layers, topk)
        unweighted = torch.full((*shape, layers, topk), float("nan"))
        return {
            "routing": router_order(filler, **order),
            "gate_weights": router_order(unweighted, **order)
            if engine_routing.gate_weights
            else None,
        }
    samples = [batch.samples[row] for _, _, row in placed]
    records = [sample.routed_experts for sample in samples]
    # the first record's width says which layers the engine records (all agree, or are refused)
    width = next((r.shape[1] for r in records if r is not None and r.dim() == 3), 0)
    columns = engine_layer_columns(width, engine_routing.num_layers, engine_routing.moe_layers)
    where = {
        "rows": [row for row, _, _ in placed],
        "starts": [start for _, start, _ in placed],
        "lengths": [len(s.prompt_ids) + len(s.response_ids) for s in samples],
        "batch_shape": shape,
        "num_layers": width,
        "topk": topk,
    }
    stage = [columns[layer] for layer in engine_routing.stage_layers]
    routing, _ = place_engine_routing(records, **where)
    gate_weights = None
    if engine_routing.gate_weights:
        weights = place_engine_gate_weights([s.routed_weights for s in samples], **where)
        gate_weights = router_order(weights, **order, layers=stage)
    return {"routing": router_order(routing, **order, layers=stage), "gate_weights": gate_weights}
