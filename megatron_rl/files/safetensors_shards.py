"""Writing safetensors shards as the tensors arrive, with the index Hugging Face loaders read."""

from __future__ import annotations

import json
import math
import struct
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import IO, Any

import torch

from megatron_rl.files.atomic import flush_to_disk, write_text_atomic
from megatron_rl.files.file_ranges import FileRange, RangeCopier
from megatron_rl.files.hf_checkpoint import INDEX_NAME
from megatron_rl.files.write_behind import WriteBehind


@dataclass(frozen=True)
class TensorSpec:
    """Name, shape and dtype of a tensor to be written, known before its data."""

    name: str
    shape: tuple[int, ...]
    dtype: torch.dtype

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * self.dtype.itemsize


# safetensors' names for torch dtypes (the file format's header field "dtype").
SAFETENSORS_DTYPES = {
    torch.float32: "F32",
    torch.bfloat16: "BF16",
    torch.float16: "F16",
    torch.float64: "F64",
    torch.int64: "I64",
    torch.int32: "I32",
    torch.int16: "I16",
    torch.int8: "I8",
    torch.uint8: "U8",
    torch.bool: "BOOL",
}


def plan_shards(specs: list[TensorSpec], max_shard_bytes: int) -> list[list[TensorSpec]]:
    """Consecutive groups of at most `max_shard_bytes` (a larger tensor gets a shard alone)."""
    shards: list[list[TensorSpec]] = []
    size = 0
    for spec in specs:
        if not shards or (shards[-1] and size + spec.nbytes > max_shard_bytes):
            shards.append([])
            size = 0
        shards[-1].append(spec)
        size += spec.nbytes
    return shards


def _header(specs: list[TensorSpec]) -> bytes:
    entries: dict[str, Any] = {"__metadata__": {"format": "pt"}}
    offset = 0
    for spec in specs:
        if spec.dtype not in SAFETENSORS_DTYPES:
            raise ValueError(f"{spec.name}: dtype {spec.dtype} cannot be written to safetensors")
        entries[spec.name] = {
            "dtype": SAFETENSORS_DTYPES[spec.dtype],
            "shape": list(spec.shape),
            "data_offsets": [offset, offset + spec.nbytes],
        }
        offset += spec.nbytes
    header = json.dumps(entries, separators=(",", ":")).encode()
    header += b" " * (-len(header) % 8)  # the format aligns the data to 8 bytes
    return struct.pack("<Q", len(header)) + header


def shard_file_sizes(specs: list[TensorSpec], max_shard_bytes: int) -> list[int]:
    """The size in bytes of each shard file `write_safetensors_shards` writes for `specs`."""
    return [
        len(_header(shard)) + sum(spec.nbytes for spec in shard)
        for shard in plan_shards(specs, max_shard_bytes)
    ]


def _check_arrival(name: str, tensor: torch.Tensor, spec: TensorSpec) -> None:
    if (name, tuple(tensor.shape), tensor.dtype) != (spec.name, spec.shape, spec.dtype):
        raise ValueError(
            f"tensor {name!r} {list(tensor.shape)} {tensor.dtype} arrived where "
            f"{spec.name!r} {list(spec.shape)} {spec.dtype} was announced"
        )


class _ShardFile:
    """The shard being written; its methods run in the writing thread (`WriteBehind`)."""

    def __init__(self) -> None:
        self.handle: IO[bytes] | None = None
        self.copier = RangeCopier()

    def start(self, path: Path, header: bytes) -> None:
        self.close()
        self.handle = open(path, "wb")  # noqa: SIM115 (closed by close)
        self.handle.write(header)

    def write(self, data: torch.Tensor) -> None:
        assert self.handle is not None, "a shard is started before its tensors are written"
        self.handle.write(memoryview(data.view(torch.uint8).numpy()))

    def copy(self, ranges: Sequence[FileRange]) -> None:
        assert self.handle is not None, "a shard is started before its tensors are written"
        self.handle.flush()  # the copy goes to the file's position, after what is buffered
        self.copier.append(ranges, self.handle.fileno())

    def close(self) -> None:
        """Flush the shard to the disk before closing it (a finished export survives a crash)."""
        if self.handle is not None:
            handle, self.handle = self.handle, None
            with handle:
                flush_to_disk(handle)


def write_safetensors_shards(
    directory: Path,
    specs: list[TensorSpec],
    tensors: Iterable[tuple[str, torch.Tensor]],
    *,
    max_shard_bytes: int,
    on_tensor: Callable[[int], None] | None = None,
    stored: Mapping[str, Sequence[FileRange]] | None = None,
) -> dict[str, str]:
    """Write `tensors`, arriving in the order of `specs`, as `model-0000i-of-0000N.safetensors`
    shards plus the index; returns the weight map. Each shard's header is written from the specs
    before its data, and each tensor goes to disk as it arrives, written by a thread of its own
    while the next ones are made: nothing is accumulated.

    A tensor whose name `stored` has when it arrives is not read: its bytes are copied from
    those file ranges (`RangeCopier`)."""
    if stored is None:
        stored = {}
    shards = plan_shards(specs, max_shard_bytes)
    files = [f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors" for i in range(len(shards))]
    expected = iter((spec, i) for i, shard in enumerate(shards) for spec in shard)
    shard = _ShardFile()
    current = -1
    try:
        with WriteBehind(lanes=1) as behind:
            for name, tensor in tensors:
                entry = next(expected, None)
                if entry is None:
                    raise ValueError(f"tensor {name!r} was not announced")
                spec, index = entry
                _check_arrival(name, tensor, spec)
                if index != current:
                    behind.put(
                        0, partial(shard.start, directory / files[index], _header(shards[index]))
                    )
                    current = index
                ranges = stored.get(name)
                if ranges is not None:
                    if sum(r.length for r in ranges) != spec.nbytes:
                        raise ValueError(
                            f"tensor {name!r}: its stored bytes are "
                            f"{sum(r.length for r in ranges)}, its {spec.dtype} "
                            f"{list(spec.shape)} has {spec.nbytes}"
                        )
                    # counted as held, as a write is: the making runs no further ahead of
                    # the copying, whose reads it would otherwise compete with for the disk
                    behind.put(0, partial(shard.copy, ranges), spec.nbytes)
                else:
                    data = tensor.detach().contiguous().cpu()
                    behind.put(0, partial(shard.write, data), spec.nbytes)
                if on_tensor is not None:
                    on_tensor(spec.nbytes)
            behind.put(0, shard.close)
    finally:
        shard.close()
        shard.copier.close()
    missing = next(expected, None)
    if missing is not None:
        raise ValueError(f"tensor {missing[0].name!r} was announced but never arrived")
    weight_map = {spec.name: files[i] for i, shard in enumerate(shards) for spec in shard}
    total = sum(spec.nbytes for spec in specs)
    index_json = {"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))}
    write_text_atomic(directory / INDEX_NAME, json.dumps(index_json, indent=2) + "\n")
    return weight_map
