"""The rollout half of a step with the shipped tiny model: DAPO's dynamic sampling, the overlong
filter and the soft overlong penalty, with the groups and samples each keeps counted."""

from __future__ import annotations

import pytest
import torch

from megatron_rl.algo import overlong_penalty, zero_variance_groups
from megatron_rl.config import load_config
from megatron_rl.rewards import ArithmeticTask, ProblemSource, get_verifier
from megatron_rl.rollout.codec import PromptCodec
from megatron_rl.rollout.local import LocalEngine
from megatron_rl.trainer.recipe import Recipe
from megatron_rl.trainer.rollout_step import rollout_step
from tests.rollout.test_collect import TINY_MODEL

GROUP = 4


@pytest.fixture(scope="module")
def parts():
    codec = PromptCodec(TINY_MODEL, max_prompt_tokens=40)
    problems = ArithmeticTask().problems("train", 64, seed=0)
    return LocalEngine.from_pretrained(TINY_MODEL), codec, problems


def _recipe(*overrides: str) -> Recipe:
    return load_config(
        Recipe,
        None,
        [
            "rollout.prompts_per_step=4",
            f"rollout.group_size={GROUP}",
            "rollout.max_new_tokens=40",
            *overrides,
        ],
    )


ARITHMETIC = get_verifier("arithmetic")  # the base model solves about half: groups differ


def _text_parity(response: str) -> float:
    return float(sum(map(ord, response)) % 2)


def _step(parts, recipe: Recipe, step: int = 1, verifier=ARITHMETIC):
    engine, codec, problems = parts
    source = ProblemSource(problems, problems[:4], per_step=recipe.rollout.prompts_per_step, seed=3)
    return rollout_step(
        engine,
        codec,
        source,
        step,
        verifier,
        rollout=recipe.rollout,
        algo=recipe.algo,
        seed=11 + step,
    )


def _groups_with_variance(batch) -> int:
    return int((~zero_variance_groups(batch.rewards, GROUP)).sum())


def test_dynamic_sampling_fills_the_step_with_groups_that_have_a_gradient(parts):
    _, plain = _step(parts, _recipe())
    assert plain["groups/zero_variance"] > 0  # the step's own problems leave some groups flat
    assert "dynamic/rounds" not in plain
    batch, metrics = _step(
        parts, _recipe("rollout.dynamic_sampling=true", "rollout.max_generation_rounds=8")
    )
    assert metrics["dynamic/groups_kept"] == 4 and metrics["dynamic/short"] == 0
    assert metrics["dynamic/rounds"] > 1
    assert metrics["dynamic/groups_generated"] > 4
    assert batch.num_rows == 4 * GROUP and _groups_with_variance(batch) == 4
    # the first round's rollout metrics are the step's own problems', as without it
    assert metrics["reward/mean"] == plain["reward/mean"]
    again, _ = _step(
        parts, _recipe("rollout.dynamic_sampling=true", "rollout.max_generation_rounds=8")
    )
    assert torch.equal(again.tokens, batch.tokens)  # the extra rounds are seeded


def test_dynamic_sampling_trains_on_what_it_has_after_its_last_round(parts):
    def flat_mostly(prompt: str, response: str, reference: str) -> float:
        return ARITHMETIC(prompt, response, reference) if prompt.startswith("1") else 0.0

    batch, metrics = _step(
        parts,
        _recipe("rollout.dynamic_sampling=true", "rollout.max_generation_rounds=2"),
        verifier=flat_mostly,
    )
    assert metrics["dynamic/rounds"] == 2 and metrics["dynamic/groups_generated"] == 8
    assert metrics["dynamic/short"] == 1 and metrics["dynamic/groups_kept"] < 4
    kept = int(metrics["dynamic/groups_kept"])
    assert (batch is None) == (kept == 0)
    if batch is not None:
        assert batch.num_rows == kept * GROUP


def test_the_overlong_filter_drops_truncated_responses_and_counts_them(parts):
    # 24 new tokens cut some responses of the tiny model short, not all
    recipe = _recipe("rollout.max_new_tokens=24", "algo.overlong_filter=true")
    batch, metrics = _step(parts, recipe)
    plain_batch, plain = _step(parts, _recipe("rollout.max_new_tokens=24"))
    truncated = round(plain["response/truncated_frac"] * 4 * GROUP)
    assert 0 < truncated < 4 * GROUP
    assert metrics["samples/overlong_filtered"] == truncated
    # their rows stay (whole groups), without a loss token
    assert batch.num_rows == plain_batch.num_rows
    assert int((~batch.loss_mask.any(dim=1)).sum()) == truncated
    assert torch.equal(batch.rewards, plain_batch.rewards)


def test_the_overlong_penalty_lowers_long_responses_rewards(parts):
    _, plain = _step(parts, _recipe())
    batch, penalised = _step(parts, _recipe("rollout.overlong_buffer=20"))
    # the verifier's reward is reported as it is, the penalty beside it; the advantages see
    # their sum
    lengths = batch.loss_mask.sum(dim=1)
    assert int(lengths.max()) > 20  # some responses reach into the buffer
    expected = float(overlong_penalty(lengths, 40, 20).mean())
    assert penalised["reward/overlong_penalty"] == pytest.approx(expected) and expected < 0
    assert penalised["reward/mean"] == plain["reward/mean"]


def test_overlong_penalty_formula():
    lengths = torch.tensor([0, 10, 12, 14, 16, 20])
    # no penalty up to 20 - 8 = 12 tokens, then -1/8 per token down to -1 at 20
    expected = torch.tensor([0.0, 0.0, 0.0, -0.25, -0.5, -1.0])
    torch.testing.assert_close(overlong_penalty(lengths, 20, 8), expected)
    for bad in (0, 20, -1, True):
        with pytest.raises(ValueError, match=r"buffer: expected an int in \(0, max_new_tokens"):
            overlong_penalty(lengths, 20, bad)


def test_the_extra_rounds_draw_the_same_problems_for_the_same_step():
    problems = ArithmeticTask().problems("train", 50, seed=0)
    source = ProblemSource(problems, problems[:2], per_step=5, seed=7)
    again = ProblemSource(problems, problems[:2], per_step=5, seed=7)
    assert source.extra_batch(3, 1) == again.extra_batch(3, 1)
    assert source.extra_batch(3, 1) != source.extra_batch(3, 2)
    assert source.extra_batch(3, 1) != source.extra_batch(4, 1)
    with pytest.raises(ValueError, match=r"step, round_index: expected >= 1"):
        source.extra_batch(3, 0)
