"""How much expert routing moved between two records of the same tokens.

A routing record is an integer tensor `[tokens, layers, topk]` of expert indices (SGLang's
`routed_experts` layout; the trainer's records are stacked the same way). Each (token, layer)
pair is a *set* of top-k experts: the order within top-k does not count.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor

from megatron_rl.algo.reductions import MetricDeclarations, Reduction

# What routing_drift reports (megatron_rl.algo.reductions): shares and means, which average.
DRIFT_METRICS: MetricDeclarations = {
    "drift/token_layer": Reduction.MEAN,
    "drift/token_any": Reduction.MEAN,
    "drift/jaccard": Reduction.MEAN,
    "drift/layer/*": Reduction.MEAN,
}


def _check(old: Tensor, new: Tensor, mask: Tensor | None) -> Tensor:
    for name, record in (("old", old), ("new", new)):
        if record.dim() != 3 or record.is_floating_point():
            raise ValueError(
                f"{name}: expected integer expert indices [tokens, layers, topk], got "
                f"{list(record.shape)} {record.dtype}"
            )
    if old.shape != new.shape:
        raise ValueError(
            f"routing records disagree in shape: old {list(old.shape)} vs new {list(new.shape)} "
            "([tokens, layers, topk])"
        )
    if mask is None:
        return torch.ones(old.shape[0], dtype=torch.bool, device=old.device)
    if mask.dtype != torch.bool or mask.shape != old.shape[:1]:
        raise ValueError(f"mask: expected bool [tokens] = [{old.shape[0]}], got {list(mask.shape)}")
    return mask


def routing_drift(
    old: Tensor,
    new: Tensor,
    mask: Tensor | None = None,
    layer_numbers: Sequence[int] | None = None,
) -> dict[str, Tensor]:
    """Drift metrics between two routing records `[tokens, layers, topk]` over the tokens in
    `mask` (`[tokens]` bool; all by default); `layer_numbers` are the model layers the records'
    layers are (by default 0, 1, ...; a model whose first layers are dense starts later):

    - `drift/token_layer`: fraction of (token, layer) pairs whose expert set differs;
    - `drift/token_any`: fraction of tokens with at least one layer different;
    - `drift/jaccard`: mean Jaccard similarity |A & B| / |A | B| of the expert sets;
    - `drift/layer/<i>`: fraction of tokens whose expert set differs at model layer i.

    All values are 0-dim float tensors (no host sync).
    """
    mask = _check(old, new, mask)
    topk = old.shape[2]
    # |A & B| by comparing every pair of slots (indices within a set are distinct)
    shared = (old[..., :, None] == new[..., None, :]).sum(dim=(-1, -2))  # [tokens, layers]
    differs = shared < topk
    jaccard = shared.float() / (2 * topk - shared).float()
    weight = mask.float()[:, None].expand_as(jaccard)
    pairs = weight.sum().clamp(min=1)
    metrics = {
        "drift/token_layer": (differs.float() * weight).sum() / pairs,
        "drift/token_any": (differs.any(dim=1).float() * mask.float()).sum()
        / mask.sum().clamp(min=1),
        "drift/jaccard": (jaccard * weight).sum() / pairs,
    }
    per_layer = (differs.float() * weight).sum(dim=0) / mask.sum().clamp(min=1)
    layer_numbers = range(old.shape[1]) if layer_numbers is None else layer_numbers
    if len(layer_numbers) != old.shape[1]:
        raise ValueError(
            f"layer_numbers: {len(layer_numbers)} given for records of {old.shape[1]} layers"
        )
    for column, layer in enumerate(layer_numbers):
        metrics[f"drift/layer/{layer}"] = per_layer[column]
    return metrics


def routing_bytes(records: list[Tensor]) -> int:
    """Bytes held by recorded routing (the replay's memory)."""
    return sum(record.numel() * record.element_size() for record in records)
