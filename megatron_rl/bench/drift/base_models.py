"""Base models of other shapes for the drift grid's `base_model.*` sweeps, built by the tiny-model
script (examples/moe/make_tiny_model.py) with its defaults, i.e. the way the shipped 4-layer model
was made, and kept in a cache directory shared by every results directory."""

from __future__ import annotations

import sys
from pathlib import Path

import megatron_rl

SCRIPT = Path(megatron_rl.__file__).resolve().parents[1] / "examples" / "moe" / "make_tiny_model.py"


def shape_name(shape: dict[str, int]) -> str:
    """The cache entry of `shape`, e.g. `layers8-experts8-topk2`."""
    return "-".join(f"{key}{shape[key]}" for key in ("layers", "experts", "topk"))


def model_path(models_dir: Path, shape: dict[str, int]) -> Path:
    return models_dir / shape_name(shape)


def is_built(models_dir: Path, shape: dict[str, int]) -> bool:
    # The script renames its staging directory into place when done: a path that exists is whole.
    return (model_path(models_dir, shape) / "config.json").is_file()


def build_command(models_dir: Path, shape: dict[str, int]) -> list[str]:
    """The command that builds `shape` into the cache (seed 0, the script's defaults)."""
    if not SCRIPT.is_file():
        raise FileNotFoundError(
            f"{SCRIPT}: the tiny-model script, which base_model.* sweeps need, is not there "
            "(run from a checkout of megatron-rl)"
        )
    out = model_path(models_dir, shape)
    return [
        sys.executable,
        str(SCRIPT),
        "--out",
        str(out),
        "--layers",
        str(shape["layers"]),
        "--experts",
        str(shape["experts"]),
        "--topk",
        str(shape["topk"]),
    ]
