"""The schedule's micro-batches: held on the host, each copied whole to the model's device."""

from __future__ import annotations

import dataclasses

import torch

from megatron_rl.trainer.micro_batch import PolicyMicroBatch


def test_a_micro_batch_moves_to_the_model_device_whole():
    tokens = torch.randint(0, 9, (2, 8))
    held = PolicyMicroBatch(
        tokens=tokens,
        loss_mask=tokens > 3,
        old_logp=torch.randn(2, 8),
        advantages=torch.randn(2),
        segment_ids=torch.zeros(2, 8, dtype=torch.long),
        routing=[torch.zeros(16, 2, dtype=torch.long)] * 2,
    )
    assert held.to(torch.device("cpu")) is held  # already there: no copy
    moved = held.to(torch.device("meta"))  # another device, without needing one here
    for item in dataclasses.fields(PolicyMicroBatch):
        value = getattr(moved, item.name)
        if getattr(held, item.name) is None:
            assert value is None, item.name
            continue
        for tensor in value if isinstance(value, list) else [value]:
            assert tensor.device.type == "meta", item.name
    assert [tuple(t.shape) for t in moved.routing] == [(16, 2), (16, 2)]
    assert held.tokens.device.type == "cpu"  # the held one is unchanged
