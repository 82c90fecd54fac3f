"""Worker for the model-building test (one process)."""

from __future__ import annotations

import torch
from megatron.core.transformer.moe.moe_layer import MoELayer
from megatron.core.transformer.moe.router import TopKRouter

from megatron_rl.algo import PolicyLossSpec
from megatron_rl.models import build
from megatron_rl.models.build import build_gpt_moe
from megatron_rl.models.config import MoEModelConfig
from megatron_rl.parallel.dims import ParallelDims
from megatron_rl.parallel.distributed import LaunchEnv, init_distributed
from megatron_rl.trainer.micro_batch import PolicyMicroBatch
from megatron_rl.trainer.optimizer import build_optimizer, wrap_for_training
from megatron_rl.trainer.optimizer_config import OptimConfig
from megatron_rl.trainer.schedule import policy_forward_backward


def build_and_step(launch: LaunchEnv, config: MoEModelConfig) -> dict:
    dims = ParallelDims(world_size=1)
    init_distributed(dims, launch)
    model = build_gpt_moe(config, dims)
    params = {name: tuple(p.shape) for name, p in model.named_parameters()}
    tokens = torch.randint(0, config.vocab_size, (2, 12))
    logits = model(tokens, torch.arange(12).expand(2, 12), attention_mask=None)

    ddp = wrap_for_training(model, distributed_optimizer=True)  # one rank: its shard is all
    optimizer = build_optimizer(ddp, OptimConfig(lr=1e-2))
    mask = torch.zeros(2, 12, dtype=torch.bool)
    mask[:, 4:11] = True
    batch = PolicyMicroBatch(tokens, mask, torch.full((2, 12), -5.0), torch.tensor([1.0, -1.0]))
    spec = PolicyLossSpec.of("gspo", clip_low=3e-4, clip_high=4e-4)
    before = {n: p.detach().clone() for n, p in ddp.module.named_parameters()}
    ddp.zero_grad_buffer()
    optimizer.zero_grad()
    step = policy_forward_backward(ddp, [batch], spec)
    with_grad = {n for n, p in ddp.module.named_parameters() if bool(p.main_grad.any())}
    updated, grad_norm, _ = optimizer.step()
    changed = {n for n, p in ddp.module.named_parameters() if not torch.equal(p, before[n])}
    return {
        "params": params,
        "num_params": sum(p.numel() for p in model.parameters()),
        "logits_shape": tuple(logits.shape),
        "logits_dtype": str(logits.dtype),
        "loss": float(step.loss),
        "updated": bool(updated),
        "grad_norm": float(grad_norm),
        "params_changed": sorted(changed),
        "params_with_grad": sorted(with_grad),
        "params_total": len(before),
    }


def expert_bias_counts(launch: LaunchEnv, config: MoEModelConfig) -> dict:
    """A router's expert-bias counts from one forward with gradients of random router inputs
    `[S, b, hidden]` with the padding mask `[b, S]` true at the last positions of each row,
    from one of the non-padding inputs alone, and megatron-core's own `TopKRouter` count of
    the padded forward (the error it raises, if it does)."""
    init_distributed(ParallelDims(world_size=1), launch, seed=3)
    model = build_gpt_moe(config, ParallelDims(world_size=1))
    router = next(m for m in model.modules() if isinstance(m, TopKRouter))
    seq, batch = 10, 3
    inputs = torch.randn(seq, batch, config.hidden_size)
    padding = torch.arange(seq)[None, :] >= torch.tensor([[10], [7], [4]])

    def count(hidden: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:
        router.local_tokens_per_expert.zero_()
        router(hidden, padding_mask=None if mask is None else mask.transpose(0, 1))
        return router.local_tokens_per_expert.clone()

    padded = count(inputs, padding)
    lengths = (~padding).sum(dim=1).tolist()
    alone = sum(count(inputs[:length, i : i + 1], None) for i, length in enumerate(lengths))
    upstream = None
    try:
        router.local_tokens_per_expert.zero_()
        _, routing_map = TopKRouter.routing(router, router.gating(inputs), None)
        # the method as written, without the torch.compile wrapper megatron-core puts on it
        upstream_count = TopKRouter._apply_expert_bias
        upstream_count = getattr(upstream_count, "_torchdynamo_orig_callable", upstream_count)
        upstream_count(router, routing_map, padding.transpose(0, 1).reshape(-1))
    except RuntimeError as error:
        upstream = str(error)
    return {
        "class": type(router).__name__,
        "padded": padded,
        "alone": alone,
        "tokens": int((~padding).sum()),
        "upstream_error": upstream,
    }


def dispatchers_compared(launch: LaunchEnv, config: MoEModelConfig) -> dict:
    """One rank: the model as built (allgather there) and the same weights under megatron-core's
    alltoall dispatcher, one forward and backward of the same tokens each: the dispatchers'
    classes, and whether logits and every gradient are equal bit for bit."""
    dims = ParallelDims(world_size=1)
    init_distributed(dims, launch)
    built = build_gpt_moe(config, dims)
    real_choice = build.dispatcher_for
    build.dispatcher_for = lambda dims, dispatcher: dispatcher  # the recipe's, as upstream
    try:
        alltoall = build_gpt_moe(config, dims, dispatcher="alltoall")
    finally:
        build.dispatcher_for = real_choice
    alltoall.load_state_dict(built.state_dict())
    tokens = torch.randint(0, config.vocab_size, (2, 12))
    grads, logits = [], []
    for model in (built, alltoall):
        out = model(tokens, torch.arange(12).expand(2, 12), attention_mask=None)
        out.square().mean().backward()
        logits.append(out.detach())
        grads.append({name: p.grad for name, p in model.named_parameters()})
    return {
        "dispatchers": [
            type(module.token_dispatcher).__name__
            for model in (built, alltoall)
            for module in model.modules()
            if isinstance(module, MoELayer)
        ][:: config.num_layers],
        "logits_equal": torch.equal(*logits),
        "grads": len(grads[0]),
        "grads_equal": sum(_same(g, grads[1][name]) for name, g in grads[0].items()),
        "grads_none": sum(g is None for g in grads[0].values()),
    }


def _same(a: torch.Tensor | None, b: torch.Tensor | None) -> bool:
    if a is None or b is None:
        return a is None and b is None
    return torch.equal(a, b)
