"""Typed configuration: dataclasses with a docstring per field, YAML recipes, dotted overrides.

`load_config(RecipeClass, "recipe.yaml", ["algo.loss=gspo", "algo.clip_high=4e-4"])` builds the
nested dataclasses from the YAML mapping, applies the overrides, converts every value to its
field's type and runs each section's `validate()`. An unknown key fails naming the nearest valid
ones; a value of the wrong type names the dotted key and the expected type. Nothing heavy starts
before the whole recipe is valid.
"""

from __future__ import annotations

import dataclasses
import difflib
import types
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal, TypeVar

import yaml

from megatron_rl.algo import LOSS_AGG_MODES, policy_loss_names

T = TypeVar("T")


class ConfigError(ValueError):
    """A recipe or override that cannot be used, with the dotted key it concerns."""


def _nearest(name: str, valid: list[str]) -> str:
    close = difflib.get_close_matches(name, valid, n=3, cutoff=0.5)
    hint = f"; did you mean {' or '.join(repr(c) for c in close)}?" if close else ""
    return f"valid keys: {', '.join(valid)}{hint}"


def _convert(value: Any, kind: Any, key: str) -> Any:
    """`value` as type `kind` (YAML scalars and override strings alike)."""
    origin = typing.get_origin(kind)
    if origin is Literal:
        choices = typing.get_args(kind)
        if value not in choices:
            raise ConfigError(
                f"{key}: expected one of {', '.join(map(repr, choices))}, got {value!r}"
            )
        return value
    if origin in (types.UnionType, typing.Union):
        options = typing.get_args(kind)
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
    if dataclasses.is_dataclass(kind):
        if not isinstance(value, dict):
            raise ConfigError(f"{key}: expected a mapping of {kind.__name__} fields, got {value!r}")
        return _build(kind, value, key)
    if kind is bool:
        if isinstance(value, bool):
            return value
        if isinstance(value, str) and value.lower() in ("true", "false"):
            return value.lower() == "true"
        raise ConfigError(f"{key}: expected true or false, got {value!r}")
    if kind is int:
        if isinstance(value, int) and not isinstance(value, bool):
            return value
        if isinstance(value, str) and value.strip().lstrip("-").isdigit():
            return int(value)
        raise ConfigError(f"{key}: expected an int, got {value!r}")
    if kind is float:
        try:
            if isinstance(value, bool) or not isinstance(value, int | float | str):
                raise ValueError
            return float(value)
        except ValueError:
            raise ConfigError(f"{key}: expected a number, got {value!r}") from None
    if kind is str:
        if not isinstance(value, str):
            raise ConfigError(f"{key}: expected a string, got {value!r}")
        return value
    if origin is list:
        (item,) = typing.get_args(kind)
        if not isinstance(value, list):
            raise ConfigError(f"{key}: expected a list, got {value!r}")
        return [_convert(entry, item, f"{key}[{index}]") for index, entry in enumerate(value)]
    if origin is dict:
        key_kind, value_kind = typing.get_args(kind)
        if not isinstance(value, dict):
            raise ConfigError(f"{key}: expected a mapping, got {value!r}")
        return {
            _convert(name, key_kind, key): _convert(entry, value_kind, f"{key}.{name}")
            for name, entry in value.items()
        }
    raise ConfigError(f"{key}: unsupported field type {kind!r}")


def _build(cls: type[T], values: dict[str, Any], prefix: str = "") -> T:
    hints = typing.get_type_hints(cls)
    names = [f.name for f in dataclasses.fields(cls)]
    unknown = [key for key in values if key not in names]
    if unknown:
        where = f"{prefix}.{unknown[0]}" if prefix else unknown[0]
        raise ConfigError(f"{where}: unknown key; {_nearest(unknown[0], names)}")
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
            where = ".".join(parts[: depth + 1])
            raise ConfigError(f"{where}: unknown key; {_nearest(part, names)}")
        if depth == len(parts) - 1:
            node[part] = yaml.safe_load(raw) if raw.strip() else raw
            return
        kind = typing.get_type_hints(kind)[part]
        if not dataclasses.is_dataclass(kind):
            raise ConfigError(f"{'.'.join(parts[: depth + 1])}: is a value, not a section")
        node = node.setdefault(part, {})


def _validate(config: Any) -> None:
    for item in dataclasses.fields(config):
        value = getattr(config, item.name)
        if dataclasses.is_dataclass(value):
            _validate(value)
    check = getattr(config, "validate", None)
    if check is not None:
        check()


def load_config(cls: type[T], recipe: str | Path | None, overrides: list[str] = ()) -> T:
    """The recipe `cls` from a YAML file (or defaults when None) with dotted overrides."""
    tree: dict[str, Any] = {}
    if recipe is not None:
        path = Path(recipe)
        if not path.is_file():
            raise ConfigError(f"recipe {path}: no such file")
        try:
            tree = yaml.safe_load(path.read_text()) or {}
        except yaml.YAMLError as error:
            raise ConfigError(f"recipe {path}: not valid YAML ({error})") from None
        if not isinstance(tree, dict):
            raise ConfigError(f"recipe {path}: expected a mapping at the top level")
    for override in overrides:
        _apply_override(tree, cls, override)
    config = _build(cls, tree)
    _validate(config)
    return config


@dataclass(kw_only=True)
class AlgoConfig:
    """The policy-optimisation algorithm."""

    loss: str = "gspo"
    """Policy loss, one of megatron_rl.algo.policy_loss_names()."""
    clip_low: float | None = None
    """Lower clip half-width; None takes the loss's default (docs/algorithms.md)."""
    clip_high: float | None = None
    """Upper clip half-width; None takes the loss's default."""
    loss_agg: str = "seq-mean-token-mean"
    """How token objectives become the loss (docs/algorithms.md, Aggregation)."""
    routing_replay: Literal["none", "r2", "r3"] = "none"
    """none; r2: replay the old policy's routing; r3: replay the rollout engine's routing."""
    updates_per_batch: int = 4
    """Minibatch updates per rollout batch (the GSPO paper uses 4)."""
    use_engine_logprobs: bool = False
    """Take old log-probs from the rollout engine instead of a trainer forward."""
    std_normalize: bool = True
    """Divide group advantages by the group's std (GRPO); false: Dr. GRPO's mean-centring only."""
    drop_zero_variance_groups: bool = False
    """Leave out groups whose rewards are all equal (they carry no gradient; always counted)."""

    def validate(self) -> None:
        if self.loss not in policy_loss_names():
            raise ConfigError(
                f"algo.loss: unknown loss {self.loss!r}; valid: {', '.join(policy_loss_names())}"
            )
        if self.loss_agg not in LOSS_AGG_MODES:
            raise ConfigError(
                f"algo.loss_agg: unknown mode {self.loss_agg!r}; valid: {', '.join(LOSS_AGG_MODES)}"
            )
        for name in ("clip_low", "clip_high"):
            value = getattr(self, name)
            if value is not None and value < 0:
                raise ConfigError(f"algo.{name}: expected >= 0, got {value}")
        if self.updates_per_batch < 1:
            raise ConfigError(
                f"algo.updates_per_batch: expected >= 1, got {self.updates_per_batch}"
            )


@dataclass(kw_only=True)
class ParallelConfig:
    """How the model is split; dp is derived from the world size (megatron_rl.parallel.dims)."""

    tp: int = 1
    """Tensor parallel size."""
    pp: int = 1
    """Pipeline parallel size."""
    ep: int = 1
    """Expert parallel size."""
    cp: int = 1
    """Context parallel size."""
    etp: int | None = None
    """Expert tensor parallel size (each expert's weights split over etp ranks); None takes tp.
    With tp > 1, etp=1 keeps each expert whole and spreads the experts by ep instead."""

    def validate(self) -> None:
        for name in ("tp", "pp", "ep", "cp", "etp"):
            value = getattr(self, name)
            if value is not None and value < 1:
                raise ConfigError(f"parallel.{name}: expected a positive int, got {value}")


def _positive(section: str, config: Any, *names: str) -> None:
    for name in names:
        value = getattr(config, name)
        if value <= 0:
            raise ConfigError(f"{section}.{name}: expected > 0, got {value}")


@dataclass(kw_only=True)
class ModelConfig:
    """The policy: a Hugging Face MoE checkpoint, loaded into Megatron-Core."""

    hf_path: str = "examples/moe/tiny_qwen3_moe"
    """Directory of the Hugging Face checkpoint (config.json, safetensors, tokenizer files)."""
    dispatcher: Literal["alltoall", "allgather"] = "alltoall"
    """Megatron-Core's MoE token dispatcher."""
    recompute: bool = False
    """Recompute activations in the backward pass (less memory, more time)."""


@dataclass(kw_only=True)
class SGLangConfig:
    """SGLang servers (rollout.backend=sglang); docs/sglang.md."""

    urls: list[str] = field(default_factory=list)
    """Servers someone else started (e.g. a SLURM job step), as http://host:port; empty: the
    trainer starts num_servers servers itself and stops them at the end."""
    router_url: str | None = None
    """An sglang-router in front of the servers, used for generation (weights go to urls)."""
    num_servers: int = 1
    """Servers the trainer starts (data-parallel rollout)."""
    host: str = "127.0.0.1"
    """Address the started servers listen on."""
    base_port: int = 30000
    """Port of the first started server; server i listens on base_port + i."""
    tp_size: int = 1
    """Tensor-parallel size of each server."""
    ep_size: int = 1
    """Expert-parallel size of each server."""
    mem_fraction_static: float = 0.8
    """SGLang's --mem-fraction-static (weights + KV cache share of device memory)."""
    dtype: str = "auto"
    """SGLang's --dtype (auto takes the checkpoint's)."""
    python: str = ""
    """Interpreter that runs sglang.launch_server; empty: the trainer's own."""
    extra_args: list[str] = field(default_factory=list)
    """More sglang.launch_server arguments, e.g. ["--device", "cpu"]."""
    env: dict[str, str] = field(default_factory=dict)
    """Environment variables added for the started servers only."""
    startup_timeout_s: float = 300.0
    """Longest wait for a started server to answer /health."""
    request_deadline_s: float = 120.0
    """How long a request that fails transiently (503, refused, timeout) is retried."""
    weight_sync: Literal["disk", "tensor", "distributed"] = "tensor"
    """disk (/update_weights_from_disk), tensor (same host, shared memory) or distributed
    (a process group with the servers: NCCL on GPU, gloo on CPU)."""
    weight_dir: str = ""
    """Where weight_sync=disk writes (must be visible to the servers); empty: RUN_DIR/sglang."""
    master_address: str = "127.0.0.1"
    """The trainer's address as the servers reach it (weight_sync=distributed)."""

    def validate(self) -> None:
        _positive(
            "rollout.sglang",
            self,
            "num_servers",
            "tp_size",
            "ep_size",
            "mem_fraction_static",
            "startup_timeout_s",
            "request_deadline_s",
        )
        for url in self.urls + ([self.router_url] if self.router_url else []):
            if not url.startswith(("http://", "https://")):
                raise ConfigError(f"rollout.sglang.urls: {url!r} is not http://host:port")


@dataclass(kw_only=True)
class RolloutConfig:
    """Sampling responses from the current policy."""

    backend: Literal["local", "sglang"] = "local"
    """Rollout engine: local (in-process Hugging Face model; CPU runs and tests) or sglang
    (SGLang servers, rollout.sglang)."""
    prompts_per_step: int = 16
    """Prompts sampled per RL step."""
    group_size: int = 8
    """Responses per prompt (the group of group-relative advantages)."""
    temperature: float = 1.0
    """Sampling temperature (log-probs are always taken at temperature 1)."""
    top_p: float = 1.0
    """Nucleus sampling threshold."""
    max_new_tokens: int = 48
    """Longest response in tokens."""
    max_batch_size: int = 256
    """Sequences the local engine generates at once."""
    sync_bucket_mb: int = 512
    """Weight sync bucket size in MiB (tensors per transfer)."""
    probe_every: int = 1
    """Check the engine's log-probs of a fixed probe sequence against the trainer's after every
    k-th weight sync; 0 never checks."""
    probe_tolerance: float = 0.02
    """Largest mean |engine - trainer| log-prob on the probe before the run stops (bf16
    engines differ by ~1e-2; stale weights by more)."""
    sglang: SGLangConfig = field(default_factory=SGLangConfig)
    """SGLang servers, for backend=sglang."""

    def validate(self) -> None:
        _positive(
            "rollout",
            self,
            "prompts_per_step",
            "max_new_tokens",
            "max_batch_size",
            "sync_bucket_mb",
            "probe_tolerance",
        )
        if self.probe_every < 0:
            raise ConfigError(f"rollout.probe_every: expected >= 0, got {self.probe_every}")
        if self.group_size < 2:
            raise ConfigError(
                f"rollout.group_size: expected >= 2, got {self.group_size} (advantages are "
                "relative to the prompt's group; one sample has no group mean or std)"
            )
        if self.temperature < 0:
            raise ConfigError(f"rollout.temperature: expected >= 0, got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise ConfigError(f"rollout.top_p: expected a value in (0, 1], got {self.top_p}")


@dataclass(kw_only=True)
class OptimConfig:
    """Megatron-Core's Adam."""

    lr: float = 1e-5
    """Learning rate (constant after warm-up)."""
    warmup_steps: int = 0
    """Optimizer steps of linear warm-up from 0."""
    weight_decay: float = 0.0
    """Decoupled weight decay."""
    clip_grad: float = 1.0
    """Global gradient-norm clip."""
    adam_beta1: float = 0.9
    """Adam beta1."""
    adam_beta2: float = 0.999
    """Adam beta2."""
    adam_eps: float = 1e-8
    """Adam epsilon."""
    distributed_optimizer: bool = True
    """Shard Adam's moments and the fp32 main weights over data-parallel ranks (megatron-core's
    distributed optimizer): each rank keeps 1/DP of the optimizer state. Used only when the
    layout has data-parallel copies (dp * cp > 1 or edp > 1). Off: every data-parallel rank
    keeps all of it."""

    def validate(self) -> None:
        _positive("optim", self, "lr", "clip_grad", "adam_eps")
        if self.warmup_steps < 0 or self.weight_decay < 0:
            raise ConfigError("optim.warmup_steps and optim.weight_decay: expected >= 0")


@dataclass(kw_only=True)
class DataConfig:
    """Prompts, references and the verifier that scores responses."""

    source: Literal["arithmetic", "jsonl"] = "arithmetic"
    """arithmetic: the built-in multi-step task; jsonl: `train_path` / `eval_path` files."""
    train_path: str | None = None
    """JSONL file with one {"prompt": ..., "answer": ...} per line (source=jsonl)."""
    eval_path: str | None = None
    """JSONL file of held-out problems (source=jsonl)."""
    verifier: str = "arithmetic"
    """Reward function, one of megatron_rl.rewards.verifier_names()."""
    reward_timeout_s: float = 5.0
    """A verifier call longer than this gives reward 0 (counted as a timeout)."""
    eval_problems: int = 256
    """Held-out problems scored at each evaluation (the first N of the eval split)."""
    min_operands: int = 3
    """Arithmetic task: fewest numbers in an expression."""
    max_operands: int = 4
    """Arithmetic task: most numbers in an expression."""
    max_operand: int = 30
    """Arithmetic task: largest number."""

    def validate(self) -> None:
        from megatron_rl.rewards import verifier_names

        if self.verifier not in verifier_names():
            raise ConfigError(
                f"data.verifier: unknown verifier {self.verifier!r}; valid: "
                f"{', '.join(verifier_names())}"
            )
        if self.source == "jsonl" and not (self.train_path and self.eval_path):
            raise ConfigError("data.train_path and data.eval_path: required when source=jsonl")
        _positive("data", self, "reward_timeout_s", "eval_problems")


@dataclass(kw_only=True)
class RunConfig:
    """The run: length, seeds, batching, where it writes."""

    name: str = "run"
    """Run name (wandb, log lines)."""
    dir: str = "runs/run"
    """Run directory: metrics.jsonl, checkpoints/, export/, wandb/."""
    steps: int = 100
    """RL steps (one rollout batch each)."""
    seed: int = 1234
    """Seed of data order, sampling and initialisation."""
    eval_every: int = 10
    """Held-out accuracy every this many steps (and before the first step and after the last)."""
    micro_batch_size: int = 32
    """Sequences per forward/backward pass (gradient accumulation makes up the minibatch)."""
    max_bad_steps: int = 3
    """Consecutive steps with a non-finite loss or gradient (skipped) before the run aborts."""

    def validate(self) -> None:
        _positive("run", self, "steps", "eval_every", "micro_batch_size", "max_bad_steps")


@dataclass(kw_only=True)
class MetricsConfig:
    """Where per-step metrics go."""

    jsonl: bool = True
    """Append every step's metrics to RUN_DIR/metrics.jsonl."""
    console: bool = True
    """Progress bar with ETA and the headline metrics."""
    wandb: Literal["auto", "online", "offline", "disabled"] = "disabled"
    """wandb logging: auto (online with WANDB_API_KEY, else offline), online, offline, disabled."""
    wandb_project: str = "megatron-rl"
    """wandb project."""


@dataclass(kw_only=True)
class CheckpointConfig:
    """Distributed checkpoints of the whole training state, and the final export."""

    save_every: int = 0
    """Save every this many steps (0: only at the end)."""
    keep: int = 2
    """Checkpoints kept on disk (the newest ones)."""
    export_hf: bool = True
    """Export the final policy to RUN_DIR/export as a Hugging Face checkpoint."""

    def validate(self) -> None:
        if self.save_every < 0 or self.keep < 1:
            raise ConfigError("checkpoint.save_every: expected >= 0; checkpoint.keep: >= 1")


@dataclass(kw_only=True)
class Recipe:
    """A training recipe: every section of `megatron-rl train RECIPE`."""

    model: ModelConfig = field(default_factory=ModelConfig)
    """The policy model."""
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    """The parallel layout."""
    rollout: RolloutConfig = field(default_factory=RolloutConfig)
    """Sampling."""
    algo: AlgoConfig = field(default_factory=AlgoConfig)
    """The algorithm."""
    optim: OptimConfig = field(default_factory=OptimConfig)
    """The optimizer."""
    data: DataConfig = field(default_factory=DataConfig)
    """Prompts and rewards."""
    run: RunConfig = field(default_factory=RunConfig)
    """Length, seeds, batching, run directory."""
    metrics: MetricsConfig = field(default_factory=MetricsConfig)
    """Metric sinks."""
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    """Checkpoints and export."""

    def validate(self) -> None:
        if self.parallel.cp > 1:
            raise ConfigError(
                "parallel.cp: the trainer does not split sequences yet (model-level context "
                "parallelism needs Transformer Engine's attention; docs/parallelism.md)"
            )
        if self.algo.routing_replay == "r2" and self.algo.use_engine_logprobs:
            raise ConfigError(
                "algo.routing_replay=r2 records routing in the trainer's old-policy forward, "
                "which algo.use_engine_logprobs=true skips; use r3 or turn one off"
            )
