"""Writing safetensors shards as the tensors arrive, with the index Hugging Face loaders read."""

from __future__ import annotations

import json
import math
import os
import struct
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from megatron_rl.files.atomic import write_text_atomic
from megatron_rl.files.hf_checkpoint import INDEX_NAME


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


def _close_durably(handle: Any) -> None:
    """Flush a written file to the disk before closing it (a finished export survives a crash)."""
    handle.flush()
    os.fsync(handle.fileno())
    handle.close()


def write_safetensors_shards(
    directory: Path,
    specs: list[TensorSpec],
    tensors: Iterable[tuple[str, torch.Tensor]],
    *,
    max_shard_bytes: int,
    on_tensor: Callable[[int], None] | None = None,
) -> dict[str, str]:
    """Write `tensors`, arriving in the order of `specs`, as `model-0000i-of-0000N.safetensors`
    shards plus the index; returns the weight map. Each shard's header is written from the specs
    before its data, and each tensor goes to disk as it arrives: nothing is accumulated."""
    shards = plan_shards(specs, max_shard_bytes)
    files = [f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors" for i in range(len(shards))]
    expected = iter((spec, i) for i, shard in enumerate(shards) for spec in shard)
    handle = None
    current = -1
    try:
        for name, tensor in tensors:
            entry = next(expected, None)
            if entry is None:
                raise ValueError(f"tensor {name!r} was not announced")
            spec, index = entry
            if (name, tuple(tensor.shape), tensor.dtype) != (spec.name, spec.shape, spec.dtype):
                raise ValueError(
                    f"tensor {name!r} {list(tensor.shape)} {tensor.dtype} arrived where "
                    f"{spec.name!r} {list(spec.shape)} {spec.dtype} was announced"
                )
            if index != current:
                if handle is not None:
                    _close_durably(handle)
                handle = open(directory / files[index], "wb")  # noqa: SIM115 (closed below)
                handle.write(_header(shards[index]))
                current = index
            data = tensor.detach().contiguous().cpu()
            handle.write(memoryview(data.view(torch.uint8).numpy()))
            if on_tensor is not None:
                on_tensor(spec.nbytes)
    finally:
        if handle is not None:
            _close_durably(handle)
    missing = next(expected, None)
    if missing is not None:
        raise ValueError(f"tensor {missing[0].name!r} was announced but never arrived")
    weight_map = {spec.name: files[i] for i, shard in enumerate(shards) for spec in shard}
    total = sum(spec.nbytes for spec in specs)
    index_json = {"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))}
    write_text_atomic(directory / INDEX_NAME, json.dumps(index_json, indent=2) + "\n")
    return weight_map
