"""The router megatron-core's MoE layers get here: its `TopKRouter`, with padding masks that work
for expert-bias counts.

megatron-core 0.16.1 leaves padding out of a router's expert-bias counts with
`routing_map & ~padding_mask` (`transformer/moe/router.py:542`): a `[tokens, experts]` map and a
`[tokens]` mask, which broadcast along the experts and fail (or, with as many tokens as
experts, mask the wrong entries). Later megatron-core masks the tokens (`[tokens, 1]`), as
`PaddingMaskedTopKRouter` does; everything else is the upstream router's.
"""

from __future__ import annotations

import torch
from megatron.core.transformer.moe.router import TopKRouter
from torch import Tensor


class PaddingMaskedTopKRouter(TopKRouter):
    """`TopKRouter` whose expert-bias counts leave out the padding tokens (module docstring)."""

    def _apply_expert_bias(self, routing_map: Tensor, padding_mask: Tensor | None = None) -> None:
        """Add this forward's tokens per expert `[experts]` to the counts the expert-bias update
        reads, padding left out: `routing_map` `[tokens, experts]`, `padding_mask` `[tokens]`
        true at padding. Only forwards with gradients count (no evaluation, no recomputation
        under no_grad), as upstream."""
        if not (self.enable_expert_bias and torch.is_grad_enabled()):
            return
        with torch.no_grad():
            if padding_mask is not None:
                routing_map = routing_map & ~padding_mask.reshape(-1, 1)
            self.local_tokens_per_expert += routing_map.sum(dim=0)
