"""A megatron-core distributed checkpoint's files (`weights/` of a megatron-rl checkpoint),
checked before they are read, so that a damaged file is named rather than met as an EOFError
deep in torch.distributed.checkpoint.

    weights/metadata.json   megatron-core's: which strategy wrote it
    weights/common.pt       megatron-core's: the state every rank shares
    weights/.metadata       torch.distributed.checkpoint's index: each item's file and byte range
    weights/__R_T.distcp    the data, one file per rank and writer
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from torch.distributed.checkpoint import FileSystemReader


def check_weights(ckpt: Path) -> None:
    """Raise a ValueError naming the file when checkpoint `ckpt`'s `weights/` is incomplete:
    megatron-core's metadata.json and common.pt, torch.distributed.checkpoint's index
    (`.metadata`), and every data file at least as long as the index says."""
    weights = ckpt / "weights"
    readers = {
        "metadata.json": lambda: json.loads((weights / "metadata.json").read_text()),
        "common.pt": lambda: torch.load(weights / "common.pt", weights_only=False),
        ".metadata": lambda: FileSystemReader(str(weights)).read_metadata(),
    }
    contents = {}
    for name, read in readers.items():
        if not (weights / name).is_file():
            raise ValueError(f"{weights / name}: missing; {ckpt} is not a complete checkpoint")
        try:
            contents[name] = read()
        except Exception as error:
            reason = f"{type(error).__name__}: {str(error).split('. ')[0]}"
            raise ValueError(f"{weights / name}: damaged ({reason}); {ckpt} is unusable") from None
    needed: dict[str, int] = {}
    for info in contents[".metadata"].storage_data.values():
        end = info.offset + info.length
        needed[info.relative_path] = max(needed.get(info.relative_path, 0), end)
    for name, size in sorted(needed.items()):
        path = weights / name
        if not path.is_file():
            raise ValueError(f"{path}: missing; {ckpt} is not a complete checkpoint")
        if path.stat().st_size < size:
            raise ValueError(
                f"{path}: truncated ({path.stat().st_size} bytes, its index needs {size}); "
                f"{ckpt} is damaged"
            )
