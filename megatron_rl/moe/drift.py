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
    "drift/activated_experts": Reduction.MEAN,
    "drift/layer/*": Reduction.MEAN,
    "drift/activated_layer/*": Reduction.MEAN,
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


def changed_routes(old: Tensor, new: Tensor) -> Tensor:
    """`[tokens, layers]` bool: the (token, layer) pairs whose expert set differs between the
    records `[tokens, layers, topk]`."""
    _check(old, new, None)
    return _shared_experts(old, new) < old.shape[2]


def _shared_experts(old: Tensor, new: Tensor) -> Tensor:
    """`[tokens, layers]` |A & B| of the expert sets, by comparing every pair of slots (indices
    within a set are distinct)."""
    return (old[..., :, None] == new[..., None, :]).sum(dim=(-1, -2))


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
    - `drift/activated_experts`: the papers' measure (GSPO, arXiv 2507.18071): the fraction of
      activated experts, (token, layer, chosen expert) triples of `old`, no longer chosen in
      `new`, i.e. the mean over (token, layer) of |A - B| / topk;
    - `drift/layer/<i>`: fraction of tokens whose expert set differs at model layer i;
    - `drift/activated_layer/<i>`: `drift/activated_experts` at model layer i.

    All values are 0-dim float tensors (no host sync).
    """
    mask = _check(old, new, mask)
    topk = old.shape[2]
    shared = _shared_experts(old, new)  # [tokens, layers]
    differs = shared < topk
    dropped = (topk - shared).float() / topk  # share of the old set's experts no longer chosen
    jaccard = shared.float() / (2 * topk - shared).float()
    weight = mask.float()[:, None].expand_as(jaccard)
    pairs = weight.sum().clamp(min=1)
    metrics = {
        "drift/token_layer": (differs.float() * weight).sum() / pairs,
        "drift/token_any": (differs.any(dim=1).float() * mask.float()).sum()
        / mask.sum().clamp(min=1),
        "drift/jaccard": (jaccard * weight).sum() / pairs,
        "drift/activated_experts": (dropped * weight).sum() / pairs,
    }
    tokens = mask.sum().clamp(min=1)
    per_layer = (differs.float() * weight).sum(dim=0) / tokens
    activated_per_layer = (dropped * weight).sum(dim=0) / tokens
    layer_numbers = range(old.shape[1]) if layer_numbers is None else layer_numbers
    if len(layer_numbers) != old.shape[1]:
        raise ValueError(
            f"layer_numbers: {len(layer_numbers)} given for records of {old.shape[1]} layers"
        )
    for column, layer in enumerate(layer_numbers):
        metrics[f"drift/layer/{layer}"] = per_layer[column]
        metrics[f"drift/activated_layer/{layer}"] = activated_per_layer[column]
    return metrics


def routing_bytes(records: list[Tensor]) -> int:
    """Bytes held by recorded routing (the replay's memory)."""
    return sum(record.numel() * record.element_size() for record in records)


# What routing_share_of_log_ratio reports: shares of one update's forward, which average.
LOG_RATIO_SHARE_METRICS: MetricDeclarations = {
    "routing/log_ratio_var_share": Reduction.MEAN,
    "routing/log_ratio_abs_share": Reduction.MEAN,
    "routing/log_ratio_var_free": Reduction.MEAN,
    "routing/log_ratio_var_held": Reduction.MEAN,
}


def routing_share_of_log_ratio(
    free_logp: Tensor, replayed_logp: Tensor, old_logp: Tensor, mask: Tensor
) -> dict[str, Tensor]:
    """How much of the token log-ratios routing causes, paired on the same parameters: the
    log-probs `[b, S]` with the routers choosing freely and with the old routing replayed, each
    against the old log-probs, over the tokens in `mask` (`[b, S]` bool):

    - `routing/log_ratio_var_share`: 1 - var(replayed log-ratio) / var(free log-ratio): the share
      of the log-ratio's variance that goes away when the routing is held (0 when routing adds
      nothing; negative when holding the routing makes the ratios vary more);
    - `routing/log_ratio_abs_share`: the same with the mean |log-ratio|;
    - `routing/log_ratio_var_free`, `routing/log_ratio_var_held`: the two variances. A share of
      one micro-batch's ~200 heavy-tailed tokens is noisy and often negative, so its mean over
      steps is biased; 1 - sum(held) / sum(free) over a run pools them (bench/drift/summary.py).

    The shares are 0 when the free log-ratio is 0 everywhere (nothing to explain).
    """
    if not free_logp.shape == replayed_logp.shape == old_logp.shape == mask.shape:
        raise ValueError(
            f"log-probs free {list(free_logp.shape)}, replayed {list(replayed_logp.shape)}, old "
            f"{list(old_logp.shape)} and mask {list(mask.shape)}: expected one shape [b, S]"
        )
    free = (free_logp - old_logp)[mask].double()
    held = (replayed_logp - old_logp)[mask].double()

    def share(held_part: Tensor, free_part: Tensor) -> Tensor:
        if free_part <= 0:
            return torch.zeros((), dtype=torch.float64)
        return 1 - held_part / free_part

    if free.numel() == 0:
        zero = torch.zeros((), dtype=torch.float64)
        return {key: zero for key in LOG_RATIO_SHARE_METRICS}
    var_free, var_held = free.var(unbiased=False), held.var(unbiased=False)
    return {
        "routing/log_ratio_var_share": share(var_held, var_free),
        "routing/log_ratio_abs_share": share(held.abs().mean(), free.abs().mean()),
        "routing/log_ratio_var_free": var_free,
        "routing/log_ratio_var_held": var_held,
    }
