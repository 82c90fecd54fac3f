"""Typed configuration: dataclasses with a docstring per field, YAML recipes, dotted overrides.

`load_config(Recipe, "recipe.yaml", ["algo.loss=gspo", "algo.clip_high=4e-4"])` builds the
nested dataclasses from the YAML mapping, applies the overrides, converts every value to its
field's type and runs each section's `validate()`. An unknown key fails naming the nearest valid
ones; a value of the wrong type names the dotted key and the expected type. Nothing heavy starts
before the whole recipe is valid.

This module knows no section: each component defines its own (`megatron_rl.models.config.
ModelConfig`, `megatron_rl.rollout.config.RolloutConfig`, ...), with each option's default in that
one place, and `megatron_rl.trainer.recipe.Recipe` puts them together.
"""

from __future__ import annotations

import dataclasses
import difflib
import enum
import math
import types
import typing
from pathlib import Path
from typing import Any, Literal, TypeVar

import yaml

T = TypeVar("T")


class ConfigError(ValueError):
    """A recipe or override that cannot be used, with the dotted key it concerns."""


def _nearest(name: str, valid: list[str]) -> str:
    close = difflib.get_close_matches(name, valid, n=3, cutoff=0.5)
    hint = f"; did you mean {' or '.join(repr(c) for c in close)}?" if close else ""
    return f"valid keys: {', '.join(valid)}{hint}"


def _unknown_key(cls: type, name: str, where: str) -> ConfigError:
    """The error for key `name` of section `cls`: what replaced it, when the section says
    (a `RENAMED` class attribute: old key -> what to write instead), or the nearest keys."""
    renamed = getattr(cls, "RENAMED", {})
    if name in renamed:
        return ConfigError(f"{where}: no longer a key; {renamed[name]}")
    names = [f.name for f in dataclasses.fields(cls)]
    return ConfigError(f"{where}: unknown key; {_nearest(name, names)}")


def _choice(value: Any, choices: tuple[Any, ...], key: str) -> Any:
    if value not in choices:
        raise ConfigError(f"{key}: expected one of {', '.join(map(repr, choices))}, got {value!r}")
    return value


def _to_bool(value: Any, key: str) -> bool:
    if isinstance(value, bool):
        return value
    if isinstance(value, str) and value.lower() in ("true", "false"):
        return value.lower() == "true"
    raise ConfigError(f"{key}: expected true or false, got {value!r}")


def _to_int(value: Any, key: str) -> int:
    if isinstance(value, int) and not isinstance(value, bool):
        return value
    if isinstance(value, str) and value.strip().lstrip("-").isdigit():
        return int(value)
    raise ConfigError(f"{key}: expected an int, got {value!r}")


def _to_float(value: Any, key: str) -> float:
    try:
        if isinstance(value, bool) or not isinstance(value, int | float | str):
            raise ValueError
        number = float(value)
    except ValueError:
        raise ConfigError(f"{key}: expected a number, got {value!r}") from None
    # nan passes every range check (each comparison is false), and no option means inf
    if not math.isfinite(number):
        raise ConfigError(f"{key}: expected a finite number, got {value!r}")
    return number


def _to_str(value: Any, key: str) -> str:
    if not isinstance(value, str):
        raise ConfigError(f"{key}: expected a string, got {value!r}")
    return value


_SCALARS = {bool: _to_bool, int: _to_int, float: _to_float, str: _to_str}


def _to_union(value: Any, options: tuple[Any, ...], key: str) -> Any:
    """The first of `options` that `value` converts to (None for "none" or "null")."""
    is_none = value is None or (isinstance(value, str) and value.lower() in ("none", "null"))
    if is_none and type(None) in options:
        return None
    errors = []
    for option in options:
        if option is type(None):
            continue
        try:
            return _convert(value, option, key)
        except ConfigError as error:
            errors.append(str(error))
    raise ConfigError(errors[0] if errors else f"{key}: got {value!r}")


def _convert(value: Any, kind: Any, key: str) -> Any:
    """`value` as type `kind` (YAML scalars and override strings alike)."""
    origin, args = typing.get_origin(kind), typing.get_args(kind)
    if origin is Literal:
        return _choice(value, args, key)
    if isinstance(kind, type) and issubclass(kind, enum.Enum):
        return kind(_choice(value, tuple(member.value for member in kind), key))
    if origin in (types.UnionType, typing.Union):
        return _to_union(value, args, key)
    if dataclasses.is_dataclass(kind):
        if not isinstance(value, dict):
            raise ConfigError(f"{key}: expected a mapping of {kind.__name__} fields, got {value!r}")
        return _build(kind, value, key)
    if kind in _SCALARS:
        return _SCALARS[kind](value, key)
    if origin is list:
        if not isinstance(value, list):
            raise ConfigError(f"{key}: expected a list, got {value!r}")
        return [_convert(entry, args[0], f"{key}[{index}]") for index, entry in enumerate(value)]
    if origin is dict:
        if not isinstance(value, dict):
            raise ConfigError(f"{key}: expected a mapping, got {value!r}")
        return {
            _convert(name, args[0], key): _convert(entry, args[1], f"{key}.{name}")
            for name, entry in value.items()
        }
    raise ConfigError(f"{key}: unsupported field type {kind!r}")


def _build(cls: type[T], values: dict[str, Any], prefix: str = "") -> T:
    hints = typing.get_type_hints(cls)
    names = [f.name for f in dataclasses.fields(cls)]
    unknown = [key for key in values if key not in names]
    if unknown:
        raise _unknown_key(cls, unknown[0], f"{prefix}.{unknown[0]}" if prefix else unknown[0])
    kwargs = {}
    for name, value in values.items():
        key = f"{prefix}.{name}" if prefix else name
        kwargs[name] = _convert(value, hints[name], key)
    try:
        return cls(**kwargs)
    except TypeError as error:
        raise ConfigError(f"{prefix or cls.__name__}: {error}") from None


def _apply_override(tree: dict[str, Any], cls: type, override: str) -> None:
    if "=" not in override:
        raise ConfigError(f"override {override!r}: expected key=value, e.g. algo.loss=gspo")
    dotted, raw = override.split("=", 1)
    parts = dotted.strip().split(".")
    node, kind = tree, cls
    for depth, part in enumerate(parts):
        names = [f.name for f in dataclasses.fields(kind)]
        if part not in names:
            raise _unknown_key(kind, part, ".".join(parts[: depth + 1]))
        if depth == len(parts) - 1:
            node[part] = yaml.safe_load(raw) if raw.strip() else raw
            return
        kind = typing.get_type_hints(kind)[part]
        if not dataclasses.is_dataclass(kind):
            raise ConfigError(f"{'.'.join(parts[: depth + 1])}: is a value, not a section")
        node = node.setdefault(part, {})
        if not isinstance(node, dict):
            where = ".".join(parts[: depth + 1])
            raise ConfigError(
                f"{where}: expected a mapping of {kind.__name__} fields, got {node!r}"
            )


def _validate(config: Any) -> None:
    for item in dataclasses.fields(config):
        value = getattr(config, item.name)
        if dataclasses.is_dataclass(value):
            _validate(value)
    check = getattr(config, "validate", None)
    if check is not None:
        check()


def read_yaml_mapping(path: Path, *, given_as: str) -> dict[str, Any]:
    """The YAML mapping in `path`; errors name it as `given_as` (`recipe`, `--grid`). An empty
    file is refused: one that sets nothing is more likely a mistake than a wish for every
    default."""
    if not path.is_file():
        raise ConfigError(f"{given_as} {path}: no such file")
    try:
        tree = yaml.safe_load(path.read_text(encoding="utf-8"))
    except UnicodeDecodeError as error:
        raise ConfigError(
            f"{given_as} {path}: not UTF-8 text (byte {error.start}: {error.reason})"
        ) from None
    except yaml.YAMLError as error:
        raise ConfigError(f"{given_as} {path}: not valid YAML ({error})") from None
    if tree is None:
        raise ConfigError(f"{given_as} {path}: empty (comments at most); expected a mapping")
    if not isinstance(tree, dict):
        raise ConfigError(f"{given_as} {path}: expected a mapping at the top level")
    return tree


def load_config(cls: type[T], recipe: str | Path | None, overrides: list[str] = ()) -> T:
    """The recipe `cls` from a YAML file (or defaults when None) with dotted overrides."""
    tree = {} if recipe is None else read_yaml_mapping(Path(recipe), given_as="recipe")
    for override in overrides:
        _apply_override(tree, cls, override)
    config = _build(cls, tree)
    _validate(config)
    return config


def check_positive(section: str, config: Any, *names: str) -> None:
    """Raise a ConfigError naming `section.name` for each field of `names` that is not > 0."""
    for name in names:
        value = getattr(config, name)
        if value <= 0:
            raise ConfigError(f"{section}.{name}: expected > 0, got {value}")
