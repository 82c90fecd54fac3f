"""R3 mapping: a synthetic SGLang routing payload lands on exactly the right training tokens for
left padding, right padding and packing, per SP slice and pipeline stage."""

from __future__ import annotations

import pytest
import torch

from megatron_rl.moe.engine_routing import (
    place_engine_gate_weights,
    place_engine_routing,
    router_order,
    router_token_mask,
)

LAYERS, TOPK = 3, 2


def _payload(sample: int, length: int) -> torch.Tensor:
    """SGLang layout [length - 1, layers, topk]; entries encode (sample, token, layer, slot)."""
    token = torch.arange(length - 1)[:, None, None]
    layer = torch.arange(LAYERS)[None, :, None]
    slot = torch.arange(TOPK)[None, None, :]
    return (sample * 10_000 + token * 100 + layer * 10 + slot + 1000).to(torch.int32)


def _decode(value: int) -> tuple[int, int, int, int]:
    value -= 1000
    return value // 10_000, value % 10_000 // 100, value % 100 // 10, value % 10


@pytest.mark.parametrize("padding", ["left", "right"])
def test_padded_rows(padding):
    lengths, seq = [5, 8, 3], 8
    starts = [seq - n if padding == "left" else 0 for n in lengths]
    samples = [_payload(i, n) for i, n in enumerate(lengths)]
    routing, covered = place_engine_routing(
        samples, [0, 1, 2], starts, lengths, (3, seq), num_layers=LAYERS, topk=TOPK
    )
    for row, (start, length) in enumerate(zip(starts, lengths, strict=True)):
        for position in range(seq):
            token = position - start
            if 0 <= token < length - 1:  # the engine routed the sample's tokens but its last
                assert covered[row, position]
                for layer in range(LAYERS):
                    for slot in range(TOPK):
                        assert _decode(int(routing[row, position, layer, slot])) == (
                            row,
                            token,
                            layer,
                            slot,
                        )
            else:
                assert not covered[row, position]
                assert routing[row, position, 0].tolist() == list(range(TOPK))


def test_gate_weights_land_beside_their_experts():
    """The engine's gate weights go where its experts go; NaN where it routed nothing."""
    lengths, starts, seq = [5, 3], [3, 0], 8
    samples = [_payload(i, n) for i, n in enumerate(lengths)]
    where = ([0, 1], starts, lengths, (2, seq))
    routing, covered = place_engine_routing(samples, *where, num_layers=LAYERS, topk=TOPK)
    weights = place_engine_gate_weights(
        [s.double() / 1e5 for s in samples], *where, num_layers=LAYERS, topk=TOPK
    )
    assert weights.dtype == torch.float32
    assert torch.equal(weights.isnan().all(-1).all(-1), ~covered)
    torch.testing.assert_close(weights[covered], routing[covered].float() / 1e5)
    with pytest.raises(ValueError, match=r"no engine gate weights; .*r3_weights needs the engine"):
        place_engine_gate_weights([None, None], *where, num_layers=LAYERS, topk=TOPK)
    with pytest.raises(ValueError, match=r"need floating \[4, 3, 2\]"):
        place_engine_gate_weights(samples, *where, num_layers=LAYERS, topk=TOPK)


def test_packed_row_and_router_order_with_sp_and_pp():
    lengths = [3, 4, 5]
    offsets = [0, 3, 7]
    samples = [_payload(i, n) for i, n in enumerate(lengths)]
    routing, covered = place_engine_routing(
        samples, [0, 0, 0], offsets, lengths, (1, 12), num_layers=LAYERS, topk=TOPK
    )
    assert covered[0].tolist() == [True, True, False, True, True, True, False] + [True] * 4 + [
        False
    ]
    assert _decode(int(routing[0, 8, 1, 1])) == (2, 1, 1, 1)
    # SP rank 1 of 2 sees positions 6..11; this pipeline stage holds layers 1 and 2
    local = router_order(routing, sp_rank=1, sp_size=2, layers=range(1, 3))
    assert len(local) == 2 and local[0].shape == (6, TOPK)
    assert _decode(int(local[0][2, 0])) == (2, 1, 1, 0)  # position 8 = sample 2, token 1


def test_router_order_is_sequence_major():
    routing = torch.arange(2 * 4).view(2, 4, 1, 1).expand(2, 4, 1, 1)
    (layer,) = router_order(routing)
    assert layer[:, 0].tolist() == [0, 4, 1, 5, 2, 6, 3, 7]  # (position, row)


@pytest.mark.parametrize(
    ("samples", "message"),
    [
        ([None], "has no engine routing; R3 needs the engine to return routed experts"),
        ([torch.zeros(4, LAYERS, TOPK, dtype=torch.int32)], r"need integer \[3, 3, 2\]"),
        ([torch.zeros(3, LAYERS + 1, TOPK, dtype=torch.int32)], r"\[3, 4, 2\]"),
        ([torch.zeros(3, LAYERS, TOPK)], "float32"),
    ],
)
def test_bad_engine_routing_is_refused(samples, message):
    with pytest.raises(ValueError, match=message):
        place_engine_routing(samples, [0], [0], [4], (1, 6), num_layers=LAYERS, topk=TOPK)
    with pytest.raises(ValueError, match="does not fit the micro-batch"):
        place_engine_routing([_payload(0, 4)], [0], [4], [4], (1, 6), num_layers=LAYERS, topk=TOPK)


@pytest.mark.parametrize(("sp_rank", "sp_size"), [(0, 1), (0, 2), (1, 2)])
def test_the_router_token_mask_follows_the_routing_token_for_token(sp_rank, sp_size):
    """Each token's mask value lands where `router_order` puts that token's routing."""
    generator = torch.Generator().manual_seed(0)
    loss_mask = torch.rand(3, 8, generator=generator) > 0.5
    # each token's routing holds its own mask value
    routing = loss_mask.long()[:, :, None, None].expand(3, 8, 1, 2)
    (ordered,) = router_order(routing, sp_rank=sp_rank, sp_size=sp_size)
    mask = router_token_mask(loss_mask, sp_rank=sp_rank, sp_size=sp_size)
    assert mask.shape == (3 * 8 // sp_size,)
    assert torch.equal(mask.long(), ordered[:, 0])
    with pytest.raises(ValueError, match="8 positions do not split over 3 SP ranks"):
        router_token_mask(loss_mask, sp_rank=0, sp_size=3)
