"""The parallel layout: derived sizes and errors that show the arithmetic."""

from __future__ import annotations

import pytest

from megatron_rl.parallel.dims import ParallelDims

MODEL = {
    "num_layers": 4,
    "num_attention_heads": 8,
    "num_query_groups": 4,
    "vocab_size": 128,
    "num_experts": 8,
    "moe_ffn_hidden_size": 64,
    "ffn_hidden_size": 256,
}


def test_derived_sizes():
    dims = ParallelDims(world_size=16, tp=2, pp=2, ep=4)
    assert (dims.dp, dims.etp, dims.edp) == (4, 2, 1)
    assert dims.sequence_parallel is True
    assert dims.describe() == (
        "world 16 = tp2 * cp1 * pp2 * dp4; experts: etp2 * ep4 * pp2 * edp1; sequence parallel"
    )
    single = ParallelDims(world_size=1)
    assert (single.dp, single.edp, single.sequence_parallel) == (1, 1, False)
    assert ParallelDims(world_size=8, tp=2, etp=1, ep=4).edp == 2


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        (
            {"world_size": 6, "tp": 2, "pp": 2},
            r"tp\(2\)\*pp\(2\)\*cp\(1\)\*dp\(\?\) != world_size\(6\): 6 is not a multiple of 4",
        ),
        (
            {"world_size": 8, "tp": 2, "dp": 2},
            r"tp\(2\)\*pp\(1\)\*cp\(1\)\*dp\(2\) = 4 != world_size\(8\); dp must be 4",
        ),
        (
            {"world_size": 4, "ep": 3},
            r"etp\(1\)\*ep\(3\)\*pp\(1\)\*edp\(\?\) != world_size\(4\)",
        ),
        ({"world_size": 2, "tp": 0}, "tp: expected a positive int, got 0"),
        ({"world_size": 2, "ep": 1.5}, "ep: expected a positive int"),
        ({"world_size": 2, "sequence_parallel": True}, "sequence_parallel: needs tp > 1"),
    ],
)
def test_invalid_layouts_fail_before_any_process_group(kwargs, message):
    with pytest.raises(ValueError, match=message):
        ParallelDims(**kwargs)


@pytest.mark.parametrize(
    ("dims", "change", "message"),
    [
        ({"tp": 2}, {"vocab_size": 129}, r"vocab_size: 129 is not divisible by tp\(2\)"),
        ({"ep": 2}, {"num_experts": 5}, r"num_experts: 5 is not divisible by ep\(2\)"),
        ({"pp": 2}, {"num_layers": 3}, r"num_layers: 3 is not divisible by pp\(2\)"),
        ({"tp": 2}, {"num_query_groups": 1}, r"num_query_groups: 1 is not divisible by tp\(2\)"),
        ({"tp": 2, "etp": 2}, {"moe_ffn_hidden_size": 33}, r"moe_ffn_hidden_size: 33"),
        ({"tp": 2, "sequence_parallel": False}, {}, "megatron-core needs sequence parallelism"),
    ],
)
def test_model_that_cannot_be_split(dims, change, message):
    with pytest.raises(ValueError, match=message):
        ParallelDims(world_size=2, **dims).check_model(**(MODEL | change))


def test_model_that_can_be_split():
    ParallelDims(world_size=8, tp=2, pp=2, ep=2).check_model(**MODEL)


def test_weights_are_replicated_only_with_data_parallel_copies():
    assert not ParallelDims(world_size=1).replicates_weights
    assert not ParallelDims(world_size=2, tp=2).replicates_weights  # dp = edp = 1
    assert ParallelDims(world_size=2).replicates_weights  # dp 2
    assert ParallelDims(world_size=2, cp=2).replicates_weights  # dense weights over dp * cp
    assert ParallelDims(world_size=2, ep=2).replicates_weights  # dense dp 2, experts edp 1
    assert ParallelDims(world_size=2, tp=2, etp=1).replicates_weights  # dp 1, experts edp 2
