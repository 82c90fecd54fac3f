"""Top-k margins, near-ties and flips by margin bucket, and routing's paired share of the
log-ratio, on hand-computed cases."""

from __future__ import annotations

import math

import pytest
import torch

from megatron_rl.moe.drift import routing_share_of_log_ratio
from megatron_rl.moe.margins import (
    NEAR_TIE,
    bucket_names,
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


def test_margin_metrics_count_routes_and_flips_per_bucket():
    # 4 tokens x 2 layers; token 3 is masked out
    margins = torch.tensor([[5e-5, 0.5], [5e-4, 2e-3], [0.02, 1e-4], [0.0, 0.0]])
    flipped = torch.tensor([[True, False], [True, False], [False, True], [True, True]])
    mask = torch.tensor([True, True, True, False])
    metrics = margin_metrics(margins, flipped, mask, layer_numbers=[1, 2])
    names = bucket_names()
    assert names == ["lt1e-04", "1e-04_1e-03", "1e-03_1e-02", "ge1e-02"]
    routes = [float(metrics[f"margin/routes/{n}"]) for n in names]
    flips = [float(metrics[f"margin/flips/{n}"]) for n in names]
    # kept margins: 5e-5 | 5e-4, 1e-4 (a margin on an edge goes to the bucket above) | 2e-3 |
    # 0.5, 0.02
    assert routes == [1, 2, 1, 2]
    assert flips == [1, 2, 0, 0]
    assert float(metrics["margin/near_tie"]) == pytest.approx(3 / 6)  # under NEAR_TIE = 1e-3
    assert NEAR_TIE == 1e-3
    assert float(metrics["margin/near_tie_layer/1"]) == pytest.approx(2 / 3)
    assert float(metrics["margin/near_tie_layer/2"]) == pytest.approx(1 / 3)
    assert float(metrics["margin/median"]) == pytest.approx(float(margins[:3].flatten().median()))
    with pytest.raises(ValueError, match="one shape"):
        margin_metrics(margins, flipped[:, :1])


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
