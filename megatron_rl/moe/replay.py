"""Routing replay for one model, on megatron-core's `RouterReplay`.

R2 records the top-k experts of every MoE layer while the old policy computes its log-probs,
then forces that routing in every training forward of the same micro-batch; R3 forces the routing
the rollout engine used (see `engine_routing.py` for mapping it onto training tokens). Either way
a micro-batch carries its routing: one `[tokens, topk]` tensor per MoE layer of this rank's
pipeline stage, tokens in the router's order (sequence-major over this rank's sequence-parallel
slice, then batch). Dense layers (DeepSeek-V3's first ones) have no router and no entry: replay
never touches them, and `layer_numbers` says which model layer each entry belongs to.

megatron-core (built with `moe_enable_routing_replay`) gives each router a `RouterReplay` and
keeps a process-wide list of them, driven by static methods. `RoutingReplay` takes the instances
of one model out of that list and drives only those, so a second model in the process (a
reference model, say) is never affected. Under replay the router still learns: megatron-core
gathers the training router's scores at the replayed experts, and with the softmax score
function (top-k first) takes the softmax over those gathered logits as the gate weights
(`transformer/moe/moe_utils.py`, `topk_routing_with_score_function`).

Activation recomputation re-runs each layer's forward during backward. megatron-core replays
those from a first-in, first-out list (REPLAY_BACKWARD); a gradient hook on each micro-batch's
output switches this model's routers to it when that micro-batch's backward begins, and the next
forward switches back. After a step, `finish()` checks that every recorded entry was consumed.

Gate-weight replay (`algo.routing_replay=r3_weights`) forces the engine's gate weights too: a
forward hook on each router puts them in the router's output in place of the weights it
recomputed, straight through: the forward multiplies the experts' outputs by the engine's
weights, and the backward takes the gradient of the trainer's own, so the router learns exactly
where it does under id-only replay. Positions the engine never routed (NaN weights: padding, each
sample's last token) keep the trainer's own. The weights follow the expert ids' first-in,
first-out order under recomputation.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import NamedTuple

import torch
from megatron.core.transformer.moe.moe_layer import MoELayer
from megatron.core.transformer.moe.moe_utils import topk_routing_with_score_function
from megatron.core.transformer.moe.router import TopKRouter
from megatron.core.transformer.moe.router_replay import RouterReplay, RouterReplayAction
from torch import Tensor

from megatron_rl.moe.margins import decision_margins, decision_scores


class ObservedRouting(NamedTuple):
    """One forward's routing, per MoE layer `[tokens, topk]` expert indices, and per MoE layer
    `[tokens]` the free choice's top-k margins (`megatron_rl.moe.margins`)."""

    free: list[Tensor]  # what the routers' current weights choose
    used: list[Tensor]  # what the forward used (under replay: the replayed experts)
    margins: list[Tensor]  # how far each free choice was from another expert taking a place


class RoutingReplay:
    """Record and replay the top-k routing of one model's MoE layers (on this rank)."""

    def __init__(self, model: torch.nn.Module) -> None:
        routers = [module for module in model.modules() if isinstance(module, TopKRouter)]
        if not routers:
            raise ValueError("routing replay: the model has no MoE layers to replay")
        if any(router.router_replay is None for router in routers):
            raise ValueError(
                "routing replay: build the model with routing_replay=True "
                "(megatron-core's moe_enable_routing_replay) to record or replay routing"
            )
        self.routers = routers
        # transformer layers carry their model-wide number (from 1) under any pipeline split
        self.layer_numbers = [
            layer.layer_number - 1
            for layer in model.decoder.layers
            if isinstance(layer.mlp, MoELayer)
        ]
        self.topk = routers[0].topk
        self.recompute = model.config.recompute_granularity == "full"
        self._replays: list[RouterReplay] = [router.router_replay for router in routers]
        # per router: the gate weights of the next forward and, in order, those of the
        # recomputed forwards to come (None: replay ids only), as megatron-core keeps the ids
        self._gate_weights: list[_GateTargets | None] = [None] * len(routers)
        self._gate_backward: list[list[_GateTargets | None]] = [[] for _ in routers]
        for layer, router in enumerate(routers):
            router.register_forward_hook(self._force_gate_weights(layer))
        owned = {id(replay) for replay in self._replays}
        RouterReplay.global_router_replay_instances[:] = [
            r for r in RouterReplay.global_router_replay_instances if id(r) not in owned
        ]
        self._loaded = 0

    @property
    def num_layers(self) -> int:
        """MoE layers on this rank (this pipeline stage)."""
        return len(self._replays)

    def record(self) -> None:
        """The next forward records its routing (collect it with `collect`)."""
        for replay in self._replays:
            replay.clear_indices()
            replay.set_router_replay_action(RouterReplayAction.RECORD)

    def collect(self) -> list[Tensor]:
        """The routing the last forward recorded: per layer, `[tokens, topk]` expert indices."""
        recorded = [replay.get_recorded_indices() for replay in self._replays]
        if any(indices is None for indices in recorded):
            raise RuntimeError("routing replay: no routing was recorded; call record() first")
        for replay in self._replays:
            replay.clear_indices()
        return [indices.detach() for indices in recorded]

    def replay(
        self, routing: list[Tensor], num_tokens: int, gate_weights: list[Tensor] | None = None
    ) -> None:
        """Force `routing` (per layer `[num_tokens, topk]`) in the next forward, and with
        `gate_weights` (per layer `[num_tokens, topk]` float, aligned with `routing`; NaN where
        the router's own weight stays) the gate weights too."""
        if len(routing) != self.num_layers:
            raise ValueError(
                f"routing: {len(routing)} layer(s) given, this rank's model has "
                f"{self.num_layers} MoE layer(s)"
            )
        for layer, indices in enumerate(routing):
            if indices.is_floating_point() or tuple(indices.shape) != (num_tokens, self.topk):
                raise ValueError(
                    f"routing: layer {layer} has {list(indices.shape)} {indices.dtype}; the "
                    f"micro-batch needs integer indices [{num_tokens}, {self.topk}] "
                    "([tokens, topk])"
                )
        targets = _gate_targets(routing, gate_weights, num_tokens, self.topk)
        for layer, (replay, indices) in enumerate(zip(self._replays, routing, strict=True)):
            replay.target_topk_idx = None
            replay.set_target_indices(indices.long())
            replay.set_router_replay_action(RouterReplayAction.REPLAY_FORWARD)
            self._gate_weights[layer] = targets[layer]
            self._gate_backward[layer].append(targets[layer])
        self._loaded += 1

    def replay_backward_from(self, output: Tensor) -> None:
        """When the backward of `output` begins, recomputed forwards replay in order."""
        if self.recompute and output.requires_grad:
            output.register_hook(self._switch_to_backward)

    def _switch_to_backward(self, grad: Tensor) -> None:
        for replay in self._replays:
            replay.set_router_replay_action(RouterReplayAction.REPLAY_BACKWARD)

    def finish(self) -> int:
        """End a step: check every replayed entry was consumed; return how many were used."""
        unconsumed = sum(len(replay.replay_backward_list) for replay in self._replays)
        for replay in self._replays:
            replay.clear_indices()
            replay.clear_router_replay_action()
        self._gate_weights = [None] * len(self._replays)
        self._gate_backward = [[] for _ in self._replays]
        loaded, self._loaded = self._loaded, 0
        if self.recompute and unconsumed:
            raise RuntimeError(
                f"routing replay: {unconsumed} replayed routing entries were not consumed by the "
                "backward recompute; forwards and backwards did not pair up"
            )
        return loaded

    def _force_gate_weights(self, layer: int) -> Callable:
        """The forward hook of router `layer`: its output with the replayed gate weights, when
        the forward replays some (the ids' action says which forward this is)."""
        replay = self._replays[layer]

        def hook(router: TopKRouter, inputs: tuple, output: tuple[Tensor, Tensor]) -> tuple | None:
            action = replay.router_replay_action
            if action is RouterReplayAction.REPLAY_FORWARD:
                targets = self._gate_weights[layer]
            elif action is RouterReplayAction.REPLAY_BACKWARD:
                queue = self._gate_backward[layer]
                targets = queue.pop(0) if queue else None
            else:
                return None
            if targets is None:
                return None
            probs, routing_map = output
            return straight_through_gate_weights(probs, *targets), routing_map

        return hook

    def observe_routing(self) -> Callable[[], ObservedRouting]:
        """Watch each router's next forward: what it would choose without replay (megatron-core's
        own top-k, with its score function, groups and bias) and that choice's top-k margins, at
        the cost of one small matmul per layer (no extra forward), and what it used (its
        routing map). Returns a function
        that removes the hooks and gives the last forward's routing."""
        free: dict[int, Tensor] = {}
        used: dict[int, Tensor] = {}
        margins: dict[int, Tensor] = {}

        def watch(layer: int) -> Callable:
            def hook(router: TopKRouter, inputs: tuple, output: tuple[Tensor, Tensor]) -> None:
                with torch.no_grad():
                    logits = router.gating(inputs[0].detach())
                    logits = logits.view(-1, router.config.num_moe_experts)
                    margins[layer] = _decision_margins(router, logits)
                    _, free_map = topk_routing_with_score_function(
                        logits,
                        router.topk,
                        use_pre_softmax=router.config.moe_router_pre_softmax,
                        num_groups=router.config.moe_router_num_groups,
                        group_topk=router.config.moe_router_group_topk,
                        scaling_factor=router.config.moe_router_topk_scaling_factor,
                        score_function=router.score_function,
                        expert_bias=router.expert_bias,
                    )
                free[layer] = _experts(free_map)
                used[layer] = _experts(output[1].detach())

            return hook

        handles = [
            router.register_forward_hook(watch(layer)) for layer, router in enumerate(self.routers)
        ]

        def stop() -> ObservedRouting:
            for handle in handles:
                handle.remove()
            layers = range(len(self.routers))
            return ObservedRouting(
                [free[i] for i in layers], [used[i] for i in layers], [margins[i] for i in layers]
            )

        return stop


class _GateTargets(NamedTuple):
    experts: Tensor  # [tokens, topk] the replayed expert ids
    weights: Tensor  # [tokens, topk] their gate weights; NaN: the router's own


def _gate_targets(
    routing: list[Tensor], gate_weights: list[Tensor] | None, num_tokens: int, topk: int
) -> list[_GateTargets | None]:
    """Per layer, the gate weights to force with its ids, or None for each (ids only)."""
    if gate_weights is None:
        return [None] * len(routing)
    if len(gate_weights) != len(routing):
        raise ValueError(
            f"gate weights: {len(gate_weights)} layer(s) given for {len(routing)} routed layer(s)"
        )
    for layer, weights in enumerate(gate_weights):
        if not weights.is_floating_point() or tuple(weights.shape) != (num_tokens, topk):
            raise ValueError(
                f"gate weights: layer {layer} has {list(weights.shape)} {weights.dtype}; the "
                f"micro-batch needs floating [{num_tokens}, {topk}] ([tokens, topk])"
            )
    return [
        _GateTargets(indices.long(), weights)
        for indices, weights in zip(routing, gate_weights, strict=True)
    ]


def straight_through_gate_weights(probs: Tensor, experts: Tensor, weights: Tensor) -> Tensor:
    """`probs` `[tokens, experts]` (a router's gate weights, zero off its top-k) with `weights`
    `[tokens, topk]` at the columns `experts` `[tokens, topk]` in the forward (NaN keeps the
    router's own), and the gradient of `probs` itself in the backward."""
    experts = experts.to(probs.device)
    own = probs.detach()
    placed = own.gather(1, experts)
    target = torch.where(
        weights.isnan(), placed, weights.to(device=probs.device, dtype=probs.dtype)
    )
    return (probs - own) + own.scatter(1, experts, target)


def _decision_margins(router: TopKRouter, logits: Tensor) -> Tensor:
    """`[tokens]` how far `router`'s choice on `[tokens, experts]` `logits` was from changing,
    on moe/margins.py's scale-free axis, with its score function, bias and groups."""
    config = router.config
    scores = decision_scores(
        logits,
        score_function=router.score_function,
        expert_bias=router.expert_bias,
        pre_softmax=config.moe_router_pre_softmax,
        grouped=bool(config.moe_router_group_topk),
    )
    return decision_margins(
        scores, router.topk, config.moe_router_num_groups, config.moe_router_group_topk
    )


def _experts(routing_map: Tensor) -> Tensor:
    """`[tokens, experts]` bool with top-k set per row -> `[tokens, topk]` expert indices."""
    return routing_map.nonzero()[:, 1].view(routing_map.shape[0], -1)
