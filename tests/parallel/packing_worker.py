"""Worker for the packed-vs-padded loss test, with the vocabulary split over TP ranks."""

from __future__ import annotations

import torch
from megatron.core import parallel_state

from megatron_rl.algo import PolicyLossSpec, subsentence_segment_ids
from megatron_rl.parallel.dims import ParallelDims
from megatron_rl.parallel.distributed import LaunchEnv, init_distributed
from megatron_rl.trainer.micro_batch import PolicyMicroBatch
from megatron_rl.trainer.schedule import policy_loss_func

VOCAB, NEWLINE = 32, 1


def packed_equals_padded(launch: LaunchEnv, cases: list[tuple[str, str]]) -> dict:
    tp = launch.world_size
    init_distributed(ParallelDims(world_size=tp, tp=tp), launch)
    rank = parallel_state.get_tensor_model_parallel_rank()
    return {case: _compare(rank, tp, *case) for case in cases}


def _compare(rank: int, tp: int, loss: str, loss_agg: str) -> dict:
    gen = torch.Generator().manual_seed(5)
    lengths = [7, 3, 11]
    width = max(lengths)
    sequences = [torch.randint(2, VOCAB, (n,), generator=gen) for n in lengths]
    for seq in sequences:
        seq[torch.rand(len(seq), generator=gen) < 0.3] = NEWLINE
    prompt = 2  # the first two tokens of every sequence are prompt
    logits = [torch.randn(n, VOCAB, generator=gen, dtype=torch.float64) for n in lengths]
    old_logp = [-torch.rand(n, generator=gen, dtype=torch.float64) * 2 - 2.5 for n in lengths]
    entropy = [torch.rand(n, generator=gen, dtype=torch.float64) for n in lengths]
    advantages = torch.randn(len(lengths), generator=gen, dtype=torch.float64)
    shard = slice(rank * VOCAB // tp, (rank + 1) * VOCAB // tp)
    spec = PolicyLossSpec.of(
        loss,
        clip_low=0.05,
        clip_high=0.05,
        loss_agg=loss_agg,
        **({"max_response_len": width} if loss_agg == "seq-mean-token-sum-norm" else {}),
    )

    def response_mask(n: int) -> torch.Tensor:
        positions = torch.arange(n)
        return (positions >= prompt - 1) & (positions < n - 1)  # predicts tokens 2..n-1

    # padded: one row per sequence, right padding
    tokens = torch.zeros(len(lengths), width, dtype=torch.long)
    padded_logits = torch.zeros(len(lengths), width, VOCAB, dtype=torch.float64)
    mask = torch.zeros(len(lengths), width, dtype=torch.bool)
    padded_old = torch.zeros(len(lengths), width, dtype=torch.float64)
    padded_entropy = torch.zeros(len(lengths), width, dtype=torch.float64)
    for i, n in enumerate(lengths):
        tokens[i, :n], padded_logits[i, :n] = sequences[i], logits[i]
        mask[i, :n], padded_old[i, :n] = response_mask(n), old_logp[i]
        padded_entropy[i, :n] = entropy[i]
    targets = torch.cat([tokens[:, 1:], tokens[:, -1:]], dim=1)
    padded = PolicyMicroBatch(
        tokens=tokens,
        loss_mask=mask,
        old_logp=padded_old,
        advantages=advantages,
        segment_ids=subsentence_segment_ids(targets, mask, [NEWLINE]),
        old_entropy=padded_entropy,
    )
    padded_input = padded_logits[..., shard].clone().requires_grad_(True)
    padded_loss, padded_denominator, _ = policy_loss_func(padded, spec, padded_input)
    padded_loss.backward()

    # packed: all sequences back to back in one row
    cu_seqlens = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()])
    packed_mask = torch.cat([response_mask(n) for n in lengths])[None]
    packed_tokens = torch.cat(sequences)[None]
    packed_segments = torch.cat([padded.segment_ids[i, :n] for i, n in enumerate(lengths)])[None]
    packed = PolicyMicroBatch(
        tokens=packed_tokens,
        loss_mask=packed_mask,
        old_logp=torch.cat(old_logp)[None],
        advantages=advantages,
        segment_ids=packed_segments,
        old_entropy=torch.cat(entropy)[None],
        cu_seqlens=cu_seqlens,
    )
    packed_input = torch.cat(logits)[None][..., shard].clone().requires_grad_(True)
    packed_loss, packed_denominator, _ = policy_loss_func(packed, spec, packed_input)
    packed_loss.backward()

    padded_grad = torch.cat([padded_input.grad[i, :n] for i, n in enumerate(lengths)])
    return {
        "padded_loss": float(padded_loss),
        "packed_loss": float(packed_loss),
        "denominators": (int(padded_denominator), int(packed_denominator)),
        "grad_error": float((packed_input.grad[0] - padded_grad).abs().max()),
        "grad_scale": float(padded_grad.abs().max()),
    }
