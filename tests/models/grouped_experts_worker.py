"""Worker of the grouped-experts test (run on gloo ranks by tests.parallel.harness)."""

from __future__ import annotations

from dataclasses import replace

import torch

from megatron_rl.models.build import build_gpt_moe
from megatron_rl.models.grouped_experts import GroupedSequentialMLP
from megatron_rl.parallel.dims import ParallelDims
from megatron_rl.parallel.distributed import LaunchEnv, init_distributed
from tests.parallel.invariance import TINY_MOE

# Fine-grained experts: 64 of width 16, top-8, the drift harness's shape.
FINE = replace(TINY_MOE, num_experts=64, router_topk=8, moe_ffn_hidden_size=16)


def grouped_equals_loop(launch: LaunchEnv, ep: int) -> dict[str, object]:
    """One forward and backward of a fine-grained model, with its experts in grouped GEMMs and
    again through megatron-core's loop (SequentialMLP.forward) on the same weights and tokens:
    the largest differences of the logits and of every gradient, and how many expert modules
    ran grouped."""
    dims = ParallelDims(world_size=launch.world_size, ep=ep)
    init_distributed(dims, launch, seed=5)
    model = build_gpt_moe(FINE, dims)
    grouped = [m for m in model.modules() if isinstance(m, GroupedSequentialMLP)]
    tokens = torch.randint(0, FINE.vocab_size, (4, 32), generator=torch.Generator().manual_seed(1))
    positions = torch.arange(32).expand(4, 32)
    weights = torch.randn(4, 32, FINE.vocab_size // 1, generator=torch.Generator().manual_seed(2))

    def run() -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        model.zero_grad(set_to_none=True)
        logits = model(tokens, positions, attention_mask=None)
        (logits * weights[..., : logits.shape[-1]]).sum().backward()
        grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
        return logits.detach(), grads

    logits, grads = run()
    original = GroupedSequentialMLP._groups
    GroupedSequentialMLP._groups = lambda self: False  # megatron-core's own loop
    try:
        loop_logits, loop_grads = run()
    finally:
        GroupedSequentialMLP._groups = original
    expert_grads = [n for n in grads if "local_experts" in n]
    return {
        "grouped_modules": sum(m._groups() for m in grouped),
        "logits_diff": float((logits - loop_logits).abs().max()),
        "logits_scale": float(loop_logits.abs().max()),
        "grad_diff": max(float((grads[n] - loop_grads[n]).abs().max()) for n in loop_grads),
        "same_grads": sorted(grads) == sorted(loop_grads),
        "expert_grads": len(expert_grads),
        "expert_grad_norm": sum(float(grads[n].norm()) for n in expert_grads),
    }
