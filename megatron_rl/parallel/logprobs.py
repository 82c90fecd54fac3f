"""Per-token log-probs and entropy from vocab-parallel logits, without gathering the vocabulary.

Each tensor-parallel rank holds logits for its slice of the vocabulary, `[..., V / tp]`. The
softmax normaliser needs two reductions over the TP group (max, then sum of exponentials); the
sampled token's logit lives on one rank and is summed in. Nothing of size V is gathered.

Memory: forward and backward walk the tokens in chunks, so the float32 temporaries are
`[chunk, V / tp]`, not `[tokens, V / tp]`; backward recomputes the softmax of each chunk from the
saved logits instead of saving probabilities. The logits are read, never written (megatron-core's
`vocab_parallel_cross_entropy`, by contrast, modifies its input in place).
"""

from __future__ import annotations

from typing import Any, NamedTuple

import torch
import torch.distributed as dist
from torch import Tensor

# Float32 elements per chunk temporary. On the host small chunks stay in the allocator's reused
# memory and in cache (chunks of hundreds of MB are mmap-ed and page-faulted afresh every time,
# which made a 1024-token chunk 7x slower than a 4-token one at vocab 152k); a GPU wants large
# chunks to keep its kernels busy.
CHUNK_ELEMENTS = {"cpu": 2**20, "cuda": 2**27}


class TokenLogProbs(NamedTuple):
    logp: Tensor  # [...] log-prob of each target token, float32
    entropy: Tensor  # [...] entropy of each position's distribution, float32


def _vocab_offset(local_vocab: int, group: dist.ProcessGroup | None) -> int:
    if group is None or dist.get_world_size(group) == 1:
        return 0
    return dist.get_rank(group) * local_vocab


def _all_reduce(tensor: Tensor, op: dist.ReduceOp, group: dist.ProcessGroup | None) -> Tensor:
    if group is not None and dist.get_world_size(group) > 1:
        dist.all_reduce(tensor, op=op, group=group)
    return tensor


def _chunks(num_tokens: int, chunk_tokens: int) -> list[slice]:
    return [slice(i, min(i + chunk_tokens, num_tokens)) for i in range(0, num_tokens, chunk_tokens)]


class _VocabParallelLogProbs(torch.autograd.Function):
    """(logits [N, V/tp], targets [N]) -> (logp [N], entropy [N]), float32."""

    @staticmethod
    def forward(
        ctx: Any,
        logits: Tensor,
        targets: Tensor,
        group: dist.ProcessGroup | None,
        chunk_tokens: int,
    ) -> tuple[Tensor, Tensor]:
        num_tokens, local_vocab = logits.shape
        offset = _vocab_offset(local_vocab, group)
        logit_max = _all_reduce(logits.amax(dim=-1).float(), dist.ReduceOp.MAX, group)

        # Per token: sum_j exp(l_j - m), sum_j exp(l_j - m) * l_j, and the target's logit.
        partial = torch.zeros(3, num_tokens, dtype=torch.float32, device=logits.device)
        local_target = targets - offset
        on_this_rank = (local_target >= 0) & (local_target < local_vocab)
        for rows in _chunks(num_tokens, chunk_tokens):
            chunk = logits[rows].float()
            exp = torch.exp(chunk - logit_max[rows, None])
            partial[0, rows] = exp.sum(dim=-1)
            partial[1, rows] = (exp * chunk).sum(dim=-1)
            index = local_target[rows].clamp(0, local_vocab - 1)[:, None]
            target_logit = chunk.gather(-1, index).squeeze(-1)
            partial[2, rows] = torch.where(on_this_rank[rows], target_logit, 0.0)
        sum_exp, sum_exp_logit, target_logit = _all_reduce(partial, dist.ReduceOp.SUM, group)

        log_normaliser = logit_max + torch.log(sum_exp)
        logp = target_logit - log_normaliser
        entropy = log_normaliser - sum_exp_logit / sum_exp
        ctx.save_for_backward(logits, targets, log_normaliser, entropy)
        ctx.offset, ctx.chunk_tokens = offset, chunk_tokens
        return logp, entropy

    @staticmethod
    def backward(
        ctx: Any, grad_logp: Tensor, grad_entropy: Tensor
    ) -> tuple[Tensor, None, None, None]:
        logits, targets, log_normaliser, entropy = ctx.saved_tensors
        num_tokens, local_vocab = logits.shape
        grad_logits = torch.empty_like(logits)
        local_target = targets - ctx.offset
        on_this_rank = (local_target >= 0) & (local_target < local_vocab)
        for rows in _chunks(num_tokens, ctx.chunk_tokens):
            chunk = logits[rows].float()
            probs = torch.exp(chunk - log_normaliser[rows, None])
            # d logp / d l_j = 1[j = target] - p_j
            # d H / d l_j = -p_j * (l_j - E_p[l]),  E_p[l] = log Z - H
            expected_logit = (log_normaliser[rows] - entropy[rows])[:, None]
            grad = -probs * (
                grad_logp[rows, None] + grad_entropy[rows, None] * (chunk - expected_logit)
            )
            index = local_target[rows].clamp(0, local_vocab - 1)[:, None]
            hit = torch.where(on_this_rank[rows], grad_logp[rows], 0.0)[:, None]
            grad.scatter_add_(-1, index, hit)
            grad_logits[rows] = grad.to(logits.dtype)
        return grad_logits, None, None, None


def default_chunk_tokens(local_vocab: int, device: torch.device) -> int:
    """Tokens per chunk so that a float32 temporary holds about CHUNK_ELEMENTS[device] values."""
    budget = CHUNK_ELEMENTS["cuda" if device.type == "cuda" else "cpu"]
    return max(1, budget // local_vocab)


def vocab_parallel_logprobs(
    logits: Tensor,
    targets: Tensor,
    *,
    group: dist.ProcessGroup | None = None,
    chunk_tokens: int | None = None,
) -> TokenLogProbs:
    """Log-prob of `targets` and entropy under softmax(logits), vocabulary sharded over `group`.

    Args:
        logits: `[..., V / tp]` this rank's contiguous slice of the vocabulary (rank r holds ids
            [r * V/tp, (r + 1) * V/tp)), any float dtype; the maths is float32.
        targets: `[...]` token ids in [0, V), long.
        group: the tensor-parallel group; None (or a group of one) for an unsharded vocabulary.
        chunk_tokens: tokens per chunk of the float32 temporaries; None picks
            `default_chunk_tokens` for the device.

    Returns:
        `TokenLogProbs(logp, entropy)`, each `[...]` float32, differentiable in `logits`.
    """
    if not logits.is_floating_point() or logits.dim() < 1:
        raise ValueError(f"logits: expected a floating tensor [..., V/tp], got {logits.dtype}")
    if targets.shape != logits.shape[:-1] or targets.is_floating_point():
        raise ValueError(
            f"targets: expected integer ids of shape {list(logits.shape[:-1])}, got "
            f"{list(targets.shape)} {targets.dtype}"
        )
    if chunk_tokens is None:
        chunk_tokens = default_chunk_tokens(logits.shape[-1], logits.device)
    if isinstance(chunk_tokens, bool) or not isinstance(chunk_tokens, int) or chunk_tokens < 1:
        raise ValueError(f"chunk_tokens: expected a positive int, got {chunk_tokens!r}")
    tp = 1 if group is None else dist.get_world_size(group)
    vocab = logits.shape[-1] * tp
    if targets.numel() and bool(((targets < 0) | (targets >= vocab)).any()):
        raise ValueError(
            f"targets: ids must lie in [0, {vocab}); got {int(targets.min())}..{int(targets.max())}"
        )
    batch_shape = targets.shape
    logp, entropy = _VocabParallelLogProbs.apply(
        logits.reshape(-1, logits.shape[-1]), targets.reshape(-1), group, chunk_tokens
    )
    return TokenLogProbs(logp.view(batch_shape), entropy.view(batch_shape))
