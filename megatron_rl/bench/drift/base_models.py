"""Base models of other shapes for the drift grid's `base_model.*` fields, built by the tiny-model
script (examples/moe/make_tiny_model.py) and kept in a cache directory shared by every results
directory; the default grid's models are shipped, as built, in examples/moe/drift_models/
(`SHIPPED`), and used from there: a rebuild on another machine need not round alike, and the
checked-in report ran on these. A model is either a named shape of the script
(`base_model.shape`: `{"shape": name}`, the papers'-regime models with the load balancing they
keep in RL) or a plain variant of the shipped tiny model (`base_model.layers` / `experts` /
`topk`: `{"layers": .., "experts": .., "topk": ..}`, built with the script's defaults, the way
the shipped 4-layer model was made)."""

from __future__ import annotations

import functools
import hashlib
import importlib.util
import json
import sys
from pathlib import Path
from typing import Any

import megatron_rl

SCRIPT = Path(megatron_rl.__file__).resolve().parents[1] / "examples" / "moe" / "make_tiny_model.py"
SHIPPED = SCRIPT.parent / "drift_models"
VARIANT_KEYS = ("layers", "experts", "topk")


def _script_path() -> Path:
    if not SCRIPT.is_file():
        raise FileNotFoundError(
            f"{SCRIPT}: the tiny-model script, which base_model.* fields need, is not there "
            "(run from a checkout of megatron-rl)"
        )
    return SCRIPT


@functools.cache
def named_shapes() -> tuple[str, ...]:
    """The script's named shapes (its `SHAPES`), the values `base_model.shape` takes."""
    name = "megatron_rl_examples_make_tiny_model"
    spec = importlib.util.spec_from_file_location(name, _script_path())
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # its dataclasses look their module up there
    spec.loader.exec_module(module)
    return tuple(module.SHAPES)


def shape_name(shape: dict[str, Any]) -> str:
    """The cache entry of `shape`: a named shape's name, or e.g. `layers8-experts8-topk2`."""
    if "shape" in shape:
        return str(shape["shape"])
    return "-".join(f"{key}{shape[key]}" for key in VARIANT_KEYS)


def model_path(models_dir: Path, shape: dict[str, Any]) -> Path:
    """Where the model of `shape` is: shipped, or in the cache `models_dir`."""
    shipped = SHIPPED / shape_name(shape)
    return shipped if _is_whole(shipped) else models_dir / shape_name(shape)


def is_built(models_dir: Path, shape: dict[str, Any]) -> bool:
    return _is_whole(model_path(models_dir, shape))


def _is_whole(model: Path) -> bool:
    # The script renames its staging directory into place when done: a path that exists is whole.
    return (model / "config.json").is_file()


def build_command(models_dir: Path, shape: dict[str, Any]) -> list[str]:
    """The command that builds `shape` into the cache (seed 0, the script's defaults)."""
    command = [sys.executable, str(_script_path()), "--out", str(models_dir / shape_name(shape))]
    if "shape" in shape:
        return [*command, "--shape", str(shape["shape"])]
    for key in VARIANT_KEYS:
        command += [f"--{key}", str(shape[key])]
    return command


def rl_options(model_dir: Path) -> dict[str, Any]:
    """The recipe overrides a built model needs in RL (its `training.json`'s `rl_options`: the
    load balancing of a named shape, e.g. `model.aux_loss_coeff`); none for other models."""
    path = model_dir / "training.json"
    if not path.is_file():
        return {}
    options = json.loads(path.read_text()).get("rl_options", {})
    if not isinstance(options, dict):
        raise ValueError(f"{path}: rl_options: expected a mapping of recipe keys, got {options!r}")
    return options


def weights_digest(model_dir: Path) -> str:
    """sha256 of the model's weights (its safetensors files, by name): what tells one build of a
    shape from another (a rebuild on another machine need not round alike)."""
    digest = hashlib.sha256()
    files = sorted(model_dir.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"{model_dir}: no *.safetensors weights")
    for path in files:
        digest.update(path.name.encode() + b"\0")
        with path.open("rb") as weights:
            for block in iter(lambda: weights.read(1 << 20), b""):
                digest.update(block)
    return digest.hexdigest()
