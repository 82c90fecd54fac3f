"""Routes flipped on purpose in the in-process engine: a set dose of routing mismatch between the
engine and the trainer, with everything else equal (rollout.flip_routes; the drift harness's
dose-response grid, docs/drift.md).

A low-precision engine flips a route where the router's k-th and (k+1)-th choices nearly tie:
rounding swaps them. Here, at every router call of a generation, a share of the tokens has its
k-th expert replaced by its (k+1)-th: the tokens with the smallest gap between those two logits
(`at="margin"`, what low precision does) or tokens drawn at random (`at="random"`, the control).
The gate weights are the router's own probabilities of the new choice (renormalised over the
top-k where the model does so), so a flipped token is computed as if its router had preferred
the (k+1)-th expert. The engine samples with, records (for R3) and returns the log-probs of the
flipped routing; the trainer sees only those, as with a real engine. Scoring (the weight-sync
probe) is not flipped.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import Tensor

from megatron_rl.rollout.config import FlipAt

# transformers' softmax top-k routers, by class, and whether each renormalises its top-k weights
# (Qwen3-MoE's as its config says, `norm_topk_prob`; Mixtral's always)
_SOFTMAX_TOP_K: dict[str, Callable[[torch.nn.Module], bool]] = {
    "Qwen3MoeTopKRouter": lambda router: bool(router.norm_topk_prob),
    "MixtralTopKRouter": lambda router: True,
}


def check_flippable(routers: list[torch.nn.Module]) -> None:
    """Raise unless the model has routers and each is a softmax top-k router this module can
    flip (a sigmoid router with groups, DeepSeek-V3's, chooses otherwise)."""
    unfit = sorted({type(r).__name__ for r in routers} - set(_SOFTMAX_TOP_K))
    if not routers or unfit:
        raise ValueError(
            "rollout.flip_routes: flips the routes of softmax top-k routers ("
            f"{', '.join(_SOFTMAX_TOP_K)}); this model has {', '.join(unfit) or 'no router'}"
        )


@dataclass(frozen=True)
class RouteFlips:
    """Flip `share` of each router call's tokens, chosen `at` the smallest margins or at random
    (the latter from a generator seeded with `seed`)."""

    share: float
    at: FlipAt
    seed: int

    def __post_init__(self) -> None:
        if not 0 <= self.share < 1:
            raise ValueError(f"rollout.flip_routes: expected a share in [0, 1), got {self.share}")
        if self.at not in ("margin", "random"):
            raise ValueError(f"rollout.flip_routes_at: expected margin or random, got {self.at!r}")

    def hook(self) -> Callable[[torch.nn.Module, tuple, tuple], tuple]:
        """A forward hook for a transformers softmax top-k router (`check_flippable`: it returns
        logits `[tokens, experts]`, gate weights `[tokens, k]` and experts `[tokens, k]`) that
        returns its output with the dose of flips; one hook serves all of an engine's routers,
        with one generator."""
        generator = torch.Generator().manual_seed(self.seed)

        def flip(module: torch.nn.Module, inputs: tuple, output: tuple) -> tuple:
            logits, _, experts = output
            weights, flipped = flip_routes(
                logits,
                experts,
                share=self.share,
                at=self.at,
                normalize=_SOFTMAX_TOP_K[type(module).__name__](module),
                generator=generator,
            )
            return logits, weights, flipped

        return flip


def flip_routes(
    logits: Tensor,
    experts: Tensor,
    *,
    share: float,
    at: FlipAt,
    normalize: bool,
    generator: torch.Generator,
) -> tuple[Tensor, Tensor]:
    """The gate weights `[tokens, k]` (in `logits`' dtype) and experts `[tokens, k]` of `experts`'
    routing (the top-k of `logits` `[tokens, experts]`, best first) with round(`share` x tokens)
    tokens' k-th expert replaced by their (k+1)-th (module docstring)."""
    tokens, k = experts.shape
    probs = torch.softmax(logits.float(), dim=-1)
    ranked_logits, ranked = torch.topk(logits.float(), k + 1, dim=-1)
    count = round(share * tokens)
    if at == "margin":
        margins = ranked_logits[:, k - 1] - ranked_logits[:, k]
        chosen = torch.argsort(margins, stable=True)[:count]
    else:
        chosen = torch.randperm(tokens, generator=generator)[:count]
    flipped = experts.clone()
    flipped[chosen, k - 1] = ranked[chosen, k].to(experts.dtype)
    weights = probs.gather(1, flipped.long())
    if normalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights.to(logits.dtype), flipped
