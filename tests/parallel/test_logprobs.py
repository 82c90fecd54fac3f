"""Log-probs and entropy from (vocab-sharded) logits equal log_softmax on the full vocabulary."""

from __future__ import annotations

import pytest
import torch

from megatron_rl.parallel.logprobs import vocab_parallel_logprobs
from tests.parallel import logprobs_worker
from tests.parallel.harness import run_on_ranks


def _reference(logits, targets):
    log_probs = torch.log_softmax(logits.double(), -1)
    logp = log_probs.gather(-1, targets[..., None]).squeeze(-1)
    return logp, -(log_probs.exp() * log_probs).sum(-1)


@pytest.mark.parametrize("chunk_tokens", [1, 4, 1024])
def test_unsharded_matches_log_softmax_value_and_gradient(chunk_tokens):
    gen = torch.Generator().manual_seed(1)
    logits = (torch.randn(4, 6, 50, generator=gen) * 5).requires_grad_(True)
    targets = torch.randint(0, 50, (4, 6), generator=gen)
    weights = torch.randn(2, 4, 6, generator=gen)
    logp, entropy = vocab_parallel_logprobs(logits, targets, chunk_tokens=chunk_tokens)
    (weights[0] * logp + weights[1] * entropy).sum().backward()

    reference = logits.detach().double().requires_grad_(True)
    ref_logp, ref_entropy = _reference(reference, targets)
    (weights[0].double() * ref_logp + weights[1].double() * ref_entropy).sum().backward()
    torch.testing.assert_close(logp.double(), ref_logp, rtol=0, atol=5e-6)
    torch.testing.assert_close(entropy.double(), ref_entropy, rtol=0, atol=5e-6)
    torch.testing.assert_close(logits.grad.double(), reference.grad, rtol=0, atol=5e-6)


def test_bfloat16_logits_are_read_in_float32_and_never_modified():
    gen = torch.Generator().manual_seed(2)
    logits = torch.randn(8, 32, generator=gen).to(torch.bfloat16).requires_grad_(True)
    before = logits.detach().clone()
    targets = torch.randint(0, 32, (8,), generator=gen)
    logp, entropy = vocab_parallel_logprobs(logits, targets)
    assert logp.dtype == entropy.dtype == torch.float32
    ref_logp, ref_entropy = _reference(logits.detach().float(), targets)
    torch.testing.assert_close(logp.double(), ref_logp, rtol=0, atol=1e-5)
    torch.testing.assert_close(entropy.double(), ref_entropy, rtol=0, atol=1e-5)
    (logp.sum() + entropy.sum()).backward()
    assert logits.grad.dtype == torch.bfloat16
    assert torch.equal(logits.detach(), before)


@pytest.mark.parametrize(
    ("logits", "targets", "message"),
    [
        (torch.zeros(2, 4, dtype=torch.long), torch.zeros(2, dtype=torch.long), "logits"),
        (torch.zeros(2, 4), torch.zeros(3, dtype=torch.long), "targets: expected integer ids"),
        (torch.zeros(2, 4), torch.zeros(2), "targets: expected integer ids"),
        (torch.zeros(2, 4), torch.tensor([0, 4]), r"targets: ids must lie in \[0, 4\)"),
    ],
)
def test_bad_input(logits, targets, message):
    with pytest.raises(ValueError, match=message):
        vocab_parallel_logprobs(logits, targets)


def test_tp2_sharded_vocabulary_matches_full_log_softmax():
    chunk_sizes = [2, 1024]  # tokens per chunk: many chunks, and one
    for rank_results in run_on_ranks(logprobs_worker.sharded_matches_full, 64, chunk_sizes):
        for chunk, result in zip(chunk_sizes, rank_results, strict=True):
            assert result["logp_error"] < 5e-6, chunk
            assert result["entropy_error"] < 5e-6, chunk
            assert result["grad_error"] < 5e-6, chunk
            assert result["logits_untouched"], chunk
