"""Routed experts in two grouped GEMMs instead of a loop over experts.

megatron-core 0.16 runs a layer's experts either as `TEGroupedMLP` / `GroupedMLP` (Transformer
Engine or the grouped_gemm package: GPU) or as `SequentialMLP`, a Python loop of one small MLP
per expert. On CPU the loop's per-expert overhead dominates fine-grained models (64 experts of
width 16: a step took 2.8x that of 8 experts of width 64 with the same active parameters).
`GroupedSequentialMLP` is `SequentialMLP` with the same experts, weights, checkpoint keys and
sharding, whose forward stacks the local experts' weights and runs all of them at once with
`torch.nn.functional.grouped_mm` (forward and backward on CPU in torch 2.13): the same sums
over the same numbers, so the outputs and gradients equal the loop's (tests/moe).

It takes the loop's place only where the loop's own MLP reduces to those two matmuls: experts
not split by tensor parallelism, no biases, a gated SiLU or a plain activation, no FP8/FP4, no
activation clamp or GLU offset; anywhere else it runs the loop.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from megatron.core.transformer.moe.experts import SequentialMLP
from torch import Tensor


class GroupedSequentialMLP(SequentialMLP):
    """`SequentialMLP` whose local experts run in two grouped GEMMs (module docstring)."""

    def _groups(self) -> bool:
        config = self.config
        return (
            self.num_local_experts > 1
            and self.tp_group.size() == 1
            and not config.add_bias_linear
            and not config.moe_apply_probs_on_input
            and not (config.fp8 or config.fp4)
            and config.activation_func_clamp_value is None
            and config.glu_linear_offset == 0
            and not config.use_te_activation_func
            and not config.bias_activation_fusion
        )

    def forward(
        self,
        permuted_local_hidden_states: Tensor,
        tokens_per_expert: Tensor,
        permuted_probs: Tensor,
    ) -> tuple[Tensor, None]:
        """`[tokens, hidden]` inputs sorted by local expert, `[local experts]` token counts and
        `[tokens]` gate weights -> `[tokens, hidden]` each token's expert output times its
        gate weight (and no bias)."""
        if not self._groups():
            return super().forward(permuted_local_hidden_states, tokens_per_expert, permuted_probs)
        inputs = permuted_local_hidden_states
        # megatron-core keeps Linear weights as [out, in]; grouped_mm takes [experts, in, out].
        fc1 = torch.stack([expert.linear_fc1.weight for expert in self.local_experts])
        fc2 = torch.stack([expert.linear_fc2.weight for expert in self.local_experts])
        ends = tokens_per_expert.to(device=inputs.device, dtype=torch.int32).cumsum(0)
        ends = ends.to(torch.int32)
        hidden = F.grouped_mm(inputs, fc1.transpose(1, 2), offs=ends)
        if self.config.gated_linear_unit:
            gate, linear = torch.chunk(hidden, 2, dim=-1)
            hidden = self.config.activation_func(gate) * linear
        else:
            hidden = self.config.activation_func(hidden)
        hidden = (hidden * permuted_probs.unsqueeze(-1)).to(inputs.dtype)
        return F.grouped_mm(hidden, fc2.transpose(1, 2), offs=ends), None
