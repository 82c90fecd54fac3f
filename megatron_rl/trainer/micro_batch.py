"""The trainer's unit of work: one micro-batch of rollouts, as the schedule feeds it to a model."""

from __future__ import annotations

from dataclasses import dataclass, fields, replace
from typing import Any, NamedTuple

import torch
from megatron.core.packed_seq_params import PackedSeqParams
from torch import Tensor

from megatron_rl.parallel.packing import packed_positions, packed_targets, unpack


@dataclass(frozen=True)
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
        old_logp: like tokens, the old log-prob of the predicted token, the ratio's
            denominator, from where the recipe's `OldLogProbs` says: the old-policy forward's,
            or the engine's (then equal to `engine_logp`); None when the update's own forward,
            detached, stands in for it (and for `old_entropy`): one update per rollout batch.
            Built None; the learner attaches it.
        engine_logp: like tokens, the rollout engine's log-prob of it (the mismatch metrics and
            corrections), or None.
        ref_logp: like tokens, the frozen reference policy's log-prob of it (KL penalty), or
            None.
        row_ids: `[b]` the rollout batch's row of each row (-1: an empty filler row), or None.
        advantages: `[b]` (or `[N]`) per-sequence advantages; per-token ones like tokens. None
            until the learner attaches them (the loss needs them).
        segment_ids: like tokens, SSPO segment ids within each sequence, or None.
        old_entropy: like tokens, old-policy entropy, or None.
        cu_seqlens: `[N + 1]` offsets of the packed sequences, or None when padded.
        routing: per MoE layer of this rank's stage, the `[tokens, topk]` experts to replay
            (R2: recorded by the old-policy pass; R3: from the rollout engine).
        gate_weights: like `routing` (float), the engine's gate weight of each of those experts
            (gate-weight replay; NaN where the trainer's own weight stays), or None.
        padding_mask: like tokens, bool, true at padding: the positions after a sequence's end
            and every position of a filler row; None when there is none. The routers leave
            padding out of their load balancing (`router_padding`).

    The trainer builds the packed form with `run.packed_sequences`
    (`megatron_rl.trainer.batches.micro_batches`); its tail past the last sequence, when the
    tokens are rounded up to the TP size, is one empty sequence of padding (row id -1).
    """

    tokens: Tensor
    loss_mask: Tensor
    old_logp: Tensor | None = None
    advantages: Tensor | None = None
    segment_ids: Tensor | None = None
    old_entropy: Tensor | None = None
    cu_seqlens: Tensor | None = None
    routing: list[Tensor] | None = None
    gate_weights: list[Tensor] | None = None
    engine_logp: Tensor | None = None
    ref_logp: Tensor | None = None
    row_ids: Tensor | None = None
    padding_mask: Tensor | None = None

    def to(self, device: torch.device) -> PolicyMicroBatch:
        """This micro-batch with every tensor on `device`; itself when they are already there."""
        if self.tokens.device == device:
            return self
        moved = {item.name: _on_device(getattr(self, item.name), device) for item in fields(self)}
        return PolicyMicroBatch(**moved)

    def with_row_advantages(self, advantages: Tensor) -> PolicyMicroBatch:
        """This micro-batch with its rows' entries of the rollout batch's `[B]` `advantages`
        (0 for filler rows); needs `row_ids`."""
        if self.row_ids is None:
            raise ValueError("with_row_advantages: the micro-batch has no row_ids")
        rows = self.row_ids
        return replace(self, advantages=torch.where(rows < 0, 0.0, advantages[rows.clamp(min=0)]))

    def first_rows(self, count: int) -> PolicyMicroBatch:
        """This padded micro-batch cut to its first `count` rows (itself when it has no more):
        per-row and per-token tensors keep those rows, `routing` those rows' tokens."""
        batch = self.tokens.shape[0]
        if count >= batch:
            return self
        if self.cu_seqlens is not None:
            raise ValueError("first_rows: a packed micro-batch is one row of many sequences")

        def cut(value: Tensor | list[Tensor] | None) -> Tensor | list[Tensor] | None:
            if isinstance(value, list):
                return [router_rows(layer, batch, count) for layer in value]
            return None if value is None else value[:count]

        return PolicyMicroBatch(
            **{item.name: cut(getattr(self, item.name)) for item in fields(self)}
        )

    def router_padding(self) -> Tensor | None:
        """The positions the routers leave out of the load-balancing loss and the expert-bias
        counts (megatron-core's `padding_mask`, like tokens): `padding_mask`, or None when
        nothing is padding or everything is. A micro-batch of filler rows alone balances over
        its tokens (copies of a real sequence): megatron-core's switch loss over no token is
        0 / 0."""
        padding = self.padding_mask
        if padding is None or not bool(padding.any()) or bool(padding.all()):
            return None
        return padding

    def router_token_count(self) -> int:
        """The tokens of this micro-batch the routers balance over (see `router_padding`)."""
        padding = self.router_padding()
        return self.tokens.numel() - (0 if padding is None else int(padding.sum()))

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
        """Megatron-core's THD attention parameters (Transformer Engine's attention, or
        `megatron_rl.models.packed_attention` without it), None when padded."""
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

    def as_rows(self, logp: Tensor, entropy: Tensor) -> LossRows:
        """The loss's per-token tensors (`logp` and `entropy` are the current policy's, like
        tokens) as `[rows, length]`: unchanged when padded, unpacked into one row per sequence
        when packed."""
        old_is_current = self.old_logp is None
        rows = LossRows(
            logp,
            entropy,
            logp.detach() if old_is_current else self.old_logp,
            self.engine_logp,
            self.loss_mask,
            self.segment_ids,
            entropy.detach() if old_is_current else self.old_entropy,
            self.ref_logp,
        )
        if self.cu_seqlens is None:
            return rows
        last = self.cu_seqlens[1:] - 1
        if bool(self.loss_mask[0, last].any()):
            raise ValueError(
                "loss_mask: true on the last token of a packed sequence, which predicts nothing"
            )
        return LossRows(
            *(
                None if field is None else unpack(field[0], self.cu_seqlens, fill=0)
                for field in rows
            )
        )


def router_rows(values: Tensor, batch: int, count: int) -> Tensor:
    """`[tokens, ...]` values of a `batch`-row micro-batch in a router's token order (position,
    then row) -> those of its first `count` rows, in the same order."""
    rest = values.shape[1:]
    return values.reshape(-1, batch, *rest)[:, :count].reshape(-1, *rest)


class LossRows(NamedTuple):
    """A micro-batch's per-token loss inputs, `[rows, length]` (see `PolicyMicroBatch`)."""

    logp: Tensor
    entropy: Tensor
    old_logp: Tensor
    engine_logp: Tensor | None
    loss_mask: Tensor
    segment_ids: Tensor | None
    old_entropy: Tensor | None
    ref_logp: Tensor | None


def _on_device(value: Tensor | list[Tensor] | None, device: torch.device) -> Any:
    if value is None:
        return None
    if isinstance(value, list):
        return [tensor.to(device) for tensor in value]
    return value.to(device)
