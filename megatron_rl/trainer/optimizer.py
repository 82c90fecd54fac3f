"""What the recipe's `optim` section (`optimizer_config.py`) builds: megatron-core's DDP wrapper,
its Adam (plain or distributed) and the learning-rate schedule."""

from __future__ import annotations

import math
from typing import NamedTuple

from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
from megatron.core.models.gpt import GPTModel
from megatron.core.optimizer import MegatronOptimizer, OptimizerConfig, get_megatron_optimizer
from megatron.core.optimizer import optimizer as megatron_optimizer
from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler

from megatron_rl.trainer.optimizer_config import OptimConfig


def wrap_for_training(model: GPTModel, *, distributed_optimizer: bool) -> DistributedDataParallel:
    """Megatron-Core's DDP wrapper: gradients in fp32 `main_grad` buffers, reduced over DP in
    `finalize_model_grads` (no averaging: the policy loss brings its own global denominator).

    With `distributed_optimizer` the gradients are reduce-scattered instead of all-reduced (a
    rank's `main_grad` is then the full gradient only on its own 1/DP shard), and the optimizer
    built on this wrapper (`build_optimizer`) keeps Adam's state and the fp32 main weights of that
    shard only, all-gathering the updated weights after each step. Code that reads whole
    gradients from `main_grad` needs it off.
    """
    ddp_config = DistributedDataParallelConfig(
        grad_reduce_in_fp32=True,
        overlap_grad_reduce=False,
        use_distributed_optimizer=distributed_optimizer,
        average_in_collective=False,
    )
    return DistributedDataParallel(config=model.config, ddp_config=ddp_config, module=model)


def build_optimizer(model: DistributedDataParallel, config: OptimConfig) -> MegatronOptimizer:
    """Megatron-Core's Adam; the distributed optimizer when `model` was wrapped for it."""
    optimizer_config = OptimizerConfig(
        optimizer="adam",
        lr=config.lr,
        weight_decay=config.weight_decay,
        clip_grad=config.clip_grad,
        adam_beta1=config.adam_beta1,
        adam_beta2=config.adam_beta2,
        adam_eps=config.adam_eps,
        bf16=model.config.bf16,
        params_dtype=model.config.params_dtype,
        use_distributed_optimizer=model.ddp_config.use_distributed_optimizer,
    )
    return get_megatron_optimizer(optimizer_config, [model])


def build_scheduler(optimizer: MegatronOptimizer, config: OptimConfig) -> OptimizerParamScheduler:
    """Linear warm-up over `warmup_steps` optimizer steps, then the constant learning rate."""
    return OptimizerParamScheduler(
        optimizer,
        init_lr=0.0 if config.warmup_steps else config.lr,
        max_lr=config.lr,
        min_lr=config.lr,
        lr_warmup_steps=config.warmup_steps,
        lr_decay_steps=config.warmup_steps + 1,
        lr_decay_style="constant",
        start_wd=config.weight_decay,
        end_wd=config.weight_decay,
        wd_incr_steps=1,
        wd_incr_style="constant",
    )


class OptimizerStep(NamedTuple):
    grad_norm: float  # of the whole gradient, before clipping (all ranks agree)
    taken: bool  # False: the loss or the gradient norm was not finite, and no step was taken


def step_if_finite(optimizer: MegatronOptimizer, *, loss: float) -> OptimizerStep:
    """The optimizer step from the gradients in the parameters' `main_grad`, unless `loss` (the
    global loss, the same on every rank) or the gradient norm is not finite: then the weights
    and Adam's state stay as they are and the next update's zero_grad drops the gradients.

    Megatron-core's `step()` runs the same stages (prepare the gradients, their norm, the clip,
    the inner step) but decides only on a loss scaler's overflow check, which float32 and
    bfloat16 runs do not have: it would apply a NaN gradient. Calling its stages here prepares
    the gradients and computes their norm once per update. A collective: every rank calls it.
    """
    found_inf = optimizer.prepare_grads()
    grad_norm = float(optimizer.get_grad_norm())
    if found_inf or not (math.isfinite(loss) and math.isfinite(grad_norm)):
        return OptimizerStep(grad_norm, taken=False)
    # As megatron-core's step() clips: each part (the dense and the expert parameters' optimizer)
    # by the norm of the whole gradient, with the function by the name its step calls (which
    # parallel/cpu_compat replaces on the host).
    for part in getattr(optimizer, "chained_optimizers", [optimizer]):
        if getattr(part, "is_stub_optimizer", False) or part.config.clip_grad <= 0:
            continue
        parameters = part.get_parameters()
        if parameters:
            megatron_optimizer.clip_grad_by_total_norm_fp32(
                parameters,
                max_norm=part.config.clip_grad,
                total_norm=grad_norm,
                use_decoupled_grad=part.config.use_precision_aware_optimizer_no_fp8_or_ds_fp8,
            )
    optimizer.step_with_ready_grads()
    return OptimizerStep(grad_norm, taken=True)
