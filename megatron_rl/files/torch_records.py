"""Where a tensor's bytes lie in a `torch.save` record inside a larger file.

A `torch_dist` data file (`files/distcp.py`) is a sequence of `torch.save` zip archives, one per
item; a tensor's bytes are stored uncompressed in one entry of its archive. `stored_tensor` finds
them from the archive's head alone, one small read at the record's start: the entries torch
writes before the tensor's bytes (the pickle, then a few short ones) are walked by their local
headers, each one's end found by the sizes written after it. What the tensor is comes
from the pickle, read without running it: only a plain tensor that fills its storage, in
row-major order, qualifies.
"""

from __future__ import annotations

import io
import math
import os
import pickle
import struct
from collections import OrderedDict
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from megatron_rl.files.file_ranges import FileRange


@dataclass(frozen=True)
class StoredTensor:
    """A tensor saved by `torch.save`: its dtype, its shape and where its bytes are."""

    dtype: torch.dtype
    shape: tuple[int, ...]
    data: FileRange


# The most of a record read to find its tensor's bytes; torch writes about 700 bytes before them.
HEAD_BYTES = 4096


def stored_tensor(fd: int, path: Path, offset: int, length: int) -> StoredTensor | None:
    """The tensor that the `torch.save` archive at bytes `offset`..`offset + length` of `path`
    (open as `fd`) holds, if its bytes are the tensor's, whole and in row-major order; None for
    anything else (an object, a view of a larger storage, strides of another order) and for an
    archive whose head is not as torch writes it."""
    head = os.pread(fd, min(length, HEAD_BYTES), offset)
    rebuilt: _Rebuilt | None = None
    try:
        for name, start, end in _entries(head):
            if rebuilt is None:
                if not name.endswith("data.pkl"):
                    continue
                if end is None:
                    return None
                rebuilt = _TensorPickle(io.BytesIO(head[start:end])).load()
                if not isinstance(rebuilt, _Rebuilt):
                    return None
                record = name.removesuffix("data.pkl") + f"data/{rebuilt.storage_key}"
            elif name == record:
                return _whole_tensor(rebuilt, FileRange(path, offset + start, length - start))
    except (pickle.UnpicklingError, ValueError, TypeError, EOFError, UnicodeDecodeError):
        return None
    return None


def _whole_tensor(rebuilt: _Rebuilt, data: FileRange) -> StoredTensor | None:
    """`rebuilt` whose bytes begin where `data` does, if it is whole and in row-major order."""
    shape, numel = rebuilt.size, math.prod(rebuilt.size)
    nbytes = numel * rebuilt.dtype.itemsize
    if len(rebuilt.stride) != len(shape) or nbytes > data.length:
        return None
    row_major = [math.prod(shape[i + 1 :]) for i in range(len(shape))]
    # a dimension of size 1 is in order whatever its stride
    strides = zip(rebuilt.stride, row_major, shape, strict=True)
    in_order = all(stride == expected for stride, expected, n in strides if n > 1)
    if not in_order or rebuilt.storage_offset != 0 or rebuilt.storage_numel != numel:
        return None
    return StoredTensor(rebuilt.dtype, shape, FileRange(data.path, data.offset, nbytes))


# A zip entry's local header: signature, version, flags, method, time, date, CRC-32,
# compressed and uncompressed size, name length, extra field length.
_LOCAL_HEADER = struct.Struct("<IHHHHHIIIHH")
_LOCAL_SIGNATURE = 0x04034B50
_SIZES_AFTER = 0x8  # flag: the CRC and sizes follow the data (a data descriptor)
_DESCRIPTOR_SIGNATURE = b"PK\x07\x08"
_DESCRIPTOR = struct.Struct("<4sIII")  # signature, CRC-32, compressed and uncompressed size
_DESCRIPTOR_64 = struct.Struct("<4sIQQ")


def _entries(head: bytes) -> Iterator[tuple[str, int, int | None]]:
    """The entries at the start of the zip archive that `head` begins, as `torch.save` writes
    them (stored uncompressed, each followed by its sizes): each name, and where its data starts
    and ends in `head`. The last one's end is None when `head` ends before it (as the tensor's
    bytes go on past the head). Stops at anything else."""
    position = 0
    while position + _LOCAL_HEADER.size <= len(head):
        signature, _, flags, method, *_, name_length, extra_length = _LOCAL_HEADER.unpack_from(
            head, position
        )
        if signature != _LOCAL_SIGNATURE or method != 0 or not flags & _SIZES_AFTER:
            return
        name_start = position + _LOCAL_HEADER.size
        start = name_start + name_length + extra_length
        name = head[name_start : name_start + name_length].decode()
        found = _descriptor(head, start)
        yield name, start, None if found is None else found[0]
        if found is None:
            return
        position = found[1]


def _descriptor(head: bytes, start: int) -> tuple[int, int] | None:
    """The end of the data starting at `start` and of the data descriptor after it: the first
    descriptor whose sizes are those of the bytes between; None if `head` has none."""
    end = head.find(_DESCRIPTOR_SIGNATURE, start)
    while end >= 0:
        for layout in (_DESCRIPTOR, _DESCRIPTOR_64):
            if end + layout.size > len(head):
                continue
            _, _, compressed, size = layout.unpack_from(head, end)
            if compressed == size == end - start:
                return end, end + layout.size
        end = head.find(_DESCRIPTOR_SIGNATURE, end + 1)
    return None


# The storage classes by which torch.save's pickle names a tensor's dtype.
_STORAGE_DTYPES = {
    "BFloat16Storage": torch.bfloat16,
    "HalfStorage": torch.float16,
    "FloatStorage": torch.float32,
    "DoubleStorage": torch.float64,
    "LongStorage": torch.int64,
    "IntStorage": torch.int32,
    "ShortStorage": torch.int16,
    "CharStorage": torch.int8,
    "ByteStorage": torch.uint8,
    "BoolStorage": torch.bool,
}


@dataclass(frozen=True)
class _Rebuilt:
    """What the pickle of a saved tensor says about it."""

    dtype: torch.dtype
    storage_key: str
    storage_numel: int
    storage_offset: int
    size: tuple[int, ...]
    stride: tuple[int, ...]


def _rebuild_tensor(
    storage: tuple[torch.dtype, str, int], offset: int, size: Any, stride: Any, *_: Any
) -> _Rebuilt:
    dtype, key, numel = storage
    return _Rebuilt(dtype, key, numel, offset, tuple(size), tuple(stride))


class _TensorPickle(pickle.Unpickler):
    """Reads a `torch.save` pickle of one tensor into `_Rebuilt`; any other class it names
    (a tensor subclass, an object) is refused, so that nothing in it is run."""

    def find_class(self, module: str, name: str) -> Any:
        if (module, name) == ("torch._utils", "_rebuild_tensor_v2"):
            return _rebuild_tensor
        if (module, name) == ("collections", "OrderedDict"):
            return OrderedDict
        if module == "torch" and name in _STORAGE_DTYPES:
            return _STORAGE_DTYPES[name]
        raise pickle.UnpicklingError(f"{module}.{name} is not part of a plain tensor")

    def persistent_load(self, pid: Any) -> tuple[torch.dtype, str, int]:
        kind, dtype, key, _location, numel = pid
        if kind != "storage" or not isinstance(dtype, torch.dtype):
            raise pickle.UnpicklingError(f"unexpected persistent id {pid!r}")
        return dtype, str(key), int(numel)
