"""Checksums of a directory's files (a checkpoint's), recorded when it is written and verified
before it is read, so that damage that keeps a file's length (bytes overwritten in place) is
named rather than loaded.

    CKPT/checksums.json   {"algorithm": "crc32",
                           "files": {"weights/__0_0.distcp": {"size": 106550, "crc32": "9a1c02f3"},
                                     ...}}

The checksum is CRC-32 (`zlib.crc32`): the fastest in the standard library, which matters
because a checkpoint is hashed at every save and read whole at every resume. On the development
machine, one core, data in memory: CRC-32 2.7 GiB/s, SHA-256 1.6 (with the CPU's SHA
instructions; a few times slower without), BLAKE2b 0.75, MD5 0.7. CRC-32 finds every damaged run
of up to 32 bits and misses other damage with a chance of 1 in 2^32: it is a check against
damage (a disk, a copy, a file system), not against someone who wants to forge a checkpoint.
Both hashing and reading release the GIL, so that the files of a directory are verified by
threads side by side.

`HashingWriter` hashes a file's bytes as they are written; `file_checksum` reads a file that
was written elsewhere (by a process of megatron-core's, say) once more, or one to be verified.
"""

from __future__ import annotations

import json
import os
import zlib
from collections.abc import Iterable, Mapping
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import IO

from megatron_rl.files.atomic import write_text_atomic
from megatron_rl.files.file_ranges import RangeReader
from megatron_rl.files.listed_names import listed_path

MANIFEST = "checksums.json"
ALGORITHM = "crc32"
_CHUNK = 8 * 2**20  # a read, when a file is hashed
# Threads that verify a directory's files side by side: enough to keep a disk (or the page
# cache) busy, few enough not to crowd a node's cores while other ranks wait.
VERIFY_THREADS = 8


@dataclass(frozen=True)
class FileChecksum:
    """A file's length and the CRC-32 of its bytes."""

    size: int
    crc32: int

    def as_json(self) -> dict[str, int | str]:
        return {"size": self.size, ALGORITHM: f"{self.crc32:08x}"}


class HashingWriter:
    """The file at `path`, created (or emptied) for writing, whose bytes are hashed as they
    pass (what torch.save and torch.distributed.checkpoint's writer ask of a file);
    `checksum` once written. A context manager that closes the file."""

    def __init__(self, path: Path) -> None:
        self.handle: IO[bytes] = open(path, "wb")  # noqa: SIM115 (closed by close)
        self.size = 0
        self.crc32 = 0

    def write(self, data: bytes | bytearray | memoryview) -> int:
        view = memoryview(data)
        self.crc32 = zlib.crc32(view, self.crc32)
        self.size += view.nbytes
        return self.handle.write(view)

    def tell(self) -> int:
        return self.handle.tell()

    def flush(self) -> None:
        self.handle.flush()

    def fileno(self) -> int:
        return self.handle.fileno()

    def close(self) -> None:
        self.handle.close()

    def __enter__(self) -> HashingWriter:
        return self

    def __exit__(self, *_: object) -> None:
        self.close()

    @property
    def checksum(self) -> FileChecksum:
        return FileChecksum(self.size, self.crc32)


def file_checksum(path: Path, *, past_page_cache: bool = False) -> FileChecksum:
    """The checksum of the file at `path`, read once: through the page cache (what is read
    next finds it there), or past it where the file system allows (`RangeReader`: for bytes
    that are not read again soon, which it would cost the kernel time to cache)."""
    crc32, size = 0, 0
    if past_page_cache:
        reader = RangeReader()
        try:
            while True:
                with reader.read(path, size, _CHUNK) as chunk:
                    if not chunk:
                        break
                    crc32 = zlib.crc32(chunk, crc32)
                    size += chunk.nbytes
        finally:
            reader.close()
        return FileChecksum(size, crc32)
    buffer = bytearray(_CHUNK)
    with open(path, "rb", buffering=0) as handle:
        os.posix_fadvise(handle.fileno(), 0, 0, os.POSIX_FADV_SEQUENTIAL)
        while count := handle.readinto(buffer):
            with memoryview(buffer)[:count] as chunk:
                crc32 = zlib.crc32(chunk, crc32)
            size += count
    return FileChecksum(size, crc32)


def file_checksums(
    directory: Path, names: Iterable[str], *, past_page_cache: bool = False
) -> dict[str, FileChecksum]:
    """The checksums of the files `names` (relative to `directory`), read side by side
    (`file_checksum`)."""
    names = list(names)

    def checksum(name: str) -> FileChecksum:
        return file_checksum(directory / name, past_page_cache=past_page_cache)

    with ThreadPoolExecutor(min(VERIFY_THREADS, max(len(names), 1))) as pool:
        return dict(zip(names, pool.map(checksum, names), strict=True))


def record_checksums(directory: Path, known: Mapping[str, FileChecksum]) -> None:
    """Write `directory`'s MANIFEST: the checksums of its files (relative paths), `known` where
    given (hashed as they were written), the others read now. Write it last."""
    names = sorted(
        path.relative_to(directory).as_posix()
        for path in directory.rglob("*")
        if path.is_file() and path.name != MANIFEST
    )
    sums = dict(known) | file_checksums(directory, [name for name in names if name not in known])
    # one file a line, for people who read it
    files = ",\n".join(
        f"  {json.dumps(name)}: {json.dumps(sums[name].as_json())}" for name in names
    )
    text = f'{{\n "algorithm": "{ALGORITHM}",\n "files": {{\n{files}\n }}\n}}\n'
    write_text_atomic(directory / MANIFEST, text)


def verify_checksums(directory: Path, *, past_page_cache: bool = False) -> bool:
    """Read every file `directory`'s MANIFEST lists, once (`file_checksum`), and raise a
    ValueError naming the first (by name) whose length or checksum differs from the recorded
    one, or that is missing. Returns False, having read nothing, when there is no MANIFEST (a
    directory written before checksums were recorded); True when every file is as it was
    written."""
    path = directory / MANIFEST
    if not path.is_file():
        return False
    recorded = _read_manifest(path, directory)
    present = [name for name in recorded if (directory / name).is_file()]
    if len(present) < len(recorded):
        missing = sorted(set(recorded) - set(present))[0]
        raise ValueError(
            f"{directory / missing}: missing (listed in {MANIFEST}); {directory} is not a "
            "complete checkpoint"
        )
    # the lengths first: a truncated file is named without reading the others
    sizes = {name: (directory / name).stat().st_size for name in present}
    damaged = {
        name: f"{sizes[name]} bytes, {recorded[name].size} when saved"
        for name in present
        if sizes[name] != recorded[name].size
    }
    if not damaged:
        largest_first = sorted(present, key=sizes.__getitem__, reverse=True)
        found_sums = file_checksums(directory, largest_first, past_page_cache=past_page_cache)
        for name, found in found_sums.items():
            if found.crc32 != recorded[name].crc32:
                damaged[name] = (
                    f"its bytes differ from those saved: CRC-32 {found.crc32:08x}, "
                    f"{recorded[name].crc32:08x} when saved"
                )
    if damaged:
        first = min(damaged)
        others = {1: "", 2: " (and 1 other file)"}.get(
            len(damaged), f" (and {len(damaged) - 1} other files)"
        )
        raise ValueError(
            f"{directory / first}: damaged ({damaged[first]}){others}; {directory} is unusable"
        )
    return True


def _read_manifest(path: Path, directory: Path) -> dict[str, FileChecksum]:
    try:
        manifest = json.loads(path.read_text())
        if manifest["algorithm"] != ALGORITHM:
            raise ValueError(f"algorithm {manifest['algorithm']!r}, this version reads {ALGORITHM}")
        recorded = {
            name: FileChecksum(int(entry["size"]), int(entry[ALGORITHM], 16))
            for name, entry in manifest["files"].items()
        }
    except (ValueError, KeyError, TypeError, AttributeError, UnicodeDecodeError) as error:
        reason = f"{type(error).__name__}: {str(error).split('. ')[0]}"
        raise ValueError(f"{path}: damaged ({reason}); {directory} is unusable") from None
    for name in recorded:
        listed_path(directory, name, path, "files")
    return recorded
