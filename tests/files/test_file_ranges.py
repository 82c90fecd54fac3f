"""Locating a tensor's bytes in a torch.save record inside a larger file, and copying file
ranges from file to file."""

from __future__ import annotations

import errno
import io
import mmap
import os

import pytest
import torch

from megatron_rl.files import file_ranges
from megatron_rl.files.file_ranges import FileRange, RangeCopier
from megatron_rl.files.torch_records import stored_tensor


def _records(path, values):
    """`values` torch.saved one after the other into `path`, after 100 bytes of something else,
    as torch.distributed.checkpoint writes its items; each record's (offset, length)."""
    spans = []
    with open(path, "wb") as handle:
        handle.write(b"x" * 100)
        for value in values:
            buffer = io.BytesIO()
            torch.save(value, buffer)
            spans.append((handle.tell(), len(buffer.getvalue())))
            handle.write(buffer.getvalue())
    return spans


def _located(path, span):
    fd = os.open(path, os.O_RDONLY)
    try:
        return stored_tensor(fd, path, *span)
    finally:
        os.close(fd)


def test_a_whole_row_major_tensor_is_found_and_anything_else_is_not(tmp_path):
    weight = torch.randn(6, 4).to(torch.bfloat16)
    values = [
        weight,
        torch.arange(5, dtype=torch.int64).reshape(5, 1),  # a dimension of size 1
        weight[2:],  # a view: torch.save writes its whole storage
        weight.t().contiguous().t(),  # every element, in another order
        {"step": 3},  # an object, not a tensor
    ]
    path = tmp_path / "items.distcp"
    spans = _records(path, values)
    for value, span in zip(values[:2], spans, strict=False):
        found = _located(path, span)
        assert (found.dtype, found.shape) == (value.dtype, tuple(value.shape))
        with open(path, "rb") as handle:
            handle.seek(found.data.offset)
            assert handle.read(found.data.length) == value.view(torch.uint8).numpy().tobytes()
    assert [_located(path, span) for span in spans[2:]] == [None, None, None]
    offset, length = spans[0]
    assert _located(path, (offset + 1, length - 1)) is None  # not a record's start


def _sources(tmp_path):
    first, second = tmp_path / "a", tmp_path / "b"
    first.write_bytes(bytes(range(251)) * 2**14)  # 4 MB, a prime period: every offset differs
    second.write_bytes(bytes(range(7, 256)) * 40)
    return first, second


def _reads_past_the_page_cache(directory):
    """Whether `directory`'s file system opens and reads files with O_DIRECT, as the copier
    does (tmpfs before Linux 6.6 and some network file systems refuse it: EINVAL)."""
    probe = directory / "o_direct_probe"
    probe.write_bytes(bytes(4096))
    try:
        fd = os.open(probe, os.O_RDONLY | os.O_DIRECT)
        try:
            with mmap.mmap(-1, 4096) as block:  # page-aligned memory, as O_DIRECT needs
                os.preadv(fd, [block], 0)
        finally:
            os.close(fd)
    except OSError as error:
        if error.errno != errno.EINVAL:
            raise
        return False
    finally:
        probe.unlink()
    return True


@pytest.mark.parametrize("direct", [True, False])
def test_ranges_are_appended_in_order_past_the_page_cache_or_through_it(
    tmp_path, monkeypatch, direct
):
    if direct and not _reads_past_the_page_cache(tmp_path):
        pytest.skip(
            f"the file system of {tmp_path} refuses O_DIRECT: the copier reads through the "
            "page cache there, which direct=False tests"
        )
    first, second = _sources(tmp_path)
    if not direct:
        opened = os.open

        # a test double for a file system without O_DIRECT (tmpfs before Linux 6.6), which
        # refuses the flag
        def refusing_direct(path, flags, *args):
            if flags & os.O_DIRECT:
                raise OSError(errno.EINVAL, "Invalid argument")
            return opened(path, flags, *args)

        monkeypatch.setattr(file_ranges.os, "open", refusing_direct)
    # unaligned offsets and lengths, a range longer than the copier's buffer (1 MiB here), a
    # source again
    monkeypatch.setattr(file_ranges, "_BUFFER", 2**20)
    ranges = [
        FileRange(first, 1000, 24),
        FileRange(second, 2, 3),
        FileRange(first, 5, 3 * 2**20 + 7),
        FileRange(second, 4096, 4096),
    ]
    with open(tmp_path / "out", "wb") as out:
        out.write(b"head")
        out.flush()
        copier = RangeCopier()
        copier.append(ranges, out.fileno())
        assert sorted(copier.direct.fds if direct else copier.cached.fds) == [first, second]
        copier.close()
    source = {first: first.read_bytes(), second: second.read_bytes()}
    expected = b"head" + b"".join(source[r.path][r.offset : r.offset + r.length] for r in ranges)
    assert (tmp_path / "out").read_bytes() == expected


def test_a_range_past_the_end_of_its_file_is_an_error_naming_it(tmp_path):
    first, _ = _sources(tmp_path)
    copier = RangeCopier()
    with open(tmp_path / "out", "wb") as out, pytest.raises(EOFError, match=str(first)):
        copier.append([FileRange(first, first.stat().st_size - 50, 100)], out.fileno())
    copier.close()


def test_a_failed_copy_raises_its_own_error_and_the_copier_still_closes(tmp_path):
    """A write that fails (here: to a file opened read-only; a full disk alike) raises its
    OSError, and closing the copier afterwards, with that error's traceback alive, releases its
    buffer (no BufferError)."""
    source = tmp_path / "source"
    source.write_bytes(bytes(range(256)) * 64)
    target = tmp_path / "target"
    target.write_bytes(b"")
    fd = os.open(target, os.O_RDONLY)
    copier = RangeCopier()
    try:
        with pytest.raises(OSError) as raised:
            copier.append([FileRange(source, 100, 5000)], fd)
        assert raised.value.errno == errno.EBADF
        copier.close()
    finally:
        os.close(fd)
