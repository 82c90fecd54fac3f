"""Drift metrics on hand-built routing records."""

from __future__ import annotations

import pytest
import torch

from megatron_rl.moe.drift import routing_bytes, routing_drift


def test_identical_records_and_order_within_topk_do_not_count():
    old = torch.tensor([[[0, 1], [2, 3]], [[4, 5], [6, 7]]])
    new = old.flip(-1)  # same sets, other order
    metrics = routing_drift(old, new)
    assert float(metrics["drift/token_layer"]) == 0
    assert float(metrics["drift/token_any"]) == 0
    assert float(metrics["drift/jaccard"]) == 1


def test_layers_are_named_by_their_model_layer_number():
    """Records of a model whose layer 0 is dense hold layers 1 and 2: the names say so."""
    old = torch.tensor([[[0, 1], [2, 3]], [[0, 1], [2, 3]]])
    new = torch.tensor([[[0, 1], [2, 4]], [[0, 1], [2, 3]]])
    metrics = routing_drift(old, new, layer_numbers=[1, 2])
    assert "drift/layer/0" not in metrics
    assert float(metrics["drift/layer/1"]) == 0
    assert float(metrics["drift/layer/2"]) == pytest.approx(1 / 2)
    with pytest.raises(ValueError, match="layer_numbers: 3 given for records of 2 layers"):
        routing_drift(old, new, layer_numbers=[1, 2, 3])


def test_hand_built_drift():
    # 3 tokens, 2 layers, top-2
    old = torch.tensor([[[0, 1], [2, 3]], [[0, 1], [2, 3]], [[0, 1], [2, 3]]])
    new = torch.tensor(
        [
            [[0, 1], [2, 3]],  # unchanged
            [[0, 5], [2, 3]],  # layer 0: one expert of two changed -> Jaccard 1/3
            [[6, 7], [3, 4]],  # layer 0: both changed (0); layer 1: one changed (1/3)
        ]
    )
    metrics = routing_drift(old, new)
    assert float(metrics["drift/token_layer"]) == pytest.approx(3 / 6)
    assert float(metrics["drift/token_any"]) == pytest.approx(2 / 3)
    assert float(metrics["drift/jaccard"]) == pytest.approx((1 + 1 + 1 / 3 + 1 + 0 + 1 / 3) / 6)
    assert float(metrics["drift/layer/0"]) == pytest.approx(2 / 3)
    assert float(metrics["drift/layer/1"]) == pytest.approx(1 / 3)
    # the papers' share of activated experts no longer chosen: 0, 1/2, 0, 0, 2/2, 1/2 of top-2
    assert float(metrics["drift/activated_experts"]) == pytest.approx((0.5 + 1 + 0.5) / 6)
    assert float(metrics["drift/activated_layer/0"]) == pytest.approx((0.5 + 1) / 3)
    assert float(metrics["drift/activated_layer/1"]) == pytest.approx(0.5 / 3)
    # a mask keeps only the tokens that count (e.g. response tokens)
    masked = routing_drift(old, new, mask=torch.tensor([True, True, False]))
    assert float(masked["drift/token_layer"]) == pytest.approx(1 / 4)
    assert float(masked["drift/layer/1"]) == 0
    assert float(masked["drift/activated_experts"]) == pytest.approx(0.5 / 4)


def test_bytes_and_bad_input():
    records = [torch.zeros(10, 2, dtype=torch.int64), torch.zeros(10, 2, dtype=torch.int32)]
    assert routing_bytes(records) == 10 * 2 * 8 + 10 * 2 * 4
    with pytest.raises(ValueError, match=r"disagree in shape: old \[2, 1, 2\] vs new \[3, 1, 2\]"):
        routing_drift(
            torch.zeros(2, 1, 2, dtype=torch.long), torch.zeros(3, 1, 2, dtype=torch.long)
        )
    with pytest.raises(ValueError, match="old: expected integer expert indices"):
        routing_drift(torch.zeros(2, 2), torch.zeros(2, 2))
    with pytest.raises(ValueError, match="mask: expected bool"):
        routing_drift(
            torch.zeros(2, 1, 2, dtype=torch.long),
            torch.zeros(2, 1, 2, dtype=torch.long),
            mask=torch.ones(3, dtype=torch.bool),
        )
