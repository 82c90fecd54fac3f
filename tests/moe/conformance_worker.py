"""Worker of the routing-replay conformance suite (tests/moe/test_replay_conformance.py): every
case of one parallel layout in one process group."""

from __future__ import annotations

from dataclasses import replace

import torch
from megatron.core import parallel_state
from megatron.core.transformer.moe.router import TopKRouter

from megatron_rl.moe.replay import RoutingReplay
from megatron_rl.parallel.dims import ParallelDims
from megatron_rl.parallel.distributed import LaunchEnv, init_distributed
from megatron_rl.rollout.engine import Sample
from megatron_rl.trainer.batches import EngineRouting, RolloutBatch, build_rollout_batch
from megatron_rl.trainer.optimizer import wrap_for_training
from megatron_rl.trainer.schedule import old_policy_pass, policy_forward_backward
from tests.moe.replay_worker import GRPO, MODELS, _build, _perturb_routers
from tests.trainer.policy_worker import engine_old_share

# prompt and response lengths of the rollouts: responses that end early (1 token) or run long,
# so rows carry different amounts of padding; the longest row is 20 tokens (even: a sequence-
# parallel split of the padded width)
LENGTHS = [(4, 1), (3, 9), (5, 15), (4, 6), (3, 2), (5, 11)]
# the cuts of each rank's rows into micro-batches, (token budget, packed): 2 rows at the batch's
# width; rows of like length within a budget, each micro-batch as wide as its longest row; the
# rows packed back to back within the budget (THD)
CUTS = {"rows": (None, False), "token_budget": (24, False), "packed": (24, True)}


def _rollouts(vocab_size: int, record_layers: int, topk: int, num_experts: int) -> RolloutBatch:
    """Seeded samples of LENGTHS (the same on every rank) with engine routing records of
    distinct random experts, `[tokens - 1, record_layers, topk]`, and random gate weights."""
    gen = torch.Generator().manual_seed(11)
    samples = []
    for prompt, response in LENGTHS:
        total = prompt + response
        tokens = torch.randint(2, vocab_size, (total,), generator=gen).tolist()
        scores = torch.rand(total - 1, record_layers, num_experts, generator=gen)
        samples.append(
            Sample(
                prompt_ids=tuple(tokens[:prompt]),
                response_ids=tuple(tokens[prompt:]),
                logprobs=-torch.rand(response, generator=gen) - 1.0,
                finish_reason="stop",
                routed_experts=scores.topk(topk, dim=-1).indices.to(torch.int32),
                routed_weights=torch.rand(total - 1, record_layers, topk, generator=gen) + 0.1,
            )
        )
    rewards = torch.tensor([float(i % 2) for i in range(len(samples))])
    return build_rollout_batch(
        samples, rewards, group_size=2, pad_id=0, newline_token_ids=[vocab_size - 1]
    )


def _used_experts(
    replay: RoutingReplay,
) -> tuple[list[list[torch.Tensor]], list[list[torch.Tensor]], list]:
    """Hooks that keep, per router of this rank, the experts each of its forwards used
    (`[tokens, topk]`, ascending) and the gate weights it passed on (`[tokens, experts]`), in
    forward order; and the hooks' handles."""
    used: list[list[torch.Tensor]] = [[] for _ in replay.routers]
    weights: list[list[torch.Tensor]] = [[] for _ in replay.routers]

    def keep(layer: int):
        def hook(router: TopKRouter, inputs: tuple, output: tuple) -> None:
            routing_map = output[1].detach()
            used[layer].append(routing_map.nonzero()[:, 1].view(routing_map.shape[0], -1))
            weights[layer].append(output[0].detach())

        return hook

    handles = [router.register_forward_hook(keep(i)) for i, router in enumerate(replay.routers)]
    return used, weights, handles


def _weight_mismatch(
    experts: list[list[torch.Tensor]],
    targets: list[list[torch.Tensor]],
    passed_on: list[list[torch.Tensor]],
) -> tuple[float, int]:
    """The largest gap between the gate weights each forward passed on at the target experts
    and the target weights, where the engine gave some (not NaN), over every micro-batch and
    MoE layer of this rank; and how many weights were compared."""
    worst, compared = 0.0, 0
    for layer_experts, layer_targets, layer_passed in zip(experts, targets, passed_on, strict=True):
        for chosen, target, passed in zip(layer_experts, layer_targets, layer_passed, strict=True):
            given = ~target.isnan()
            if given.any():
                gap = (passed.gather(1, chosen) - target.to(passed.dtype))[given].abs().max()
                worst = max(worst, float(gap))
                compared += int(given.sum())
    return worst, compared


def _mismatch(targets: list[list[torch.Tensor]], used: list[list[torch.Tensor]]) -> float:
    """The share of (token, layer) whose used experts differ from the target's, over every
    micro-batch and MoE layer of this rank."""
    differing = total = 0
    for layer_targets, layer_used in zip(targets, used, strict=True):
        for target, seen in zip(layer_targets, layer_used, strict=True):
            differing += int((target.sort(dim=1).values != seen).any(dim=1).sum())
            total += target.shape[0]
    return differing / total


def _case(
    dims: ParallelDims,
    model_name: str,
    cut: str,
    source: str,
    batch: RolloutBatch,
    recompute: bool,
) -> dict[str, float]:
    """One case: the model's routing recorded on the micro-batches (R2) or the engine's (R3; with
    its gate weights: r3_weights) replayed in an update after the routers moved (`recompute`:
    with full activation recomputation, whose forwards in the backward must replay it too)."""
    torch.manual_seed(0)
    config = MODELS[model_name]
    model = _build(model_name, dims, routing_replay=True, recompute=recompute)
    ddp = wrap_for_training(model, distributed_optimizer=False)
    replay = RoutingReplay(model)
    sequence_parallel = model.config.sequence_parallel
    tp = parallel_state.get_tensor_model_parallel_world_size()
    engine = None
    if source in ("r3", "r3_weights"):
        engine = EngineRouting(
            num_layers=config.num_layers,
            moe_layers=tuple(range(config.first_dense_layers, config.num_layers)),
            stage_layers=tuple(replay.layer_numbers),
            topk=config.router_topk,
            sp_rank=parallel_state.get_tensor_model_parallel_rank() if sequence_parallel else 0,
            sp_size=tp if sequence_parallel else 1,
            gate_weights=source == "r3_weights",
        )
    share = engine_old_share(
        batch,
        torch.linspace(-1.0, 1.0, batch.num_rows),
        dims.dp,
        micro_batch_size=2,
        micro_batch_tokens=CUTS[cut][0],
        width_multiple=tp if sequence_parallel else 1,
        packed=CUTS[cut][1],
        engine_routing=engine,
    )
    if source == "r2":  # the old-policy forward records what the routers choose
        computed = old_policy_pass(ddp, share, replay=replay, record_routing=True)
        share = [replace(m, routing=c.routing) for m, c in zip(share, computed, strict=True)]
    targets = [[micro.routing[layer] for micro in share] for layer in range(replay.num_layers)]
    _perturb_routers(model)
    # without a pipeline each micro-batch's backward follows its forward: with recomputation,
    # a second forward of it
    forwards = [[t for t in layer for _ in range(1 + recompute)] for layer in targets]
    free_used, _, handles = _used_experts(replay)
    old_policy_pass(ddp, [replace(m, routing=None, gate_weights=None) for m in share])
    for handle in handles:
        handle.remove()
    used, passed_on, handles = _used_experts(replay)
    ddp.zero_grad_buffer()
    policy_forward_backward(ddp, share, GRPO, replay=replay)
    for handle in handles:
        handle.remove()
    router_grads = [
        float(p.main_grad.abs().max())
        for n, p in ddp.module.named_parameters()
        if n.endswith("router.weight")
    ]
    weight_mismatch, weights_compared = None, 0
    if source == "r3_weights":
        weights = [
            [w for micro in share for w in [micro.gate_weights[layer]] * (1 + recompute)]
            for layer in range(replay.num_layers)
        ]
        weight_mismatch, weights_compared = _weight_mismatch(forwards, weights, passed_on)
    return {
        "replay_mismatch": _mismatch(forwards, used),
        "weight_mismatch": weight_mismatch,
        "weights_compared": weights_compared,
        "free_mismatch": _mismatch(targets, free_used),
        "smallest_router_grad": min(router_grads),
        "shapes": len({tuple(m.tokens.shape) for m in share}),
        "micro_batches": len(share),
    }


def conformance(
    launch: LaunchEnv, layout: dict[str, int], recompute: bool = False
) -> dict[str, dict[str, float]]:
    """Every case (model x cut x R2/R3/r3_weights) at `layout`, keyed `model/cut/source`."""
    if recompute and layout.get("pp", 1) > 1:
        raise ValueError("recompute: the cases expect each backward right after its forward")
    dims = ParallelDims(world_size=launch.world_size, **layout)
    init_distributed(dims, launch, seed=5)
    results = {}
    for model_name, config in MODELS.items():
        moe_layers = config.num_layers - config.first_dense_layers
        batch = _rollouts(config.vocab_size, moe_layers, config.router_topk, config.num_experts)
        for cut in CUTS:
            for source in ("r2", "r3", "r3_weights"):
                results[f"{model_name}/{cut}/{source}"] = _case(
                    dims, model_name, cut, source, batch, recompute
                )
    return results
