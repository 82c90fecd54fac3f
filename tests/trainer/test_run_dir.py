"""What a run finds in its run directory: an earlier run is never taken for an empty directory,
`latest` is recovered, a damaged checkpoint is named and passed over, pruning never removes the
checkpoint just written, and what interrupted saves left is cleared. The checkpoints are real
torch.distributed.checkpoint files (written without a process group)."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp

from megatron_rl.checkpoint.format import METADATA, read_metadata, write_metadata
from megatron_rl.files.checksums import record_checksums
from megatron_rl.files.distcp import check_weights
from megatron_rl.models.hf_source import inspect_hf
from megatron_rl.trainer.checkpoints import resume_point
from megatron_rl.trainer.run_dir import LATEST, complete_checkpoints, prune
from tests.trainer.run_cli import TINY_MODEL


@pytest.fixture(scope="module")
def weights(tmp_path_factory) -> Path:
    """A `weights/` directory as megatron-core writes it: torch.distributed.checkpoint's files
    (two tensors, one data file), common.pt and metadata.json."""
    directory = tmp_path_factory.mktemp("template") / "weights"
    state = {"decoder.weight": torch.arange(4096.0), "output.weight": torch.ones(64, 64)}
    dcp.save(state, checkpoint_id=str(directory), no_dist=True)
    torch.save({"iteration": 1}, directory / "common.pt")
    (directory / "metadata.json").write_text(json.dumps({"sharded_backend": "torch_dist"}))
    return directory


def _checkpoint(run_dir: Path, weights: Path, step: int, *, checksums: bool = False) -> Path:
    """A checkpoint of `weights` and a trainer.json after `step`; with `checksums`, its
    checksums.json as a save writes it."""
    path = run_dir / "checkpoints" / f"step_{step:06d}"
    shutil.copytree(weights, path / "weights")
    state = {"step": step, "world_size": 1, "scheduler": {}, "trainer": {}}
    (path / "trainer.json").write_text(json.dumps(state))
    if checksums:
        record_checksums(path, {})
    return path


def _data_file(checkpoint: Path) -> Path:
    (path,) = (checkpoint / "weights").glob("*.distcp")
    return path


def test_a_fresh_run_refuses_an_earlier_run_even_without_latest(tmp_path, weights):
    _checkpoint(tmp_path, weights, 2)
    _checkpoint(tmp_path, weights, 4)
    assert not (tmp_path / "checkpoints" / LATEST).exists()
    with pytest.raises(ValueError, match=r"holds an earlier run \(checkpoints up to step_000004"):
        resume_point(tmp_path, resume=False)
    assert len(complete_checkpoints(tmp_path / "checkpoints")) == 2  # nothing was touched


def test_a_fresh_run_refuses_the_metrics_of_a_run_that_saved_nothing(tmp_path):
    (tmp_path / "metrics.jsonl").write_text('{"step": 0}\n')
    with pytest.raises(ValueError, match=r"metrics\.jsonl, no checkpoint.*--resume"):
        resume_point(tmp_path, resume=False)
    assert resume_point(tmp_path, resume=True) is None  # --resume starts it again from step 0


def test_resume_recovers_a_missing_latest_and_clears_leftovers(tmp_path, weights, capsys):
    _checkpoint(tmp_path, weights, 2)
    newest = _checkpoint(tmp_path, weights, 4)
    checkpoints = tmp_path / "checkpoints"
    leftovers = [
        checkpoints / ".step_000006.partial",  # a save cut short
        checkpoints / ".step_000001.removing",  # a removal cut short
        checkpoints / f".{LATEST}.abc123.tmp",  # a pointer write cut short
    ]
    leftovers[0].mkdir()
    (leftovers[1] / "weights").mkdir(parents=True)
    leftovers[2].write_text("step_000006\n")
    assert resume_point(tmp_path, resume=True) == newest
    assert (checkpoints / LATEST).read_text() == "step_000004\n"
    assert sorted(path.name for path in checkpoints.iterdir()) == [
        LATEST,
        "step_000002",
        "step_000004",
    ]
    said = capsys.readouterr().err
    assert "latest: missing; resuming step_000004" in said
    assert all(path.name in said for path in leftovers)


def test_resume_passes_over_a_damaged_newest_checkpoint_and_names_its_file(
    tmp_path, weights, capsys
):
    older = _checkpoint(tmp_path, weights, 2)
    newest = _checkpoint(tmp_path, weights, 4)
    (tmp_path / "checkpoints" / LATEST).write_text("step_000004\n")
    damaged = _data_file(newest)
    os.truncate(damaged, 100)
    assert resume_point(tmp_path, resume=True) == older
    said = capsys.readouterr().err
    assert f"{damaged}: truncated (100 bytes" in said and "kept as step_000004.damaged" in said
    assert (tmp_path / "checkpoints" / "step_000004.damaged" / "trainer.json").is_file()
    assert (tmp_path / "checkpoints" / LATEST).read_text() == "step_000002\n"
    # the damaged one is no longer a checkpoint: pruning and the next resume leave it alone
    assert complete_checkpoints(tmp_path / "checkpoints") == [older]


def _overwrite_middle(path: Path) -> None:
    size = path.stat().st_size
    with open(path, "r+b") as handle:
        handle.seek(size // 2 - 2048)
        handle.write(b"\xff" * 4096)
    assert path.stat().st_size == size


def test_damage_that_keeps_sizes_and_a_garbage_trainer_json_are_set_aside_under_free_names(
    tmp_path, weights, capsys
):
    older = _checkpoint(tmp_path, weights, 2, checksums=True)
    middle = _checkpoint(tmp_path, weights, 4, checksums=True)
    newest = _checkpoint(tmp_path, weights, 6)  # saved before checksums: its lengths only
    checkpoints = tmp_path / "checkpoints"
    # names taken by checkpoints set aside before
    (checkpoints / "step_000004.damaged" / "weights").mkdir(parents=True)
    (checkpoints / "step_000006.damaged").mkdir()
    (checkpoints / "step_000006.damaged-2").mkdir()
    damaged = _data_file(middle)
    _overwrite_middle(damaged)
    (newest / "trainer.json").write_text('{"step": 6, "world_si')  # a torn write
    assert resume_point(tmp_path, resume=True) == older
    said = capsys.readouterr().err.splitlines()
    assert said[0] == (
        f"megatron-rl: {newest / 'trainer.json'}: damaged (not JSON: Unterminated string "
        f"starting at: line 1 column 13 (char 12)); {newest} is unusable; it is kept as "
        "step_000006.damaged-3, and an older checkpoint is tried"
    )
    assert said[1].startswith(
        f"megatron-rl: {damaged}: damaged (its bytes differ from those saved: CRC-32 "
    )
    assert said[1].endswith("it is kept as step_000004.damaged-2, and an older checkpoint is tried")
    assert (checkpoints / LATEST).read_text() == "step_000002\n"
    assert (checkpoints / "step_000006.damaged-3" / "trainer.json").is_file()
    assert (checkpoints / "step_000004.damaged-2" / "checksums.json").is_file()
    assert complete_checkpoints(checkpoints) == [older]


def test_a_damaged_checkpoint_is_set_aside_beside_one_set_aside_before(tmp_path, weights, capsys):
    older = _checkpoint(tmp_path, weights, 2)
    newest = _checkpoint(tmp_path, weights, 4)
    earlier = tmp_path / "checkpoints" / "step_000004.damaged"
    (earlier / "weights").mkdir(parents=True)  # not empty: a rename onto it would fail
    os.truncate(_data_file(newest), 100)
    assert resume_point(tmp_path, resume=True) == older
    assert "it is kept as step_000004.damaged-2," in capsys.readouterr().err
    assert (earlier / "weights").is_dir()
    assert (earlier.with_name("step_000004.damaged-2") / "trainer.json").is_file()


def test_when_every_checkpoint_is_damaged_the_newest_file_is_named_and_nothing_moves(
    tmp_path, weights
):
    only = _checkpoint(tmp_path, weights, 2, checksums=True)
    _overwrite_middle(_data_file(only))
    with pytest.raises(ValueError) as raised:
        resume_point(tmp_path, resume=True)
    message = str(raised.value)
    assert message.startswith(f"{_data_file(only)}: damaged (its bytes differ from those saved")
    assert message.endswith(
        f"no checkpoint in {tmp_path / 'checkpoints'} can be resumed (restore the file, or move "
        "step_000002 away to start again from step 0)"
    )
    assert complete_checkpoints(tmp_path / "checkpoints") == [only]


def test_pruning_never_removes_the_checkpoint_just_written(tmp_path, weights):
    # checkpoints of higher steps, then a new one of a lower step (e.g. a restarted count)
    for step in (10, 20):
        _checkpoint(tmp_path, weights, step)
    written = _checkpoint(tmp_path, weights, 3)
    prune(tmp_path / "checkpoints", keep=5, newest=written)  # fewer than `keep`: all stay
    assert len(complete_checkpoints(tmp_path / "checkpoints")) == 3
    prune(tmp_path / "checkpoints", keep=2, newest=written)
    names = sorted(path.name for path in (tmp_path / "checkpoints").iterdir())
    assert names == ["step_000003", "step_000020"]


@pytest.mark.parametrize(
    ("damage", "message"),
    [
        ("missing metadata.json", r"weights/metadata\.json: missing"),
        ("truncated common.pt", r"weights/common\.pt: damaged \(RuntimeError: PytorchStream"),
        ("truncated .metadata", r"weights/\.metadata: damaged \(UnpicklingError"),
        ("truncated data file", r"weights/__0_0\.distcp: truncated \(10 bytes, its index needs"),
    ],
)
def test_a_damaged_weights_file_is_named(tmp_path, weights, damage, message):
    checkpoint = _checkpoint(tmp_path, weights, 1)
    check_weights(checkpoint)
    files = {
        "metadata.json": checkpoint / "weights" / "metadata.json",
        "common.pt": checkpoint / "weights" / "common.pt",
        ".metadata": checkpoint / "weights" / ".metadata",
        "data file": _data_file(checkpoint),
    }
    how, name = damage.split(" ", 1)
    if how == "missing":
        files[name].unlink()
    else:
        os.truncate(files[name], 10)
    with pytest.raises(ValueError, match=message):
        check_weights(checkpoint)


def test_a_checkpoint_without_its_hf_files_is_refused(tmp_path):
    source = inspect_hf(TINY_MODEL, given_as="--hf")
    checkpoint = tmp_path / "step_000001"
    (checkpoint / "weights").mkdir(parents=True)
    write_metadata(checkpoint, source.family, source.config, TINY_MODEL)
    listed = json.loads((checkpoint / METADATA).read_text())["hf_files"]
    assert "config.json" in listed and "tokenizer.json" in listed
    read_metadata(checkpoint)
    (checkpoint / "hf" / "tokenizer.json").unlink()
    with pytest.raises(ValueError, match=r"--ckpt .*: hf/ lacks tokenizer\.json"):
        read_metadata(checkpoint, given_as="--ckpt")
