"""The convert CLI: bad input fails clearly and leaves nothing half-written; --overwrite."""

from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from safetensors.torch import load_file, save_file
from torch.distributed.checkpoint import FileSystemReader

from megatron_rl.cli import main
from megatron_rl.files.torch_records import stored_tensor
from tests.checkpoint.tiny_hf import save_tiny
from tests.processes import group_gone, live_group_members
from tests.small_disk import on_small_disk
from tests.trainer.run_cli import REPO, train_environment


@pytest.fixture
def hf(tmp_path):
    return save_tiny("qwen3_moe", tmp_path / "hf")


def _cli(*args: str) -> subprocess.CompletedProcess:
    script = Path(sys.executable).parent / "megatron-rl"
    return subprocess.run([str(script), *args], capture_output=True, text=True, timeout=300)


def _leftovers(directory: Path) -> list[str]:
    return sorted(p.name for p in directory.iterdir() if p.name.startswith("."))


def _edit_config(directory: Path, **changes) -> None:
    path = directory / "config.json"
    path.write_text(json.dumps(json.loads(path.read_text()) | changes))


def test_missing_config(hf, tmp_path, capsys):
    (hf / "config.json").unlink()
    assert main(["convert", "hf-to-mcore", "--hf", str(hf), "--out", str(tmp_path / "o")]) == 2
    assert "config.json: missing" in capsys.readouterr().err
    missing = tmp_path / "missing"
    assert main(["convert", "hf-to-mcore", "--hf", str(missing), "--out", str(tmp_path / "o")]) == 2
    assert f"--hf {missing}: not a directory" in capsys.readouterr().err  # the flag given


def test_missing_weights_and_corrupt_file(hf, tmp_path, capsys):
    weights = hf / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:1000])
    assert main(["convert", "hf-to-mcore", "--hf", str(hf), "--out", str(tmp_path / "o")]) == 2
    assert "model.safetensors: not a readable safetensors file" in capsys.readouterr().err
    weights.unlink()
    assert main(["convert", "hf-to-mcore", "--hf", str(hf), "--out", str(tmp_path / "o")]) == 2
    assert (
        "no weights (model.safetensors or model.safetensors.index.json)" in capsys.readouterr().err
    )
    assert not (tmp_path / "o").exists()


def test_unsupported_architecture_lists_the_supported_ones(hf, tmp_path, capsys):
    _edit_config(hf, architectures=["LlamaForCausalLM"], model_type="llama")
    assert main(["convert", "hf-to-mcore", "--hf", str(hf), "--out", str(tmp_path / "o")]) == 2
    error = capsys.readouterr().err
    assert "architecture ['LlamaForCausalLM'] is not supported" in error
    assert "supported: Qwen3MoeForCausalLM, MixtralForCausalLM" in error


def test_tensor_the_mapping_does_not_use(hf, tmp_path, capsys):
    weights = load_file(hf / "model.safetensors")
    weights["model.layers.0.mlp.shared_expert.weight"] = weights["model.norm.weight"].clone()
    save_file(weights, hf / "model.safetensors", metadata={"format": "pt"})
    assert main(["convert", "hf-to-mcore", "--hf", str(hf), "--out", str(tmp_path / "o")]) == 2
    assert "mlp.shared_expert.weight" in capsys.readouterr().err


def test_existing_output_is_refused_without_overwrite(hf, tmp_path, capsys):
    out = tmp_path / "o"
    out.mkdir()
    (out / "keep").write_text("mine")
    assert main(["convert", "hf-to-mcore", "--hf", str(hf), "--out", str(out)]) == 2
    assert "already exists; pass --overwrite" in capsys.readouterr().err
    assert (out / "keep").read_text() == "mine"
    assert main(["convert", "mcore-to-hf", "--ckpt", str(hf), "--out", str(out)]) == 2
    assert f"--ckpt {hf}: no megatron_rl.json; not a megatron-rl" in capsys.readouterr().err


def test_config_that_disagrees_with_the_weights_names_the_tensor_and_leaves_nothing(hf, tmp_path):
    _edit_config(hf, moe_intermediate_size=8)
    done = _cli("convert", "hf-to-mcore", "--hf", str(hf), "--out", str(tmp_path / "o"))
    assert done.returncode == 2, done.stderr
    assert "model.layers.0.mlp.experts.0.gate_proj.weight: checkpoint shape [16, 32]" in done.stderr
    assert "disagrees with the shape [8, 32] the config implies" in done.stderr
    assert not (tmp_path / "o").exists() and _leftovers(tmp_path) == []


def test_overwrite_replaces_a_finished_conversion(hf, tmp_path):
    out = tmp_path / "o"
    first = _cli("convert", "hf-to-mcore", "--hf", str(hf), "--out", str(out))
    assert first.returncode == 0, first.stderr
    assert "hf-to-mcore" in first.stderr  # the progress bar
    again = _cli("convert", "hf-to-mcore", "--hf", str(hf), "--out", str(out), "--overwrite")
    assert again.returncode == 0, again.stderr
    assert json.loads((out / "megatron_rl.json").read_text())["architecture"] == (
        "Qwen3MoeForCausalLM"
    )
    assert _leftovers(tmp_path) == []


def test_a_checkpoint_of_an_unknown_format_or_damaged_is_refused(hf, tmp_path, capsys):
    ckpt = tmp_path / "ckpt"
    done = _cli("convert", "hf-to-mcore", "--hf", str(hf), "--out", str(ckpt))
    assert done.returncode == 0, done.stderr
    metadata = ckpt / "megatron_rl.json"
    written = metadata.read_text()
    metadata.write_text(json.dumps(json.loads(written) | {"format": 99}))
    out = tmp_path / "back"
    killed = tmp_path / ".other.partial"  # what a killed conversion to another --out left
    killed.mkdir()
    (killed / "model.safetensors").write_bytes(bytes(3 * 2**20))
    to_hf = ["convert", "mcore-to-hf", "--ckpt", str(ckpt), "--out", str(out)]
    assert main(to_hf) == 2
    said = capsys.readouterr().err
    assert "format 99, this version of megatron-rl reads formats 1, 2" in said
    metadata.write_text(written)
    data = sorted((ckpt / "weights").glob("*.distcp"))[-1]
    assert main(to_hf) == 0  # noted, not removed: another conversion may be writing it
    assert f"note: {killed} (3 MiB) was left by an interrupted" in capsys.readouterr().err
    assert killed.is_dir()
    shutil.rmtree(out)
    # a truncated data file, named before anything is loaded
    data.write_bytes(data.read_bytes()[:100])
    assert main(to_hf) == 2
    assert f"{data}: truncated (100 bytes, its index needs" in capsys.readouterr().err
    # a file lost from hf/ (e.g. by a removal cut short)
    (ckpt / "hf" / "config.json").unlink()
    assert main(to_hf) == 2
    assert "hf/ lacks config.json" in capsys.readouterr().err
    assert not out.exists()


def test_a_full_disk_ends_a_conversion_in_one_line_and_leaves_nothing(hf, tmp_path):
    disk = tmp_path / "disk"
    disk.mkdir()
    script = str(Path(sys.executable).parent / "megatron-rl")
    command = [script, "convert", "hf-to-mcore", "--hf", str(hf), "--out", str(disk / "out")]
    result = subprocess.run(
        on_small_disk(str(disk), "256k", command), capture_output=True, text=True, timeout=300
    )
    assert result.returncode == 1, result.stderr[-3000:]
    assert "Traceback" not in result.stderr, result.stderr[-3000:]
    (error,) = [line for line in result.stderr.splitlines() if "error" in line]
    assert error.startswith("megatron-rl: error: ") and str(disk) in error
    assert error.endswith(": No space left on device")
    assert result.stdout.splitlines()[-1] == "left: "  # no staging directory, no --out


def test_sigkill_during_a_conversion_leaves_no_process_and_only_its_staging(hf, tmp_path):
    """SIGKILL (as `kill -9 PID`) while the conversion writes: the conversion writes in its own
    process, so nothing outlives it, and only its staging directory is left."""
    out = tmp_path / "out"
    args = ["convert", "hf-to-mcore", "--hf", str(hf), "--out", str(out)]
    process = subprocess.Popen(
        [sys.executable, "-m", "tests.checkpoint.hold_worker", str(tmp_path), *args],
        cwd=REPO,
        env=train_environment(),
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        start_new_session=True,
    )
    try:
        deadline = time.monotonic() + 180
        while not (tmp_path / "writing").is_file():
            assert process.poll() is None and time.monotonic() < deadline, "no save began"
            time.sleep(0.1)
        writer = int((tmp_path / "writing").read_text())
        os.kill(process.pid, signal.SIGKILL)
        process.wait()
        assert writer == process.pid  # no writer processes of its own
        assert group_gone(process.pid, timeout_s=10), live_group_members(process.pid)
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(process.pid, signal.SIGKILL)
        process.wait()
    assert not out.exists() and _leftovers(tmp_path) == [".out.partial"]


def test_a_full_disk_during_an_export_ends_in_one_line_with_the_space_needed(hf, tmp_path):
    """mcore-to-hf with its --out on 64 KiB: the export (about 130 KiB) does not fit; the copy
    of the checkpoint's bytes into a shard is where the disk fills."""
    ckpt = tmp_path / "ckpt"
    assert main(["convert", "hf-to-mcore", "--hf", str(hf), "--out", str(ckpt)]) == 0
    disk = tmp_path / "disk"
    disk.mkdir()
    script = str(Path(sys.executable).parent / "megatron-rl")
    command = [script, "convert", "mcore-to-hf", "--ckpt", str(ckpt), "--out", str(disk / "out")]
    result = subprocess.run(
        on_small_disk(str(disk), "64k", command), capture_output=True, text=True, timeout=300
    )
    assert result.returncode == 1, result.stderr[-3000:]
    assert "Traceback" not in result.stderr, result.stderr[-3000:]
    (error,) = [line for line in result.stderr.splitlines() if "error" in line]
    assert error.startswith(f"megatron-rl: error: {disk / 'out'}: no space left for the export")
    assert re.search(r"it needs about 0\.1\d MiB, 0\.0\d MiB were free", error), error
    assert result.stdout.splitlines()[-1] == "left: "  # no staging directory, no --out


def _overwrite_the_largest_tensors_bytes(ckpt: Path) -> Path:
    """4 KiB of 0xff in the middle of the stored bytes of the checkpoint's largest tensor, its
    file's size kept (float32 NaNs, as the issue found exported); returns the file."""
    weights = ckpt / "weights"
    items = FileSystemReader(str(weights)).read_metadata().storage_data.values()
    info = max(items, key=lambda item: item.length)
    path = weights / info.relative_path
    fd = os.open(path, os.O_RDWR)
    try:
        stored = stored_tensor(fd, path, info.offset, info.length)
        assert stored is not None and stored.data.length >= 8192
        os.pwrite(fd, b"\xff" * 4096, stored.data.offset + stored.data.length // 2 - 2048)
    finally:
        os.close(fd)
    return path


def test_a_checkpoint_damaged_in_place_is_refused_naming_the_file(hf, tmp_path):
    """4 KiB of 0xff in a tensor's bytes, its file's size kept: the export stops before it
    writes anything, naming the file; a checkpoint saved before checksums is exported as
    before, with a note."""
    ckpt = tmp_path / "ckpt"
    assert main(["convert", "hf-to-mcore", "--hf", str(hf), "--out", str(ckpt)]) == 0
    saved = {path: path.read_bytes() for path in (ckpt / "weights").glob("*.distcp")}
    data = _overwrite_the_largest_tensors_bytes(ckpt)
    assert data.stat().st_size == len(saved[data])
    out = tmp_path / "back"
    done = _cli("convert", "mcore-to-hf", "--ckpt", str(ckpt), "--out", str(out))
    assert done.returncode == 2, done.stderr[-3000:]
    assert "Traceback" not in done.stderr, done.stderr[-3000:]
    (line,) = [line for line in done.stderr.splitlines() if "error" in line]
    assert line.startswith(f"megatron-rl: error: {data}: damaged (its bytes differ from those")
    assert line.endswith(f"; {ckpt} is unusable")
    assert not out.exists() and _leftovers(tmp_path) == []
    # whole, without its checksums (as saved by an earlier version): exported, with a note
    data.write_bytes(saved[data])
    (ckpt / "checksums.json").unlink()
    done = _cli("convert", "mcore-to-hf", "--ckpt", str(ckpt), "--out", str(out))
    assert done.returncode == 0, done.stderr[-3000:]
    assert f"note: --ckpt {ckpt} was saved without checksums" in done.stderr


def test_what_a_killed_overwrite_left_is_named_and_removed_once_replaced(hf, tmp_path, capsys):
    """A conversion killed while its --overwrite replaced the old --out leaves the old one
    renamed `.OUT.old-PID`: the next conversion to OUT names it and removes it once the new OUT
    is in place; one left beside another output is named and kept."""
    out = tmp_path / "o"
    retired = tmp_path / ".o.old-4242"  # a killed conversion's pid
    (retired / "weights").mkdir(parents=True)
    (retired / "weights" / "__0_0.distcp").write_bytes(bytes(2 * 2**20))
    other = tmp_path / ".other.old-4243"
    other.mkdir()
    convert = ["convert", "hf-to-mcore", "--hf", str(hf), "--out", str(out), "--overwrite"]
    assert main(convert) == 0
    said = capsys.readouterr().err
    assert (
        f"note: {retired} (2 MiB) was left by an interrupted --overwrite of {out}; it is "
        "removed once the new one is written"
    ) in said
    assert f"note: {other} (0 MiB) was left by an interrupted conversion or export" in said
    assert not retired.exists() and other.is_dir()
    assert (out / "megatron_rl.json").is_file()
