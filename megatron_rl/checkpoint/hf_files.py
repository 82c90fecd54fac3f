"""Hugging Face checkpoint directories: reading safetensors lazily, writing them atomically.

A directory holds `config.json`, the weights as one `model.safetensors` or as shards listed in
`model.safetensors.index.json`, and tokenizer files. Reading opens shards on demand and reads one
tensor at a time (shapes come from the headers, without loading). Writing goes to a temporary
directory beside the target, which is renamed into place only when everything is written.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import save_file

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


class HFCheckpoint:
    """A Hugging Face checkpoint directory, read lazily."""

    def __init__(self, directory: str | os.PathLike[str]) -> None:
        self.directory = Path(directory)
        if not self.directory.is_dir():
            raise ValueError(f"--hf {self.directory}: not a directory")
        self.config = read_config(self.directory)
        self._file_of = self._weight_map()
        self._handles: dict[Path, Any] = {}

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
            return self._handle(path).get_tensor(name)
        except SafetensorError as error:
            raise ValueError(f"{path}: cannot read tensor {name!r} ({error})") from None

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


@contextmanager
def staged_directory(out: Path, *, overwrite: bool) -> Iterator[Path]:
    """A temporary directory beside `out`, renamed to `out` when the block completes; removed
    (and `out` left as it was) if it raises."""
    check_output_dir(out, overwrite=overwrite)
    staging = Path(tempfile.mkdtemp(prefix=f".{out.name}.partial-", dir=out.parent))
    try:
        yield staging
        publish(staging, out)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise


def publish(staging: Path, out: Path) -> None:
    """Move a completed `staging` directory to `out`, replacing an old `out` only after."""
    if out.exists():
        retired = out.parent / f".{out.name}.old-{os.getpid()}"
        os.replace(out, retired)
        os.replace(staging, out)
        shutil.rmtree(retired, ignore_errors=True)
    else:
        os.replace(staging, out)


def write_safetensors_shards(
    directory: Path,
    tensors: Iterable[tuple[str, torch.Tensor]],
    *,
    max_shard_bytes: int,
    on_tensor: Any = None,
) -> dict[str, str]:
    """Write `(name, tensor)` pairs as `model-0000i-of-0000N.safetensors` shards of at most
    `max_shard_bytes` (a larger tensor gets a shard of its own) plus the index; returns the
    weight map. At most one shard's tensors are held at a time."""
    shard_files: list[str] = []
    weight_map: dict[str, str] = {}
    pending: dict[str, torch.Tensor] = {}
    pending_bytes = 0
    total_bytes = 0

    def flush() -> None:
        nonlocal pending, pending_bytes
        if not pending:
            return
        name = f"shard-{len(shard_files):05d}.safetensors"
        save_file(pending, str(directory / name), metadata={"format": "pt"})
        shard_files.append(name)
        for tensor_name in pending:
            weight_map[tensor_name] = name
        pending, pending_bytes = {}, 0

    for name, tensor in tensors:
        if name in weight_map or name in pending:
            raise ValueError(f"tensor {name!r} was produced twice")
        size = tensor.numel() * tensor.element_size()
        if pending and pending_bytes + size > max_shard_bytes:
            flush()
        pending[name] = tensor.detach().contiguous().cpu()
        pending_bytes += size
        total_bytes += size
        if on_tensor is not None:
            on_tensor(size)
    flush()

    count = len(shard_files)
    final = {
        old: f"model-{i + 1:05d}-of-{count:05d}.safetensors" for i, old in enumerate(shard_files)
    }
    for old, new in final.items():
        os.replace(directory / old, directory / new)
    weight_map = {name: final[file] for name, file in sorted(weight_map.items())}
    index = {"metadata": {"total_size": total_bytes}, "weight_map": weight_map}
    (directory / INDEX_NAME).write_text(json.dumps(index, indent=2) + "\n")
    return weight_map


def copy_assets(files: Iterable[Path], directory: Path) -> None:
    for path in files:
        shutil.copy2(path, directory / path.name)
