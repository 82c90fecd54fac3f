"""Every registered policy loss on one synthetic rollout batch whose log-ratios mimic MoE drift.

The batch: groups of responses to the same prompt with binary rewards; old log-probs of sampled
tokens; current log-probs equal to the old ones plus small noise, except on a fraction of tokens
(default 10%, the share of activated experts that GSPO's paper reports changing after an update)
whose log-probs move a lot, as when a token's experts change. It shows where each loss puts its
clipping: GRPO drops individual tokens, GSPO whole sequences, SSPO single segments.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from megatron_rl.algo import (
    POLICY_LOSSES,
    compute_policy_loss,
    group_advantages,
    subsentence_segment_ids,
)

NEWLINE_TOKEN = 1


@dataclass(frozen=True)
class DriftBatchSpec:
    """Shape and drift of the synthetic batch."""

    prompts: int = 16
    group_size: int = 8
    max_response_len: int = 256
    routing_changed_frac: float = 0.1  # share of tokens whose log-prob moves a lot
    routing_changed_std: float = 0.5  # std of their log-ratio
    noise_std: float = 0.005  # std of every other token's log-ratio
    seed: int = 0


def drift_batch(spec: DriftBatchSpec) -> dict[str, torch.Tensor]:
    """The synthetic rollout batch as loss inputs (`[B, T]` tensors, right-padded)."""
    gen = torch.Generator().manual_seed(spec.seed)
    rows, width = spec.prompts * spec.group_size, spec.max_response_len
    lengths = torch.randint(width // 8, width + 1, (rows,), generator=gen)
    mask = torch.arange(width)[None, :] < lengths[:, None]
    token_ids = torch.randint(2, 1000, (rows, width), generator=gen)
    token_ids[torch.rand(rows, width, generator=gen) < 1 / 12] = NEWLINE_TOKEN
    old_logp = -torch.distributions.Exponential(2.0).sample((rows, width))
    changed = torch.rand(rows, width, generator=gen) < spec.routing_changed_frac
    std = torch.where(changed, spec.routing_changed_std, spec.noise_std)
    logp = old_logp + std * torch.randn(rows, width, generator=gen)
    rewards = (torch.rand(rows, generator=gen) < 0.5).float()
    return {
        "logp": logp,
        "old_logp": old_logp,
        "advantages": group_advantages(rewards, spec.group_size).advantages,
        "mask": mask,
        "segment_ids": subsentence_segment_ids(token_ids, mask, [NEWLINE_TOKEN]),
        "old_entropy": torch.rand(rows, width, generator=gen),
    }


def loss_table(spec: DriftBatchSpec) -> list[dict[str, object]]:
    """One row per registered loss, each at its default clip range."""
    batch = drift_batch(spec)
    rows = []
    for name, loss_spec in POLICY_LOSSES.items():
        clip_low, clip_high = loss_spec.default_clip
        loss, metrics = compute_policy_loss(
            name,
            batch["logp"],
            batch["old_logp"],
            batch["advantages"],
            batch["mask"],
            clip_low=clip_low,
            clip_high=clip_high,
            segment_ids=batch["segment_ids"],
            old_entropy=batch["old_entropy"],
        )
        rows.append(
            {
                "loss": name,
                "unit": loss_spec.unit,
                "clip_low": clip_low,
                "clip_high": clip_high,
                "value": float(loss),
                **{key: float(value) for key, value in metrics.items()},
            }
        )
    return rows


def format_markdown(rows: list[dict[str, object]]) -> str:
    """The table as markdown."""
    columns = [
        ("loss", "loss", "{}"),
        ("ratio unit", "unit", "{}"),
        ("clip (low, high)", None, None),
        ("loss value", "value", "{:+.4f}"),
        ("clip_frac/token", "clip_frac/token", "{:.3f}"),
        ("clip_frac/seq", "clip_frac/seq", "{:.3f}"),
        ("ratio min", "ratio/min", "{:.4f}"),
        ("ratio max", "ratio/max", "{:.4f}"),
    ]
    lines = [
        "| " + " | ".join(title for title, _, _ in columns) + " |",
        "|" + "|".join("---" for _ in columns) + "|",
    ]
    for row in rows:
        cells = []
        for _, key, fmt in columns:
            if key is None:
                cells.append(f"({row['clip_low']:g}, {row['clip_high']:g})")
            else:
                cells.append(fmt.format(row[key]))
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)
