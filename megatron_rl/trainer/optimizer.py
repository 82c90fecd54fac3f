"""What the recipe's `optim` section (`optimizer_config.py`) builds: megatron-core's DDP wrapper,
its Adam (plain or distributed) and the learning-rate schedule."""

from __future__ import annotations

from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
from megatron.core.models.gpt import GPTModel
from megatron.core.optimizer import MegatronOptimizer, OptimizerConfig, get_megatron_optimizer
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
