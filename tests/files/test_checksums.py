"""Checksums of a directory's files: hashed as written (a torch.save through `HashingWriter`)
equals read back; damage that keeps a file's size, a changed size, a missing file and a garbage
manifest are each named; a directory without a manifest (written before checksums) is read as
before."""

from __future__ import annotations

import json
import os
import zlib

import pytest
import torch

from megatron_rl.files import checksums, file_ranges
from megatron_rl.files.checksums import (
    MANIFEST,
    FileChecksum,
    HashingWriter,
    file_checksum,
    record_checksums,
    verify_checksums,
)


def _overwrite_middle(path, count=4096, byte=0xFF):
    """`count` bytes in the middle of `path` set to `byte`, its size unchanged."""
    size = path.stat().st_size
    with open(path, "r+b") as handle:
        handle.seek(size // 2 - count // 2)
        handle.write(bytes([byte]) * count)
    assert path.stat().st_size == size


@pytest.fixture
def directory(tmp_path):
    """A directory of files, one hashed as it was written, with its manifest."""
    (tmp_path / "weights").mkdir()
    with HashingWriter(tmp_path / "weights" / "data.pt") as handle:
        torch.save(torch.arange(8192.0), handle)
    (tmp_path / "trainer.json").write_text('{"step": 1}\n')
    record_checksums(tmp_path, {"weights/data.pt": handle.checksum})
    return tmp_path


def test_a_file_hashed_as_written_has_the_checksum_of_its_bytes(directory, monkeypatch):
    path = directory / "weights" / "data.pt"
    data = path.read_bytes()
    expected = FileChecksum(len(data), zlib.crc32(data))
    assert file_checksum(path) == expected
    assert file_checksum(path, past_page_cache=True) == expected
    monkeypatch.setattr(file_ranges, "_BUFFER", 4096)  # many reads, the last one short
    monkeypatch.setattr(checksums, "_CHUNK", 4096)
    assert file_checksum(path, past_page_cache=True) == expected
    state = (directory / "trainer.json").read_bytes()
    manifest = json.loads((directory / MANIFEST).read_text())
    assert manifest == {
        "algorithm": "crc32",
        "files": {
            "trainer.json": {"size": len(state), "crc32": f"{zlib.crc32(state):08x}"},
            "weights/data.pt": {"size": len(data), "crc32": f"{zlib.crc32(data):08x}"},
        },
    }
    assert verify_checksums(directory) is True


@pytest.mark.parametrize("past_page_cache", [False, True])
def test_bytes_overwritten_in_place_are_named(directory, past_page_cache):
    data = directory / "weights" / "data.pt"
    _overwrite_middle(data)
    with pytest.raises(ValueError) as raised:
        verify_checksums(directory, past_page_cache=past_page_cache)
    message = str(raised.value)
    assert message.startswith(f"{data}: damaged (its bytes differ from those saved: CRC-32 ")
    assert message.endswith(f"when saved); {directory} is unusable")
    assert "\n" not in message


def test_a_changed_size_a_missing_file_and_several_damaged_files(directory):
    data, state = directory / "weights" / "data.pt", directory / "trainer.json"
    _overwrite_middle(data)
    state.write_text('{"step": 2}\n')  # the same size
    # the first by name is named, the others counted
    with pytest.raises(ValueError, match=r"^\S+/trainer\.json: damaged .* \(and 1 other file\);"):
        verify_checksums(directory)
    os.truncate(data, 100)  # a changed size is named without reading the files
    with pytest.raises(ValueError, match=rf"^{data}: damaged \(100 bytes, \d+ when saved\);"):
        verify_checksums(directory)
    data.unlink()
    with pytest.raises(ValueError, match=rf"^{data}: missing \(listed in checksums\.json\)"):
        verify_checksums(directory)


@pytest.mark.parametrize(
    ("manifest", "reason"),
    [
        ("{not json", "JSONDecodeError"),
        ('{"algorithm": "md5", "files": {}}', "algorithm 'md5', this version reads crc32"),
        ('{"algorithm": "crc32", "files": {"a": {"size": 1}}}', "KeyError"),
    ],
)
def test_a_damaged_manifest_is_named(directory, manifest, reason):
    (directory / MANIFEST).write_text(manifest)
    with pytest.raises(ValueError, match=rf"^{directory / MANIFEST}: damaged \(.*{reason}"):
        verify_checksums(directory)


def test_a_directory_written_before_checksums_is_not_read(directory):
    (directory / MANIFEST).unlink()
    _overwrite_middle(directory / "weights" / "data.pt")  # not found: nothing was recorded
    assert verify_checksums(directory) is False
