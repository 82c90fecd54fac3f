"""Byte ranges of files, and copying them from file to file.

A conversion whose output holds a tensor's bytes unchanged from its input need not make the
tensor: it copies the bytes (`RangeCopier`). It reads them once, so it reads them past the page
cache where the file system allows (`O_DIRECT`): filling the page cache costs the kernel a page
to allocate, and later to evict, for every 4 KiB read, which on the development machine was
three quarters of the copy's CPU time (docs/conversion.md).
"""

from __future__ import annotations

import errno
import mmap
import os
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

# O_DIRECT's unit: offsets, lengths and memory aligned to it suit every logical block size in use.
_ALIGN = 4096
_BUFFER = 8 * 2**20  # a copy's reads, at most


@dataclass(frozen=True)
class FileRange:
    """`length` bytes of the file at `path`, from `offset`."""

    path: Path
    offset: int
    length: int


class OpenFiles:
    """Files opened for reading as they are asked for, each once, until `close` (or the end of a
    `with` block)."""

    def __init__(self) -> None:
        self.fds: dict[Path, int] = {}

    def fd(self, path: Path, flags: int = 0) -> int:
        """`path` opened read-only, with `flags` (the first time it is asked for)."""
        if path not in self.fds:
            self.fds[path] = os.open(path, os.O_RDONLY | flags)
        return self.fds[path]

    def close(self) -> None:
        for fd in self.fds.values():
            os.close(fd)
        self.fds.clear()

    def __enter__(self) -> OpenFiles:
        return self

    def __exit__(self, *_: object) -> None:
        self.close()


class RangeReader:
    """Reads byte ranges of files past the page cache where their file system allows
    (`O_DIRECT`), through it elsewhere (tmpfs, some network file systems); keeps each file open
    until `close`."""

    def __init__(self) -> None:
        self.direct = OpenFiles()  # the sources read past the page cache
        self.cached = OpenFiles()  # those whose file systems refuse it
        self.map = mmap.mmap(-1, _BUFFER)  # aligned to a page, as O_DIRECT needs
        self.buffer = memoryview(self.map)

    def read(self, path: Path, offset: int, count: int) -> memoryview:
        """Up to `count` bytes of `path` from `offset` (at most 8 MiB): fewer at its end, none
        past it. A view of this reader's buffer, valid until the next read: release it (`with`)
        before `close`."""
        if path not in self.cached.fds:
            try:
                return self._read_direct(self.direct.fd(path, os.O_DIRECT), offset, count)
            except OSError as error:
                if error.errno != errno.EINVAL:  # EINVAL: no O_DIRECT on this file system
                    raise
        return memoryview(os.pread(self.cached.fd(path), min(count, _BUFFER), offset))

    def _read_direct(self, fd: int, offset: int, count: int) -> memoryview:
        """As `read`, from `fd` opened with O_DIRECT: the aligned blocks that hold the bytes,
        at most a buffer's worth, are read into the buffer."""
        start = offset - offset % _ALIGN
        stop = min(start + _BUFFER, -(-(offset + count) // _ALIGN) * _ALIGN)
        filled = os.preadv(fd, [self.buffer[: stop - start]], start)
        skip = offset - start
        return self.buffer[skip : max(skip, min(filled, skip + count))]

    def close(self) -> None:
        self.direct.close()
        self.cached.close()
        self.buffer.release()
        self.map.close()


class RangeCopier(RangeReader):
    """Appends file ranges to an open file descriptor, reading each source as `RangeReader`
    does; keeps each source open until `close`."""

    def append(self, ranges: Iterable[FileRange], out_fd: int) -> None:
        """Write the bytes of `ranges`, in order, at `out_fd`'s position (which advances)."""
        for file_range in ranges:
            offset, end = file_range.offset, file_range.offset + file_range.length
            while offset < end:
                # each view of the buffer released as it is left, an error too (a full disk):
                # the buffer's memory cannot be unmapped while a view of it lives
                with self.read(file_range.path, offset, end - offset) as data:
                    if not data:
                        raise EOFError(
                            f"{file_range.path}: ends before byte {end} (its range "
                            f"{file_range.offset}+{file_range.length} was to be copied)"
                        )
                    offset += len(data)
                    _write_all(out_fd, data)


def _write_all(fd: int, data: memoryview) -> None:
    """Write all of `data` at `fd`'s position (a write may take part of it)."""
    written = 0
    while written < len(data):
        with data[written:] as rest:
            written += os.write(fd, rest)
