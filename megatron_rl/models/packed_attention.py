"""Core attention over packed (THD) sequences without Transformer Engine.

megatron-core 0.16 attends over packed sequences (`PackedSeqParams(qkv_format="thd")`, several
sequences back to back in one row, `cu_seqlens` their offsets) only in Transformer Engine's
attention; its torch `DotProductAttention` asserts that no packed sequence reaches it. The rest
of the model already takes them on CPU: `SelfAttention` hands the core attention `[t, heads, d]`
and applies RoPE per sequence with positions restarting at each one (its unfused THD path), and
the MLPs and routers see tokens alone.

`PackedDotProductAttention` is `DotProductAttention` that, given packed sequences, lays them
out as a padded batch of their own (each sequence a row, padded after its end to the longest),
runs the torch module's causal attention over it and takes each sequence's positions back in
packed order. Causal attention never lets a position see the padding after it, so each sequence
attends to itself alone, with the padded form's arithmetic: a packed micro-batch gives the padded
one's outputs and gradients (tests/models). Only the attention's scores see that padding; the
projections, norms, routers, experts and logits run on the packed tokens. (Attending to each
sequence alone in a loop does less arithmetic, but on CPU its per-sequence operations cost more
than they save: 1.75x the padded passes' training phase on the tiny recipe,
docs/benchmarks/micro_batches.md.)
Without packed sequences it is `DotProductAttention`.
"""

from __future__ import annotations

import torch
from megatron.core.packed_seq_params import PackedSeqParams
from megatron.core.transformer.dot_product_attention import DotProductAttention
from megatron.core.transformer.enums import AttnMaskType
from torch import Tensor

from megatron_rl.parallel.packing import packed_positions


class PackedDotProductAttention(DotProductAttention):
    """`DotProductAttention` that also takes packed sequences (module docstring)."""

    def forward(
        self,
        query: Tensor,
        key: Tensor,
        value: Tensor,
        attention_mask: Tensor | None,
        attn_mask_type: AttnMaskType | None = None,
        attention_bias: Tensor | None = None,
        packed_seq_params: PackedSeqParams | None = None,
    ) -> Tensor:
        """Padded: `[s, b, heads, d]` query, key and value -> `[s, b, heads x d]`. Packed:
        `[t, heads, d]` (t the packed tokens) -> `[t, heads x d]`."""
        if packed_seq_params is None:
            return super().forward(
                query, key, value, attention_mask, attn_mask_type, attention_bias
            )
        _check_packed(packed_seq_params, attention_mask, self.attn_mask_type, query.shape[0])
        sequence, position = packed_positions(packed_seq_params.cu_seqlens_q.long())
        rows = int(sequence[-1]) + 1
        longest = int(position.max()) + 1

        def padded(packed: Tensor) -> Tensor:
            """`[t, heads, d]` -> `[longest, rows, heads, d]`, zero after each sequence."""
            layout = packed.new_zeros(longest, rows, *packed.shape[1:])
            return layout.index_put((position, sequence), packed)

        # the torch module asserts attention_bias is None: passed on, not dropped
        context = super().forward(
            padded(query), padded(key), padded(value), None, attn_mask_type, attention_bias
        )
        return context[position, sequence]


def _check_packed(
    params: PackedSeqParams, attention_mask: Tensor | None, mask_type: AttnMaskType, tokens: int
) -> None:
    """Refuse what the per-sequence attention does not reproduce: another layout, keys that are
    not the queries' sequences, an explicit mask, a non-causal attention, context parallelism's
    padded offsets, and offsets that do not cover the tokens."""
    if params.qkv_format != "thd":
        raise ValueError(f"packed_seq_params.qkv_format: expected 'thd', got {params.qkv_format!r}")
    if params.cu_seqlens_q_padded is not None or params.cu_seqlens_kv_padded is not None:
        raise ValueError("packed_seq_params: padded offsets (context parallelism) need TE")
    if not torch.equal(params.cu_seqlens_q, params.cu_seqlens_kv):
        raise ValueError(
            "packed_seq_params: cu_seqlens_kv must equal cu_seqlens_q (self attention)"
        )
    if attention_mask is not None or mask_type is not AttnMaskType.causal:
        raise ValueError("packed sequences: only causal attention without an explicit mask")
    if int(params.cu_seqlens_q[0]) != 0 or int(params.cu_seqlens_q[-1]) != tokens:
        raise ValueError(
            f"packed_seq_params.cu_seqlens_q: expected offsets from 0 to the {tokens} packed "
            f"tokens, got {params.cu_seqlens_q.tolist()}"
        )
