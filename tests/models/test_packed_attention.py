"""Packed (THD) sequences through a real megatron-core model on CPU
(megatron_rl.models.packed_attention): the logits and gradients of the padded form, with GQA
and with MLA, on one rank, split by TP = 2 (sequence parallelism) and by EP = 2."""

from __future__ import annotations

import pytest
import torch
from megatron.core.packed_seq_params import PackedSeqParams
from megatron.core.transformer.enums import AttnMaskType

from megatron_rl.models.packed_attention import _check_packed
from tests.models import packed_attention_worker
from tests.parallel.harness import run_on_ranks


@pytest.mark.timeout(300)
@pytest.mark.parametrize(
    ("model", "layout"),
    [
        ("qwen3_like", {}),
        ("deepseek_like", {}),
        ("qwen3_like", {"tp": 2}),
        ("deepseek_like", {"tp": 2}),
        ("qwen3_like", {"ep": 2}),
    ],
    ids=["gqa_one_rank", "mla_one_rank", "gqa_tp2", "mla_tp2", "gqa_ep2"],
)
def test_packed_sequences_give_the_padded_logits_and_gradients(model, layout):
    world_size = max(layout.values(), default=1)
    results = run_on_ranks(
        packed_attention_worker.packed_equals_padded, model, layout, world_size=world_size
    )
    for result in results:
        assert result["same_grads"] and result["grads"] > 20
        assert result["logits_diff"] <= 1e-6 * max(1.0, result["logits_scale"])
        assert result["grad_diff"] <= 1e-6 * result["grad_scale"]


def _params(q: list[int], kv: list[int] | None = None, fmt: str = "thd") -> PackedSeqParams:
    kv = q if kv is None else kv
    return PackedSeqParams(
        qkv_format=fmt,
        cu_seqlens_q=torch.tensor(q, dtype=torch.int32),
        cu_seqlens_kv=torch.tensor(kv, dtype=torch.int32),
        max_seqlen_q=8,
        max_seqlen_kv=8,
    )


@pytest.mark.timeout(30)
@pytest.mark.parametrize(
    ("params", "mask_type", "message"),
    [
        (_params([0, 4, 10], fmt="sbhd"), AttnMaskType.causal, "qkv_format"),
        (_params([0, 4, 10], [0, 5, 10]), AttnMaskType.causal, "cu_seqlens_kv"),
        (_params([0, 4, 9]), AttnMaskType.causal, "the 10 packed tokens"),
        (_params([0, 4, 10]), AttnMaskType.padding, "causal"),
    ],
    ids=["format", "kv_offsets", "short_offsets", "not_causal"],
)
def test_packed_attention_refuses_what_it_cannot_reproduce(params, mask_type, message):
    with pytest.raises(ValueError, match=message):
        _check_packed(params, None, mask_type, tokens=10)
