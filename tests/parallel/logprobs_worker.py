"""Worker for the TP-sharded log-prob test: each rank holds half the vocabulary."""

from __future__ import annotations

import torch
from megatron.core import parallel_state

from megatron_rl.parallel.dims import ParallelDims
from megatron_rl.parallel.distributed import LaunchEnv, init_distributed
from megatron_rl.parallel.logprobs import vocab_parallel_logprobs


def sharded_matches_full(launch: LaunchEnv, vocab: int, chunk_sizes: list[int]) -> list[dict]:
    """The errors against the float64 full-vocabulary reference, at each of `chunk_sizes`
    (tokens per chunk; one launch for all of them, as a launch costs seconds)."""
    init_distributed(ParallelDims(world_size=launch.world_size, tp=launch.world_size), launch)
    group = parallel_state.get_tensor_model_parallel_group()
    return [_sharded_errors(launch, group, vocab, chunk) for chunk in chunk_sizes]


def _sharded_errors(launch: LaunchEnv, group, vocab: int, chunk_tokens: int) -> dict:
    gen = torch.Generator().manual_seed(0)
    full = torch.randn(3, 5, vocab, generator=gen, dtype=torch.float64) * 4
    targets = torch.randint(0, vocab, (3, 5), generator=gen)
    weights = torch.randn(2, 3, 5, generator=gen, dtype=torch.float64)

    reference = full.clone().requires_grad_(True)
    log_probs = torch.log_softmax(reference, -1)
    ref_logp = log_probs.gather(-1, targets[..., None]).squeeze(-1)
    ref_entropy = -(log_probs.exp() * log_probs).sum(-1)
    (weights[0] * ref_logp + weights[1] * ref_entropy).sum().backward()

    width = vocab // launch.world_size
    shard = slice(launch.rank * width, (launch.rank + 1) * width)
    local = full[..., shard].float().clone().requires_grad_(True)
    before = local.detach().clone()
    logp, entropy = vocab_parallel_logprobs(local, targets, group=group, chunk_tokens=chunk_tokens)
    (weights[0].float() * logp + weights[1].float() * entropy).sum().backward()
    return {
        "logp_error": float((logp.double() - ref_logp).abs().max()),
        "entropy_error": float((entropy.double() - ref_entropy).abs().max()),
        "grad_error": float((local.grad.double() - reference.grad[..., shard]).abs().max()),
        "logits_untouched": bool(torch.equal(local.detach(), before)),
    }
