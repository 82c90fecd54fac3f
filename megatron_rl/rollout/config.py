"""The recipe's `rollout` section: sampling, the engine that samples, and weight sync."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal, get_args

from megatron_rl.config import ConfigError, check_positive
from megatron_rl.rollout.sglang.config import SGLangConfig

EngineDtype = Literal["float32", "bfloat16", "float8_emulated"]
"""The local engine's precisions (RolloutConfig.engine_dtype)."""
FlipAt = Literal["margin", "random"]
"""Which tokens' routes the local engine flips (RolloutConfig.flip_routes_at)."""


@dataclass(frozen=True, kw_only=True)
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
    local_process: bool = False
    """Run the local engine in a child process of its own (no GIL shared with the trainer;
    weights and samples go over shared memory) rather than in the trainer's rank-0 process
    (docs/training.md, Asynchronous rollouts)."""
    engine_dtype: EngineDtype = "float32"
    """The local engine's weights and activations: bfloat16 makes its probabilities differ from
    a float32 trainer's as a production engine's do (SGLang's own: rollout.sglang.dtype);
    float8_emulated rounds every linear layer's weights (128x128 blocks) and inputs (per token,
    groups of 128), routers included, to FP8 e4m3 as FP8 engines do, computing in float32
    (megatron_rl.rollout.fp8_emulation)."""
    flip_routes: float = 0.0
    """The local engine flips this share of the tokens' routes at every router call of a
    generation (the k-th expert for the (k+1)-th), a set dose of routing mismatch with the
    trainer (megatron_rl.rollout.route_flips; softmax top-k routers). 0: none."""
    flip_routes_at: FlipAt = "margin"
    """Which tokens' routes rollout.flip_routes flips: margin, those whose k-th and (k+1)-th
    router logits are closest (as a low-precision engine does), or random (the control)."""
    sync_bucket_mb: int = 512
    """Weight sync bucket size in MiB (tensors per transfer)."""
    probe_every: int = 1
    """Check the engine's log-probs of a fixed probe sequence against the trainer's after every
    k-th weight sync; 0 never checks."""
    probe_tolerance: float = 0.02
    """Largest mean |engine - trainer| log-prob on the probe before the run stops (bf16
    engines differ by ~1e-2; stale weights by more)."""
    dynamic_sampling: bool = False
    """DAPO's dynamic sampling: leave out groups whose rewards are all equal and generate groups
    of further problems until the step has prompts_per_step groups that carry a gradient (at
    most max_generation_rounds rounds)."""
    max_generation_rounds: int = 3
    """With dynamic_sampling: generation rounds per step at most, the first included; after
    the last the step trains on the groups it has (counted in dynamic/short)."""
    overlong_buffer: int = 0
    """DAPO's soft overlong punishment: a response's reward falls linearly from 0 to -1 over the
    last this many tokens before max_new_tokens (0: off)."""
    max_staleness: int = 0
    """Asynchronous rollouts: the policy versions a step's samples may lag behind. 0:
    lock-step (generate, then train); k > 0: the engine generates the samples of step t + k + 1
    while the trainer trains step t + 1 (k = 1: one step off-policy; docs/training.md,
    Asynchronous rollouts)."""
    partial_rollouts: bool = False
    """With max_staleness > 0: a weight sync that finds a generation in flight pauses it, loads
    the new weights and lets it go on with them (each token marked with the version that
    generated it), rather than wait for it to finish with the old ones (docs/training.md,
    Partial rollouts)."""
    sglang: SGLangConfig = field(default_factory=SGLangConfig)
    """SGLang servers, for backend=sglang."""

    def validate(self) -> None:
        check_positive(
            "rollout",
            self,
            "prompts_per_step",
            "max_new_tokens",
            "max_batch_size",
            "sync_bucket_mb",
            "probe_tolerance",
        )
        if self.engine_dtype not in get_args(EngineDtype):  # a config built in code
            raise ConfigError(
                f"rollout.engine_dtype: expected one of {', '.join(get_args(EngineDtype))}, "
                f"got {self.engine_dtype!r}"
            )
        if self.max_staleness < 0:
            raise ConfigError(
                f"rollout.max_staleness: expected >= 0 (0: lock-step), got {self.max_staleness}"
            )
        if self.local_process and self.backend != "local":
            raise ConfigError(
                f"rollout.local_process: runs the local engine in a process of its own; "
                f"rollout.backend={self.backend} has its own servers"
            )
        if self.partial_rollouts and self.max_staleness == 0:
            raise ConfigError(
                "rollout.partial_rollouts: needs rollout.max_staleness >= 1 (in lock-step no "
                "generation is in flight when the weights are synced)"
            )
        if not 0 <= self.flip_routes < 1:
            raise ConfigError(
                f"rollout.flip_routes: expected a share in [0, 1), got {self.flip_routes}"
            )
        if self.flip_routes_at not in get_args(FlipAt):  # a config built in code
            raise ConfigError(
                f"rollout.flip_routes_at: expected margin or random, got {self.flip_routes_at!r}"
            )
        if self.flip_routes and self.backend != "local":
            raise ConfigError(
                f"rollout.flip_routes: the local engine flips routes; rollout.backend="
                f"{self.backend} does not"
            )
        if self.probe_every < 0:
            raise ConfigError(f"rollout.probe_every: expected >= 0, got {self.probe_every}")
        if self.max_generation_rounds < 1:
            raise ConfigError(
                f"rollout.max_generation_rounds: expected >= 1, got {self.max_generation_rounds}"
            )
        if not 0 <= self.overlong_buffer < self.max_new_tokens:
            raise ConfigError(
                f"rollout.overlong_buffer: expected 0 (off) up to rollout.max_new_tokens - 1 = "
                f"{self.max_new_tokens - 1}, got {self.overlong_buffer}"
            )
        if self.group_size < 2:
            raise ConfigError(
                f"rollout.group_size: expected >= 2, got {self.group_size} (advantages are "
                "relative to the prompt's group; one sample has no group mean or std)"
            )
        if self.temperature < 0:
            raise ConfigError(f"rollout.temperature: expected >= 0, got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise ConfigError(f"rollout.top_p: expected a value in (0, 1], got {self.top_p}")
