"""Telling the kernel which of a file's bytes will be read soon, or not again.

A reader that takes tensors in an order of its own, not the file's, from a file not in the page
cache, would otherwise wait for the disk at every few pages it touches (`read_ahead`). A
benchmark that compares steps reading from the disk first forgets what is cached (`drop_cached`).
"""

from __future__ import annotations

import os
from collections.abc import Iterable, Mapping
from pathlib import Path


def read_ahead(ranges: Mapping[Path, Iterable[tuple[int, int]]]) -> None:
    """Have the kernel start reading each `(offset, length)` of each file: a hint that returns
    once the reads are queued (`posix_fadvise(WILLNEED)`); nothing where the system has no such
    call. Ranges that touch are asked for as one: each call costs about as much as queueing
    a few MB of reads."""
    _advise({path: _joined(spans) for path, spans in ranges.items()}, "POSIX_FADV_WILLNEED")


def drop_cached(paths: Iterable[Path]) -> None:
    """Have the kernel forget the cached pages of these files, so that they are read from the
    disk next (`posix_fadvise(DONTNEED)`; pages not yet written are kept: flush them first);
    nothing where the system has no such call."""
    _advise({path: [(0, 0)] for path in paths}, "POSIX_FADV_DONTNEED")


def _joined(spans: Iterable[tuple[int, int]]) -> list[tuple[int, int]]:
    """`(offset, length)` spans, sorted, with those that overlap or touch made one."""
    joined: list[tuple[int, int]] = []
    for offset, length in sorted(spans):
        if joined and offset <= joined[-1][0] + joined[-1][1]:
            start, last_length = joined[-1]
            joined[-1] = (start, max(start + last_length, offset + length) - start)
        else:
            joined.append((offset, length))
    return joined


def _advise(ranges: Mapping[Path, Iterable[tuple[int, int]]], advice: str) -> None:
    if not hasattr(os, "posix_fadvise"):
        return  # the kernel's own guesses stand
    for path, spans in ranges.items():
        fd = os.open(path, os.O_RDONLY)
        try:
            for offset, length in spans:
                os.posix_fadvise(fd, offset, length, getattr(os, advice))
        finally:
            os.close(fd)
