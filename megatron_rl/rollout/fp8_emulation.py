"""FP8 (e4m3) rounding of a float32 model's linear layers, emulated: `rollout.engine_dtype:
float8_emulated`.

FP8 rollout engines (SGLang and vLLM serving DeepSeek-V3-style block-quantised checkpoints) run
every linear layer's matmul on e4m3 operands: the weight in 128x128 blocks, each with its own
scale, and the activation entering the layer per token in groups of 128 along the hidden
dimension (DeepSeek-V3 technical report, section 3.3). This module reproduces that *rounding*,
not its speed: each operand is quantised and dequantised (x / scale -> e4m3 -> float32 * scale,
scale = amax / 448, the e4m3 maximum) and the matmul itself runs in float32, so that a float32
trainer sees the probabilities an FP8 engine would give it.

What is quantised, for a transformers causal LM (`Fp8Emulation`):
    - every torch.nn.Linear (attention projections, dense and shared-expert MLPs): weights in
      128x128 blocks, inputs per (token, 128-group);
    - the MoE routers (their `[experts, hidden]` weight and their input alike; DeepSeek-V3's
      own FP8 release keeps its router in bf16, this emulation is the stricter arm);
    - the routed experts, whose weights transformers keeps fused as 3-D parameters
      (`gate_up_proj [experts, 2 * inter, hidden]`, `down_proj [experts, hidden, inter]`) and
      runs through grouped_mm or batched_mm: the weights are quantised by whoever writes them
      (the engine quantises each expert's checkpoint tensor, gate, up and down apart, as the
      checkpoint stores them), the input of gate/up by a pre-hook on the experts module and the
      input of down (the gated activation `act(gate) * up`) by wrapping the module's
      `_apply_gate`, which those two implementations call between the matmuls. transformers'
      "eager" experts loop computes the gated activation inline, so it is refused.
What is not: the token embeddings and lm_head (as FP8 checkpoints keep them), norms, router
biases, attention's own matmuls (QK^T, PV), softmaxes and the residual stream; and the matmul
outputs stay float32 where a real engine would write bf16.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch
from torch import Tensor, nn

E4M3_MAX = 448.0
"""Largest finite float8_e4m3fn value."""
BLOCK = 128
"""Side of a weight's quantisation block and length of an activation's quantisation group."""

# The experts implementations that call `_apply_gate` between their two matmuls.
_GATED_EXPERTS = ("grouped_mm", "batched_mm")


def _round_e4m3(values: Tensor, amax: Tensor) -> Tensor:
    """`values` rounded to e4m3 at scale `amax / 448` (broadcast against `values`), in float32;
    a group whose amax is 0 is all zeros and stays so."""
    scale = amax / E4M3_MAX
    scale = torch.where(scale > 0, scale, torch.ones_like(scale))
    # torch's cast saturates at 448 as well; the clamp makes it independent of that (and is
    # what SGLang's quantisation kernels do).
    scaled = (values / scale).clamp(-E4M3_MAX, E4M3_MAX)
    return scaled.to(torch.float8_e4m3fn).to(torch.float32) * scale


def quantize_weight_blocks(weight: Tensor, block: int = BLOCK) -> Tensor:
    """`weight` `[..., rows, cols]` (one matrix, or a stack of them such as `[experts, out, in]`)
    rounded to e4m3 in `block` x `block` tiles of each matrix, each tile scaled by its own
    amax / 448; returned dequantised, float32, same shape. The last row and column of tiles
    are partial where rows or cols is not a multiple of `block` (their amax is over the
    elements they hold)."""
    *lead, rows, cols = weight.shape
    values = weight.detach().to(torch.float32)
    pad_rows, pad_cols = -rows % block, -cols % block
    # Zero padding leaves each tile's amax as it is.
    padded = nn.functional.pad(values, (0, pad_cols, 0, pad_rows))
    row_tiles, col_tiles = (rows + pad_rows) // block, (cols + pad_cols) // block
    tiles = padded.reshape(*lead, row_tiles, block, col_tiles, block)
    amax = tiles.abs().amax(dim=(-3, -1), keepdim=True)  # [..., row tiles, 1, col tiles, 1]
    rounded = _round_e4m3(tiles, amax).reshape(padded.shape)
    return rounded[..., :rows, :cols].contiguous()


def quantize_activation_groups(activation: Tensor, group: int = BLOCK) -> Tensor:
    """`activation` `[..., hidden]` rounded to e4m3 per token (each leading index) in groups of
    `group` consecutive hidden elements, each scaled by its own amax / 448 (the last group is
    partial where hidden is not a multiple of `group`); returned dequantised, float32, same
    shape."""
    *lead, hidden = activation.shape
    values = activation.to(torch.float32)
    pad = -hidden % group
    groups = nn.functional.pad(values, (0, pad)).reshape(*lead, (hidden + pad) // group, group)
    amax = groups.abs().amax(dim=-1, keepdim=True)  # [..., groups, 1]
    return _round_e4m3(groups, amax).reshape(*lead, hidden + pad)[..., :hidden]


def _quantize_first_input(module: nn.Module, args: tuple, kwargs: dict[str, Any]) -> Any:
    """Forward pre-hook: the module's input (first positional argument, or `input` /
    `hidden_states` given by name) quantised per (token, 128-group)."""
    if args:
        return (quantize_activation_groups(args[0]), *args[1:]), kwargs
    for name in ("input", "hidden_states"):
        if name in kwargs:
            return args, {**kwargs, name: quantize_activation_groups(kwargs[name])}
    raise TypeError(f"fp8 emulation: {type(module).__name__} was called without an input")


class Fp8Emulation:
    """Activation quantisers hooked onto `model`, and the parameters whose weights must be
    quantised (module docstring: which, and which not).

    The weights are left to the caller: it writes them (at load and at every weight sync)
    through `quantize_weight_blocks`, per checkpoint tensor, so that every version the engine
    serves is quantised; `weights` names the parameters to which that applies.

    Args:
        model: a float32 transformers model.
        routers: its MoE router modules (a 2-D `weight`, called with the hidden states).
        unquantised: modules left in float32 (the embeddings and lm_head).

    Raises:
        ValueError: a parameter of two or more dimensions that none of the above covers (a
            layer kind this emulation does not know), a model that is not float32, or MoE
            experts run by an implementation that computes the gated activation inline.
    """

    def __init__(
        self,
        model: nn.Module,
        *,
        routers: Iterable[nn.Module],
        unquantised: Iterable[nn.Module],
    ) -> None:
        dtypes = {param.dtype for param in model.parameters()}
        if dtypes != {torch.float32}:
            got = sorted(map(str, dtypes))
            raise ValueError(f"fp8 emulation: needs a float32 model, got {got}")
        routers = list(routers)
        left_alone = {id(p) for module in unquantised for p in module.parameters()}
        self.weights: list[nn.Parameter] = []
        for module in model.modules():
            if any(id(p) in left_alone for p in module.parameters(recurse=False)):
                continue
            if isinstance(module, nn.Linear) or any(module is r for r in routers):
                self.weights.append(module.weight)
            elif _is_fused_experts(module):
                self._check_gated(module)
                self.weights += [p for p in module.parameters(recurse=False) if p.dim() == 3]
                module._apply_gate = _quantized_gate(module._apply_gate)
            else:
                continue
            module.register_forward_pre_hook(_quantize_first_input, with_kwargs=True)
        covered = left_alone | {id(p) for p in self.weights}
        missed = [n for n, p in model.named_parameters() if p.dim() >= 2 and id(p) not in covered]
        if missed:
            raise ValueError(
                f"fp8 emulation: no rule for parameter(s) {missed[:3]} (neither a Linear, a "
                "router, fused experts, an embedding nor lm_head)"
            )

    @staticmethod
    def _check_gated(experts: nn.Module) -> None:
        implementation = getattr(getattr(experts, "config", None), "_experts_implementation", None)
        if not getattr(experts, "has_gate", False) or implementation not in _GATED_EXPERTS:
            raise ValueError(
                f"fp8 emulation: {type(experts).__name__} runs as experts_implementation="
                f"{implementation!r} (gated: {getattr(experts, 'has_gate', None)}); the input of "
                f"its down projection can be quantised with a gated {' or '.join(_GATED_EXPERTS)} "
                "only"
            )


def _is_fused_experts(module: nn.Module) -> bool:
    """transformers' MoE experts (`use_experts_implementation`): 3-D weight parameters
    `[experts, out, in]` and the gating step `_apply_gate` between the two matmuls."""
    own = list(module.parameters(recurse=False))
    return hasattr(module, "_apply_gate") and bool(own) and all(p.dim() == 3 for p in own)


def _quantized_gate(apply_gate: Any) -> Any:
    """`apply_gate` (`[tokens x topk, 2 * inter]` -> `[tokens x topk, inter]`) with its output,
    the down projection's input, quantised per (row, 128-group)."""

    def gate(gate_up: Tensor) -> Tensor:
        return quantize_activation_groups(apply_gate(gate_up))

    return gate
