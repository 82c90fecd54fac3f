"""Byte ranges of files, and copying them from file to file inside the kernel.

A conversion whose output holds a tensor's bytes unchanged from its input need not read them into
its own memory and write them out again: `copy_file_range` copies them between the page caches
of the two files (or shares the blocks, on a file system with reflinks), as `cp` does.
"""

from __future__ import annotations

import errno
import os
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

# What copy_file_range raises where the two files' file systems cannot copy between them (an
# older kernel, a network or FUSE file system): the bytes are then copied through this process.
_NO_KERNEL_COPY = {errno.EXDEV, errno.ENOSYS, errno.EOPNOTSUPP, errno.EINVAL}
_CHUNK = 16 * 2**20  # of a copy through this process


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

    def fd(self, path: Path) -> int:
        if path not in self.fds:
            self.fds[path] = os.open(path, os.O_RDONLY)
        return self.fds[path]

    def close(self) -> None:
        for fd in self.fds.values():
            os.close(fd)
        self.fds.clear()

    def __enter__(self) -> OpenFiles:
        return self

    def __exit__(self, *_: object) -> None:
        self.close()


class RangeCopier:
    """Appends file ranges to an open file descriptor; keeps each source open until `close`."""

    def __init__(self) -> None:
        self.sources = OpenFiles()
        self.in_kernel = hasattr(os, "copy_file_range")

    def append(self, ranges: Iterable[FileRange], out_fd: int) -> None:
        """Write the bytes of `ranges`, in order, at `out_fd`'s position (which advances)."""
        for file_range in ranges:
            source = self.sources.fd(file_range.path)
            offset, left = file_range.offset, file_range.length
            while left:
                copied = self._copy(source, out_fd, left, offset)
                if copied == 0:
                    raise EOFError(
                        f"{file_range.path}: ends before byte {offset + left} (its range "
                        f"{file_range.offset}+{file_range.length} was to be copied)"
                    )
                offset, left = offset + copied, left - copied

    def _copy(self, source: int, out_fd: int, count: int, offset: int) -> int:
        if self.in_kernel:
            try:
                return os.copy_file_range(source, out_fd, count, offset)
            except OSError as error:
                if error.errno not in _NO_KERNEL_COPY:
                    raise
                self.in_kernel = False
        data = os.pread(source, min(count, _CHUNK), offset)
        view = memoryview(data)
        while view:
            view = view[os.write(out_fd, view) :]
        return len(data)

    def close(self) -> None:
        self.sources.close()
