"""How close each routing decision was to going the other way, and whether it did.

A router chooses the top-k experts by its selection scores, as megatron-core ranks them: the
logits (softmax routers; softmax keeps their order), the softmax probabilities (pre-softmax
routers), or the sigmoid score plus the expert bias (DeepSeek-V3's routers); group-limited
routing (n_group) first keeps the groups whose top scores sum highest. The *margin* of a
(token, layer) is how far the decision was from changing, in units that do not depend on the
number of experts or the score function's scale (`decision_scores`): the gap between the weakest
chosen expert and the strongest one left out, in logits for softmax routers (a log-probability
ratio), and in standard deviations of the token's scores for the others; under group-limited
routing the smaller of that gap within the kept groups and the gap between the last kept group
and the first dropped one (a group-score tie flips routes whatever the experts' own gaps).
Routes flip at small margins, so margins say where routing drift will come from.
"""

from __future__ import annotations

from collections.abc import Sequence
from itertools import pairwise

import torch
from torch import Tensor

from megatron_rl.algo.reductions import MetricDeclarations, Reduction

NEAR_TIE = 0.01
"""A (token, layer) whose margin is below this is a near-tie (`margin/near_tie*`): a hundredth
of a logit, or of the token's score spread."""

MARGIN_EDGES = (1e-3, 1e-2, 1e-1, 1.0)
"""Bucket edges of the flip rate by margin: [0, 1e-3), [1e-3, 1e-2), ..., [1, inf)."""

MARGIN_METRICS: MetricDeclarations = {
    "margin/median": Reduction.MEAN,
    "margin/near_tie": Reduction.MEAN,
    "margin/near_tie_layer/*": Reduction.MEAN,
    # counts, so that rates over a step, a run or a grid are sums over sums; per layer too
    "margin/routes/*": Reduction.SUM,
    "margin/flips/*": Reduction.SUM,
    "margin/routes_layer/*": Reduction.SUM,
    "margin/flips_layer/*": Reduction.SUM,
}


def bucket_names() -> list[str]:
    """Names of the margin buckets, in order: `lt1e-04`, `1e-04_1e-03`, ..., `ge1e-02`."""
    edges = [f"{edge:.0e}" for edge in MARGIN_EDGES]
    return [f"lt{edges[0]}", *(f"{a}_{b}" for a, b in pairwise(edges)), f"ge{edges[-1]}"]


def selection_scores(
    logits: Tensor, *, score_function: str, expert_bias: Tensor | None = None
) -> Tensor:
    """`[tokens, experts]` router logits -> the scores top-k is taken by, `[tokens, experts]`
    float32: softmax probabilities, or sigmoid scores plus `expert_bias` (`[experts]`)."""
    logits = logits.float()
    if score_function == "softmax":
        return torch.softmax(logits, dim=-1)
    if score_function == "sigmoid":
        scores = torch.sigmoid(logits)
        return scores if expert_bias is None else scores + expert_bias.float()
    raise ValueError(f"score_function: expected 'softmax' or 'sigmoid', got {score_function!r}")


def decision_scores(
    logits: Tensor,
    *,
    score_function: str,
    expert_bias: Tensor | None = None,
    pre_softmax: bool = False,
    grouped: bool = False,
) -> Tensor:
    """`[tokens, experts]` router logits -> `[tokens, experts]` float32 scores that rank experts
    (and, summed, groups) as megatron-core's top-k does, on a scale-free axis: the logits of a
    softmax router (a gap is the log of the two experts' probability ratio), else the selection
    scores over their standard deviation across the token's experts (sigmoid + bias; the
    probabilities of a pre-softmax router with groups, whose group sums are over probabilities)."""
    if score_function == "softmax" and not (pre_softmax and grouped):
        return logits.float()
    scores = selection_scores(logits, score_function=score_function, expert_bias=expert_bias)
    spread = scores.std(dim=-1, keepdim=True).clamp_min(torch.finfo(torch.float32).tiny)
    return scores / spread


def decision_margins(
    scores: Tensor, topk: int, num_groups: int | None = None, group_topk: int | None = None
) -> Tensor:
    """`[tokens, experts]` decision scores -> `[tokens]` margins (module docstring): the top-k
    margin, or under group-limited routing (`group_topk` of `num_groups` groups, ranked by the sum
    of their top topk // group_topk scores) the smaller of the group margin and the top-k margin
    among the kept groups' experts."""
    if not group_topk:
        return topk_margins(scores, topk)
    if not num_groups or scores.shape[-1] % num_groups:
        raise ValueError(
            f"num_groups: expected a divisor of the {scores.shape[-1]} experts, got {num_groups}"
        )
    tokens, experts = scores.shape
    per_group = experts // num_groups
    grouped = scores.view(tokens, num_groups, per_group)
    group_scores = grouped.topk(topk // group_topk, dim=-1).values.sum(dim=-1)  # [tokens, groups]
    kept = torch.zeros_like(group_scores, dtype=torch.bool)
    kept.scatter_(1, group_scores.topk(group_topk, dim=-1).indices, True)
    eligible = scores.masked_fill(~kept.repeat_interleave(per_group, dim=1), -torch.inf)
    return torch.minimum(topk_margins(group_scores, group_topk), topk_margins(eligible, topk))


def topk_margins(scores: Tensor, topk: int) -> Tensor:
    """`[tokens, experts]` selection scores -> `[tokens]` the k-th largest less the (k+1)-th;
    +inf when every expert is chosen (nothing could take a chosen expert's place)."""
    if scores.dim() != 2 or not 1 <= topk <= scores.shape[1]:
        raise ValueError(
            f"scores: expected [tokens, experts] with topk in [1, experts], got "
            f"{list(scores.shape)} and topk {topk}"
        )
    if topk == scores.shape[1]:
        return torch.full(scores.shape[:1], torch.inf, device=scores.device)
    top = scores.topk(topk + 1, dim=-1).values
    return top[:, topk - 1] - top[:, topk]


def margin_metrics(
    margins: Tensor,
    flipped: Tensor,
    mask: Tensor | None = None,
    layer_numbers: Sequence[int] | None = None,
) -> dict[str, Tensor]:
    """Margins `[tokens, layers]` of one routing and whether each (token, layer) flipped
    (`[tokens, layers]` bool: its expert set changed afterwards), over the tokens in `mask`
    (`[tokens]` bool; all by default):

    - `margin/median`: the median margin;
    - `margin/near_tie`: the share of (token, layer) with margin below NEAR_TIE, and
      `margin/near_tie_layer/<i>` at model layer i (`layer_numbers`, by default 0, 1, ...);
    - `margin/routes/<bucket>`, `margin/flips/<bucket>`: (token, layer) pairs with a margin in
      each bucket of MARGIN_EDGES (`bucket_names`), and how many of them flipped;
      `margin/routes_layer/<i>/<bucket>` and `margin/flips_layer/<i>/<bucket>` at layer i.
    """
    if margins.shape != flipped.shape or margins.dim() != 2 or flipped.dtype != torch.bool:
        raise ValueError(
            f"margins {list(margins.shape)} and flipped {list(flipped.shape)} {flipped.dtype}: "
            "expected float and bool [tokens, layers] of one shape"
        )
    if mask is None:
        mask = torch.ones(margins.shape[0], dtype=torch.bool, device=margins.device)
    layer_numbers = range(margins.shape[1]) if layer_numbers is None else layer_numbers
    if len(layer_numbers) != margins.shape[1]:
        raise ValueError(
            f"layer_numbers: {len(layer_numbers)} given for margins of {margins.shape[1]} layers"
        )
    kept, kept_flips = margins[mask], flipped[mask]  # [tokens kept, layers]
    near = (kept < NEAR_TIE).float()
    metrics = {
        "margin/median": kept.median() if kept.numel() else torch.tensor(torch.nan),
        "margin/near_tie": near.mean() if kept.numel() else torch.tensor(torch.nan),
    }
    per_layer = near.mean(dim=0) if kept.shape[0] else torch.full((kept.shape[1],), torch.nan)
    for column, layer in enumerate(layer_numbers):
        metrics[f"margin/near_tie_layer/{layer}"] = per_layer[column]
    edges = torch.tensor(MARGIN_EDGES, dtype=kept.dtype, device=kept.device)
    bucket = torch.bucketize(kept, edges, right=True)  # 0 .. len(edges)
    for index, name in enumerate(bucket_names()):
        inside = bucket == index  # [tokens kept, layers]
        routes, flips = inside.sum(dim=0).float(), (inside & kept_flips).sum(dim=0).float()
        metrics[f"margin/routes/{name}"] = routes.sum()
        metrics[f"margin/flips/{name}"] = flips.sum()
        for column, layer in enumerate(layer_numbers):
            metrics[f"margin/routes_layer/{layer}/{name}"] = routes[column]
            metrics[f"margin/flips_layer/{layer}/{name}"] = flips[column]
    return metrics
