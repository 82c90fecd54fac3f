"""Rollout collection with the shipped tiny model: groups, rewards, failures and timeouts
counted."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest

from megatron_rl.rewards import ArithmeticTask, ProblemSource, ScoringPool, get_verifier
from megatron_rl.rollout.codec import PromptCodec
from megatron_rl.rollout.collect import collect_rollouts
from megatron_rl.rollout.engine import SamplingParams
from megatron_rl.rollout.local import LocalEngine
from tests.rewards.misbehaving import misbehave_on_reference

TINY_MODEL = Path(__file__).resolve().parents[2] / "examples" / "moe" / "tiny_qwen3_moe"


@pytest.fixture(scope="module")
def parts():
    codec = PromptCodec(TINY_MODEL, max_prompt_tokens=40)
    params = SamplingParams(max_new_tokens=40, stop_token_ids=codec.stop_token_ids)
    return LocalEngine.from_pretrained(TINY_MODEL), codec, params


def test_rewards_and_metrics(parts):
    engine, codec, params = parts
    problems = ArithmeticTask().problems("eval", 4, seed=0)
    rollouts = collect_rollouts(
        engine,
        codec,
        problems,
        get_verifier("arithmetic"),
        params,
        group_size=3,
        seed=1,
    )
    assert len(rollouts.samples) == 12 and rollouts.rewards.shape == (12,)
    for index, sample in enumerate(rollouts.samples):
        text = codec.decode(sample.response_ids)
        expected = get_verifier("arithmetic")("", text, problems[index // 3].reference)
        assert rollouts.rewards[index] == expected
    assert rollouts.metrics["reward/mean"] == float(rollouts.rewards.mean())
    assert rollouts.metrics["reward/failures"] == 0


def test_a_failing_verifier_costs_rewards_not_the_step(parts):
    engine, codec, params = parts
    problems = ArithmeticTask().problems("eval", 2, seed=0)

    def flaky(prompt: str, response: str, reference: str) -> float:
        if prompt == problems[0].prompt:
            raise RuntimeError("verifier bug")
        return 1.0

    rollouts = collect_rollouts(engine, codec, problems, flaky, params, group_size=2, seed=0)
    assert rollouts.rewards.tolist() == [0.0, 0.0, 1.0, 1.0]
    assert rollouts.metrics["reward/failures"] == 2


@pytest.mark.timeout(60)
def test_rewards_past_the_deadline_are_counted_as_timeouts(parts):
    engine, codec, params = parts
    hung, ok = (
        dataclasses.replace(problem, reference=reference)
        for problem, reference in zip(
            ArithmeticTask().problems("eval", 2, seed=0), ["sleep", "ok"], strict=True
        )
    )
    with ScoringPool(workers=2, timeout_s=1.0, memory_limit_mb=2048) as pool:
        rollouts = collect_rollouts(
            engine,
            codec,
            [hung, ok],
            misbehave_on_reference,
            params,
            group_size=2,
            seed=0,
            scoring=pool,
        )
    assert rollouts.rewards.tolist() == [0.0, 0.0, 1.0, 1.0]
    assert rollouts.metrics["reward/timeouts"] == 2
    assert rollouts.metrics["reward/failures"] == 0


def test_prompts_longer_than_the_context_are_refused():
    codec = PromptCodec(TINY_MODEL, max_prompt_tokens=5)
    with pytest.raises(ValueError, match=r"7 tokens, longer than the 5 allowed"):
        codec.encode_prompt("1+2+3+\n")
    assert codec.newline_token_ids == [codec.tokenizer.convert_tokens_to_ids("\n")]


def test_problem_source_batches_depend_on_seed_and_step_only():
    task = ArithmeticTask()
    source = ProblemSource(task.problems("train", 10, seed=0), ["held-out"], per_step=4, seed=1)
    again = ProblemSource(task.problems("train", 10, seed=0), ["held-out"], per_step=4, seed=1)
    assert again.train_batch(3) == source.train_batch(3)  # fresh object, same batch
    epoch = [p for step in (1, 2) for p in source.train_batch(step)] + source.train_batch(3)[:2]
    assert sorted(p.prompt for p in epoch) == sorted(p.prompt for p in source.train)
    with pytest.raises(ValueError, match="step: expected >= 1"):
        source.train_batch(0)
