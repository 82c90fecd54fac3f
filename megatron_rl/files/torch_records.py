"""Where a tensor's bytes lie in a `torch.save` record inside a larger file.

A `torch_dist` data file (`files/distcp.py`) is a sequence of `torch.save` zip archives, one per
item; a tensor's bytes are stored uncompressed in one entry of its archive. `stored_tensor` finds
them, with torch's own archive reader, and says what they are from the archive's pickle, read
without running it: only a plain tensor that fills its storage, in row-major order, qualifies.
"""

from __future__ import annotations

import io
import math
import os
import pickle
from collections import OrderedDict
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


def stored_tensor(fd: int, path: Path, offset: int, length: int) -> StoredTensor | None:
    """The tensor that the `torch.save` archive at bytes `offset`..`offset + length` of `path`
    (open as `fd`) holds, if its bytes are the tensor's, whole and in row-major order; None for
    anything else (an object, a view of a larger storage, strides of another order)."""
    try:
        archive = torch._C.PyTorchFileReader(_FileSlice(fd, offset, length))
        rebuilt = _TensorPickle(io.BytesIO(archive.get_record("data.pkl"))).load()
        if not isinstance(rebuilt, _Rebuilt):
            return None
        record = f"data/{rebuilt.storage_key}"
        data_offset = archive.get_record_offset(record)
    except (RuntimeError, pickle.UnpicklingError, ValueError, TypeError, EOFError):
        return None
    shape, numel = rebuilt.size, math.prod(rebuilt.size)
    nbytes = numel * rebuilt.dtype.itemsize
    if len(rebuilt.stride) != len(shape):
        return None
    row_major = [math.prod(shape[i + 1 :]) for i in range(len(shape))]
    # a dimension of size 1 is in order whatever its stride
    strides = zip(rebuilt.stride, row_major, shape, strict=True)
    in_order = all(stride == expected for stride, expected, n in strides if n > 1)
    if not in_order or rebuilt.storage_offset != 0 or rebuilt.storage_numel != numel:
        return None
    if data_offset + nbytes > length:
        return None
    return StoredTensor(rebuilt.dtype, shape, FileRange(path, offset + data_offset, nbytes))


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


class _FileSlice(io.RawIOBase):
    """Bytes `offset`..`offset + length` of the open file `fd`, as a file of their own."""

    def __init__(self, fd: int, offset: int, length: int) -> None:
        self.fd, self.offset, self.length, self.position = fd, offset, length, 0

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def tell(self) -> int:
        return self.position

    def seek(self, position: int, whence: int = os.SEEK_SET) -> int:
        base = {os.SEEK_SET: 0, os.SEEK_CUR: self.position, os.SEEK_END: self.length}[whence]
        self.position = base + position
        return self.position

    def readinto(self, buffer: Any) -> int:
        count = max(0, min(len(buffer), self.length - self.position))
        data = os.pread(self.fd, count, self.offset + self.position)
        buffer[: len(data)] = data
        self.position += len(data)
        return len(data)
