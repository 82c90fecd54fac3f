"""Scoring a batch of responses: one reward per sample, whatever its verifier does.

`score_responses` turns a verifier that raises, returns garbage, hangs or crashes into a 0.0
reward and a count, so that one bad sample never stops a training step. The trainer scores in a
`ScoringPool`: worker processes with a deadline per call and a memory limit, because a generated
answer can make a verifier compute for hours while holding the GIL (`scoring_pool.py`). Without
a pool the verifier runs in the calling thread, with no deadline: for verifiers that are trusted
to return, and for tests. Nothing here logs: the caller reports the counts.
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

from megatron_rl.rewards.verifiers import Verifier

if TYPE_CHECKING:
    from megatron_rl.rewards.scoring_pool import ScoringPool


@dataclass(frozen=True)
class RewardScores:
    """The rewards of a batch and how many samples got 0.0 because their verifier misbehaved."""

    rewards: list[float]
    """One reward per sample, in input order."""
    failures: int
    """Samples whose verifier raised, returned a non-numeric or non-finite value, or took its
    worker process down (its memory limit, a crash)."""
    timeouts: int
    """Samples whose verifier did not return within the pool's deadline (its worker was
    killed)."""

    @classmethod
    def of(cls, outcomes: Sequence[float | None], timeouts: int) -> RewardScores:
        """The scores of per-sample outcomes, None for a sample that failed or timed out, of
        which `timeouts` timed out."""
        rewards = [0.0 if outcome is None else outcome for outcome in outcomes]
        failures = sum(outcome is None for outcome in outcomes) - timeouts
        return cls(rewards=rewards, failures=failures, timeouts=timeouts)


def score_responses(
    verifier: Verifier,
    prompts: Sequence[str],
    responses: Sequence[str],
    references: Sequence[str],
    pool: ScoringPool | None = None,
) -> RewardScores:
    """Score every sample with `verifier`; misbehaviour costs that sample a 0.0, never an exception.

    A verifier that raises, or returns a non-numeric or non-finite value, scores 0.0 and counts
    as a failure. With `pool`, each call runs in one of its worker processes, under its deadline
    (an overrun scores 0.0 and counts as a timeout) and memory limit (a worker that dies scores
    its sample 0.0 as a failure); `verifier` must then be a module-level function. Without one,
    the calls run one by one in the calling thread, with no deadline.

    Raises:
        ValueError: the three sequences differ in length, or `pool` cannot send `verifier` to
            its workers.
    """
    lengths = {"prompts": len(prompts), "responses": len(responses), "references": len(references)}
    if len(set(lengths.values())) > 1:
        counts = ", ".join(f"{name}={length}" for name, length in lengths.items())
        raise ValueError(f"prompts, responses and references must have equal lengths; got {counts}")
    samples = list(zip(prompts, responses, references, strict=True))
    if pool is not None:
        return pool.score(verifier, samples)
    return RewardScores.of([_reward_or_none(verifier, *sample) for sample in samples], timeouts=0)


def checked_reward(verifier: Verifier, prompt: str, response: str, reference: str) -> float | None:
    """The verifier's reward as a float, or None when it is not a finite real number; what the
    verifier raises propagates."""
    value = verifier(prompt, response, reference)
    reward = float(value) if isinstance(value, numbers.Real) else math.nan
    return reward if math.isfinite(reward) else None


def _reward_or_none(verifier: Verifier, prompt: str, response: str, reference: str) -> float | None:
    """The sample's reward, or None when the verifier failed."""
    try:
        return checked_reward(verifier, prompt, response, reference)
    except Exception:
        # A verifier bug or a malformed response must cost one sample, not the training step.
        return None
