"""Batch scoring: one reward per sample whatever the verifier does, in this thread or in the
scoring pool's workers."""

from __future__ import annotations

import threading

import pytest

from megatron_rl.rewards import RewardScores, ScoringPool, get_verifier, score_responses
from tests.rewards.misbehaving import misbehave


@pytest.mark.parametrize("in_pool", [False, True], ids=["in-process", "pool"])
def test_misbehaving_verifiers_score_zero_and_count_as_failures(in_pool, request):
    pool = request.getfixturevalue("scoring_pool") if in_pool else None
    responses = ["ok", "raise", "ok", "nan", "inf", "text", "wrong"]
    scores = score_responses(
        misbehave, ["p"] * len(responses), responses, ["r"] * len(responses), pool
    )
    assert scores == RewardScores(
        rewards=[1.0, 0.0, 1.0, 0.0, 0.0, 0.0, 0.0], failures=4, timeouts=0
    )


def test_without_a_pool_verifiers_run_in_the_calling_thread():
    threads = []

    def record_thread(prompt: str, response: str, reference: str) -> float:
        threads.append(threading.current_thread())
        return 0.5

    scores = score_responses(record_thread, ["p", "q"], ["a", "b"], ["r", "s"])
    assert scores.rewards == [0.5, 0.5]
    assert threads == [threading.current_thread()] * 2


@pytest.mark.timeout(120)
def test_the_registered_verifiers_score_in_workers():
    # A deadline that leaves a fresh worker time to import math-verify and sympy.
    with ScoringPool(workers=2, timeout_s=60.0, memory_limit_mb=2048) as pool:
        math = score_responses(
            get_verifier("math"),
            ["?"] * 3,
            ["\\boxed{0.5}", "\\boxed{2}", "#### 1/2"],
            ["\\frac{1}{2}"] * 3,
            pool,
        )
        arithmetic = score_responses(
            get_verifier("arithmetic"), ["?"] * 2, ["#### 1,000", "#### 999"], ["1000"] * 2, pool
        )
    assert math == RewardScores(rewards=[1.0, 0.0, 1.0], failures=0, timeouts=0)
    assert arithmetic == RewardScores(rewards=[1.0, 0.0], failures=0, timeouts=0)


@pytest.mark.parametrize("in_pool", [False, True], ids=["in-process", "pool"])
def test_empty_batch_scores_nothing(in_pool, request):
    pool = request.getfixturevalue("scoring_pool") if in_pool else None
    assert score_responses(misbehave, [], [], [], pool) == RewardScores([], 0, 0)


def test_length_mismatch_names_the_arguments():
    with pytest.raises(ValueError, match="prompts=2, responses=1, references=2"):
        score_responses(misbehave, ["p", "q"], ["ok"], ["r", "s"])
