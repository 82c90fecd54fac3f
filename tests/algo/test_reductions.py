"""Metric reductions: each declared metric combines by its own rule, an undeclared one is refused,
and a non-finite value is never averaged away."""

from __future__ import annotations

import math

import pytest
import torch

from megatron_rl.algo import (
    LOSS_METRICS,
    MISMATCH_METRICS,
    MetricReductions,
    MismatchCorrection,
    Reduction,
    compute_policy_loss,
)
from tests.algo.batches import random_batch


def test_each_metric_combines_by_its_declared_reduction():
    table = MetricReductions(
        {"a/mean": Reduction.MEAN, "a/max": Reduction.MAX, "a/min": Reduction.MIN},
        {"n/count": Reduction.SUM, "lr": Reduction.LAST, "layer/*": Reduction.MAX},
    )
    values = [1.0, 4.0, 2.0]
    assert table.combine("a/mean", values) == pytest.approx(7 / 3)
    assert table.combine("a/max", values) == 4.0 and table.combine("a/min", values) == 1.0
    assert table.combine("n/count", values) == 7.0 and table.combine("lr", values) == 2.0
    assert table.combine("layer/12", values) == 4.0  # a family: every name it begins
    assert math.isnan(table.combine("a/mean", []))


def test_an_undeclared_metric_is_refused_and_no_name_has_two_reductions():
    table = MetricReductions(LOSS_METRICS, MISMATCH_METRICS)
    # a name ending in "max" is not thereby a maximum: nothing is guessed from spelling
    with pytest.raises(KeyError, match="'mismatch/new_max' declares no reduction"):
        table.of("mismatch/new_max")
    with pytest.raises(ValueError, match="'x' declared with two reductions: mean and max"):
        MetricReductions({"x": Reduction.MEAN}, {"x": Reduction.MAX})


@pytest.mark.parametrize("reduction", list(Reduction))
def test_a_nan_among_the_values_makes_the_result_nan(reduction):
    table = MetricReductions({"m": reduction})
    assert math.isnan(table.combine("m", [1.0, math.nan, 2.0]))
    if reduction in (Reduction.MEAN, Reduction.SUM, Reduction.MAX):
        assert table.combine("m", [1.0, math.inf]) == math.inf


def test_every_metric_the_loss_reports_is_declared():
    table = MetricReductions(LOSS_METRICS, MISMATCH_METRICS)
    batch = random_batch(6, 8, seed=2)
    for name in ("sspo", "grpo"):
        _, metrics = compute_policy_loss(
            name,
            batch.logp,
            batch.old_logp,
            batch.advantages,
            batch.mask,
            clip_low=0.2,
            clip_high=0.2,
            engine_logp=batch.old_logp,
            mismatch=MismatchCorrection.of("mis"),
            entropy=torch.ones_like(batch.logp),
            entropy_coef=0.1,
            ref_logp=batch.old_logp,
            kl_coef=0.1,
            **batch.kwargs(),
        )
        assert [key for key in metrics if key not in table] == []
