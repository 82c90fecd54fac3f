"""Samples -> padded rollout batches -> equal-shaped micro-batches per data-parallel rank."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from megatron_rl.algo import group_advantages
from megatron_rl.rollout.engine import Sample
from megatron_rl.trainer.batches import (
    EngineRouting,
    build_rollout_batch,
    micro_batches,
    minibatch_rows,
)
from megatron_rl.trainer.learner import step_advantages
from megatron_rl.trainer.recipe import AlgoConfig

NEWLINE = 9


def _sample(prompt, response, routed=False, layers=2):
    total = len(prompt) + len(response)
    return Sample(
        prompt_ids=tuple(prompt),
        response_ids=tuple(response),
        logprobs=-torch.arange(1, len(response) + 1, dtype=torch.float32),
        finish_reason="stop",
        routed_experts=torch.arange((total - 1) * layers * 2, dtype=torch.int32).view(-1, layers, 2)
        % 97
        if routed
        else None,
    )


def test_positions_predict_the_response_tokens():
    samples = [_sample([1, 2, 3], [4, NEWLINE, 5]), _sample([6], [7, 8])]
    batch = build_rollout_batch(
        samples, torch.tensor([1.0, 0.0]), group_size=2, pad_id=0, newline_token_ids=[NEWLINE]
    )
    assert batch.tokens.tolist() == [[1, 2, 3, 4, NEWLINE, 5], [6, 7, 8, 0, 0, 0]]
    # Position t predicts token t + 1: the response starts being predicted at prompt - 1.
    assert batch.loss_mask.tolist() == [
        [False, False, True, True, True, False],
        [True, True, False, False, False, False],
    ]
    assert batch.engine_logp[0, 2:5].tolist() == [-1.0, -2.0, -3.0]
    assert batch.engine_logp[1, :2].tolist() == [-1.0, -2.0]
    # "4\n" is the first segment, "5" the second.
    assert batch.segment_ids[0].tolist() == [-1, -1, 0, 0, 1, -1]
    # the padding after each sequence, which the routers leave out of their load balancing
    assert batch.padding_mask.tolist() == [[False] * 6, [False] * 3 + [True] * 3]


def test_an_empty_response_is_a_row_without_loss_tokens():
    samples = [_sample([1, 2], []), _sample([1, 2], [3])]
    batch = build_rollout_batch(
        samples, torch.zeros(2), group_size=2, pad_id=0, newline_token_ids=[NEWLINE]
    )
    assert not batch.loss_mask[0].any() and batch.loss_mask[1].sum() == 1
    assert batch.training_rows() == [1]


def test_micro_batches_have_one_shape_and_equal_counts_on_every_rank():
    samples = [_sample([1, 2], [3] * (i % 4 + 1)) for i in range(7)]
    batch = build_rollout_batch(
        samples,
        torch.arange(7, dtype=torch.float32),
        group_size=7,
        pad_id=0,
        newline_token_ids=[NEWLINE],
    )
    rows = list(range(7))
    per_rank = [
        micro_batches(batch, rows, dp_rank=rank, dp_size=2, micro_batch_size=3) for rank in range(2)
    ]
    assert [len(m) for m in per_rank] == [2, 2]
    shapes = {tuple(mb.tokens.shape) for ranks in per_rank for mb in ranks}
    assert shapes == {(2, batch.tokens.shape[1])}
    # Rank 0 takes rows 0, 2, 4, 6 and rank 1 rows 1, 3, 5 plus one empty row (-1).
    assert [mb.row_ids.tolist() for mb in per_rank[1]] == [[1, 3], [5, -1]]
    empty = per_rank[1][1]
    assert not empty.loss_mask[1].any() and (empty.segment_ids[1] == -1).all()
    # a filler row is all padding; a real row is padded after its sequence (row 5: 2 + 2)
    assert empty.padding_mask[1].all() and empty.padding_mask[0].tolist() == [
        False,
        False,
        False,
        False,
        True,
        True,
    ]
    assert empty.router_token_count() == 4
    every = sorted(int(r) for ranks in per_rank for mb in ranks for r in mb.row_ids)
    assert every == [-1, 0, 1, 2, 3, 4, 5, 6]
    # the learner attaches the old log-probs and advantages; the engine's ride along
    assert all(mb.old_logp is None and mb.advantages is None for mb in per_rank[0])
    assert torch.equal(per_rank[0][0].engine_logp, batch.engine_logp[[0, 2]])


def test_the_routers_balance_over_every_token_when_none_or_all_are_padding():
    samples = [_sample([1, 2], [3]), _sample([1, 2], [3, 4])]
    batch = build_rollout_batch(
        samples, torch.zeros(2), group_size=2, pad_id=0, newline_token_ids=[NEWLINE]
    )
    (padded,) = micro_batches(batch, [0, 1], dp_rank=0, dp_size=1, micro_batch_size=2)
    assert padded.router_padding().tolist() == [[False, False, False, True], [False] * 4]
    (whole,) = micro_batches(batch, [1], dp_rank=0, dp_size=1, micro_batch_size=1)
    assert whole.router_padding() is None and whole.router_token_count() == 4
    # rank 1 of 2 gets a filler row only: megatron-core's switch loss over no token is 0 / 0
    (filler,) = micro_batches(batch, [1], dp_rank=1, dp_size=2, micro_batch_size=1)
    assert filler.padding_mask.all() and filler.router_padding() is None
    assert filler.router_token_count() == 4


def test_micro_batches_take_their_rows_advantages_and_filler_rows_none():
    samples = [_sample([1, 2], [3]), _sample([1, 2], [3, 4]), _sample([1], [5, 6])]
    batch = build_rollout_batch(
        samples, torch.zeros(3), group_size=3, pad_id=0, newline_token_ids=[NEWLINE]
    )
    advantages = torch.tensor([0.5, -1.0, 2.0])
    # rank 1 of 2 holds row 1 and a filler row
    (micro,) = micro_batches(batch, [0, 1, 2], dp_rank=1, dp_size=2, micro_batch_size=2)
    assert micro.row_ids.tolist() == [1, -1]
    assert micro.with_row_advantages(advantages).advantages.tolist() == [-1.0, 0.0]
    with pytest.raises(ValueError, match="row_ids"):
        replace(micro, row_ids=None).with_row_advantages(advantages)


def test_minibatches_cover_every_row_once_and_depend_on_the_seed():
    chunks = minibatch_rows(range(10), 4, seed=3)
    assert sorted(r for chunk in chunks for r in chunk) == list(range(10))
    assert [len(c) for c in chunks] == [3, 3, 2, 2]
    assert minibatch_rows(range(10), 4, seed=3) == chunks != minibatch_rows(range(10), 4, seed=4)
    assert sorted(r for c in minibatch_rows([2, 5, 7], 2, seed=0) for r in c) == [2, 5, 7]


def test_fewer_rows_than_minibatches_give_one_minibatch_per_row():
    # a step that kept fewer samples than algo.updates_per_batch used to stop the run
    assert minibatch_rows([6], 4, seed=0) == [[6]]
    assert sorted(minibatch_rows(range(3), 4, seed=0)) == [[0], [1], [2]]
    with pytest.raises(ValueError, match="0 rows"):
        minibatch_rows([], 4, seed=0)


def test_engine_routing_lands_in_router_order():
    samples = [_sample([1, 2, 3], [4, 5], routed=True), _sample([6], [7], routed=True)]
    batch = build_rollout_batch(
        samples, torch.ones(2), group_size=2, pad_id=0, newline_token_ids=[NEWLINE]
    )
    routing = EngineRouting(num_layers=2, moe_layers=(0, 1), stage_layers=(0, 1), topk=2)
    (micro,) = micro_batches(
        batch, [0, 1], dp_rank=0, dp_size=1, micro_batch_size=2, engine_routing=routing
    )
    layer0 = micro.routing[0].view(batch.tokens.shape[1], 2, 2)  # [position, row, topk]
    torch.testing.assert_close(layer0[:4, 0], samples[0].routed_experts[:, 0].long())
    torch.testing.assert_close(layer0[:1, 1], samples[1].routed_experts[:, 0].long())


@pytest.mark.parametrize("engine_records", ["all_layers", "moe_layers"])
def test_engine_routing_of_a_model_with_a_dense_first_layer(engine_records):
    """Layers 0 dense, 1-3 MoE, this stage holding layers 2 and 3 (PP): an engine that records
    every layer (SGLang's layout) and one that records MoE layers only (the in-process engine)
    both give this stage the routing of model layers 2 and 3."""
    width = 4 if engine_records == "all_layers" else 3
    samples = [_sample([1, 2, 3], [4, 5], routed=True, layers=width)]
    batch = build_rollout_batch(
        samples, torch.ones(1), group_size=1, pad_id=0, newline_token_ids=[NEWLINE]
    )
    routing = EngineRouting(num_layers=4, moe_layers=(1, 2, 3), stage_layers=(2, 3), topk=2)
    (micro,) = micro_batches(
        batch, [0], dp_rank=0, dp_size=1, micro_batch_size=1, engine_routing=routing
    )
    assert len(micro.routing) == 2
    record = samples[0].routed_experts.long()
    for stage_layer, model_layer in enumerate((2, 3)):
        column = model_layer if engine_records == "all_layers" else model_layer - 1
        torch.testing.assert_close(micro.routing[stage_layer][:4], record[:, column])


def test_engine_routing_of_an_unexpected_width_is_refused():
    samples = [_sample([1, 2, 3], [4, 5], routed=True, layers=2)]
    batch = build_rollout_batch(
        samples, torch.ones(1), group_size=1, pad_id=0, newline_token_ids=[NEWLINE]
    )
    routing = EngineRouting(num_layers=4, moe_layers=(1, 2, 3), stage_layers=(1, 2, 3), topk=2)
    with pytest.raises(ValueError, match=r"records cover 2 layer.*4 layer.*3 of them MoE"):
        micro_batches(batch, [0], dp_rank=0, dp_size=1, micro_batch_size=1, engine_routing=routing)


def test_advantages_are_the_groups_of_the_rewards_less_the_kl_in_the_reward():
    samples = [_sample([1], [2, 3]) for _ in range(4)]
    rewards = torch.tensor([1.0, 0.0, 1.0, 1.0])
    batch = build_rollout_batch(
        samples, rewards, group_size=2, pad_id=0, newline_token_ids=[NEWLINE]
    )
    algo = AlgoConfig()
    expected = group_advantages(rewards, 2).advantages
    torch.testing.assert_close(step_advantages(batch, algo), expected)
    kl_rows = torch.tensor([0.0, 0.5, 2.0, 0.0], dtype=torch.float64)
    shaped = AlgoConfig(kl_coef=0.1, kl_in_reward=True)
    expected = group_advantages(rewards.double() - 0.1 * kl_rows, 2).advantages.float()
    torch.testing.assert_close(step_advantages(batch, shaped, kl_rows), expected)
    assert float(step_advantages(batch, shaped, kl_rows)[2]) != 0  # the KL split the tie


def _batch_of_lengths(lengths):
    samples = [_sample([1, 2], [3] * (length - 2)) for length in lengths]
    return build_rollout_batch(
        samples,
        torch.zeros(len(samples)),
        group_size=len(samples),
        pad_id=0,
        newline_token_ids=[NEWLINE],
    )


def test_a_token_budget_groups_rows_of_like_length_cut_to_their_width():
    lengths = [30, 5, 12, 29, 6, 11, 40, 7]
    batch = _batch_of_lengths(lengths)
    (planned,) = [
        micro_batches(
            batch,
            list(range(8)),
            dp_rank=0,
            dp_size=1,
            micro_batch_size=3,
            micro_batch_tokens=64,
            width_multiple=4,
        )
    ]
    # longest first; each pass fits 64 tokens at its longest row's width (rounded up to 4) and
    # 3 rows; the 40-token row is alone (two would be 80)
    assert [mb.row_ids.tolist() for mb in planned] == [[6], [0, 3], [2, 5, 7], [4, 1]]
    assert [tuple(mb.tokens.shape) for mb in planned] == [(1, 40), (2, 32), (3, 12), (2, 8)]
    for mb in planned:
        for i, row in enumerate(mb.row_ids.tolist()):
            real = lengths[row]
            assert torch.equal(mb.tokens[i, :real], batch.tokens[row, :real])
            assert mb.padding_mask[i].tolist() == [p >= real for p in range(mb.tokens.shape[1])]
            width = min(mb.tokens.shape[1], batch.tokens.shape[1])
            assert torch.equal(mb.loss_mask[i, :width], batch.loss_mask[row, :width])
    # every loss token of the batch is in exactly one pass
    assert sum(int(mb.loss_mask.sum()) for mb in planned) == int(batch.loss_mask.sum())
    padded = sum(int(mb.padding_mask.sum()) for mb in planned)
    assert padded < int(batch.padding_mask.sum())  # 28 padding positions against 172


def test_a_token_budget_gives_every_rank_as_many_micro_batches():
    batch = _batch_of_lengths([40, 38, 36, 5, 6, 7])
    per_rank = [
        micro_batches(
            batch,
            list(range(6)),
            dp_rank=rank,
            dp_size=2,
            micro_batch_size=8,
            micro_batch_tokens=80,
        )
        for rank in range(2)
    ]
    # rank 0 holds rows 0, 2, 4 (40, 36, 6 tokens): 2 x 40 fit in 80, a third does not;
    # rank 1 rows 1, 3, 5 (38, 5, 7): 38 with 7, then 5
    assert [[mb.row_ids.tolist() for mb in rank] for rank in per_rank] == [
        [[0, 2], [4]],
        [[1, 5], [3]],
    ]
    # a rank with fewer passes than another adds passes of one empty row
    filler = micro_batches(
        batch, [0, 1, 2], dp_rank=1, dp_size=2, micro_batch_size=8, micro_batch_tokens=40
    )
    assert [mb.row_ids.tolist() for mb in filler] == [[1], [-1]]
    assert filler[1].padding_mask.all() and not filler[1].loss_mask.any()


def test_packed_micro_batches_hold_the_rows_back_to_back_with_a_tail_to_the_tp_multiple():
    lengths = [30, 5, 12, 29, 6, 11, 40, 7]
    batch = _batch_of_lengths(lengths)
    planned = micro_batches(
        batch,
        list(range(8)),
        dp_rank=0,
        dp_size=1,
        micro_batch_size=2,  # no bound on a packed micro-batch's rows
        micro_batch_tokens=64,
        width_multiple=4,
        packed=True,
    )
    # first fit, longest first: 40 + 12 + 11 (63: one tail token to 64); 30 + 29, and 5 joins
    # them later (64); 7 fits neither, 6 joins it (13: three tail tokens to 16)
    assert [mb.row_ids.tolist() for mb in planned] == [[6, 2, 5, -1], [0, 3, 1], [7, 4, -1]]
    for mb in planned:
        assert mb.tokens.shape[0] == 1 and mb.tokens.shape[1] % 4 == 0
        offsets = mb.cu_seqlens.tolist()
        assert offsets[0] == 0 and offsets[-1] == mb.tokens.shape[1]
        for i, row in enumerate(mb.row_ids.tolist()):
            start, end = offsets[i], offsets[i + 1]
            if row < 0:  # the tail: padding, no loss, one empty sequence
                assert mb.padding_mask[0, start:end].all() and not mb.loss_mask[0, start:end].any()
                continue
            assert end - start == lengths[row]
            assert torch.equal(mb.tokens[0, start:end], batch.tokens[row, : lengths[row]])
            assert torch.equal(mb.loss_mask[0, start:end], batch.loss_mask[row, : lengths[row]])
            assert torch.equal(mb.engine_logp[0, start:end], batch.engine_logp[row, : end - start])
            assert not mb.padding_mask[0, start:end].any()
            assert not mb.loss_mask[0, end - 1]  # a sequence's last token predicts nothing
    assert sum(int(mb.loss_mask.sum()) for mb in planned) == int(batch.loss_mask.sum())
    assert sum(int(mb.padding_mask.sum()) for mb in planned) == 1 + 3
    # the loss's rows: one per sequence, the tail an empty one
    rows = planned[0].as_rows(planned[0].engine_logp, planned[0].engine_logp)
    assert rows.loss_mask.shape == (4, 40) and not rows.loss_mask[3].any()


def test_packed_micro_batches_by_rows_and_the_filler_of_a_short_rank():
    batch = _batch_of_lengths([40, 38, 36, 5, 6, 7])
    by_rows = micro_batches(
        batch, list(range(6)), dp_rank=0, dp_size=1, micro_batch_size=4, packed=True
    )
    assert [mb.row_ids.tolist() for mb in by_rows] == [[0, 1, 2], [3, 4, 5]]
    assert [tuple(mb.tokens.shape) for mb in by_rows] == [(1, 114), (1, 18)]
    assert not any(mb.padding_mask.any() for mb in by_rows)
    filler = micro_batches(
        batch,
        [0, 1, 2],
        dp_rank=1,
        dp_size=2,
        micro_batch_size=8,
        micro_batch_tokens=40,
        width_multiple=2,
        packed=True,
    )
    assert [mb.row_ids.tolist() for mb in filler] == [[1], [-1]]
    assert filler[1].tokens.shape == (1, 2) and filler[1].padding_mask.all()
    assert filler[1].cu_seqlens.tolist() == [0, 2] and not filler[1].loss_mask.any()


def test_engine_routing_lands_at_each_packed_sequence_offset():
    samples = [_sample([1, 2, 3], [4, 5], routed=True), _sample([6], [7], routed=True)]
    batch = build_rollout_batch(
        samples, torch.ones(2), group_size=2, pad_id=0, newline_token_ids=[NEWLINE]
    )
    routing = EngineRouting(num_layers=2, moe_layers=(0, 1), stage_layers=(0, 1), topk=2)
    (micro,) = micro_batches(
        batch,
        [0, 1],
        dp_rank=0,
        dp_size=1,
        micro_batch_size=2,
        width_multiple=4,
        packed=True,
        engine_routing=routing,
    )
    assert micro.cu_seqlens.tolist() == [0, 5, 7, 8]
    layer1 = micro.routing[1]  # [tokens, topk], the packed row's order
    torch.testing.assert_close(layer1[:4], samples[0].routed_experts[:, 1].long())
    torch.testing.assert_close(layer1[5:6], samples[1].routed_experts[:, 1].long())


@pytest.mark.parametrize("packed", [False, True], ids=["padded", "packed"])
def test_every_rank_runs_as_many_budget_passes_as_the_busiest_and_no_more(packed):
    # rank 0 holds rows 0, 2, 4 (40, 36, 38 tokens: three passes of a 40-token budget); rank 1
    # rows 1, 3, 5 (5, 6, 7: one pass)
    batch = _batch_of_lengths([40, 5, 36, 6, 38, 7])
    per_rank = [
        micro_batches(
            batch,
            list(range(6)),
            dp_rank=rank,
            dp_size=2,
            micro_batch_size=8,
            micro_batch_tokens=40,
            packed=packed,
        )
        for rank in range(2)
    ]
    assert [len(passes) for passes in per_rank] == [3, 3]
    assert [mb.row_ids.tolist() for mb in per_rank[1]] == [[5, 3, 1], [-1], [-1]]
    alone = micro_batches(
        batch, [1, 3], dp_rank=0, dp_size=1, micro_batch_size=8, micro_batch_tokens=40
    )
    assert [mb.row_ids.tolist() for mb in alone] == [[3, 1]]  # one rank: no filler pass


@pytest.mark.parametrize("packed", [False, True], ids=["padded", "packed"])
def test_a_filler_pass_of_an_r3_step_replays_the_default_experts(packed):
    samples = [_sample([1, 2, 3], [4] * n, routed=True) for n in (30, 2, 28, 3)]
    batch = build_rollout_batch(
        samples, torch.ones(4), group_size=4, pad_id=0, newline_token_ids=[NEWLINE]
    )
    routing = EngineRouting(
        num_layers=2, moe_layers=(0, 1), stage_layers=(0, 1), topk=2, sp_rank=1, sp_size=2
    )
    passes = micro_batches(
        batch,
        [0, 1, 2, 3],
        dp_rank=1,
        dp_size=2,
        micro_batch_size=8,
        micro_batch_tokens=40,
        width_multiple=2,
        packed=packed,
        engine_routing=routing,
    )
    # rank 1 holds rows 1 and 3 (5 and 6 tokens: one pass); rank 0 rows 0 and 2 (two passes)
    assert [mb.row_ids.tolist()[:2] for mb in passes] == [[3, 1], [-1]]
    filler = passes[1]
    assert len(filler.routing) == 2
    for layer in filler.routing:  # this SP rank's half of the filler's tokens
        assert layer.shape == (filler.tokens.numel() // 2, 2)
        assert torch.equal(layer, torch.arange(2).expand_as(layer))
