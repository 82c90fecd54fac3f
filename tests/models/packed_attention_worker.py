"""Worker of the packed-attention test (run on gloo ranks by tests.parallel.harness)."""

from __future__ import annotations

import torch
from megatron.core import parallel_state
from megatron.core.packed_seq_params import PackedSeqParams

from megatron_rl.models.build import build_gpt_moe
from megatron_rl.parallel.dims import ParallelDims
from megatron_rl.parallel.distributed import LaunchEnv, init_distributed
from megatron_rl.parallel.packing import packed_positions
from tests.moe.replay_worker import TINY_DEEPSEEK
from tests.parallel.invariance import TINY_MOE

MODELS = {"qwen3_like": TINY_MOE, "deepseek_like": TINY_DEEPSEEK}
# Sequences of unlike lengths; packed, they fill 64 tokens (a multiple of TP = 2).
LENGTHS = (23, 9, 17, 15)


def packed_equals_padded(launch: LaunchEnv, model_name: str, layout: dict[str, int]) -> dict:
    """The same sequences through one model, right-padded `[4, 24]` and packed `[1, 64]`: the
    largest difference of the logits at the sequences' positions and of every gradient of a
    weighted sum of them (the weights drawn per sequence position, equal in both forms)."""
    dims = ParallelDims(world_size=launch.world_size, **layout)
    init_distributed(dims, launch, seed=5)
    config = MODELS[model_name]
    model = build_gpt_moe(config, dims)
    gen = torch.Generator().manual_seed(1)
    sequences = [torch.randint(0, config.vocab_size, (n,), generator=gen) for n in LENGTHS]
    width = max(LENGTHS) + 1  # a multiple of TP = 2 (sequence parallelism splits it)
    padded = torch.zeros(len(LENGTHS), width, dtype=torch.long)
    for row, sequence in enumerate(sequences):
        padded[row, : len(sequence)] = sequence
    cu_seqlens = torch.tensor([0, *torch.tensor(LENGTHS).cumsum(0).tolist()], dtype=torch.int32)
    sequence_of, position = packed_positions(cu_seqlens)
    weights = torch.randn(len(LENGTHS), width, config.vocab_size, generator=gen)

    def run(packed: bool) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        model.zero_grad(set_to_none=True)
        if packed:
            params = PackedSeqParams(
                qkv_format="thd",
                cu_seqlens_q=cu_seqlens,
                cu_seqlens_kv=cu_seqlens,
                max_seqlen_q=width,
                max_seqlen_kv=width,
            )
            logits = model(
                torch.cat(sequences)[None], position[None], None, packed_seq_params=params
            )[0]
        else:
            logits = model(padded, torch.arange(width).expand_as(padded), None)
            logits = logits[sequence_of, position]
        vocab = logits.shape[-1]  # this TP rank's share of the vocabulary
        start = vocab * parallel_state.get_tensor_model_parallel_rank()
        chosen = weights[sequence_of, position][:, start : start + vocab]
        (logits * chosen).sum().backward()
        grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
        for name, param in model.named_parameters():
            # Sequence parallelism: a replicated weight's gradient is the sum over the TP ranks
            # (each saw its share of the tokens; the two forms share them out differently).
            if getattr(param, "sequence_parallel", False) and name in grads:
                torch.distributed.all_reduce(
                    grads[name], group=parallel_state.get_tensor_model_parallel_group()
                )
        return logits.detach(), grads

    padded_logits, padded_grads = run(packed=False)
    packed_logits, packed_grads = run(packed=True)
    return {
        "logits_diff": float((packed_logits - padded_logits).abs().max()),
        "logits_scale": float(padded_logits.abs().max()),
        "same_grads": sorted(packed_grads) == sorted(padded_grads),
        "grads": len(padded_grads),
        "grad_diff": max(float((packed_grads[n] - g).abs().max()) for n, g in padded_grads.items()),
        "grad_scale": max(float(g.abs().max()) for g in padded_grads.values()),
    }
