"""The optimizer's part of a training checkpoint: megatron-core's `sharded_state_dict` and
`load_state_dict`, with what megatron-core 0.16.1 needs around them for the distributed optimizer
under torch's Adam (no Transformer Engine or Apex: the CPU, and GPU images without them).

The distributed optimizer's state is saved bucket by bucket as it lies on the ranks
(`dp_reshardable`, Megatron-LM's default): no gathering, resharding only over DP. megatron-core's
own default, `fully_sharded_model_space`, cannot be saved: dist_checkpointing refuses its
flattened tensors ("ShardedTensor.flattened_range is not supported").
"""

from __future__ import annotations

from typing import Any

import torch
from megatron.core.dist_checkpointing.mapping import ShardedStateDict
from megatron.core.optimizer import MegatronOptimizer
from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer

SHARDING = {"distrib_optim_sharding_type": "dp_reshardable"}


def is_distributed(optimizer: MegatronOptimizer) -> bool:
    """True when `optimizer` (or any optimizer it chains) is megatron-core's distributed one."""
    return any(isinstance(inner, DistributedOptimizer) for inner in _optimizers(optimizer))


def optimizer_sharded_state_dict(
    optimizer: MegatronOptimizer, model_state: ShardedStateDict, *, is_loading: bool
) -> dict[str, Any]:
    """The optimizer's sharded state for dist_checkpointing, beside the model's `model_state`."""
    if is_loading:
        _allocate_state(optimizer)
    return optimizer.sharded_state_dict(model_state, is_loading=is_loading, metadata=SHARDING)


def load_optimizer_state(optimizer: MegatronOptimizer, loaded: dict[str, Any]) -> None:
    """Put the state dist_checkpointing loaded into `optimizer`."""
    # The distributed optimizer copies fp32 main weights in place into views of the parameters.
    with torch.no_grad():
        optimizer.load_state_dict(loaded)
    _restore_step_counts(optimizer)


def _optimizers(optimizer: MegatronOptimizer) -> list[MegatronOptimizer]:
    return list(getattr(optimizer, "chained_optimizers", [optimizer]))


def _allocate_state(optimizer: MegatronOptimizer) -> None:
    """Give a distributed optimizer that has not stepped yet its Adam state, to load into.

    `DistributedOptimizer.state_dict` reads the step count from the per-weight state
    (optimizer/distrib_optimizer.py:640-642) and fails on an optimizer that has none yet.
    megatron-core fills such a state with placeholder values (a step on zero gradients) before
    loading in its FSDP path; the same is done here, and the checkpoint then overwrites every
    value.
    """
    for inner in _optimizers(optimizer):
        if isinstance(inner, DistributedOptimizer) and not inner.optimizer.state:
            inner._init_optimizer_states_with_dummy_values()


def _restore_step_counts(optimizer: MegatronOptimizer) -> None:
    """Set each weight's Adam step count from the checkpoint after a distributed optimizer
    loaded its state.

    The step count is saved in the param groups, and `DistributedOptimizer.load_state_dict`
    restores it there and into one step tensor shared by every weight
    (optimizer/distrib_optimizer.py:825). Loading the parameter state then copies the step this
    optimizer had before loading over it (:1664 keeps the step out of the checkpoint, :940 copies
    it back), and torch's Adam would advance a shared step once per weight. Either way the bias
    correction after a resume would differ from an uninterrupted run's. Each weight gets its own
    step tensor, with the checkpoint's value.
    """
    for inner in _optimizers(optimizer):
        if not isinstance(inner, DistributedOptimizer):
            continue
        adam = inner.optimizer
        for group in adam.param_groups:
            for weight in group["params"]:
                state = adam.state.get(weight, {})
                if "step" in state and "step" in group:
                    state["step"] = torch.tensor(float(group["step"]), dtype=state["step"].dtype)
