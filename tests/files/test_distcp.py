"""megatron-core's torch_dist format written item by item (`StreamingSave`): a tensor's value is
made when it is written, in the tensor's dtype, a tensor without one is written as it is, and
megatron-core's loader reads the result; a value of another shape is refused, naming the
tensor, and no index is written."""

from __future__ import annotations

from pathlib import Path

import torch
from megatron.core import dist_checkpointing
from megatron.core.dist_checkpointing.mapping import ShardedTensor

from megatron_rl.checkpoint.format import save_weights
from megatron_rl.files.distcp import TensorValue
from megatron_rl.parallel.dims import ParallelDims
from megatron_rl.parallel.distributed import LaunchEnv, init_distributed
from tests.parallel.harness import run_on_ranks


def _address(tensor: torch.Tensor) -> int:
    return tensor.untyped_storage().data_ptr()


def _nothing() -> None:
    pass


def _save_and_load(launch: LaunchEnv, directory: str) -> dict:
    init_distributed(ParallelDims(world_size=1), launch)
    made, kept = torch.zeros(4, 3), torch.arange(6.0)
    state = {
        "made": ShardedTensor.from_rank_offsets("made", made),
        "kept": ShardedTensor.from_rank_offsets("kept", kept),
    }
    value = torch.arange(12, dtype=torch.float64).reshape(4, 3)
    good, bad = Path(directory) / "good", Path(directory) / "bad"
    good.mkdir()
    save_weights(state, good, {_address(made): TensorValue(made, lambda: value, _nothing)})
    wanted = {
        "made": ShardedTensor.from_rank_offsets("made", torch.empty(4, 3)),
        "kept": ShardedTensor.from_rank_offsets("kept", torch.empty(6)),
    }
    loaded = dist_checkpointing.load(wanted, str(good))
    bad.mkdir()
    try:
        save_weights(
            {"made": ShardedTensor.from_rank_offsets("made", made)},
            bad,
            {_address(made): TensorValue(made, lambda: torch.zeros(2, 3), _nothing)},
        )
        refused = ""
    except ValueError as error:
        refused = str(error)
    return {
        "made": loaded["made"],
        "kept": loaded["kept"],
        "refused": refused,
        "bad_files": sorted(path.name for path in bad.iterdir()),
    }


def test_values_are_made_as_written_and_read_back(tmp_path):
    (report,) = run_on_ranks(_save_and_load, str(tmp_path), world_size=1)
    assert report["made"].dtype == torch.float32  # the state dict's tensor's dtype
    assert torch.equal(report["made"], torch.arange(12.0).reshape(4, 3))
    assert torch.equal(report["kept"], torch.arange(6.0))
    assert report["refused"] == "made: its value is [2, 3], the state dict's tensor [4, 3]"
    assert ".metadata" not in report["bad_files"]
