"""The drift grid: arms x sweep points x seeds over one recipe, and the runs it plans.

A grid file (YAML; every key optional, the default grid is `DEFAULT_GRID`):

    seeds: [1, 2, 3]                 # run.seed of each repeat
    set: {run.steps: 30}             # recipe overrides of every run
    arms:                            # name: overrides, or name: null for a built-in arm
      grpo_r2: null
      my_arm: {algo.loss: grpo, algo.clip_high: 0.28}
    sweeps:                          # each varies its fields around the base point
      - {name: off_policy, field: algo.updates_per_batch, values: [1, 2, 8], arms: [grpo]}
      - {name: deep, points: [{base_model.layers: 8, algo.updates_per_batch: 8}]}
    launcher: []                     # runs `-m megatron_rl.cli train RECIPE`: python (default),
                                     # or torchrun and its options ($NAME: from the environment)
    threads: 1                       # torch threads per run

The base point is the recipe with `set`; every arm runs there. A sweep point runs the sweep's
arms (all by default) with its fields changed; a point equal to the base point is the base
point. Fields are dotted recipe keys, or `base_model.layers` / `base_model.experts` /
`base_model.topk`: a model of another shape, built by the tiny-model script (base_models.py).
"""

from __future__ import annotations

import dataclasses
import enum
import json
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from megatron_rl.config import ConfigError, load_config, read_yaml_mapping
from megatron_rl.files.hf_checkpoint import read_config
from megatron_rl.models.families import family_for
from megatron_rl.trainer.recipe import Recipe

# The algorithm of each built-in arm, in full, so that the recipe's own algo choices never leak
# into an arm (clip None: the loss's paper default).
_ALGO_DEFAULTS = {
    "algo.clip_low": None,
    "algo.clip_high": None,
    "algo.mismatch": "none",
    "algo.mismatch_level": None,
    "algo.mismatch_lower": None,
    "algo.mismatch_upper": None,
    "optim.freeze_router": False,
}
BUILTIN_ARMS: dict[str, dict[str, Any]] = {
    "grpo": {"algo.loss": "grpo", "algo.routing_replay": "none"},
    "grpo_r2": {"algo.loss": "grpo", "algo.routing_replay": "r2"},
    "grpo_r3": {"algo.loss": "grpo", "algo.routing_replay": "r3"},
    "gspo": {"algo.loss": "gspo", "algo.routing_replay": "none"},
    "gspo_engine_logp": {
        "algo.loss": "gspo",
        "algo.routing_replay": "none",
        "algo.mismatch": "bypass",
    },
    "gspo_token": {"algo.loss": "gspo_token", "algo.routing_replay": "none"},
    "sspo": {"algo.loss": "sspo", "algo.routing_replay": "none"},
    # what peers' example configs do without saying: the routers are not trained
    "grpo_frozen_router": {
        "algo.loss": "grpo",
        "algo.routing_replay": "none",
        "optim.freeze_router": True,
    },
    # the mismatch corrections of the train-vs-engine studies
    "grpo_tis": {"algo.loss": "grpo", "algo.routing_replay": "none", "algo.mismatch": "tis"},
    "grpo_mis_geometric": {
        "algo.loss": "grpo",
        "algo.routing_replay": "none",
        "algo.mismatch": "mis",
        "algo.mismatch_level": "geometric",
    },
}

# The arms of the first grid (docs/benchmarks/drift), before the papers' regime was sought.
ORIGINAL_ARMS = ("grpo", "grpo_r2", "grpo_r3", "gspo", "gspo_engine_logp", "gspo_token", "sspo")

SHAPE_FIELDS = ("base_model.layers", "base_model.experts", "base_model.topk")
# What the default CPU grid costs: ~1.2 s per step of the tiny recipe on one thread, so a
# 30-step run takes ~50 s with start-up; depth 8 twice that. See docs/drift.md.
DEFAULT_GRID: dict[str, Any] = {
    "seeds": [1, 2, 3],
    "set": {
        "run.steps": 30,
        "run.eval_every": 5,
        "data.eval_problems": 64,
        "checkpoint.save_every": 0,
        "checkpoint.export_hf": False,
        "metrics.console": False,
        "metrics.wandb": "disabled",
        "metrics.routing_probe": True,
    },
    "arms": dict.fromkeys(ORIGINAL_ARMS),
    "sweeps": [
        {
            "name": "off_policy",
            "field": "algo.updates_per_batch",
            "values": [1, 2, 4, 8],
            "arms": ["grpo", "grpo_r2", "gspo"],
        },
        {
            "name": "depth",
            "field": "base_model.layers",
            "values": [2, 4, 8],
            "arms": ["grpo", "grpo_r2", "gspo"],
        },
        {
            "name": "lr",
            "field": "optim.lr",
            "values": [4.0e-4],
            "arms": ["grpo", "grpo_r2", "gspo"],
        },
        {
            # The papers' regime through depth and staleness together, not the step size.
            "name": "deep_off_policy",
            "points": [{"base_model.layers": 8, "algo.updates_per_batch": 8}],
            "arms": ["grpo", "grpo_r2", "gspo"],
        },
    ],
}

_GRID_KEYS = ("seeds", "set", "arms", "sweeps", "launcher", "threads")
_SWEEP_KEYS = ("name", "field", "values", "points", "arms")


class GridError(ConfigError):
    """A grid that cannot run, naming the key and what was expected."""


@dataclass(frozen=True)
class PlannedRun:
    """One run of the grid: its arm, its point (every swept field's value) and seed."""

    run_id: str
    arm: str
    cell: str  # "base" or the sweep point's label
    point: dict[str, Any]  # every swept field of the grid -> this run's value
    seed: int
    overrides: dict[str, Any]  # dotted recipe key -> value
    shape: dict[str, int] | None  # the base model to build, or None for the recipe's
    recipe: (
        Recipe  # the run's recipe, checked (on the recipe's model: the runner sets the built one)
    )


@dataclass(frozen=True)
class DriftGrid:
    """A validated grid over one recipe: the runs it plans and what identifies it."""

    recipe_path: str
    recipe_overrides: list[str]
    seeds: list[int]
    common: dict[str, Any]
    arms: dict[str, dict[str, Any]]
    sweeps: list[dict[str, Any]]
    launcher: list[str]
    threads: int
    base_shape: dict[str, int]
    runs: list[PlannedRun] = field(default_factory=list)

    def identity(self) -> dict[str, Any]:
        """What a results directory must match to be resumed: the grid and the recipe."""
        recipe = Path(self.recipe_path)
        return {
            "recipe": recipe.read_text(),
            "recipe_overrides": self.recipe_overrides,
            "seeds": self.seeds,
            "set": self.common,
            "arms": self.arms,
            "sweeps": self.sweeps,
            "launcher": self.launcher,
            "threads": self.threads,
        }


def load_grid(
    recipe_path: str | Path, grid_path: str | Path | None, overrides: list[str] = ()
) -> DriftGrid:
    """The grid of `grid_path` (the default grid when None) over the recipe with `overrides`,
    every run's recipe checked before anything starts."""
    raw = DEFAULT_GRID
    if grid_path is not None:
        raw = read_yaml_mapping(Path(grid_path), given_as="--grid")
    unknown = sorted(set(raw) - set(_GRID_KEYS))
    if unknown:
        raise GridError(f"grid: unknown key {unknown[0]!r}; valid keys: {', '.join(_GRID_KEYS)}")
    base_recipe = load_config(Recipe, recipe_path, list(overrides))
    seeds = _int_list(raw.get("seeds", [1, 2, 3]), "seeds")
    common = _mapping(raw.get("set", {}), "set")
    arms = _arms(raw.get("arms", dict.fromkeys(ORIGINAL_ARMS)))
    sweeps = [_sweep(entry, index, arms) for index, entry in enumerate(raw.get("sweeps", []))]
    launcher = raw.get("launcher", [])
    if not isinstance(launcher, list) or not all(isinstance(part, str) for part in launcher):
        raise GridError(f"launcher: expected a list of strings, got {launcher!r}")
    threads = raw.get("threads", 1)
    if not isinstance(threads, int) or threads < 1:
        raise GridError(f"threads: expected an integer >= 1, got {threads!r}")
    base_shape = _model_shape(base_recipe.model.hf_path)
    grid = DriftGrid(
        recipe_path=str(recipe_path),
        recipe_overrides=list(overrides),
        seeds=seeds,
        common=common,
        arms=arms,
        sweeps=sweeps,
        launcher=launcher,
        threads=threads,
        base_shape=base_shape,
    )
    grid.runs.extend(_plan(grid))
    return grid


def recipe_for(grid: DriftGrid, run: PlannedRun, model_path: Path | None = None) -> Recipe:
    """The full recipe of `run` (checked), on the model at `model_path` if given."""
    model = {} if model_path is None else {"model.hf_path": str(model_path)}
    return load_config(Recipe, grid.recipe_path, _run_overrides(grid, run.overrides | model))


def _run_overrides(grid: DriftGrid, overrides: dict[str, Any]) -> list[str]:
    return grid.recipe_overrides + override_strings(overrides)


def override_strings(overrides: dict[str, Any]) -> list[str]:
    """Dotted key -> value as the trainer's KEY=VALUE overrides (JSON values, which YAML reads)."""
    return [f"{key}={json.dumps(value)}" for key, value in overrides.items()]


def _int_list(value: Any, key: str) -> list[int]:
    if not isinstance(value, list) or not value or not all(isinstance(v, int) for v in value):
        raise GridError(f"{key}: expected a non-empty list of integers, got {value!r}")
    if len(set(value)) != len(value):
        raise GridError(f"{key}: repeated values in {value!r}")
    return value


def _mapping(value: Any, key: str) -> dict[str, Any]:
    if not isinstance(value, dict) or not all(isinstance(k, str) for k in value):
        raise GridError(f"{key}: expected a mapping of dotted recipe keys to values, got {value!r}")
    return dict(value)


def _arms(value: Any) -> dict[str, dict[str, Any]]:
    if not isinstance(value, dict) or not value:
        raise GridError(
            f"arms: expected a mapping of arm names to overrides (or null), got {value!r}"
        )
    arms = {}
    for name, overrides in value.items():
        if overrides is None:
            if name not in BUILTIN_ARMS:
                raise GridError(
                    f"arms.{name}: unknown arm; built-in arms: {', '.join(BUILTIN_ARMS)} "
                    "(or give its recipe overrides)"
                )
            overrides = BUILTIN_ARMS[name]
        arms[str(name)] = _ALGO_DEFAULTS | _mapping(overrides, f"arms.{name}")
    return arms


def _sweep(entry: Any, index: int, arms: dict[str, dict[str, Any]]) -> dict[str, Any]:
    where = f"sweeps[{index}]"
    if not isinstance(entry, dict):
        raise GridError(f"{where}: expected a mapping with name and field/values or points")
    unknown = sorted(set(entry) - set(_SWEEP_KEYS))
    if unknown:
        raise GridError(
            f"{where}: unknown key {unknown[0]!r}; valid keys: {', '.join(_SWEEP_KEYS)}"
        )
    name = entry.get("name")
    if not isinstance(name, str) or not re.fullmatch(r"[A-Za-z0-9_]+", name):
        raise GridError(f"{where}.name: expected a name of letters, digits and _, got {name!r}")
    if ("field" in entry) == ("points" in entry):
        raise GridError(f"{where} ({name}): give either field and values, or points")
    if "field" in entry:
        values = entry.get("values")
        if not isinstance(values, list) or not values:
            raise GridError(f"{where}.values ({name}): expected a non-empty list")
        points = [{entry["field"]: value} for value in values]
    else:
        points = entry["points"]
        if not isinstance(points, list) or not points:
            raise GridError(f"{where}.points ({name}): expected a non-empty list of mappings")
        points = [_mapping(point, f"{where}.points[{i}]") for i, point in enumerate(points)]
    sweep_arms = entry.get("arms", list(arms))
    if not isinstance(sweep_arms, list) or not sweep_arms:
        raise GridError(f"{where}.arms ({name}): expected a non-empty list of arm names")
    for arm in sweep_arms:
        if arm not in arms:
            raise GridError(
                f"{where}.arms ({name}): {arm!r} is not an arm of the grid ({', '.join(arms)})"
            )
    for point in points:
        for key, value in point.items():
            if key in SHAPE_FIELDS and (not isinstance(value, int) or value < 1):
                raise GridError(f"{where} ({name}): {key} expects an integer >= 1, got {value!r}")
    return {"name": name, "points": points, "arms": sweep_arms}


def _model_shape(hf_path: str) -> dict[str, int]:
    """The shape of the model at `hf_path`, as its family reads its config.json."""
    hf_config = read_config(Path(hf_path), given_as="model.hf_path")
    config = family_for(hf_config).config_from_hf(hf_config)
    return {"layers": config.num_layers, "experts": config.num_experts, "topk": config.router_topk}


def _plan(grid: DriftGrid) -> list[PlannedRun]:
    """Every run, base point first; each recipe checked, each run once."""
    swept = list(dict.fromkeys(key for s in grid.sweeps for p in s["points"] for key in p))
    base = _base_values(grid, swept)
    cells: dict[str, tuple[dict[str, Any], list[str]]] = {"base": (base, list(grid.arms))}
    for sweep in grid.sweeps:
        for point in sweep["points"]:
            values = base | point
            label = "base" if values == base else _label(point)
            _, arms = cells.setdefault(label, (values, []))
            arms.extend(arm for arm in sweep["arms"] if arm not in arms)
    runs, seen = [], set()
    for label, (values, arms) in cells.items():
        for arm in arms:
            for seed in grid.seeds:
                run = _planned(grid, arm, label, values, seed, base)
                if run.run_id not in seen:
                    seen.add(run.run_id)
                    runs.append(run)
    return runs


def _base_values(grid: DriftGrid, swept: list[str]) -> dict[str, Any]:
    """Each swept field's value at the base point: the recipe's (and the recipe model's shape)."""
    common = override_strings(grid.common)
    recipe = load_config(Recipe, grid.recipe_path, grid.recipe_overrides + common)
    values = {}
    for key in swept:
        if key in SHAPE_FIELDS:
            values[key] = grid.base_shape[key.split(".")[1]]
            continue
        values[key] = _recipe_value(recipe, key)
    return values


def _recipe_value(recipe: Recipe, key: str) -> Any:
    node: Any = recipe
    for depth, part in enumerate(key.split(".")):
        names = (
            [item.name for item in dataclasses.fields(node)]
            if dataclasses.is_dataclass(node)
            else []
        )
        if part not in names:
            where = ".".join(key.split(".")[: depth + 1])
            valid = ", ".join(names) if names else "none: it is a value"
            raise GridError(
                f"sweep field {key}: {where} is not a recipe field (valid here: {valid}; or one "
                f"of {', '.join(SHAPE_FIELDS)})"
            )
        node = getattr(node, part)
    return node.value if isinstance(node, enum.Enum) else node


def _label(point: dict[str, Any]) -> str:
    return "__".join(f"{key.split('.')[-1]}={value}" for key, value in point.items())


def _planned(
    grid: DriftGrid, arm: str, label: str, values: dict[str, Any], seed: int, base: dict[str, Any]
) -> PlannedRun:
    shape = None
    overrides = dict(grid.common) | grid.arms[arm]
    for key, value in values.items():
        if key not in SHAPE_FIELDS:
            overrides[key] = value
    wanted = grid.base_shape | {k.split(".")[1]: v for k, v in values.items() if k in SHAPE_FIELDS}
    if wanted != grid.base_shape:
        shape = wanted
    run_id = f"{arm}--{label}--seed{seed}"
    overrides["run.seed"] = seed
    overrides["run.name"] = run_id
    try:
        recipe = load_config(Recipe, grid.recipe_path, _run_overrides(grid, overrides))
    except ConfigError as error:
        raise GridError(f"arm {arm}, point {label}: {error}") from None
    return PlannedRun(run_id, arm, label, values, seed, overrides, shape, recipe)
