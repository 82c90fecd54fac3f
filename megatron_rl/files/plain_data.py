"""Pickles read as plain data: a checkpoint's file that names a function or class beyond what
such a file is made of is refused before any of it is built, so that nothing it names is run.

`load_plain_data` is `torch.load(weights_only=True)`: tensors, numbers, strings, containers (and
what the caller allows besides); a file that names anything else raises `NotPlainData`, naming
what it names (torch finds them without running the pickle).

`read_distcp_index` reads torch.distributed.checkpoint's index (`weights/.metadata`), a plain
pickle that torch's own loader unpickles with nothing refused. Here it is unpickled allowing only
what such an index is made of: the dataclasses and enums of torch.distributed.checkpoint's
metadata, planner and filesystem modules, torch.Size, torch's dtypes, layouts and memory
formats, OrderedDict and pathlib's paths. Building those runs no code of the file's choosing,
and an index that passes names nothing else when torch reads it again.
"""

from __future__ import annotations

import dataclasses
import enum
import pathlib
import pickle
import uuid
from collections import OrderedDict
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
import torch.distributed.checkpoint.filesystem as dcp_filesystem
import torch.distributed.checkpoint.metadata as dcp_metadata
import torch.distributed.checkpoint.planner as dcp_planner
from torch.distributed.checkpoint.metadata import Metadata, StorageMeta

TRUST = "load only checkpoints you trust"


class NotPlainData(ValueError):
    """A file that names code or objects other than plain data; it was not loaded."""

    def __init__(self, path: Path, named: Sequence[str]) -> None:
        super().__init__(
            f"{path}: holds code or objects that are not plain data ({', '.join(named)}); "
            f"it was not loaded ({TRUST})"
        )


def load_plain_data(path: Path, *, allowed: Sequence[Any] = ()) -> Any:
    """`torch.load` of `path` as plain data (`weights_only=True`), with the functions and
    classes `allowed` besides (`torch.serialization.safe_globals`); `NotPlainData` names what
    else the file names. A damaged file raises torch's exception, or a pickle.UnpicklingError
    saying so where torch's would read as a refusal."""
    with torch.serialization.safe_globals(list(allowed)):
        try:
            return torch.load(path, map_location="cpu", weights_only=True)
        except pickle.UnpicklingError:
            try:
                named = torch.serialization.get_unsafe_globals_in_checkpoint(path)
            except Exception:
                named = []  # not an archive torch.save writes
            if named:
                raise NotPlainData(path, sorted(named)) from None
            raise pickle.UnpicklingError("not a pickle that torch.save writes") from None


def _index_classes() -> dict[tuple[str, str], Any]:
    """What torch.distributed.checkpoint's index may name, by (module, name) as a pickle names
    it: see the module docstring."""
    allowed: dict[tuple[str, str], Any] = {}
    for module in (dcp_metadata, dcp_planner, dcp_filesystem):
        for name, value in vars(module).items():
            if not isinstance(value, type) or value.__module__ != module.__name__:
                continue  # not a class, or one the module imports
            if dataclasses.is_dataclass(value) or issubclass(value, enum.Enum):
                allowed[(module.__name__, name)] = value
    for name, value in vars(torch).items():
        if isinstance(value, torch.dtype | torch.layout | torch.memory_format):
            allowed[("torch", name)] = value
    allowed[("torch", "Size")] = torch.Size
    # how a torch.layout pickles: a lookup of the layout by its name
    allowed[("torch.serialization", "_get_layout")] = torch.serialization._get_layout
    allowed[("collections", "OrderedDict")] = OrderedDict
    # the checkpoint's path, where torch's own writer records it (StorageMeta.checkpoint_id)
    allowed[("pathlib", "PosixPath")] = pathlib.PosixPath
    allowed[("pathlib", "PurePosixPath")] = pathlib.PurePosixPath
    return allowed


_INDEX_CLASSES = _index_classes()


class _IndexUnpickler(pickle.Unpickler):
    def __init__(self, file: Any, path: Path) -> None:
        super().__init__(file)
        self.path = path

    def find_class(self, module: str, name: str) -> Any:
        if (module, name) not in _INDEX_CLASSES:
            raise NotPlainData(self.path, [f"{module}.{name}"])
        return _INDEX_CLASSES[(module, name)]


def read_distcp_index(path: Path) -> Metadata:
    """torch.distributed.checkpoint's index at `path` (`.metadata`), as its `FileSystemReader`
    reads it, unpickled allowing only what an index is made of (the module docstring):
    `NotPlainData` names anything else it names. A damaged file raises the unpickler's own
    exception (pickle.UnpicklingError, EOFError, ...)."""
    with open(path, "rb") as file:
        index = _IndexUnpickler(file, path).load()
    if not isinstance(index, Metadata):
        raise pickle.UnpicklingError(f"a {type(index).__name__}, not an index")
    # as torch's reader leaves it (FileSystemReader.read_metadata)
    if getattr(index, "storage_meta", None) is None:
        index.storage_meta = StorageMeta()
    index.storage_meta.load_id = str(uuid.uuid4())
    return index
