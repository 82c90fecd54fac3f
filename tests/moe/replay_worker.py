"""Workers for the routing-replay tests (R2 on a real megatron-core MoE model): a Qwen3-MoE-like
model, every layer MoE with a softmax router, and a DeepSeek-V3-like one."""

from __future__ import annotations

from dataclasses import replace

import torch
from megatron.core.transformer.moe.router import TopKRouter

from megatron_rl.algo import PolicyLossSpec
from megatron_rl.models.build import build_gpt_moe
from megatron_rl.models.config import MoEModelConfig
from megatron_rl.moe.drift import routing_drift
from megatron_rl.moe.replay import RoutingReplay
from megatron_rl.parallel.dims import ParallelDims
from megatron_rl.parallel.distributed import LaunchEnv, init_distributed
from megatron_rl.trainer.micro_batch import PolicyMicroBatch
from megatron_rl.trainer.optimizer import wrap_for_training
from megatron_rl.trainer.schedule import old_policy_pass, policy_forward_backward
from tests.parallel.invariance import TINY_MOE, micro_batches

GRPO = PolicyLossSpec.of("grpo", clip_low=0.2, clip_high=0.27)
# DeepSeek-V3's shape: MLA, a dense first layer, then MoE layers whose sigmoid router adds a
# score-correction bias to choose among the experts of its best group, scales the weights and
# has a shared expert beside it. Four layers: under PP=2 the first stage holds the dense layer
# and one MoE layer, the second two MoE layers.
TINY_DEEPSEEK = MoEModelConfig(
    num_layers=4,
    first_dense_layers=1,
    hidden_size=64,
    num_attention_heads=4,
    num_query_groups=4,
    multi_latent_attention=True,
    q_lora_rank=32,
    kv_lora_rank=32,
    qk_nope_head_dim=16,
    qk_rope_head_dim=8,
    v_head_dim=16,
    ffn_hidden_size=128,
    moe_ffn_hidden_size=32,
    num_experts=8,
    router_topk=2,
    router_score_function="sigmoid",
    router_expert_bias=True,
    router_num_groups=2,
    router_group_topk=1,
    router_topk_scaling_factor=2.5,
    router_float32=True,
    shared_expert_ffn_hidden_size=32,
    vocab_size=128,
)
MODELS = {"qwen3_like": TINY_MOE, "deepseek_like": TINY_DEEPSEEK}


def _build(name: str, dims: ParallelDims, **options) -> torch.nn.Module:
    """The model `name`, its score-correction biases (loaded, never trained) set apart from 0
    by a fixed draw, so that they change which experts some tokens choose."""
    model = build_gpt_moe(MODELS[name], dims, **options)
    gen = torch.Generator().manual_seed(3)
    for module in model.modules():
        if getattr(module, "expert_bias", None) is not None:
            module.expert_bias.copy_(torch.randn(module.expert_bias.shape, generator=gen) * 0.02)
    return model


def _record(
    ddp: torch.nn.Module, replay: RoutingReplay, batches: list[PolicyMicroBatch]
) -> list[PolicyMicroBatch]:
    """R2's old-policy pass: the micro-batches with the routing it recorded."""
    computed = old_policy_pass(ddp, batches, replay=replay, record_routing=True)
    return [replace(b, routing=old.routing) for b, old in zip(batches, computed, strict=True)]


def _stack(routing: list[torch.Tensor]) -> torch.Tensor:
    """Per-layer [tokens, topk] -> [tokens, layers, topk] (the drift metrics' layout)."""
    return torch.stack(routing, dim=1)


def _perturb_routers(model: torch.nn.Module, seed: int = 7) -> None:
    """A large update of the router weights: routing changes for many tokens."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("router.weight"):
                param.add_(torch.randn(param.shape, generator=gen) * 0.5)


def _force_routing(model: torch.nn.Module, routing: list[torch.Tensor]) -> None:
    """An independent way to force routing: replace each router's routing function by one that
    takes the given experts and weighs them as the router would: the softmax of its logits
    over them, or (sigmoid routers) their sigmoid scores renormalised and scaled."""
    routers = [m for m in model.modules() if isinstance(m, TopKRouter)]
    for router, indices in zip(routers, routing, strict=True):
        config = router.config

        def routing_fn(logits, padding_mask=None, indices=indices, config=config):
            logits = logits.view(-1, logits.shape[-1])
            if config.moe_router_score_function == "sigmoid":
                scores = torch.sigmoid(logits.float()).gather(1, indices)
                probs = scores / (scores.sum(-1, keepdim=True) + 1e-20)
                probs = (probs * config.moe_router_topk_scaling_factor).type_as(logits)
            else:
                probs = torch.softmax(logits.gather(1, indices), dim=-1)
            routing_probs = torch.zeros_like(logits).scatter(1, indices, probs)
            routing_map = torch.zeros_like(logits, dtype=torch.bool).scatter(1, indices, True)
            return routing_probs, routing_map

        router.routing = routing_fn


def r2_matches_forced_routing(launch: LaunchEnv, model_name: str) -> dict:
    dims = ParallelDims(world_size=1)
    init_distributed(dims, launch)
    model = _build(model_name, dims, routing_replay=True)
    ddp = wrap_for_training(model, distributed_optimizer=False)
    replay = RoutingReplay(model)
    (batch,) = _record(ddp, replay, micro_batches(count=1))
    old_routing = batch.routing
    _perturb_routers(model)

    stop = replay.observe_routing()
    replayed = policy_forward_backward(ddp, [batch], GRPO, replay=replay)
    free, used, _ = stop()
    grads = {n: p.main_grad.clone() for n, p in ddp.module.named_parameters()}

    # reference: same weights, routing forced by replacing the routers' routing function
    perturbed = {k: v.clone() for k, v in model.state_dict().items() if torch.is_tensor(v)}
    reference_model = build_gpt_moe(MODELS[model_name], dims)
    reference_model.load_state_dict(perturbed, strict=False)
    _force_routing(reference_model, old_routing)
    reference = wrap_for_training(reference_model, distributed_optimizer=False)
    batch = replace(batch, routing=None)
    forced = policy_forward_backward(reference, [batch], GRPO)
    errors = [
        float((p.main_grad - grads[n]).abs().max() / grads[n].abs().max().clamp(min=1e-30))
        for n, p in reference.module.named_parameters()
    ]

    # without replay, the perturbed routers route differently
    free_model = build_gpt_moe(MODELS[model_name], dims)
    free_model.load_state_dict(perturbed, strict=False)
    free_loss = policy_forward_backward(
        wrap_for_training(free_model, distributed_optimizer=False), [batch], GRPO
    ).loss
    return {
        "drift_used": float(routing_drift(_stack(old_routing), _stack(used))["drift/token_layer"]),
        "drift_free": float(routing_drift(_stack(old_routing), _stack(free))["drift/token_layer"]),
        "replayed_loss": float(replayed.loss),
        "forced_loss": float(forced.loss),
        "free_loss": float(free_loss),
        "worst_grad_error": max(errors),
        "router_grad": max(
            float(g.abs().max()) for n, g in grads.items() if n.endswith("router.weight")
        ),
        "replayed_layers": replay.layer_numbers,
        "routing_layers": len(old_routing),
    }


def _recorded_then_moved(
    dims: ParallelDims, model_name: str, recompute: bool, count: int
) -> tuple[torch.nn.Module, RoutingReplay, list[PolicyMicroBatch]]:
    """The model `model_name` (seeded, with replay, `recompute`: full activation recompute), its
    routing recorded on `count` micro-batches, then its routers moved."""
    torch.manual_seed(0)
    model = _build(model_name, dims, routing_replay=True, recompute=recompute)
    ddp = wrap_for_training(model, distributed_optimizer=False)
    replay = RoutingReplay(model)
    batches = _record(ddp, replay, micro_batches(count=count))
    _perturb_routers(model)
    return ddp, replay, batches


def recompute_gives_same_gradients(launch: LaunchEnv, model_name: str) -> dict:
    dims = ParallelDims(world_size=1)
    init_distributed(dims, launch)
    grads = {}
    for recompute in (False, True):
        ddp, replay, batches = _recorded_then_moved(dims, model_name, recompute, count=3)
        policy_forward_backward(ddp, batches, GRPO, replay=replay)
        grads[recompute] = {n: p.main_grad.clone() for n, p in ddp.module.named_parameters()}
    errors = [
        float((grads[True][n] - g).abs().max() / g.abs().max().clamp(min=1e-30))
        for n, g in grads[False].items()
    ]
    return {"worst_grad_error": max(errors), "num_params": len(errors)}


def replay_at_layout(launch: LaunchEnv, layout: dict, model_name: str = "qwen3_like") -> dict:
    """R2 on a split model: record, change routing, replay; what the routers used vs recorded."""
    dims = ParallelDims(world_size=launch.world_size, **layout)
    init_distributed(dims, launch)
    model = _build(model_name, dims, routing_replay=True)
    ddp = wrap_for_training(model, distributed_optimizer=False)
    replay = RoutingReplay(model)
    batches = _record(ddp, replay, micro_batches(count=2))
    recorded = batches[-1].routing
    _perturb_routers(model)
    stop = replay.observe_routing()
    step = policy_forward_backward(ddp, batches, GRPO, replay=replay)
    free, used, _ = stop()  # the last micro-batch's forward
    return {
        "drift_used": float(routing_drift(_stack(recorded), _stack(used))["drift/token_layer"]),
        "drift_free": float(routing_drift(_stack(recorded), _stack(free))["drift/token_layer"]),
        "tokens_per_router": int(recorded[0].shape[0]),
        "loss": float(step.loss),
        "replayed_layers": replay.layer_numbers,
    }


def r3_round_trip(launch: LaunchEnv) -> dict:
    """Engine routing simulated from the trainer's own routing, converted to SGLang's layout,
    mapped back by R3 and replayed: the routers use exactly the engine's experts."""
    from megatron_rl.moe.engine_routing import place_engine_routing, router_order

    dims = ParallelDims(world_size=1)
    init_distributed(dims, launch)
    model = build_gpt_moe(TINY_MOE, dims, routing_replay=True)
    ddp = wrap_for_training(model, distributed_optimizer=False)
    replay = RoutingReplay(model)
    (batch,) = _record(ddp, replay, micro_batches(count=1))
    rows, seq = batch.tokens.shape
    # router order [seq * rows, topk] per layer -> [rows, seq, layers, topk] -> SGLang per sample
    stacked = torch.stack(batch.routing, dim=1).view(seq, rows, replay.num_layers, -1)
    per_sample = [stacked[:, row][: seq - 1].to(torch.int32) for row in range(rows)]
    routing, covered = place_engine_routing(
        per_sample,
        list(range(rows)),
        [0] * rows,
        [seq] * rows,
        (rows, seq),
        num_layers=replay.num_layers,
        topk=replay.topk,
    )
    batch = replace(batch, routing=router_order(routing))
    _perturb_routers(model)
    stop = replay.observe_routing()
    policy_forward_backward(ddp, [batch], GRPO, replay=replay)
    used = stop().used
    expected = _stack(batch.routing)
    return {
        "drift_used": float(routing_drift(expected, _stack(used))["drift/token_layer"]),
        "covered": int(covered.sum()),
        "tokens": rows * seq,
    }


def bad_input_messages(launch: LaunchEnv) -> dict:
    """The errors replay gives for what it cannot do; never a silent fall-back to free routing."""
    dims = ParallelDims(world_size=1)
    init_distributed(dims, launch)
    messages = {}

    def message(key, action):
        try:
            action()
        except (ValueError, RuntimeError) as error:
            messages[key] = str(error)

    message("no_replay_built", lambda: RoutingReplay(build_gpt_moe(TINY_MOE, dims)))
    model = build_gpt_moe(TINY_MOE, dims, routing_replay=True)
    replay = RoutingReplay(model)
    good = torch.zeros(48, 2, dtype=torch.long)
    message("layers", lambda: replay.replay([good], num_tokens=48))
    message("tokens", lambda: replay.replay([good, good], num_tokens=40))
    message("dtype", lambda: replay.replay([good.float(), good], num_tokens=48))
    message("collect_without_record", replay.collect)
    (batch,) = micro_batches(count=1)
    ddp = wrap_for_training(model, distributed_optimizer=False)
    message("no_routing", lambda: policy_forward_backward(ddp, [batch], GRPO, replay=replay))
    return messages


def _captured_gate_weights(replay: RoutingReplay) -> tuple[list[list[torch.Tensor]], list]:
    """Hooks after replay's own that keep, per router, the gate weights `[tokens, experts]`
    (zero off the top-k) each of its forwards passed on, in forward order; and the handles."""
    seen: list[list[torch.Tensor]] = [[] for _ in replay.routers]

    def keep(layer: int):
        def hook(router: TopKRouter, inputs: tuple, output: tuple) -> None:
            seen[layer].append(output[0].detach().clone())

        return hook

    return seen, [router.register_forward_hook(keep(i)) for i, router in enumerate(replay.routers)]


def _update_with(
    ddp: torch.nn.Module,
    replay: RoutingReplay,
    batches: list[PolicyMicroBatch],
    weights: list[list[torch.Tensor] | None],
) -> tuple[float, dict[str, torch.Tensor], list[list[torch.Tensor]]]:
    """One update of `batches` with gate `weights` per micro-batch: its loss, the gradients and
    per router the gate weights each forward passed on."""
    ddp.zero_grad_buffer()
    seen, handles = _captured_gate_weights(replay)
    given = [replace(b, gate_weights=w) for b, w in zip(batches, weights, strict=True)]
    step = policy_forward_backward(ddp, given, GRPO, replay=replay)
    for handle in handles:
        handle.remove()
    grads = {n: p.main_grad.clone() for n, p in ddp.module.named_parameters()}
    return float(step.loss), grads, seen


def _worst_grad_error(grads: dict[str, torch.Tensor], reference: dict[str, torch.Tensor]) -> float:
    return max(
        float((grads[n] - g).abs().max() / g.abs().max().clamp(min=1e-30))
        for n, g in reference.items()
    )


def _gate_weight_cases(
    dims: ParallelDims, model_name: str, recompute: bool
) -> tuple[dict, dict[str, torch.Tensor]]:
    """`gate_weight_replay` at one setting of recomputation: its report and the gradients of
    the update with other weights."""
    ddp, replay, batches = _recorded_then_moved(dims, model_name, recompute, count=2)
    ids_loss, ids_grads, ids_seen = _update_with(ddp, replay, batches, [None, None])
    # each micro-batch's own weights at the replayed experts (a forward, then its recompute)
    forwards = 1 + recompute
    own = [
        [
            seen[forwards * i].gather(1, experts)
            for seen, experts in zip(ids_seen, b.routing, strict=True)
        ]
        for i, b in enumerate(batches)
    ]
    own_loss, own_grads, _ = _update_with(ddp, replay, batches, own)
    unset = [[torch.full_like(w, float("nan")) for w in o] for o in own]
    nan_loss, nan_grads, _ = _update_with(ddp, replay, batches, unset)
    gen = torch.Generator().manual_seed(5)
    other = [[torch.rand(w.shape, generator=gen) + 0.1 for w in o] for o in own]
    for weights in other:  # the first MoE layer keeps its own weights on its first 5 tokens
        weights[0][:5] = float("nan")
    other_loss, other_grads, other_seen = _update_with(ddp, replay, batches, other)
    used_error = 0.0
    for i, b in enumerate(batches):
        for layer, experts in enumerate(b.routing):
            target = other[i][layer]
            # the first MoE layer's input is the same as without gate weights: its kept
            # tokens must show its own weights; later layers' own weights moved
            expected = torch.where(target.isnan(), own[i][layer], target)
            checked = torch.ones_like(target, dtype=torch.bool) if layer == 0 else ~target.isnan()
            for seen in other_seen[layer][forwards * i : forwards * (i + 1)]:
                error = (seen.gather(1, experts) - expected)[checked].abs().max()
                used_error = max(used_error, float(error))
    report = {
        "own_loss_error": abs(own_loss - ids_loss),
        "own_worst_grad_error": _worst_grad_error(own_grads, ids_grads),
        "nan_loss_error": abs(nan_loss - ids_loss),
        "nan_worst_grad_error": _worst_grad_error(nan_grads, ids_grads),
        "other_loss_change": abs(other_loss - ids_loss),
        "other_used_error": used_error,
        "other_forwards": len(other_seen[0]),
        "other_smallest_router_grad": min(
            float(g.abs().max()) for n, g in other_grads.items() if n.endswith("router.weight")
        ),
    }
    return report, other_grads


def gate_weight_replay(launch: LaunchEnv, model_name: str) -> dict:
    """Gate-weight replay after the routers moved, with and without activation recomputation:
    the trainer's own weights (or NaN: keep them) give id-only replay's loss and gradients; other
    weights reach every forward (the recomputed ones too) and the router still learns."""
    dims = ParallelDims(world_size=1)
    init_distributed(dims, launch)
    report: dict = {}
    other_grads = {}
    for recompute in (False, True):
        report[f"recompute={recompute}"], other_grads[recompute] = _gate_weight_cases(
            dims, model_name, recompute
        )
    report["recompute_grad_error"] = _worst_grad_error(other_grads[True], other_grads[False])
    return report
