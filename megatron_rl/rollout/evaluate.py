"""Held-out accuracy: greedy responses to evaluation problems, scored by a verifier."""

from __future__ import annotations

from collections.abc import Sequence

from megatron_rl.rewards import Problem, ScoringPool, Verifier, score_responses
from megatron_rl.rollout.codec import PromptCodec
from megatron_rl.rollout.engine import RolloutEngine, SamplingParams


def held_out_accuracy(
    engine: RolloutEngine,
    codec: PromptCodec,
    problems: Sequence[Problem],
    verifier: Verifier,
    *,
    max_new_tokens: int,
    scoring: ScoringPool | None = None,
) -> float:
    """Mean reward of one greedy (temperature 0) response per problem, scored in the `scoring`
    pool's worker processes (without one, in this thread with no deadline)."""
    params = SamplingParams(
        temperature=0.0, max_new_tokens=max_new_tokens, stop_token_ids=codec.stop_token_ids
    )
    groups = engine.generate(
        [codec.encode_prompt(p.prompt, origin=p.origin) for p in problems], params
    )
    responses = [codec.decode(group[0].response_ids) for group in groups]
    scores = score_responses(
        verifier,
        [p.prompt for p in problems],
        responses,
        [p.reference for p in problems],
        scoring,
    )
    return sum(scores.rewards) / len(problems)
