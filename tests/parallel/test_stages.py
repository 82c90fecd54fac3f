"""Values across pipeline stages: the last stage's on every stage, per-layer records joined in
layer order (2 gloo ranks)."""

from __future__ import annotations

import pytest
import torch

from tests.parallel import stages_worker
from tests.parallel.harness import run_on_ranks

RECORDS = torch.arange(12).reshape(3, 2, 2)  # one stage's records, as the worker makes them


@pytest.mark.parametrize("pp", [1, 2])
def test_last_stage_values_and_joined_records_reach_every_stage(pp):
    reports = run_on_ranks(stages_worker.across_stages, pp)
    for report in reports:
        assert report["from_last"] == {"loss": 0.25, "clip_frac/seq": 0.5}
        if pp == 1:  # nothing to join: each rank keeps its own
            assert report["joined"] == RECORDS.tolist()
        else:  # the first stage's layers, then the second's (stage 1's tagged +100)
            assert report["joined"] == torch.cat([RECORDS, RECORDS + 100], dim=1).tolist()
            uneven = torch.cat([RECORDS[:, :1], RECORDS + 100], dim=1)
            assert report["joined_uneven"] == uneven.tolist()
    assert [report["stage"] for report in reports] == ([0, 0] if pp == 1 else [0, 1])
