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
    stop_at_collapse: false          # stop each run at its first collapse event
    claims: [1, 2, ..., 21]          # the claims the report checks (claims/; default these)

The base point is the recipe with `set`; every arm runs there. A sweep point runs the sweep's
arms (all by default) with its fields changed; a point equal to the base point is the base
point. Fields are dotted recipe keys, or the base model's: `base_model.shape` (a named shape of
the tiny-model script, e.g. `fine_qwen3`, with the RL options its load balancing needs), or
`base_model.layers` / `base_model.experts` / `base_model.topk` (a variant of the recipe's
model), built by the tiny-model script (base_models.py); `set` may give them too.
"""

from __future__ import annotations

import dataclasses
import enum
import json
import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from megatron_rl.bench.drift import base_models
from megatron_rl.bench.drift.claims import CLAIMS, DRIFT_CLAIMS
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
    "algo.mismatch_mask_level": None,
    "algo.mismatch_mask_lower": None,
    "algo.mismatch_mask_upper": None,
    "optim.freeze_router": False,
}
GEOMETRIC_BAND = (0.999, 1.001)
BUILTIN_ARMS: dict[str, dict[str, Any]] = {
    "grpo": {"algo.loss": "grpo", "algo.routing_replay": "none"},
    "grpo_r2": {"algo.loss": "grpo", "algo.routing_replay": "r2"},
    "grpo_r3": {"algo.loss": "grpo", "algo.routing_replay": "r3"},
    "grpo_r3_weights": {"algo.loss": "grpo", "algo.routing_replay": "r3_weights"},
    "gspo": {"algo.loss": "gspo", "algo.routing_replay": "none"},
    "gspo_r2": {"algo.loss": "gspo", "algo.routing_replay": "r2"},
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
    # The geometric band of the mismatch studies' examples, [0.999, 1.001]: MIS's default
    # [0, 2] never masked in the 128-expert grid (the largest geometric ratio was 1.106, the
    # lower end 0 cannot act), so that arm duplicated plain GRPO (issue 51). The fire rate
    # (mis_masked_frac in summary.csv) says how often this one acts.
    "grpo_mis_geometric": {
        "algo.loss": "grpo",
        "algo.routing_replay": "none",
        "algo.mismatch": "mis",
        "algo.mismatch_level": "geometric",
        "algo.mismatch_lower": GEOMETRIC_BAND[0],
        "algo.mismatch_upper": GEOMETRIC_BAND[1],
    },
    # both at once: token TIS masked by the geometric band, the recipe that kept the public
    # Qwen3-30B-A3B runs of the mismatch studies from collapsing
    "grpo_tis_mis_geometric": {
        "algo.loss": "grpo",
        "algo.routing_replay": "none",
        "algo.mismatch": "tis",
        "algo.mismatch_mask_level": "geometric",
        "algo.mismatch_mask_lower": GEOMETRIC_BAND[0],
        "algo.mismatch_mask_upper": GEOMETRIC_BAND[1],
    },
}

# The arms of the first grid (docs/benchmarks/drift-tiny), before the papers' regime was
# sought.
ORIGINAL_ARMS = ("grpo", "grpo_r2", "grpo_r3", "gspo", "gspo_engine_logp", "gspo_token", "sspo")

VARIANT_FIELDS = ("base_model.layers", "base_model.experts", "base_model.topk")
# The base model's fields: a named shape of the tiny-model script, or a variant of the recipe's.
SHAPE_FIELDS = (*VARIANT_FIELDS, "base_model.shape")
# The default CPU grid, in the papers' regime (issue 36): the fine-grained Qwen3-MoE-shaped model
# at 128 experts (of width 16, top-8, 8 layers, the aux loss on at 0.3; `base_model.shape:
# fine_qwen3_e128`) at the largest learning rate the pilots found the dense control stable at
# (3e-4; at 1e-3 the dense control collapses too). Its pilots: ~5.3% of activated experts differ
# from the old policy's after each update at 4 updates per batch over 25 steps, against ~1.7% of
# the 64-expert fine_qwen3 at aux 0.01 (docs/drift.md). The routing probe is on. Off-policy
# degrees run with a bfloat16 engine (as production engines are), where R3 differs from R2; the
# float32 engine (the base point) is the zero-mismatch oracle.
REGIME_LR = 3.0e-4
_PAPERS_SET: dict[str, Any] = {
    "base_model.shape": "fine_qwen3_e128",
    "optim.lr": REGIME_LR,
    "run.steps": 25,
    "run.eval_every": 5,
    "data.eval_problems": 64,
    "checkpoint.save_every": 0,
    "checkpoint.export_hf": False,
    "metrics.console": False,
    "metrics.wandb": "disabled",
    "metrics.routing_probe": True,
}
# The engines' log-probs differ from the float32 trainer's on the weight-sync probe by about
# 0.01 (bfloat16) and 0.1 (float8 emulated): the probe's tolerance is set above that.
BF16_ENGINE = {"rollout.engine_dtype": "bfloat16", "rollout.probe_tolerance": 0.2}
FP8_ENGINE = {"rollout.engine_dtype": "float8_emulated", "rollout.probe_tolerance": 0.5}
OFF_POLICY_ARMS = ["grpo", "grpo_r2", "grpo_r3", "gspo"]
DEFAULT_GRID: dict[str, Any] = {
    "seeds": [1, 2, 3],
    "set": _PAPERS_SET,
    "arms": dict.fromkeys(
        [
            "grpo",
            "grpo_r2",
            "grpo_r3",
            "gspo",
            "gspo_r2",
            "gspo_engine_logp",
            "gspo_token",
            "sspo",
            "grpo_frozen_router",
            "grpo_tis",
            "grpo_mis_geometric",
            "grpo_tis_mis_geometric",
        ]
    ),
    # At the base point's float32 engine R3 equals R2 and the corrections are 1: those arms run
    # in the low-precision points only.
    "base_arms": [
        "grpo",
        "grpo_r2",
        "gspo",
        "gspo_r2",
        "gspo_engine_logp",
        "gspo_token",
        "sspo",
        "grpo_frozen_router",
    ],
    "sweeps": [
        {
            "name": "off_policy",
            "points": [BF16_ENGINE | {"algo.updates_per_batch": n} for n in (1, 2, 4, 8)],
            "arms": OFF_POLICY_ARMS,
        },
        {
            "name": "fp8_engine",
            "points": [FP8_ENGINE],
            "arms": [*OFF_POLICY_ARMS, "grpo_tis", "grpo_mis_geometric", "grpo_tis_mis_geometric"],
        },
        {
            "name": "sigmoid_router",
            "field": "base_model.shape",
            "values": ["fine_deepseek_e128"],
            "arms": ["grpo", "grpo_r2", "gspo"],
        },
        {
            "name": "dense",
            "field": "base_model.shape",
            "values": ["dense_control"],
            "arms": ["grpo", "gspo"],
        },
    ],
}

# `--quick`: one seed, 12 steps, the fewest runs that give every claim a verdict (at lower
# confidence: no seed spread). 14 min 17 s with --jobs 2 on 2 cores (docs/drift.md).
QUICK_GRID: dict[str, Any] = {
    "seeds": [1],
    "set": _PAPERS_SET | {"run.steps": 12, "run.eval_every": 4},
    "arms": dict.fromkeys(
        [
            "grpo",
            "grpo_r2",
            "gspo",
            "gspo_engine_logp",
            "grpo_frozen_router",
            "grpo_r3",
            "grpo_tis",
            "grpo_mis_geometric",
            "grpo_tis_mis_geometric",
        ]
    ),
    "base_arms": ["grpo", "grpo_r2", "gspo", "gspo_engine_logp", "grpo_frozen_router"],
    "sweeps": [
        {
            "name": "on_policy",
            "points": [BF16_ENGINE | {"algo.updates_per_batch": n} for n in (1, 2)],
            "arms": ["grpo", "grpo_r2"],
        },
        {
            "name": "off_policy",
            "points": [BF16_ENGINE | {"algo.updates_per_batch": n} for n in (4, 8)],
            "arms": ["grpo", "grpo_r2", "grpo_r3"],
        },
        {
            "name": "fp8_engine",
            "points": [FP8_ENGINE],
            "arms": ["grpo", "grpo_r3", "grpo_tis", "grpo_mis_geometric", "grpo_tis_mis_geometric"],
        },
        {
            "name": "other_models",
            "field": "base_model.shape",
            "values": ["fine_deepseek_e128", "dense_control"],
            "arms": ["grpo"],
        },
    ],
}

_GRID_KEYS = (
    "seeds",
    "set",
    "arms",
    "base_arms",
    "sweeps",
    "launcher",
    "threads",
    "stop_at_collapse",
    "claims",
)
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
    shape: dict[str, Any] | None  # the base model to build (base_models), or None: the recipe's
    recipe: (
        Recipe  # the run's recipe, checked (on the recipe's model: the runner sets the built one)
    )


@dataclass(frozen=True)
class DriftGrid:
    """A validated grid over one recipe: the runs it plans and what identifies it."""

    recipe_path: str
    recipe_overrides: list[str]
    seeds: list[int]
    common: dict[str, Any]  # `set`'s recipe overrides
    arms: dict[str, dict[str, Any]]
    base_arms: list[str]  # the arms of the base point
    sweeps: list[dict[str, Any]]
    launcher: list[str]
    threads: int
    base_shape: dict[str, int]  # the recipe model's layers, experts, topk
    base_model: dict[str, Any] = field(default_factory=dict)  # `set`'s base_model.* fields
    # stop a run at its first collapse event (collapse.py): a survival experiment's runs need
    # no steps past it
    stop_at_collapse: bool = False
    # the claims its report checks, by number (claims/); not part of its identity: they change
    # what is read from the runs, not the runs
    claims: tuple[int, ...] = DRIFT_CLAIMS
    runs: list[PlannedRun] = field(default_factory=list)

    def identity(self) -> dict[str, Any]:
        """What a results directory must match to be resumed: the grid and the recipe."""
        recipe = Path(self.recipe_path)
        # a grid whose base point runs every arm is identified as before base_arms existed
        base_arms = {} if self.base_arms == list(self.arms) else {"base_arms": self.base_arms}
        # and one that runs every step as before stop_at_collapse existed
        stops = {"stop_at_collapse": True} if self.stop_at_collapse else {}
        return (
            base_arms
            | stops
            | {
                "recipe": recipe.read_text(),
                "recipe_overrides": self.recipe_overrides,
                "seeds": self.seeds,
                "set": self.common | self.base_model,
                "arms": self.arms,
                "sweeps": self.sweeps,
                "launcher": self.launcher,
                "threads": self.threads,
            }
        )


# A grid: a grid file, a grid already read (QUICK_GRID), or None for DEFAULT_GRID.
GridSource = str | Path | Mapping[str, Any] | None


def load_grid(recipe_path: str | Path, grid: GridSource, overrides: list[str] = ()) -> DriftGrid:
    """The grid `grid` over the recipe with `overrides`, every run's recipe checked before
    anything starts."""
    if grid is None:
        raw = DEFAULT_GRID
    elif isinstance(grid, Mapping):
        raw = grid
    else:
        raw = read_yaml_mapping(Path(grid), given_as="--grid")
    unknown = sorted(set(raw) - set(_GRID_KEYS))
    if unknown:
        raise GridError(f"grid: unknown key {unknown[0]!r}; valid keys: {', '.join(_GRID_KEYS)}")
    base_recipe = load_config(Recipe, recipe_path, list(overrides))
    seeds = _int_list(raw.get("seeds", [1, 2, 3]), "seeds")
    common = _mapping(raw.get("set", {}), "set")
    base_model = {key: common.pop(key) for key in list(common) if key in SHAPE_FIELDS}
    for key, value in base_model.items():
        _check_model_field(key, value, "set")
    arms = _arms(raw.get("arms", dict.fromkeys(ORIGINAL_ARMS)))
    base_arms = _arm_list(raw.get("base_arms", list(arms)), arms, "base_arms")
    sweeps = [_sweep(entry, index, arms) for index, entry in enumerate(raw.get("sweeps", []))]
    model_fields = {*base_model, *(key for s in sweeps for p in s["points"] for key in p)}
    if "base_model.shape" in model_fields and model_fields & set(VARIANT_FIELDS):
        raise GridError(
            "base_model.shape: a named shape fixes layers, experts and topk; a grid sets or "
            f"sweeps either it or {', '.join(VARIANT_FIELDS)}"
        )
    launcher = raw.get("launcher", [])
    if not isinstance(launcher, list) or not all(isinstance(part, str) for part in launcher):
        raise GridError(f"launcher: expected a list of strings, got {launcher!r}")
    threads = raw.get("threads", 1)
    if not isinstance(threads, int) or threads < 1:
        raise GridError(f"threads: expected an integer >= 1, got {threads!r}")
    stop_at_collapse = raw.get("stop_at_collapse", False)
    if not isinstance(stop_at_collapse, bool):
        raise GridError(f"stop_at_collapse: expected true or false, got {stop_at_collapse!r}")
    claims = raw.get("claims", list(DRIFT_CLAIMS))
    if not isinstance(claims, list) or not all(
        isinstance(n, int) and 1 <= n <= len(CLAIMS) for n in claims
    ):
        raise GridError(
            f"claims: expected a list of claim numbers 1 .. {len(CLAIMS)}, got {claims!r}"
        )
    base_shape = _model_shape(base_recipe.model.hf_path)
    grid = DriftGrid(
        recipe_path=str(recipe_path),
        recipe_overrides=list(overrides),
        seeds=seeds,
        common=common,
        arms=arms,
        base_arms=base_arms,
        sweeps=sweeps,
        launcher=launcher,
        threads=threads,
        base_shape=base_shape,
        base_model=base_model,
        stop_at_collapse=stop_at_collapse,
        claims=tuple(claims),
    )
    grid.runs.extend(_plan(grid))
    return grid


# Every run's, whatever the grid: nothing resumes a run past its end (an interrupted run starts
# afresh), so it saves no final checkpoint. Not part of the grid's identity: it changes no number.
RUN_SET: dict[str, Any] = {"checkpoint.save_last": False}


def recipe_for(grid: DriftGrid, run: PlannedRun, model_path: Path | None = None) -> Recipe:
    """The full recipe of `run` (checked), on the model at `model_path` if given, with the RL
    options that model keeps (`base_models.rl_options`: a named shape's load balancing)."""
    model = {}
    if model_path is not None:
        model = base_models.rl_options(model_path) | {"model.hf_path": str(model_path)}
    return load_config(Recipe, grid.recipe_path, _run_overrides(grid, run.overrides | model))


def _run_overrides(grid: DriftGrid, overrides: dict[str, Any]) -> list[str]:
    return grid.recipe_overrides + override_strings(overrides | RUN_SET)


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
    sweep_arms = _arm_list(entry.get("arms", list(arms)), arms, f"{where}.arms ({name})")
    for point in points:
        for key, value in point.items():
            if key in SHAPE_FIELDS:
                _check_model_field(key, value, f"{where} ({name})")
    return {"name": name, "points": points, "arms": sweep_arms}


def _arm_list(value: Any, arms: dict[str, dict[str, Any]], where: str) -> list[str]:
    if not isinstance(value, list) or not value:
        raise GridError(f"{where}: expected a non-empty list of arm names")
    for arm in value:
        if arm not in arms:
            raise GridError(f"{where}: {arm!r} is not an arm of the grid ({', '.join(arms)})")
    return value


def _check_model_field(key: str, value: Any, where: str) -> None:
    if key == "base_model.shape":
        shapes = base_models.named_shapes()
        if value not in shapes:
            raise GridError(
                f"{where}: base_model.shape expects one of the tiny-model script's shapes "
                f"({', '.join(shapes)}), got {value!r}"
            )
    elif not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise GridError(f"{where}: {key} expects an integer >= 1, got {value!r}")


def _model_shape(hf_path: str) -> dict[str, int]:
    """The shape of the model at `hf_path`, as its family reads its config.json."""
    hf_config = read_config(Path(hf_path), given_as="model.hf_path")
    config = family_for(hf_config).config_from_hf(hf_config)
    return {"layers": config.num_layers, "experts": config.num_experts, "topk": config.router_topk}


def _plan(grid: DriftGrid) -> list[PlannedRun]:
    """Every run, base point first; each recipe checked, each run once."""
    swept = list(dict.fromkeys(key for s in grid.sweeps for p in s["points"] for key in p))
    base = _base_values(grid, swept)
    cells: dict[str, tuple[dict[str, Any], list[str]]] = {"base": (base, list(grid.base_arms))}
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
        if key in grid.base_model:
            values[key] = grid.base_model[key]
        elif key == "base_model.shape":
            values[key] = None  # the recipe's own model
        elif key in VARIANT_FIELDS:
            values[key] = grid.base_shape[key.split(".")[1]]
        else:
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


def _shape(grid: DriftGrid, fields: dict[str, Any]) -> dict[str, Any] | None:
    """The base model of a run from its base_model.* fields: a named shape, a variant of the
    recipe's model, or None for the recipe's model itself."""
    if fields.get("base_model.shape") is not None:
        return {"shape": fields["base_model.shape"]}
    variant = {k.split(".")[1]: v for k, v in fields.items() if k in VARIANT_FIELDS}
    wanted = grid.base_shape | variant
    return None if wanted == grid.base_shape else wanted


def _label(point: dict[str, Any]) -> str:
    return "__".join(f"{key.split('.')[-1]}={value}" for key, value in point.items())


def _planned(
    grid: DriftGrid, arm: str, label: str, values: dict[str, Any], seed: int, base: dict[str, Any]
) -> PlannedRun:
    overrides = dict(grid.common) | grid.arms[arm]
    for key, value in values.items():
        if key not in SHAPE_FIELDS:
            overrides[key] = value
    shape = _shape(grid, grid.base_model | {k: v for k, v in values.items() if k in SHAPE_FIELDS})
    run_id = f"{arm}--{label}--seed{seed}"
    overrides["run.seed"] = seed
    overrides["run.name"] = run_id
    try:
        recipe = load_config(Recipe, grid.recipe_path, _run_overrides(grid, overrides))
    except ConfigError as error:
        raise GridError(f"arm {arm}, point {label}: {error}") from None
    return PlannedRun(run_id, arm, label, values, seed, overrides, shape, recipe)
