"""The recipe's `optim` section (kept apart from `optimizer.py`, which imports megatron-core, so
that a recipe is checked in a moment)."""

from __future__ import annotations

from dataclasses import dataclass

from megatron_rl.config import ConfigError, check_positive


@dataclass(frozen=True, kw_only=True)
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
    freeze_router: bool = False
    """Leave the MoE routers' weights out of training (the expert-bias of sigmoid routers is
    not a weight: model.router_bias_update_rate moves it). Routing still changes as the layers
    below the router change; the drift harness's `grpo_frozen_router` arm measures how much."""

    def validate(self) -> None:
        check_positive("optim", self, "lr", "clip_grad", "adam_eps")
        if self.warmup_steps < 0 or self.weight_decay < 0:
            raise ConfigError("optim.warmup_steps and optim.weight_decay: expected >= 0")
        for name in ("adam_beta1", "adam_beta2"):
            value = getattr(self, name)
            if not 0 <= value < 1:
                raise ConfigError(f"optim.{name}: expected in [0, 1), got {value}")
