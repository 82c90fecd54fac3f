"""How close each routing decision was to going the other way, and whether it did.

A router chooses the top-k experts by a selection score: the softmax probability (softmax
routers; the same order as the logits) or the sigmoid score plus the expert bias (DeepSeek-V3's
routers). The *margin* of a (token, layer) is the k-th largest score less the (k+1)-th: how far
the weakest chosen expert is ahead of the strongest one left out. Routes flip at near-ties
(measured on the harness models: a third to a half of the routes with margin under 1e-4 flip
after an update, almost none above 1e-2), so margins say where routing drift will come from.
Group-limited routing (DeepSeek-V3's n_group) is measured over all experts: the margin is then a
lower bound on how far the decision was from flipping.
"""

from __future__ import annotations

from collections.abc import Sequence
from itertools import pairwise

import torch
from torch import Tensor

from megatron_rl.algo.reductions import MetricDeclarations, Reduction

NEAR_TIE = 1e-3
"""A (token, layer) whose margin is below this is a near-tie (`margin/near_tie*`)."""

MARGIN_EDGES = (1e-4, 1e-3, 1e-2)
"""Bucket edges of the flip rate by margin: [0, 1e-4), [1e-4, 1e-3), [1e-3, 1e-2), [1e-2, inf)."""

MARGIN_METRICS: MetricDeclarations = {
    "margin/median": Reduction.MEAN,
    "margin/near_tie": Reduction.MEAN,
    "margin/near_tie_layer/*": Reduction.MEAN,
    # counts, so that rates over a step, a run or a grid are sums over sums
    "margin/routes/*": Reduction.SUM,
    "margin/flips/*": Reduction.SUM,
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
      each bucket of MARGIN_EDGES (`bucket_names`), and how many of them flipped.
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
        inside = bucket == index
        metrics[f"margin/routes/{name}"] = inside.sum().float()
        metrics[f"margin/flips/{name}"] = (inside & kept_flips).sum().float()
    return metrics
