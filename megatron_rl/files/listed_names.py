"""File names that one file lists for its directory (a Hugging Face index's `weight_map`, a
checksum manifest's `files`, torch.distributed.checkpoint's index), joined to that directory
only when they stay inside it.

The check is on the name, after `..` is resolved, not on where the joined path's links lead:
Hugging Face's download cache keeps a model's files as links into a directory beside the one
the model is read from, and a link inside the directory is the directory owner's own choice.
"""

from __future__ import annotations

import os
from pathlib import Path, PurePosixPath


def listed_path(directory: Path, name: object, listed_in: Path, field: str) -> Path:
    """`directory / name`, where `name` is a file name that `listed_in` lists under `field`;
    a ValueError names the file, the field and the name when it is not a relative name that
    stays inside `directory` (an absolute name, or one that `..` takes out of it)."""
    if not isinstance(name, str) or not name:
        raise ValueError(f"{listed_in}: {field} lists {name!r}, which is not a file name")
    if PurePosixPath(name).is_absolute() or os.path.normpath(name).split(os.sep)[0] == "..":
        raise ValueError(
            f"{listed_in}: {field} lists {name!r}, which is outside {directory}; refused (a "
            "name listed there must be a file inside that directory)"
        )
    return directory / name
