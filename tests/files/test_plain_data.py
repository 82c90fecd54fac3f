"""A checkpoint's pickles are read as plain data: a common.pt or a torch.distributed.checkpoint
index (`.metadata`) that names a callable is refused by `check_weights` with one line naming the
file and the callable, and the callable is not run; a real index reads as torch reads it, a
damaged one is named damaged, and an index whose data file lies outside `weights/` is refused."""

from __future__ import annotations

import json
import os
import pickle
import shlex
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemReader

from megatron_rl.files.distcp import check_weights
from megatron_rl.files.plain_data import NotPlainData, load_plain_data, read_distcp_index


class _RunsCommand:
    """Unpickled, runs `command` in a shell (what a hostile pickle does)."""

    def __init__(self, command: str) -> None:
        self.command = command

    def __reduce__(self):
        return os.system, (self.command,)


@pytest.fixture
def ckpt(tmp_path) -> Path:
    """A checkpoint's `weights/` as megatron-core writes it: torch.distributed.checkpoint's
    files (two tensors, one data file), common.pt and metadata.json."""
    weights = tmp_path / "ckpt" / "weights"
    state = {"decoder.weight": torch.arange(4096.0), "output.weight": torch.ones(64, 64)}
    dcp.save(state, checkpoint_id=str(weights), no_dist=True)
    torch.save(
        {"iteration": 1, "optimizer": {"param_groups": [{"lr": 1e-3}]}}, weights / "common.pt"
    )
    (weights / "metadata.json").write_text(json.dumps({"sharded_backend": "torch_dist"}))
    return weights.parent


def _touch(marker: Path) -> _RunsCommand:
    return _RunsCommand(f"touch {shlex.quote(str(marker))}")


def test_a_whole_checkpoint_passes_and_its_index_reads_as_torch_reads_it(ckpt):
    index = check_weights(ckpt)
    theirs = FileSystemReader(str(ckpt / "weights")).read_metadata()
    ours = read_distcp_index(ckpt / "weights" / ".metadata")
    for read in (index, ours):
        assert read.state_dict_metadata == theirs.state_dict_metadata
        assert read.storage_data == theirs.storage_data
        assert read.storage_meta.checkpoint_id == theirs.storage_meta.checkpoint_id
        assert read.storage_meta.load_id  # given on reading, as torch's reader gives it


def test_a_common_pt_that_names_a_callable_is_refused_and_nothing_runs(ckpt, tmp_path):
    marker = tmp_path / "ran"
    common = ckpt / "weights" / "common.pt"
    torch.save({"iteration": 1, "hook": _touch(marker)}, common)
    with pytest.raises(NotPlainData) as refused:
        check_weights(ckpt)
    assert str(refused.value) == (
        f"{common}: holds code or objects that are not plain data (posix.system); it was not "
        "loaded (load only checkpoints you trust)"
    )
    assert isinstance(refused.value, ValueError)  # named as every bad checkpoint file is
    assert not marker.exists()


def test_an_index_that_names_a_callable_is_refused_and_nothing_runs(ckpt, tmp_path):
    marker = tmp_path / "ran"
    path = ckpt / "weights" / ".metadata"
    index = FileSystemReader(str(ckpt / "weights")).read_metadata()
    index.storage_meta.modules = [_touch(marker)]
    path.write_bytes(pickle.dumps(index))
    with pytest.raises(
        NotPlainData, match=r"\.metadata: holds code or objects that are not plain "
    ):
        check_weights(ckpt)
    with pytest.raises(NotPlainData, match=r"\(posix\.system\)"):
        read_distcp_index(path)
    assert not marker.exists()


def test_a_damaged_index_or_common_pt_is_named_damaged(ckpt):
    path = ckpt / "weights" / ".metadata"
    path.write_bytes(path.read_bytes()[:100])
    with pytest.raises(ValueError, match=rf"^{path}: damaged \(") as raised:
        check_weights(ckpt)
    assert not isinstance(raised.value, NotPlainData)
    common = ckpt / "weights" / "common.pt"
    common.write_bytes(b"\xff" * 64)
    with pytest.raises(pickle.UnpicklingError, match=r"^not a pickle that torch\.save writes$"):
        load_plain_data(common)


def test_an_index_naming_a_data_file_outside_the_checkpoint_is_refused(ckpt):
    path = ckpt / "weights" / ".metadata"
    index = read_distcp_index(path)
    for key, info in index.storage_data.items():
        index.storage_data[key] = type(info)("../../outside.distcp", info.offset, info.length)
    path.write_bytes(pickle.dumps(index))
    with pytest.raises(ValueError) as refused:
        check_weights(ckpt)
    assert str(refused.value).startswith(
        f"{path}: storage_data lists '../../outside.distcp', which is outside {ckpt / 'weights'}"
    )
