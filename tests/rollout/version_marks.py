"""What a partially rolled-out sample's log-probs must be: each token's under the weights of the
version it is marked with."""

from __future__ import annotations

from collections.abc import Mapping

import torch
from torch import Tensor

from megatron_rl.rollout.engine import Sample
from megatron_rl.rollout.local import LocalEngine


def logprobs_by_mark(sample: Sample, references: Mapping[int, LocalEngine]) -> Tensor:
    """`[len(sample.response_ids)]`: each response token's log-prob (after its prompt and the
    tokens before it) under `references[v]`, v the version the token is marked with."""
    versions = sample.response_versions()
    sequence = list(sample.prompt_ids + sample.response_ids)
    start = len(sample.prompt_ids) - 1
    scores = {v: references[v].score([sequence])[0][start:] for v in set(versions)}
    return torch.stack([scores[v][i] for i, v in enumerate(versions)])
