"""R3: the rollout engine's routing, mapped onto the tokens each router of the trainer sees.

SGLang returns, per sample, int32 `[prompt_len + response_len - 1, num_layers, topk]`: row j is
the routing of the sample's token j as it went through the model. The last token was generated
but never fed back, so it has no row (the off-by-one). In a training micro-batch the router sees
token t of each row (the input at t, which predicts t + 1), so engine row j belongs to the
sample's j-th token wherever the batch put it: after left padding, from the right-padded start,
or at the sample's offset in a packed row.

Engines differ in which layers a record covers: every layer of the model (dense layers hold no
routing) or the MoE layers only (the in-process engine records transformers' routers).
`engine_layer_columns` tells which column holds each MoE layer, from the record's width.

Positions the engine never routed (padding, each sample's last token) get experts 0..topk-1:
under causal attention they cannot change the routing or the log-probs of the sample's earlier
tokens. `covered` says which positions carry engine routing (for drift metrics). The engine's
gate weights (gate-weight replay) are placed the same way, NaN where it routed nothing (the
trainer's own weights stay there).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple

import torch
from torch import Tensor


def place_engine_routing(
    samples: Sequence[Tensor],
    rows: Sequence[int],
    starts: Sequence[int],
    lengths: Sequence[int],
    batch_shape: tuple[int, int],
    *,
    num_layers: int,
    topk: int,
) -> tuple[Tensor, Tensor]:
    """Put each sample's engine routing at its tokens' place in the micro-batch.

    Args:
        samples: per sample, `[length - 1, num_layers, topk]` integer experts (SGLang's layout).
        rows, starts, lengths: where sample i's `lengths[i]` tokens sit: row `rows[i]`, columns
            `starts[i] ...`. Padded batches: one sample per row; packed: all in row 0 at their
            `cu_seqlens` offsets.
        batch_shape: `(b, S)` of the micro-batch's tokens.

    Returns:
        `routing` `[b, S, num_layers, topk]` long, and `covered` `[b, S]` bool.
    """
    batch, seq = batch_shape
    routing = torch.arange(topk).expand(batch, seq, num_layers, topk).clone()
    covered = torch.zeros(batch, seq, dtype=torch.bool)
    placed = _placed(samples, rows, starts, lengths, batch_shape, (num_layers, topk), ROUTING)
    for record, (row, columns) in zip(samples, placed, strict=True):
        routing[row, columns] = record.long()
        covered[row, columns] = True
    return routing, covered


def place_engine_gate_weights(
    samples: Sequence[Tensor],
    rows: Sequence[int],
    starts: Sequence[int],
    lengths: Sequence[int],
    batch_shape: tuple[int, int],
    *,
    num_layers: int,
    topk: int,
) -> Tensor:
    """Put each sample's engine gate weights (`[length - 1, num_layers, topk]` float, beside its
    routing) at its tokens' place, as `place_engine_routing` does with the experts: `[b, S,
    num_layers, topk]` float32, NaN where the engine routed nothing."""
    batch, seq = batch_shape
    weights = torch.full((batch, seq, num_layers, topk), float("nan"))
    shape = (num_layers, topk)
    placed = _placed(samples, rows, starts, lengths, batch_shape, shape, GATE_WEIGHTS)
    for record, (row, columns) in zip(samples, placed, strict=True):
        weights[row, columns] = record.float()
    return weights


class _Record(NamedTuple):
    """What an engine record per token holds, for placing it and for its errors."""

    name: str  # as errors name it
    integer: bool  # integer ids, else floating values
    source: str  # which engines return it


ROUTING = _Record(
    "routing",
    integer=True,
    source="R3 needs the engine to return routed experts "
    "(SGLang: --enable-return-routed-experts, return_routed_experts)",
)
GATE_WEIGHTS = _Record(
    "gate weights",
    integer=False,
    source="algo.routing_replay=r3_weights needs the engine to return them "
    "(the in-process engine does; SGLang returns expert ids only)",
)


def _placed(
    samples: Sequence[Tensor | None],
    rows: Sequence[int],
    starts: Sequence[int],
    lengths: Sequence[int],
    batch_shape: tuple[int, int],
    per_token: tuple[int, int],
    record_kind: _Record,
) -> list[tuple[int, slice]]:
    """Per sample, the micro-batch row and columns its engine record covers (its tokens but the
    last), after checking the record's type and shape `[length - 1, *per_token]` and that it
    fits."""
    batch, seq = batch_shape
    what = record_kind.name
    if not len(samples) == len(rows) == len(starts) == len(lengths):
        raise ValueError(f"{what}: {len(samples)} engine record(s) for {len(rows)} placed samples")
    placed = []
    for index, (record, row, start, length) in enumerate(
        zip(samples, rows, starts, lengths, strict=True)
    ):
        expected = (length - 1, *per_token)
        if record is None:
            raise ValueError(f"{what}: sample {index} has no engine {what}; {record_kind.source}")
        if record.is_floating_point() == record_kind.integer or tuple(record.shape) != expected:
            kind = "integer" if record_kind.integer else "floating"
            raise ValueError(
                f"{what}: sample {index} has engine {what} {list(record.shape)} {record.dtype}; "
                f"its {length} tokens and the model need {kind} [{length - 1}, "
                f"{per_token[0]}, {per_token[1]}] ([tokens - 1, layers, topk])"
            )
        if start < 0 or start + length > seq or not 0 <= row < batch:
            raise ValueError(
                f"{what}: sample {index} at row {row}, columns {start}..{start + length} does "
                f"not fit the micro-batch {list(batch_shape)}"
            )
        placed.append((row, slice(start, start + length - 1)))
    return placed


def engine_layer_columns(
    record_layers: int, num_layers: int, moe_layers: Sequence[int]
) -> dict[int, int]:
    """Model layer -> the column of an engine record `[tokens, record_layers, topk]` that holds
    its routing, for each MoE layer: records of every layer are indexed by the model layer;
    records of the MoE layers alone by the MoE layer's rank among them."""
    if record_layers == num_layers:
        return {layer: layer for layer in moe_layers}
    if record_layers == len(moe_layers):
        return {layer: column for column, layer in enumerate(moe_layers)}
    raise ValueError(
        f"routing: the engine's records cover {record_layers} layer(s); the model has "
        f"{num_layers} layer(s), {len(moe_layers)} of them MoE (a record covers either all "
        "layers or the MoE layers)"
    )


def router_token_mask(loss_mask: Tensor, *, sp_rank: int = 0, sp_size: int = 1) -> Tensor:
    """`[b, S]` -> `[tokens]`: the mask in a router's token order, as `router_order` orders the
    routing (sequence-major over this rank's sequence-parallel slice)."""
    seq = loss_mask.shape[1]
    if seq % sp_size != 0:
        raise ValueError(f"loss mask: {seq} positions do not split over {sp_size} SP ranks")
    width = seq // sp_size
    return loss_mask[:, sp_rank * width : (sp_rank + 1) * width].transpose(0, 1).reshape(-1)


def router_order(
    routing: Tensor, *, sp_rank: int = 0, sp_size: int = 1, layers: Sequence[int] | None = None
) -> list[Tensor]:
    """`[b, S, layers, topk]` -> per layer `[tokens, topk]` in a router's token order: sequence-
    major (position, then row) over this rank's sequence-parallel slice, for the MoE layers of
    this pipeline stage (`layers`: their columns in `routing`; all by default)."""
    batch, seq, num_layers, topk = routing.shape
    if seq % sp_size != 0:
        raise ValueError(f"routing: {seq} positions do not split over {sp_size} SP ranks")
    width = seq // sp_size
    local = routing[:, sp_rank * width : (sp_rank + 1) * width].transpose(0, 1)
    flat = local.reshape(width * batch, num_layers, topk)
    layers = range(num_layers) if layers is None else layers
    return [flat[:, layer].contiguous() for layer in layers]
