"""Hugging Face checkpoint directories: reading safetensors lazily, writing them atomically.

A directory holds `config.json`, the weights as one `model.safetensors` or as shards listed in
`model.safetensors.index.json`, and tokenizer files. Reading opens shards on demand and reads one
tensor at a time (shapes come from the headers, without loading). Writing goes to a temporary
directory beside the target, which is renamed into place only when everything is written.
"""

from __future__ import annotations

import json
import math
import os
import shutil
import struct
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError, safe_open

from megatron_rl.fileio import write_text_atomic

INDEX_NAME = "model.safetensors.index.json"
SINGLE_NAME = "model.safetensors"
# Tokenizer and generation files copied along with the weights when present.
ASSET_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "added_tokens.json",
    "vocab.json",
    "merges.txt",
    "tokenizer.model",
    "chat_template.jinja",
    "generation_config.json",
)


def read_config(directory: Path) -> dict[str, Any]:
    path = directory / "config.json"
    if not path.is_file():
        raise ValueError(f"{path}: missing; a Hugging Face checkpoint needs its config.json")
    try:
        config = json.loads(path.read_text())
    except json.JSONDecodeError as error:
        raise ValueError(f"{path}: not valid JSON ({error})") from None
    if not isinstance(config, dict):
        raise ValueError(f"{path}: expected a JSON object")
    return config


# safetensors maps its files into memory; every page a read touches stays resident while the
# file is open. Reopening a file after this many bytes keeps that resident set small.
REOPEN_AFTER_BYTES = 256 * 2**20


class HFCheckpoint:
    """A Hugging Face checkpoint directory, read lazily."""

    def __init__(self, directory: str | os.PathLike[str]) -> None:
        self.directory = Path(directory)
        if not self.directory.is_dir():
            raise ValueError(f"--hf {self.directory}: not a directory")
        self.config = read_config(self.directory)
        self._file_of = self._weight_map()
        self._handles: dict[Path, Any] = {}
        self._bytes_read: dict[Path, int] = {}

    def _weight_map(self) -> dict[str, Path]:
        index = self.directory / INDEX_NAME
        if index.is_file():
            try:
                weight_map = json.loads(index.read_text())["weight_map"]
            except (json.JSONDecodeError, KeyError, TypeError) as error:
                raise ValueError(f"{index}: not a valid safetensors index ({error!r})") from None
            files = {name: self.directory / file for name, file in weight_map.items()}
            for path in sorted(set(files.values())):
                if not path.is_file():
                    raise ValueError(f"{path}: listed in {INDEX_NAME} but missing")
            return files
        single = self.directory / SINGLE_NAME
        if not single.is_file():
            raise ValueError(
                f"{self.directory}: no weights ({SINGLE_NAME} or {INDEX_NAME}); only safetensors "
                "checkpoints are supported"
            )
        with self._open(single) as handle:
            return dict.fromkeys(handle.keys(), single)

    @contextmanager
    def _open(self, path: Path) -> Iterator[Any]:
        try:
            with safe_open(str(path), framework="pt") as handle:
                yield handle
        except SafetensorError as error:
            raise ValueError(f"{path}: not a readable safetensors file ({error})") from None

    def _handle(self, path: Path) -> Any:
        if path not in self._handles:
            try:
                self._handles[path] = safe_open(str(path), framework="pt")
            except SafetensorError as error:
                raise ValueError(f"{path}: not a readable safetensors file ({error})") from None
        return self._handles[path]

    def names(self) -> set[str]:
        return set(self._file_of)

    def _path(self, name: str) -> Path:
        if name not in self._file_of:
            raise ValueError(f"{self.directory}: tensor {name!r} is missing from the checkpoint")
        return self._file_of[name]

    def shape(self, name: str) -> tuple[int, ...]:
        return tuple(self._handle(self._path(name)).get_slice(name).get_shape())

    def tensor(self, name: str) -> torch.Tensor:
        path = self._path(name)
        try:
            tensor = self._handle(path).get_tensor(name)
        except SafetensorError as error:
            raise ValueError(f"{path}: cannot read tensor {name!r} ({error})") from None
        self._bytes_read[path] = (
            self._bytes_read.get(path, 0) + tensor.numel() * tensor.element_size()
        )
        if self._bytes_read[path] > REOPEN_AFTER_BYTES:
            self._handles.pop(path, None)
            self._bytes_read[path] = 0
        return tensor

    def close(self) -> None:
        """Unmap every open file."""
        self._handles.clear()
        self._bytes_read.clear()

    def largest_file_bytes(self) -> int:
        return max(path.stat().st_size for path in set(self._file_of.values()))

    def asset_files(self) -> list[Path]:
        return [self.directory / name for name in ASSET_FILES if (self.directory / name).is_file()]


def check_output_dir(out: Path, *, overwrite: bool) -> None:
    """Refuse an existing output unless `overwrite`; fail before any work is done."""
    if out.exists() and not overwrite:
        raise ValueError(f"--out {out}: already exists; pass --overwrite to replace it")
    if not out.parent.is_dir():
        raise ValueError(f"--out {out}: parent directory {out.parent} does not exist")


def publish(staging: Path, out: Path) -> None:
    """Move a completed `staging` directory to `out`, replacing an old `out` only after."""
    if out.exists():
        retired = out.parent / f".{out.name}.old-{os.getpid()}"
        os.replace(out, retired)
        os.replace(staging, out)
        shutil.rmtree(retired, ignore_errors=True)
    else:
        os.replace(staging, out)


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


def copy_assets(files: Iterable[Path], directory: Path) -> None:
    for path in files:
        shutil.copy2(path, directory / path.name)
