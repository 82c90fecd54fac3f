"""Asking the kernel to read a file's bytes before they are used.

A reader that takes tensors in an order of its own, not the file's, from a file not in the page
cache, would otherwise wait for the disk at every few pages it touches.
"""

from __future__ import annotations

import os
from collections.abc import Iterable, Mapping
from pathlib import Path


def read_ahead(ranges: Mapping[Path, Iterable[tuple[int, int]]]) -> None:
    """Have the kernel start reading each `(offset, length)` of each file: a hint that returns
    at once (`posix_fadvise(WILLNEED)`); nothing where the system has no such call."""
    if not hasattr(os, "posix_fadvise"):
        return  # the bytes are read when they are touched
    for path, spans in ranges.items():
        fd = os.open(path, os.O_RDONLY)
        try:
            for offset, length in spans:
                os.posix_fadvise(fd, offset, length, os.POSIX_FADV_WILLNEED)
        finally:
            os.close(fd)
