"""Workers for the load-balancing tests (run on gloo ranks by tests.parallel.harness)."""

from __future__ import annotations

from dataclasses import replace

import torch
from megatron.core import parallel_state
from megatron.core.transformer.moe.router import TopKRouter

from megatron_rl.algo import PolicyLossSpec
from megatron_rl.models.build import build_gpt_moe
from megatron_rl.models.config import ModelConfig
from megatron_rl.moe.replay_mode import RoutingReplayMode
from megatron_rl.parallel.dims import ParallelDims
from megatron_rl.parallel.distributed import LaunchEnv, init_distributed
from megatron_rl.rollout.codec import PromptCodec
from megatron_rl.rollout.local import LocalEngine
from megatron_rl.trainer.micro_batch import PolicyMicroBatch
from megatron_rl.trainer.optimizer import wrap_for_training
from megatron_rl.trainer.optimizer_config import OptimConfig
from megatron_rl.trainer.policy import Policy
from megatron_rl.trainer.schedule import policy_forward_backward
from tests.parallel.invariance import TINY_MOE, micro_batches
from tests.trainer.policy_worker import _one_update, _rollout_batch, _share, _sync


def switch_loss(
    inputs: torch.Tensor, weight: torch.Tensor, topk: int, keep: torch.Tensor | None = None
) -> torch.Tensor:
    """Megatron-core's switch load-balancing loss of one micro-batch, by hand (coefficient 1):
    E * sum_e(f_e * P_e), f_e the share of the T * topk choices that went to expert e, P_e the
    mean softmax score of e (`switch_load_balancing_loss_func` and
    `compute_routing_scores_for_aux_loss`, megatron/core/transformer/moe/moe_utils.py), over
    the router's `[tokens, hidden]` inputs, or those of them `keep` `[tokens]` says."""
    tokens = inputs.reshape(-1, inputs.shape[-1]).double()
    if keep is not None:
        tokens = tokens[keep]
    scores = torch.softmax(tokens @ weight.double().T, dim=-1)
    chosen = torch.zeros_like(scores).scatter(1, scores.topk(topk, dim=1).indices, 1.0)
    count, experts = scores.shape
    share, mean_score = chosen.sum(0) / (count * topk), scores.sum(0) / count
    return experts * (share * mean_score).sum()


PAD = TINY_MOE.vocab_size - 1  # the padded micro-batches' pad token, used nowhere else


def right_padded(batches: list[PolicyMicroBatch]) -> list[PolicyMicroBatch]:
    """`batches` with each row padded (token PAD) after the token its last loss position
    predicts, by different amounts, and the first micro-batch's last row a filler row (all
    padding, no loss token)."""
    padded = []
    for index, mb in enumerate(batches):
        positions = torch.arange(mb.tokens.shape[1])
        last = torch.where(mb.loss_mask, positions, -1).max(dim=1, keepdim=True).values
        padding = positions[None, :] > last + 1
        loss_mask = mb.loss_mask.clone()
        if index == 0:
            padding[-1], loss_mask[-1] = True, False
        tokens = torch.where(padding, PAD, mb.tokens.clamp(max=PAD - 1))
        padded.append(replace(mb, tokens=tokens, loss_mask=loss_mask, padding_mask=padding))
    assert all(bool(mb.padding_mask.any()) for mb in padded)
    return padded


def aux_loss_gradient(
    launch: LaunchEnv,
    loss_agg: str,
    coeff: float,
    no_loss_tokens: bool = False,
    padded: bool = False,
) -> dict:
    """One forward-backward of the same micro-batches by two copies of a model, built with aux
    loss coefficient `coeff` and 0. Returns the last MoE layer's router weight gradient
    difference (all DP ranks reduce it) and, for this rank's micro-batches, the sum over them
    of n_i times the hand-computed switch loss's gradient and the sum of the n_i, n_i their
    non-padding tokens (`no_loss_tokens`: with every loss mask empty; `padded`: right-padded,
    `right_padded`), and the largest gradient of the pad token's embedding."""
    dims = ParallelDims(world_size=launch.world_size)
    init_distributed(dims, launch, seed=5)
    rank = parallel_state.get_data_parallel_rank()
    models = {
        c: wrap_for_training(
            build_gpt_moe(replace(TINY_MOE, moe_aux_loss_coeff=c), dims),
            distributed_optimizer=False,
        )
        for c in (coeff, 0.0)
    }
    models[0.0].module.load_state_dict(models[coeff].module.state_dict())
    routers = [m for m in models[coeff].module.modules() if isinstance(m, TopKRouter)]
    inputs: list[torch.Tensor] = []
    routers[-1].register_forward_hook(lambda module, args, out: inputs.append(args[0].detach()))
    spec = PolicyLossSpec.of("grpo", clip_low=0.2, clip_high=0.2, loss_agg=loss_agg)
    batches = micro_batches(count=3, seed=rank)
    if no_loss_tokens:  # a global denominator of 0: megatron-core does not divide
        batches = [replace(mb, loss_mask=torch.zeros_like(mb.loss_mask)) for mb in batches]
    if padded:
        batches = right_padded(batches)
    grads, pad_grads = {}, {}
    for c, model in models.items():
        model.zero_grad_buffer()
        policy_forward_backward(model, batches, spec)
        named = dict(model.module.named_parameters())
        grads[c] = named[_router_name(model)].main_grad.clone()
        pad_grads[c] = named["embedding.word_embeddings.weight"].main_grad[PAD].abs().max()
    assert models[coeff].config.moe_aux_loss_coeff == coeff  # restored after the update
    weight = routers[-1].weight.detach().double().requires_grad_(True)
    kept = [
        None if mb.padding_mask is None else ~mb.padding_mask.transpose(0, 1).reshape(-1)
        for mb in batches
    ]
    counts = [
        x.shape[0] * x.shape[1] if k is None else int(k.sum())
        for x, k in zip(inputs, kept, strict=True)
    ]
    total = sum(
        n * switch_loss(x, weight, TINY_MOE.router_topk, k)
        for x, k, n in zip(inputs, kept, counts, strict=True)
    )
    (hand,) = torch.autograd.grad(total, weight)
    return {
        "difference": (grads[coeff] - grads[0.0]).double(),
        "hand_sum": hand,
        "count": sum(counts),
        "policy_grad": grads[0.0].abs().max().item(),
        "pad_embedding_grad": max(float(g) for g in pad_grads.values()),
    }


def _router_name(model: torch.nn.Module) -> str:
    names = [n for n, _ in model.module.named_parameters() if n.endswith("router.weight")]
    return names[-1]


def _expert_biases(policy: Policy) -> torch.Tensor:
    routers = [m for m in policy.model.module.modules() if isinstance(m, TopKRouter)]
    return torch.stack([router.expert_bias.detach().clone() for router in routers])


def bias_update_sync(launch: LaunchEnv, hf_dir: str, rate: float) -> dict:
    """A policy of a sigmoid + expert-bias model with `model.router_bias_update_rate=rate`: its
    expert biases before and after an old-policy forward and after one update, and the engine's
    e_score_correction_bias before and after the weight sync."""
    dims = ParallelDims(world_size=launch.world_size)
    init_distributed(dims, launch, seed=5)
    config = ModelConfig(hf_path=hf_dir, router_bias_update_rate=rate)
    policy = Policy(config, dims, OptimConfig(lr=1e-3))
    engine = LocalEngine.from_pretrained(hf_dir) if launch.rank == 0 else None
    batch = _rollout_batch(engine, PromptCodec(hf_dir, max_prompt_tokens=64))
    start = _expert_biases(policy)
    policy.old_policy(_share(policy, batch, micro_batch_size=4), RoutingReplayMode.NONE)
    counted = [
        float(m.local_tokens_per_expert.sum())
        for m in policy.model.module.modules()
        if isinstance(m, TopKRouter)
    ]
    _one_update(policy, batch)  # an old-policy forward, then the update
    updated = _expert_biases(policy)

    def engine_biases() -> torch.Tensor:
        names = [
            n for n, _ in engine.model.named_buffers() if n.endswith("e_score_correction_bias")
        ]
        buffers = dict(engine.model.named_buffers())
        return torch.stack([buffers[n].detach().float().clone() for n in names])

    result = {"start": start, "updated": updated, "counted_without_grad": counted}
    if engine is not None:
        result["engine_before"] = engine_biases()
    _sync(policy, engine, version=1)
    if engine is not None:
        result["engine_after"] = engine_biases()
    return result
