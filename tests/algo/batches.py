"""Random rollout-like batches for the loss tests."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from megatron_rl.algo import subsentence_segment_ids

NEWLINE = 1  # token id that ends a line in these synthetic batches


@dataclass
class Batch:
    logp: torch.Tensor  # [B, T] float64, requires grad
    old_logp: torch.Tensor  # [B, T]
    advantages: torch.Tensor  # [B]
    mask: torch.Tensor  # [B, T] bool
    segment_ids: torch.Tensor  # [B, T]
    old_entropy: torch.Tensor  # [B, T]

    def kwargs(self) -> dict:
        return {"segment_ids": self.segment_ids, "old_entropy": self.old_entropy}


def random_batch(
    batch: int = 6,
    seq: int = 12,
    *,
    seed: int = 0,
    drift: float = 0.05,
    padding: str = "right",
    dtype: torch.dtype = torch.float64,
) -> Batch:
    """Responses of random lengths (1..seq), padded left or right; padding holds NaN so that any
    leak of padding into the maths shows up. Rows have newline tokens, hence several segments."""
    gen = torch.Generator().manual_seed(seed)
    lengths = torch.randint(1, seq + 1, (batch,), generator=gen)
    positions = torch.arange(seq)[None, :]
    if padding == "right":
        mask = positions < lengths[:, None]
    else:
        mask = positions >= seq - lengths[:, None]
    token_ids = torch.randint(2, 20, (batch, seq), generator=gen)
    token_ids[torch.rand(batch, seq, generator=gen) < 0.25] = NEWLINE
    old_logp = -torch.rand(batch, seq, generator=gen, dtype=torch.float64) * 3 - 0.05
    logp = old_logp + drift * torch.randn(batch, seq, generator=gen, dtype=torch.float64)
    nan = torch.full_like(logp, float("nan"))
    logp = torch.where(mask, logp, nan).to(dtype).requires_grad_(True)
    old_logp = torch.where(mask, old_logp, nan).to(dtype)
    advantages = torch.randn(batch, generator=gen, dtype=torch.float64).to(dtype)
    old_entropy = (torch.rand(batch, seq, generator=gen, dtype=torch.float64) * 0.05).to(dtype)
    return Batch(
        logp=logp,
        old_logp=old_logp,
        advantages=advantages,
        mask=mask,
        segment_ids=subsentence_segment_ids(token_ids, mask, [NEWLINE]),
        old_entropy=old_entropy,
    )


def fresh_logp(batch: Batch) -> torch.Tensor:
    """A new leaf with the same values, so that two losses can be differentiated separately."""
    return batch.logp.detach().clone().requires_grad_(True)
