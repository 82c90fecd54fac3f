"""Writing so that a crash never leaves a half-written file or directory behind.

A file is written to a temporary sibling, flushed to the disk and renamed over its target. A
directory (a checkpoint, an export, a set of weights) is written into a staging sibling,
`.NAME.partial`, and renamed to NAME only when everything in it is complete; an older NAME is
replaced only after that. A run killed in between leaves the old NAME intact and, at most, the
staging directory, which the next attempt at the same NAME removes first. A stop signal
(`megatron_rl.process.stop`) does not cut the renames that replace an old NAME.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import IO

import torch.distributed as dist

from megatron_rl.parallel.collectives import any_rank, from_rank0
from megatron_rl.process.stop import STOPS, uninterrupted

# The process's umask, read once (reading it means setting it): a new file gets the mode that
# open() would give it, not mkstemp's owner-only 0600 (a run directory is often shared).
_UMASK = os.umask(0o022)
os.umask(_UMASK)


def flush_to_disk(handle: IO[bytes]) -> None:
    """Flush an open file's writes through Python's buffer and the page cache to the disk."""
    handle.flush()
    os.fsync(handle.fileno())


def write_bytes_atomic(path: str | os.PathLike[str], data: bytes) -> Path:
    """Write `data` to `path` through a temporary file in the same directory and an atomic
    rename; a file already at `path` keeps its permissions, a new one gets open()'s."""
    target = Path(path)
    target.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp_name = tempfile.mkstemp(prefix=f".{target.name}.", suffix=".tmp", dir=target.parent)
    try:
        with os.fdopen(fd, "wb") as handle:
            handle.write(data)
            flush_to_disk(handle)
        if target.exists():
            shutil.copymode(target, tmp_name)
        else:
            os.chmod(tmp_name, 0o666 & ~_UMASK)
        os.replace(tmp_name, target)
    except BaseException:
        Path(tmp_name).unlink(missing_ok=True)
        raise
    return target


def write_text_atomic(path: str | os.PathLike[str], text: str) -> Path:
    """`write_bytes_atomic` of `text` in UTF-8."""
    return write_bytes_atomic(path, text.encode("utf-8"))


def check_output_dir(out: Path, *, overwrite: bool) -> None:
    """Refuse an existing output unless `overwrite`, and a missing parent directory, before any
    work is done (the conversions' `--out`; the trainer's outputs always have their parent)."""
    if out.exists() and not overwrite:
        raise ValueError(f"--out {out}: already exists; pass --overwrite to replace it")
    if not out.parent.is_dir():
        raise ValueError(f"--out {out}: parent directory {out.parent} does not exist")


def staging_left_beside(out: Path) -> list[tuple[Path, int]]:
    """Staging directories and retired copies (`retired_copies`) of other outputs in `out`'s
    directory (what killed writes left; one may also be another write in progress), each with
    its size in bytes. `out`'s own are removed by the next write to `out`."""
    own = {out.parent / f".{out.name}.partial", *retired_copies(out)}
    found = []
    for left in sorted([*out.parent.glob(".*.partial"), *out.parent.glob(".*.old-*")]):
        if left.is_dir() and left not in own:
            found.append((left, directory_size(left)))
    return found


def retired_copies(out: Path) -> list[Path]:
    """Old `out`s that a write killed while it replaced them left (`publish`: `.OUT.old-PID`;
    one left between the two renames is the only copy of the old `out`). The next write to
    `out` removes them once the new `out` is in place."""
    return sorted(out.parent.glob(f".{out.name}.old-*"))


def directory_size(directory: Path) -> int:
    """The bytes of the files under `directory`."""
    return sum(path.stat().st_size for path in directory.rglob("*") if path.is_file())


def publish(staging: Path, out: Path) -> None:
    """Move a completed `staging` directory to `out`, replacing an old `out` only after; then
    remove the old one, and any that killed writes left (`retired_copies`)."""
    if out.exists():
        retired = out.parent / f".{out.name}.old-{os.getpid()}"
        with uninterrupted():  # a stop between the two renames would leave no `out`
            os.replace(out, retired)
            os.replace(staging, out)
    else:
        os.replace(staging, out)
    for retired in retired_copies(out):
        shutil.rmtree(retired, ignore_errors=True)


def _fresh_staging(out: Path, overwrite: bool) -> Path:
    check_output_dir(out, overwrite=overwrite)
    staging = out.parent / f".{out.name}.partial"
    shutil.rmtree(staging, ignore_errors=True)  # left by a run killed while writing
    staging.mkdir()
    return staging


@contextmanager
def staged_directory(out: Path, *, overwrite: bool, collective: bool = False) -> Iterator[Path]:
    """A staging directory that becomes `out` when the block completes, and is removed when it
    raises (see the module docstring). `overwrite` allows replacing an existing `out`.

    `collective`: every rank of the job enters the block and writes into the same staging
    directory (a file system they share); rank 0 creates it, and publishes it only when every
    rank has completed its block.
    """
    if not collective:
        staging = _fresh_staging(out, overwrite)
        try:
            yield staging
        except BaseException as error:
            shutil.rmtree(staging, ignore_errors=True)
            _raise_naming(error, out)
        publish(staging, out)
        return
    staging = from_rank0(lambda: _fresh_staging(out, overwrite))
    is_rank0 = not dist.is_initialized() or dist.get_rank() == 0
    try:
        try:
            yield staging
        except STOPS:
            raise
        except BaseException as error:  # torch.distributed.checkpoint's are BaseExceptions
            _finish_together(staging, out, failed=True, is_rank0=is_rank0)
            _raise_naming(error, out)
        _finish_together(staging, out, failed=False, is_rank0=is_rank0)
    except STOPS:
        # A stop: the other ranks are stopping as well, wherever they were, so no collective
        # follows (it could pair with another one, or wait for ever). Unless it came after
        # the publishing renames, the staging directory is still there.
        if is_rank0:
            shutil.rmtree(staging, ignore_errors=True)
        raise


def _raise_naming(error: BaseException, out: Path) -> None:
    """Raise `error` again; an OSError that names no file (a full disk, as safetensors reports
    it) names `out`, whose write failed."""
    if isinstance(error, OSError) and error.filename is None and error.strerror:
        raise OSError(error.errno, error.strerror, str(out)) from error
    raise error


def _finish_together(staging: Path, out: Path, *, failed: bool, is_rank0: bool) -> None:
    """Rank 0 publishes `staging` as `out` when no rank `failed`, else removes it (a collective)."""
    failed_somewhere = any_rank(failed)
    if is_rank0:
        if failed_somewhere:
            shutil.rmtree(staging, ignore_errors=True)
        else:
            publish(staging, out)
    if dist.is_initialized():
        dist.barrier()
