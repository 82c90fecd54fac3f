"""FP8 e4m3 emulation: the block and group quantisers against a plain-Python reference (its
own e4m3 rounding, no torch float8)."""

from __future__ import annotations

import math
import struct

import pytest
import torch

from megatron_rl.rollout.fp8_emulation import quantize_activation_groups, quantize_weight_blocks


def _f32(value: float) -> float:
    """`value` rounded to the nearest float32 (a float64 quotient or product of two float32s
    rounded once more is the correctly rounded float32 one)."""
    return struct.unpack("f", struct.pack("f", value))[0]


def _e4m3(value: float) -> float:
    """`value` (|value| <= 448) rounded to nearest-even e4m3fn: 3 mantissa bits, exponents down
    to -6, subnormals in steps of 2**-9."""
    if value == 0:
        return 0.0
    _, exponent = math.frexp(abs(value))  # abs(value) = m * 2**exponent, 0.5 <= m < 1
    step = 2.0 ** (max(exponent - 1, -6) - 3)
    return math.copysign(round(abs(value) / step) * step, value)


def _reference_group(values: list[float]) -> list[float]:
    """One block or group: scale = amax / 448 (float32), each value / scale clamped to the e4m3
    range, rounded to e4m3 and multiplied back by the scale."""
    scale = _f32(max(abs(v) for v in values) / 448.0)
    if scale == 0:
        return [0.0] * len(values)
    return [_f32(_e4m3(min(max(_f32(v / scale), -448.0), 448.0)) * scale) for v in values]


def _reference_weight(matrix: torch.Tensor, block: int = 128) -> torch.Tensor:
    rows, cols = matrix.shape
    values = matrix.tolist()
    out = [[0.0] * cols for _ in range(rows)]
    for top in range(0, rows, block):
        for left in range(0, cols, block):
            block_rows = range(top, min(top + block, rows))
            cells = [(r, c) for r in block_rows for c in range(left, min(left + block, cols))]
            rounded = _reference_group([values[r][c] for r, c in cells])
            for (r, c), value in zip(cells, rounded, strict=True):
                out[r][c] = value
    return torch.tensor(out, dtype=torch.float32)


def _reference_activation(rows: torch.Tensor, group: int = 128) -> torch.Tensor:
    out = []
    for row in rows.reshape(-1, rows.shape[-1]).tolist():
        out.append(
            [v for s in range(0, len(row), group) for v in _reference_group(row[s : s + group])]
        )
    return torch.tensor(out, dtype=torch.float32).view(rows.shape)


def _awkward(*shape: int, seed: int) -> torch.Tensor:
    """Random values over twelve orders of magnitude (some land in e4m3's subnormals or flush
    to zero after scaling), float32."""
    generator = torch.Generator().manual_seed(seed)
    magnitude = 10.0 ** (torch.rand(*shape, generator=generator) * 12 - 9)
    return torch.randn(*shape, generator=generator) * magnitude


@pytest.mark.timeout(60)
def test_block_quantiser_matches_a_python_reference():
    # 300 x 260: a 3 x 3 grid of blocks, the last row and column partial (44 and 4 wide).
    weight = _awkward(300, 260, seed=0)
    weight[128:256, :128] = 0  # an all-zero block stays zero (no 0 / 0)
    weight[:128, 128:256] = torch.randint(-3, 4, (128, 128)) * 128.0  # amax 384: scale 6/7
    weight[256:, 256:] = torch.tensor([448.0, -448.0, 1.0, 0.5]).repeat(11)[:, None]  # scale 1
    weight[5, 7] = 1e4  # one outlier sets its block's scale
    quantised = quantize_weight_blocks(weight)
    assert quantised.dtype == torch.float32 and quantised.shape == weight.shape
    expected = _reference_weight(weight)
    assert torch.equal(quantised, expected)
    assert torch.equal(quantised[128:256, :128], torch.zeros(128, 128))
    assert torch.equal(quantised[256:, 256:], weight[256:, 256:])  # 448 and the rest kept
    assert 0 < float((quantised != weight).float().mean()) < 1
    # A stack of matrices ([experts, out, in]) is quantised matrix by matrix.
    experts = _awkward(3, 130, 96, seed=1)
    stacked = quantize_weight_blocks(experts)
    for index in range(3):
        assert torch.equal(stacked[index], _reference_weight(experts[index]))
    assert torch.equal(quantize_weight_blocks(torch.zeros(5, 3)), torch.zeros(5, 3))


@pytest.mark.timeout(60)
def test_activation_quantiser_matches_a_python_reference():
    # hidden 300: groups of 128, 128 and 44 per token.
    activation = _awkward(2, 5, 300, seed=2)
    activation[0, 1] = 0  # an all-zero token
    activation[1, 2, 128:256] = 0  # an all-zero group between two others
    activation[1, 3, :4] = torch.tensor([448.0, -448.0, 3.0, 0.25])  # scale 1 in its group
    activation[1, 3, 4:128] = 0
    activation[0, 4, 290] = -1e5  # an outlier sets its group's scale only
    quantised = quantize_activation_groups(activation)
    assert quantised.dtype == torch.float32 and quantised.shape == activation.shape
    assert torch.equal(quantised, _reference_activation(activation))
    assert torch.equal(quantised[0, 1], torch.zeros(300))
    assert torch.equal(quantised[1, 2, 128:256], torch.zeros(128))
    assert torch.equal(quantised[1, 3, :128], activation[1, 3, :128])  # all representable
    # Groups are per token: another token's outlier leaves this one's scale alone.
    torch.testing.assert_close(
        quantize_activation_groups(activation[0, 3:4]), quantised[0, 3:4], atol=0, rtol=0
    )
