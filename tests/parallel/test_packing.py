"""Packed (THD) sequences: unpacking, next-token targets, a loss path equal to the padded one."""

from __future__ import annotations

import pytest
import torch

from megatron_rl.algo import LOSS_AGG_MODES
from megatron_rl.parallel.packing import packed_positions, packed_targets, unpack
from tests.parallel import packing_worker
from tests.parallel.harness import run_on_ranks

CU = torch.tensor([0, 3, 4, 8])


def test_positions_targets_and_unpack():
    sequence, position = packed_positions(CU)
    assert sequence.tolist() == [0, 0, 0, 1, 2, 2, 2, 2]
    assert position.tolist() == [0, 1, 2, 0, 0, 1, 2, 3]
    tokens = torch.tensor([10, 11, 12, 20, 30, 31, 32, 33])
    assert packed_targets(tokens, CU).tolist() == [11, 12, 12, 20, 31, 32, 33, 33]
    values = torch.arange(8.0).requires_grad_(True)
    rows = unpack(values, CU, fill=-1)
    assert rows.tolist() == [[0, 1, 2, -1], [3, -1, -1, -1], [4, 5, 6, 7]]
    (rows * torch.arange(12.0).view(3, 4)).sum().backward()
    assert values.grad.tolist() == [0, 1, 2, 4, 8, 9, 10, 11]
    assert unpack(torch.ones(8, 2), CU).shape == (3, 4, 2)


@pytest.mark.parametrize(
    ("cu", "message"),
    [
        (torch.tensor([0, 3, 3, 8]), "strictly increasing"),
        (torch.tensor([1, 3, 8]), "from 0 to the packed length"),
        (torch.tensor([0.0, 8.0]), "1-D integer"),
        (torch.tensor([0, 9]), "packed: 8 tokens, but cu_seqlens ends at 9"),
    ],
)
def test_bad_cu_seqlens(cu, message):
    with pytest.raises(ValueError, match=message):
        unpack(torch.ones(8), cu)


def test_packed_loss_path_equals_padded_at_tp2():
    cases = [(loss, agg) for loss in ("gspo", "grpo", "sspo") for agg in LOSS_AGG_MODES]
    for report in run_on_ranks(packing_worker.packed_equals_padded, cases):
        assert len(report) == len(cases)
        for case, result in report.items():
            assert result["packed_loss"] == pytest.approx(result["padded_loss"], rel=1e-6), case
            assert result["denominators"][0] == result["denominators"][1], case
            assert result["grad_error"] <= 1e-6 * result["grad_scale"], case
            assert result["grad_scale"] > 0, case
