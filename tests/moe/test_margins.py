"""Top-k margins, near-ties and flips by margin bucket, and routing's paired share of the
log-ratio, on hand-computed cases."""

from __future__ import annotations

import math

import pytest
import torch
from megatron.core.transformer.moe.moe_utils import topk_routing_with_score_function

from megatron_rl.moe.drift import routing_share_of_log_ratio
from megatron_rl.moe.margins import (
    NEAR_TIE,
    bucket_names,
    decision_margins,
    decision_scores,
    margin_metrics,
    selection_scores,
    topk_margins,
)


def test_margins_are_the_gap_between_the_kth_and_the_next_score():
    scores = torch.tensor([[0.5, 0.3, 0.15, 0.05], [0.25, 0.25, 0.25, 0.25]])
    assert topk_margins(scores, 1).tolist() == pytest.approx([0.2, 0.0])
    assert topk_margins(scores, 2).tolist() == pytest.approx([0.15, 0.0])  # a tie: margin 0
    assert topk_margins(scores, 4).tolist() == [math.inf, math.inf]  # nothing left out
    with pytest.raises(ValueError, match=r"\[tokens, experts\] with topk in \[1, experts\]"):
        topk_margins(scores, 5)


def test_selection_scores_are_what_top_k_is_taken_by():
    logits = torch.tensor([[2.0, 0.0, -1.0]])
    assert selection_scores(logits, score_function="softmax").sum() == pytest.approx(1)
    bias = torch.tensor([0.0, 0.6, 0.0])
    sigmoid = selection_scores(logits, score_function="sigmoid", expert_bias=bias)
    expected = torch.sigmoid(logits) + bias  # the bias chooses experts, not their weights
    assert torch.equal(sigmoid, expected)
    # sigmoid(2) = 0.881 vs sigmoid(0) + 0.6 = 1.1: the bias moved expert 1 into the top-1
    assert int(sigmoid.argmax()) == 1
    with pytest.raises(ValueError, match="score_function"):
        selection_scores(logits, score_function="sparsemax")


def test_margin_metrics_count_routes_and_flips_per_bucket_and_layer():
    # 4 tokens x 2 layers; token 3 is masked out
    margins = torch.tensor([[5e-4, 5.0], [5e-3, 2e-2], [0.2, 1e-3], [0.0, 0.0]])
    flipped = torch.tensor([[True, False], [True, False], [False, True], [True, True]])
    mask = torch.tensor([True, True, True, False])
    metrics = margin_metrics(margins, flipped, mask, layer_numbers=[1, 2])
    names = bucket_names()
    assert names == ["lt1e-03", "1e-03_1e-02", "1e-02_1e-01", "1e-01_1e+00", "ge1e+00"]
    routes = [float(metrics[f"margin/routes/{n}"]) for n in names]
    flips = [float(metrics[f"margin/flips/{n}"]) for n in names]
    # kept margins: 5e-4 | 5e-3, 1e-3 (a margin on an edge goes to the bucket above) | 2e-2 |
    # 0.2 | 5.0
    assert routes == [1, 2, 1, 1, 1]
    assert flips == [1, 2, 0, 0, 0]
    layer_1 = [float(metrics[f"margin/routes_layer/1/{n}"]) for n in names]
    assert layer_1 == [1, 1, 0, 1, 0]
    assert [float(metrics[f"margin/flips_layer/2/{n}"]) for n in names] == [0, 1, 0, 0, 0]
    assert float(metrics["margin/near_tie"]) == pytest.approx(3 / 6)  # under NEAR_TIE = 0.01
    assert NEAR_TIE == 0.01
    assert float(metrics["margin/near_tie_layer/1"]) == pytest.approx(2 / 3)
    assert float(metrics["margin/near_tie_layer/2"]) == pytest.approx(1 / 3)
    assert float(metrics["margin/median"]) == pytest.approx(float(margins[:3].flatten().median()))
    with pytest.raises(ValueError, match="one shape"):
        margin_metrics(margins, flipped[:, :1])


def test_a_softmax_routers_margin_is_its_logit_gap_whatever_the_expert_count():
    logits = torch.tensor([[2.0, 1.5, -1.0, 0.0]])
    margin = decision_margins(decision_scores(logits, score_function="softmax"), topk=1)
    probabilities = torch.softmax(logits, dim=-1)[0]
    assert float(margin[0]) == pytest.approx(math.log(probabilities[0] / probabilities[1]))
    # 124 more experts far below: the probabilities shrink, the margin does not
    wider = torch.cat([logits, torch.full((1, 124), -20.0)], dim=1)
    assert torch.equal(
        decision_margins(decision_scores(wider, score_function="softmax"), 1), margin
    )
    shifted = decision_scores(logits + 3.0, score_function="softmax")
    assert decision_margins(shifted, 1).tolist() == pytest.approx(margin.tolist())


def test_a_sigmoid_routers_margin_is_its_score_gap_over_the_scores_spread():
    logits = torch.tensor([[2.0, 0.0, -1.0, 0.5]])
    bias = torch.tensor([0.0, 0.6, 0.0, 0.0])
    scores = torch.sigmoid(logits) + bias
    by_hand = (scores[0, 1] - scores[0, 0]) / scores.std()  # expert 1, then expert 0
    unit = decision_scores(logits, score_function="sigmoid", expert_bias=bias)
    assert float(decision_margins(unit, topk=1)[0]) == pytest.approx(float(by_hand))


def test_a_group_score_tie_is_a_small_margin_where_the_experts_gaps_are_large():
    # top-2 of one kept group of two, groups ranked by the sum of their top-2 scores: group A
    # [3.0, 0.0] sums 3.0, group B [1.6, 1.399] 2.999, a near-tie; within A nothing is left out
    scores = torch.tensor([[3.0, 0.0, 1.6, 1.399]])
    grouped = decision_margins(scores, topk=2, num_groups=2, group_topk=1)
    assert float(grouped[0]) == pytest.approx(1e-3, abs=1e-6)
    # over all experts the decision looks safe (1.6 vs 1.399), and it is not: a group-score
    # tie swaps both of group A's experts for group B's
    assert float(decision_margins(scores, topk=2)[0]) == pytest.approx(0.201, abs=1e-6)
    # groups far apart: the margin is the experts' own gap within the kept group
    apart = torch.tensor([[3.0, 2.95, 1.0, -5.0]])
    margin = decision_margins(apart, topk=1, num_groups=2, group_topk=1)
    assert float(margin[0]) == pytest.approx(0.05, abs=1e-6)
    with pytest.raises(ValueError, match="num_groups: expected a divisor of the 4 experts"):
        decision_margins(scores, topk=1, num_groups=3, group_topk=1)


@pytest.mark.parametrize(
    ("score_function", "pre_softmax", "groups"),
    [
        ("softmax", False, (4, 2)),
        ("softmax", True, (4, 2)),
        ("sigmoid", False, (4, 2)),
        ("sigmoid", False, None),
        ("softmax", True, None),
    ],
)
def test_decision_scores_rank_experts_and_groups_as_megatron_core_chooses(
    score_function, pre_softmax, groups
):
    generator = torch.Generator().manual_seed(0)
    logits = torch.randn(64, 16, generator=generator)
    bias = torch.randn(16, generator=generator) * 0.1 if score_function == "sigmoid" else None
    num_groups, group_topk = groups or (None, None)
    _, routing_map = topk_routing_with_score_function(
        logits,
        4,
        use_pre_softmax=pre_softmax,
        num_groups=num_groups,
        group_topk=group_topk,
        score_function=score_function,
        expert_bias=bias,
    )
    scores = decision_scores(
        logits,
        score_function=score_function,
        expert_bias=bias,
        pre_softmax=pre_softmax,
        grouped=groups is not None,
    )
    margins = decision_margins(scores, 4, num_groups, group_topk)
    if groups:
        group_scores = scores.view(64, num_groups, -1).topk(4 // group_topk, dim=-1).values.sum(-1)
        kept = torch.zeros_like(group_scores, dtype=torch.bool)
        kept.scatter_(1, group_scores.topk(group_topk, dim=-1).indices, True)
        scores = scores.masked_fill(~kept.repeat_interleave(16 // num_groups, dim=1), -torch.inf)
    chosen = torch.zeros_like(routing_map).scatter_(1, scores.topk(4, dim=-1).indices, True)
    assert torch.equal(chosen, routing_map)
    assert bool((margins > 0).all())  # random scores: no exact ties


def test_routing_share_of_the_log_ratio_is_paired_on_the_same_weights():
    old = torch.zeros(1, 4)
    mask = torch.tensor([[True, True, True, False]])
    free = torch.tensor([[0.2, -0.2, 0.0, 9.0]])  # the masked 9.0 counts for nothing
    # the old routing replayed takes away routing's part: what is left is var 0.01 of 0.0267
    held = torch.tensor([[0.1, -0.1, 0.0, 9.0]])
    shares = routing_share_of_log_ratio(free, held, old, mask)
    assert float(shares["routing/log_ratio_var_share"]) == pytest.approx(1 - 0.25)
    assert float(shares["routing/log_ratio_abs_share"]) == pytest.approx(1 - 0.5)
    # the variances themselves, for a share pooled over steps
    assert float(shares["routing/log_ratio_var_free"]) == pytest.approx(0.08 / 3)
    assert float(shares["routing/log_ratio_var_held"]) == pytest.approx(0.02 / 3)
    # routing is all of it: replayed, the log-probs are the old ones
    all_routing = routing_share_of_log_ratio(free, old, old, mask)
    assert float(all_routing["routing/log_ratio_var_share"]) == 1
    # no log-ratio at all: nothing to explain, share 0
    none = routing_share_of_log_ratio(old, old, old, mask)
    assert float(none["routing/log_ratio_var_share"]) == 0
    with pytest.raises(ValueError, match=r"expected one shape \[b, S\]"):
        routing_share_of_log_ratio(free, held[:, :2], old, mask)
