"""Core attention over packed (THD) sequences without Transformer Engine.

megatron-core 0.16 attends over packed sequences (`PackedSeqParams(qkv_format="thd")`, several
sequences back to back in one row, `cu_seqlens` their offsets) only in Transformer Engine's
attention; its torch `DotProductAttention` asserts that no packed sequence reaches it. The rest
of the model already takes them on CPU: `SelfAttention` hands the core attention `[t, heads, d]`
and applies RoPE per sequence with positions restarting at each one (its unfused THD path), and
the MLPs and routers see tokens alone.

`PackedDotProductAttention` is `DotProductAttention` that, given packed sequences, runs the
same causal attention on each sequence alone (its own rows of the packed tensors, no mask beyond
the causal one) and puts the results back in packed order: every sequence attends to itself
only, and the work grows with the sum of the squared lengths, not with rows x the longest
length squared as padding does. It is the torch module's own arithmetic per sequence, so a
packed micro-batch gives the padded one's outputs and gradients (tests/models). Without packed
sequences it is `DotProductAttention`.
"""

from __future__ import annotations

import itertools

import torch
from megatron.core.packed_seq_params import PackedSeqParams
from megatron.core.transformer.dot_product_attention import DotProductAttention
from megatron.core.transformer.enums import AttnMaskType
from torch import Tensor


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
        `[t, heads, d]` (t the packed tokens) -> `[t, 1, heads x d]`."""
        if packed_seq_params is None:
            return super().forward(
                query, key, value, attention_mask, attn_mask_type, attention_bias
            )
        _check_packed(packed_seq_params, attention_mask, self.attn_mask_type, query.shape[0])
        outputs = []
        for start, end in itertools.pairwise(packed_seq_params.cu_seqlens_q.tolist()):
            each = slice(start, end)
            # the torch module asserts attention_bias is None: passed on, not dropped
            sequence = (query[each, None], key[each, None], value[each, None])
            outputs.append(super().forward(*sequence, None, attn_mask_type, attention_bias))
        return torch.cat(outputs, dim=0)


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
