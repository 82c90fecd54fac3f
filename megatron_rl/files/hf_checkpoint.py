"""Hugging Face checkpoint directories, read lazily.

A directory holds `config.json`, the weights as one `model.safetensors` or as shards listed in
`model.safetensors.index.json`, and tokenizer files. Reading opens shards on demand and reads one
tensor at a time (shapes come from the headers, without loading). Writing shards:
`megatron_rl.files.safetensors_shards`.
"""

from __future__ import annotations

import json
import os
import shutil
import struct
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError, safe_open

from megatron_rl.files.listed_names import listed_path
from megatron_rl.files.readahead import read_ahead

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
    "tiktoken.model",
    "chat_template.jinja",
    "generation_config.json",
)


def read_config(directory: Path, *, given_as: str | None = None) -> dict[str, Any]:
    """The config.json of the Hugging Face checkpoint `directory`; `given_as` is how the user
    named the directory (`--hf`, `model.hf_path`), for error messages."""
    if not directory.is_dir():
        named = f"{given_as} {directory}" if given_as else str(directory)
        raise ValueError(f"{named}: not a directory")
    path = directory / "config.json"
    if not path.is_file():
        raise ValueError(f"{path}: missing; a Hugging Face checkpoint needs its config.json")
    return read_config_file(path)


def read_config_file(path: Path) -> dict[str, Any]:
    """A Hugging Face config.json (under any name) as a mapping."""
    try:
        config = json.loads(path.read_text())
    except json.JSONDecodeError as error:
        raise ValueError(f"{path}: not valid JSON ({error})") from None
    except OSError as error:
        raise ValueError(f"{path}: cannot be read ({error.strerror})") from None
    if not isinstance(config, dict):
        raise ValueError(f"{path}: expected a JSON object")
    return config


# safetensors maps its files into memory; every page a read touches stays resident while the
# file is open. Reopening a file after this many bytes keeps that resident set small.
REOPEN_AFTER_BYTES = 256 * 2**20


class HFCheckpoint:
    """A Hugging Face checkpoint directory, read lazily.

    Args:
        directory: the checkpoint's directory.
        given_as: how the user named it (`--hf`, `model.hf_path`), for error messages.
    """

    def __init__(self, directory: str | os.PathLike[str], *, given_as: str | None = None) -> None:
        self.directory = Path(directory)
        self.config = read_config(self.directory, given_as=given_as)
        self._file_of = self._weight_map()
        self._handles: dict[Path, Any] = {}
        self._bytes_read: dict[Path, int] = {}
        self._ranges: dict[Path, dict[str, tuple[int, int]]] = {}

    def _weight_map(self) -> dict[str, Path]:
        index = self.directory / INDEX_NAME
        if index.is_file():
            try:
                weight_map = json.loads(index.read_text())["weight_map"]
            except (json.JSONDecodeError, KeyError, TypeError) as error:
                raise ValueError(f"{index}: not a valid safetensors index ({error!r})") from None
            if not isinstance(weight_map, dict):
                raise ValueError(
                    f"{index}: not a valid safetensors index (weight_map is not an object)"
                )
            files = {
                name: listed_path(self.directory, file, index, "weight_map")
                for name, file in weight_map.items()
            }
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

    def prefetch(self, names: Iterable[str]) -> None:
        """Have the kernel start reading these tensors' bytes (a hint; it returns at once)."""
        by_file: dict[Path, list[tuple[int, int]]] = {}
        for name in names:
            path = self._path(name)
            start, end = self._byte_ranges(path)[name]
            by_file.setdefault(path, []).append((start, end - start))
        read_ahead(by_file)

    def _byte_ranges(self, path: Path) -> dict[str, tuple[int, int]]:
        """Where each tensor's bytes lie in safetensors file `path` (its header: an 8-byte
        little-endian length, then JSON with each tensor's `data_offsets` after the header)."""
        if path not in self._ranges:
            try:
                with open(path, "rb") as file:
                    (length,) = struct.unpack("<Q", file.read(8))
                    header = json.loads(file.read(length))
                start = 8 + length
                self._ranges[path] = {
                    name: (start + entry["data_offsets"][0], start + entry["data_offsets"][1])
                    for name, entry in header.items()
                    if name != "__metadata__"
                }
            except (OSError, ValueError, KeyError, TypeError, struct.error) as error:
                raise ValueError(f"{path}: not a readable safetensors header ({error})") from None
        return self._ranges[path]

    def close(self) -> None:
        """Unmap every open file."""
        self._handles.clear()
        self._bytes_read.clear()


def asset_files(directory: Path) -> list[Path]:
    """The tokenizer and generation files (ASSET_FILES) present in `directory`, and the modules
    of a tokenizer that is code of its own (`tokenizer_code_files`)."""
    names = [*ASSET_FILES, *tokenizer_code_files(directory)]
    return [directory / name for name in names if (directory / name).is_file()]


def tokenizer_code_files(directory: Path) -> list[str]:
    """The Python modules that tokenizer_config.json's auto_map names for AutoTokenizer
    (`["tokenization_moonshot.TikTokenTokenizer", null]`: tokenization_moonshot.py); none for
    a tokenizer of transformers' own, or a tokenizer_config.json that is not JSON (loading the
    tokenizer names that). A ValueError names a module whose file would be outside `directory`."""
    path = directory / "tokenizer_config.json"
    try:
        auto_map = json.loads(path.read_bytes()).get("auto_map") if path.is_file() else None
    except ValueError:
        return []
    classes = auto_map.get("AutoTokenizer") if isinstance(auto_map, dict) else None
    if isinstance(classes, str):
        classes = [classes]
    if not isinstance(classes, list):
        return []
    # "module.Class", or "repo--module.Class" for code kept in another repository
    modules = {ref.split("--")[-1].rsplit(".", 1)[0] for ref in classes if isinstance(ref, str)}
    for module in modules:  # a file copied with the weights: one of the directory's
        listed_path(directory, f"{module}.py", path, "auto_map")
    return sorted(f"{module}.py" for module in modules)


def copy_assets(files: Iterable[Path], directory: Path) -> None:
    for path in files:
        shutil.copy2(path, directory / path.name)
