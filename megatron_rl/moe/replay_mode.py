"""The routing-replay choice of a recipe (`algo.routing_replay`) and what each choice asks of the
trainer and the rollout engine, so that no caller compares the names."""

from __future__ import annotations

from enum import StrEnum


class RoutingReplayMode(StrEnum):
    """none: routers choose freely in every forward; r2: the updates replay the routing the old
    policy's forward recorded; r3: the old-policy forward and the updates replay the routing the
    rollout engine used (its experts; the gate weights are the trainer's); r3_weights: as r3,
    with the engine's gate weights too (the in-process engine returns them; SGLang does not)."""

    NONE = "none"
    R2 = "r2"
    R3 = "r3"
    R3_WEIGHTS = "r3_weights"

    @property
    def replays(self) -> bool:
        """The minibatch updates force a recorded routing instead of routing freely."""
        return self is not RoutingReplayMode.NONE

    @property
    def uses_engine_routing(self) -> bool:
        """The engine returns each token's experts, and the trainer replays them (R3)."""
        return self in (RoutingReplayMode.R3, RoutingReplayMode.R3_WEIGHTS)

    @property
    def replays_gate_weights(self) -> bool:
        """The engine returns each token's gate weights beside its experts, and the trainer
        forces them in the forward (straight through: the router's gradient is its own)."""
        return self is RoutingReplayMode.R3_WEIGHTS

    @property
    def records_old_routing(self) -> bool:
        """The old-policy forward records the routing it chose: R2 replays it, and without
        replay it is what the drift metrics compare the updated routers with."""
        return not self.uses_engine_routing

    @property
    def needs_old_policy_forward(self) -> bool:
        """Only the trainer's old-policy forward can provide the routing (R2 records it there)."""
        return self is RoutingReplayMode.R2
