"""Every policy loss against an independent float64 reference (value and gradient), where the
gradient flows, what clips, and the edge cases."""

from __future__ import annotations

import math

import pytest
import torch

from megatron_rl.algo import (
    LOSS_AGG_MODES,
    compute_policy_loss,
    extreme_token_frac,
    group_advantages,
    policy_loss_names,
)
from tests.algo import reference
from tests.algo.batches import fresh_logp, random_batch

# Ranges chosen so that, at the drift of random_batch below, each loss clips some units and not
# others (both branches are then exercised by the reference comparison).
CLIP = {
    "grpo": (0.1, 0.12),
    "gspo": (0.03, 0.04),
    "gspo_token": (0.03, 0.04),
    "sspo": (0.01, 0.01),
    "gmpo": (0.1, 0.12),
    "cispo": (0.1, 0.05),
}
REFERENCES = {
    "grpo": reference.grpo,
    "gspo": reference.gspo,
    "gspo_token": reference.gspo_token,
    "sspo": reference.sspo,
    "gmpo": reference.gmpo,
    "cispo": reference.cispo_paper,
}


def _reference_loss(name, logp, batch, loss_agg, max_len=None, **sspo_options):
    clip_low, clip_high = CLIP[name]
    args = (logp, batch.old_logp, batch.advantages, batch.mask, clip_low, clip_high, loss_agg)
    if name == "sspo":
        return reference.sspo(
            *args,
            max_len,
            segment_ids=batch.segment_ids,
            old_entropy=batch.old_entropy,
            beta=sspo_options.get("sspo_entropy_coef", 1.0),
            lower=sspo_options.get("sspo_lower", "entropy"),
        )
    return REFERENCES[name](*args, max_len)


def _loss(name, logp, batch, clip=None, **options):
    clip_low, clip_high = clip or CLIP[name]
    return compute_policy_loss(
        name,
        logp,
        batch.old_logp,
        batch.advantages,
        batch.mask,
        clip_low=clip_low,
        clip_high=clip_high,
        **batch.kwargs(),
        **options,
    )


def test_registry_lists_every_loss_of_the_issue():
    assert set(policy_loss_names()) == {"grpo", "gspo", "gspo_token", "sspo", "gmpo", "cispo"}


@pytest.mark.parametrize("padding", ["right", "left"])
@pytest.mark.parametrize("loss_agg", LOSS_AGG_MODES)
@pytest.mark.parametrize("name", ["grpo", "gspo", "gspo_token", "sspo", "gmpo", "cispo"])
def test_value_and_gradient_match_float64_reference(name, loss_agg, padding):
    # drift large enough that every loss clips some of its units with these ranges
    batch = random_batch(8, 10, seed=3, drift=0.1, padding=padding)
    max_len = 10 if loss_agg == "seq-mean-token-sum-norm" else None
    options = {"max_response_len": max_len} if max_len else {}

    logp = fresh_logp(batch)
    loss, metrics = _loss(name, logp, batch, loss_agg=loss_agg, **options)
    loss.backward()

    ref_logp = fresh_logp(batch)
    ref_loss = _reference_loss(name, ref_logp, batch, loss_agg, max_len)
    ref_loss.backward()

    if name == "cispo":  # our value is sg(r-hat) A, the paper's sg(r-hat) A log pi: same gradient
        ref_value = reference.cispo_value(
            batch.logp, batch.old_logp, batch.advantages, batch.mask, *CLIP[name], loss_agg, max_len
        )
        torch.testing.assert_close(loss, ref_value, rtol=1e-12, atol=1e-12)
    else:
        torch.testing.assert_close(loss, ref_loss, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(logp.grad, ref_logp.grad, rtol=1e-10, atol=1e-12)
    assert not torch.isnan(logp.grad).any()
    assert 0 < float(metrics["clip_frac/token"]) < 1


@pytest.mark.parametrize("lower", ["entropy", "fixed"])
@pytest.mark.parametrize("beta", [0.0, 0.5, 2.0])
def test_sspo_options_match_reference(lower, beta):
    batch = random_batch(8, 12, seed=5, drift=0.08)
    logp = fresh_logp(batch)
    loss, _ = _loss("sspo", logp, batch, sspo_entropy_coef=beta, sspo_lower=lower)
    loss.backward()
    ref_logp = fresh_logp(batch)
    ref = _reference_loss(
        "sspo", ref_logp, batch, "seq-mean-token-mean", sspo_entropy_coef=beta, sspo_lower=lower
    )
    ref.backward()
    torch.testing.assert_close(loss, ref, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(logp.grad, ref_logp.grad, rtol=1e-10, atol=1e-12)


def test_sspo_without_entropy_needs_no_old_entropy():
    batch = random_batch(4, 8, seed=1)
    loss, _ = compute_policy_loss(
        "sspo",
        batch.logp,
        batch.old_logp,
        batch.advantages,
        batch.mask,
        clip_low=0.1,
        clip_high=0.1,
        segment_ids=batch.segment_ids,
        sspo_entropy_coef=0.0,
    )
    assert torch.isfinite(loss)


def test_gspo_gives_every_token_of_a_sequence_the_same_gradient():
    batch = random_batch(8, 12, seed=7, drift=0.01)
    logp = fresh_logp(batch)
    loss, metrics = _loss("gspo", logp, batch, check_finite=True)
    loss.backward()
    assert float(metrics["clip_frac/seq"]) < 1.0  # some sequences are not clipped
    num_rows = batch.mask.any(1).sum()
    for i in range(8):
        grads = logp.grad[i][batch.mask[i]]
        torch.testing.assert_close(grads, grads[0].expand_as(grads), rtol=1e-12, atol=1e-15)
        assert (logp.grad[i][~batch.mask[i]] == 0).all()
        s_i = torch.exp((batch.logp[i] - batch.old_logp[i])[batch.mask[i]].mean()).detach()
        clipped_row = float(metrics["clip_frac/seq"]) > 0 and grads.abs().max() == 0
        if not clipped_row:  # d(-A s / N) / d logp_t = -A s / (|y| N)
            expected = -batch.advantages[i] * s_i / (batch.mask[i].sum() * num_rows)
            torch.testing.assert_close(grads[0], expected, rtol=1e-12, atol=0)


@pytest.mark.parametrize("loss_agg", LOSS_AGG_MODES)
def test_gspo_token_equals_gspo_under_sequence_advantages(loss_agg):
    batch = random_batch(8, 12, seed=11, drift=0.01)
    options = {"max_response_len": 12} if loss_agg == "seq-mean-token-sum-norm" else {}
    options["clip"] = (3e-3, 4e-3)  # GSPO-like ranges: some sequences clip, some do not
    logp_seq, logp_tok = fresh_logp(batch), fresh_logp(batch)
    loss_seq, m_seq = _loss("gspo", logp_seq, batch, loss_agg=loss_agg, **options)
    loss_tok, m_tok = _loss("gspo_token", logp_tok, batch, loss_agg=loss_agg, **options)
    loss_seq.backward()
    loss_tok.backward()
    assert 0 < float(m_seq["clip_frac/seq"]) < 1
    torch.testing.assert_close(loss_tok, loss_seq, rtol=1e-12, atol=1e-14)
    torch.testing.assert_close(logp_tok.grad, logp_seq.grad, rtol=1e-10, atol=1e-15)
    for key in ("clip_frac/token", "clip_frac/seq", "clip_frac/low", "clip_frac/high"):
        torch.testing.assert_close(m_tok[key], m_seq[key])


def test_gspo_token_takes_per_token_advantages_gspo_refuses_them():
    batch = random_batch(4, 6, seed=2)
    per_token = torch.randn(4, 6, dtype=torch.float64)
    logp = fresh_logp(batch)
    loss, _ = compute_policy_loss(
        "gspo_token", logp, batch.old_logp, per_token, batch.mask, clip_low=0.2, clip_high=0.2
    )
    loss.backward()
    ref_logp = fresh_logp(batch)
    ref = reference.gspo_token(
        ref_logp, batch.old_logp, per_token, batch.mask, 0.2, 0.2, "seq-mean-token-mean"
    )
    ref.backward()
    torch.testing.assert_close(loss, ref, rtol=1e-12, atol=1e-14)
    torch.testing.assert_close(logp.grad, ref_logp.grad, rtol=1e-10, atol=1e-15)
    with pytest.raises(ValueError, match=r"advantages: loss 'gspo'.*gspo_token"):
        compute_policy_loss(
            "gspo", logp, batch.old_logp, per_token, batch.mask, clip_low=0.2, clip_high=0.2
        )
    # [B, T] advantages that are constant along each row are the same as [B]
    spread = batch.advantages[:, None].expand(4, 6).clone()
    a, _ = compute_policy_loss(
        "gspo", logp, batch.old_logp, spread, batch.mask, clip_low=0.2, clip_high=0.2
    )
    b, _ = compute_policy_loss(
        "gspo", logp, batch.old_logp, batch.advantages, batch.mask, clip_low=0.2, clip_high=0.2
    )
    torch.testing.assert_close(a, b, rtol=0, atol=0)


@pytest.mark.parametrize("name", ["grpo", "gspo", "gspo_token", "sspo", "gmpo", "cispo"])
def test_old_logp_and_old_entropy_get_no_gradient(name):
    batch = random_batch(4, 8, seed=4)
    batch.old_logp.requires_grad_(True)
    batch.old_entropy.requires_grad_(True)
    loss, metrics = _loss(name, batch.logp, batch)
    loss.backward()
    assert batch.old_logp.grad is None
    assert batch.old_entropy.grad is None
    assert batch.logp.grad is not None
    assert all(not value.requires_grad for value in metrics.values())


def test_cispo_gradient_is_clipped_weight_times_advantage_and_never_dropped():
    batch = random_batch(6, 10, seed=8, drift=0.3)
    logp = fresh_logp(batch)
    loss, metrics = compute_policy_loss(
        "cispo",
        logp,
        batch.old_logp,
        batch.advantages,
        batch.mask,
        clip_low=1.0,
        clip_high=0.1,
        loss_agg="token-mean",
    )
    loss.backward()
    ratio = torch.exp(batch.logp - batch.old_logp).detach()
    weight = ratio.clamp(max=1.1)
    expected = -(weight * batch.advantages[:, None]) / batch.mask.sum()
    torch.testing.assert_close(logp.grad[batch.mask], expected[batch.mask], rtol=1e-12, atol=0)
    assert float(metrics["clip_frac/high"]) > 0  # weights were clipped ...
    assert (logp.grad[batch.mask] != 0).all()  # ... yet every token keeps a gradient
    assert float(metrics["clip_frac/low"]) == 0  # clip_low = 1: no lower bound


def _one_row(log_ratios, advantage, dtype=torch.float64):
    """A single response whose token log-ratios are given; old logp fixed at -1."""
    log_ratios = torch.tensor(log_ratios, dtype=dtype)
    old_logp = torch.full_like(log_ratios, -1.0)[None]
    logp = (old_logp + log_ratios[None]).clone().requires_grad_(True)
    mask = torch.ones_like(logp, dtype=torch.bool)
    return logp, old_logp, torch.tensor([advantage], dtype=dtype), mask


def test_grpo_clips_a_token_just_outside_the_range_not_one_just_inside():
    eps = 1e-6
    outside, inside = math.log(1.2 + eps), math.log(1.2 - eps)
    logp, old, adv, mask = _one_row([outside, inside, 0.0], advantage=1.0)
    loss, metrics = compute_policy_loss("grpo", logp, old, adv, mask, clip_low=0.2, clip_high=0.2)
    loss.backward()
    assert logp.grad[0, 0] == 0
    assert logp.grad[0, 1] != 0 and logp.grad[0, 2] != 0
    assert float(metrics["clip_frac/token"]) == pytest.approx(1 / 3)
    assert float(metrics["clip_frac/high"]) == pytest.approx(1 / 3)
    assert float(metrics["clip_frac/low"]) == 0
    assert float(metrics["clip_frac/seq"]) == 1.0


def test_clip_is_one_sided_by_the_advantage_sign():
    low_ratio = math.log(0.5)
    # A > 0 with a low ratio: PPO keeps the unclipped (smaller) term, so the gradient flows
    logp, old, adv, mask = _one_row([low_ratio], advantage=1.0)
    loss, metrics = compute_policy_loss("grpo", logp, old, adv, mask, clip_low=0.2, clip_high=0.2)
    loss.backward()
    assert logp.grad[0, 0] != 0 and float(metrics["clip_frac/token"]) == 0
    # A < 0 with a low ratio: clipped at the low side, no gradient
    logp, old, adv, mask = _one_row([low_ratio], advantage=-1.0)
    loss, metrics = compute_policy_loss("grpo", logp, old, adv, mask, clip_low=0.2, clip_high=0.2)
    loss.backward()
    assert logp.grad[0, 0] == 0 and float(metrics["clip_frac/low"]) == 1.0
    torch.testing.assert_close(loss, torch.tensor(0.8, dtype=torch.float64))


def test_gspo_clips_whole_sequences():
    eps = 1e-7
    # row 0: sequence ratio just above 1 + 4e-4 although one token is far below 1;
    # row 1: sequence ratio just inside.
    above = math.log(1 + 4e-4 + eps)
    inside = math.log(1 + 4e-4 - eps)
    row0 = [3 * above + 0.5, -0.5, 0.0]  # mean = above
    row1 = [inside, inside, inside]
    logp = torch.full((2, 3), -1.0, dtype=torch.float64) + torch.tensor([row0, row1])
    logp.requires_grad_(True)
    old = torch.full((2, 3), -1.0, dtype=torch.float64)
    mask = torch.ones(2, 3, dtype=torch.bool)
    adv = torch.tensor([1.0, 1.0], dtype=torch.float64)
    loss, metrics = compute_policy_loss("gspo", logp, old, adv, mask, clip_low=3e-4, clip_high=4e-4)
    loss.backward()
    assert (logp.grad[0] == 0).all()  # every token of the clipped sequence loses its gradient
    assert (logp.grad[1] != 0).all()
    assert float(metrics["clip_frac/seq"]) == 0.5
    assert float(metrics["clip_frac/token"]) == 0.5
    assert float(metrics["clip_frac/high"]) == 0.5


def test_sspo_clips_only_the_offending_segment():
    # one row, three segments of 2 tokens; the middle one's ratio is far above its bound
    log_ratios = [0.001, -0.001, 0.5, 0.4, 0.0, 0.002]
    logp, old, adv, mask = _one_row(log_ratios, advantage=1.0)
    segment_ids = torch.tensor([[0, 0, 1, 1, 2, 2]])
    entropy = torch.full_like(old, 0.1)
    loss, metrics = compute_policy_loss(
        "sspo",
        logp,
        old,
        adv,
        mask,
        clip_low=0.2,
        clip_high=0.2,
        segment_ids=segment_ids,
        old_entropy=entropy,
    )
    loss.backward()
    assert (logp.grad[0, 2:4] == 0).all()
    assert (logp.grad[0, [0, 1, 4, 5]] != 0).all()
    assert float(metrics["clip_frac/token"]) == pytest.approx(2 / 6)
    assert float(metrics["clip_frac/segment"]) == pytest.approx(1 / 3)
    # the upper bound grows with the segment's entropy: at entropy 0.6 the same segment passes
    # (1 + 0.2 + 0.6 = 1.8 > exp(0.45) = 1.57)
    _, metrics = compute_policy_loss(
        "sspo",
        logp,
        old,
        adv,
        mask,
        clip_low=0.2,
        clip_high=0.2,
        segment_ids=segment_ids,
        old_entropy=torch.full_like(old, 0.6),
    )
    assert float(metrics["clip_frac/segment"]) == 0


def test_gmpo_clips_tokens_in_log_space_inside_the_geometric_mean():
    logp, old, adv, mask = _one_row([0.6, 0.0, -0.1], advantage=2.0)
    loss, metrics = compute_policy_loss("gmpo", logp, old, adv, mask, clip_low=0.4, clip_high=0.4)
    loss.backward()
    # token 0 is capped at log-ratio 0.4: J = 2 * exp((0.4 + 0 - 0.1) / 3)
    torch.testing.assert_close(loss, torch.tensor(-2 * math.exp(0.3 / 3), dtype=torch.float64))
    assert logp.grad[0, 0] == 0 and (logp.grad[0, 1:] != 0).all()
    assert float(metrics["clip_frac/high"]) == pytest.approx(1 / 3)


@pytest.mark.parametrize("name", ["grpo", "gspo", "gspo_token", "sspo", "gmpo", "cispo"])
def test_all_equal_rewards_give_zero_advantage_finite_loss_zero_gradient(name):
    batch = random_batch(8, 10, seed=9, drift=0.2)
    rewards = torch.tensor([1.0, 1.0, 1.0, 1.0, 0.3, 0.3, 0.3, 0.3], dtype=torch.float64)
    result = group_advantages(rewards, 4)
    assert int(result.num_zero_variance_groups) == 2
    assert (result.advantages == 0).all()
    batch.advantages = result.advantages
    loss, metrics = _loss(name, batch.logp, batch)
    loss.backward()
    assert torch.isfinite(loss) and float(loss.detach()) == 0
    assert (batch.logp.grad == 0).all()
    if name != "cispo":  # cispo reports clipped weights whatever the advantage
        assert float(metrics["clip_frac/token"]) == 0  # PPO-clip never acts without advantage
    assert all(torch.isfinite(v) for v in metrics.values())


@pytest.mark.parametrize("name", ["grpo", "gspo", "gspo_token", "sspo", "gmpo", "cispo"])
def test_fully_masked_rows_and_length_one_responses(name):
    batch = random_batch(6, 8, seed=12, drift=0.1)
    batch.mask[2] = False  # a fully masked row
    batch.mask[4] = False
    batch.mask[4, 0] = True  # a length-1 response (right padding: position 0 is a real token)
    logp = fresh_logp(batch)
    loss, metrics = _loss(name, logp, batch)
    loss.backward()
    assert torch.isfinite(loss) and torch.isfinite(logp.grad).all()
    assert (logp.grad[2] == 0).all()
    assert float(metrics["loss/denominator"]) == 5  # the empty row is not a sequence
    # dropping the empty row changes nothing
    keep = [0, 1, 3, 4, 5]
    for field in ("old_logp", "advantages", "mask", "segment_ids", "old_entropy"):
        setattr(batch, field, getattr(batch, field)[keep])
    logp_kept = logp.detach()[keep].clone().requires_grad_(True)
    loss_kept, _ = _loss(name, logp_kept, batch)
    loss_kept.backward()
    torch.testing.assert_close(loss, loss_kept, rtol=1e-12, atol=1e-15)
    torch.testing.assert_close(logp.grad[keep], logp_kept.grad, rtol=1e-12, atol=1e-15)
    ref_logp = logp.detach()[keep].clone().requires_grad_(True)
    ref = _reference_loss(name, ref_logp, batch, "seq-mean-token-mean")
    if name != "cispo":
        torch.testing.assert_close(loss_kept, ref, rtol=1e-12, atol=1e-15)


@pytest.mark.parametrize("name", ["grpo", "gspo", "gspo_token", "sspo", "gmpo", "cispo"])
def test_left_and_right_padding_give_the_same_loss(name):
    right = random_batch(6, 9, seed=13, drift=0.1, padding="right")
    left = random_batch(6, 9, seed=13, drift=0.1, padding="right")
    # move every response to the end of its row
    for i in range(6):
        n = int(right.mask[i].sum())
        for field in ("logp", "old_logp", "old_entropy", "segment_ids", "mask"):
            source, target = getattr(right, field), getattr(left, field)
            with torch.no_grad():
                target[i] = torch.roll(source[i], 9 - n)
    logp_right, logp_left = fresh_logp(right), fresh_logp(left)
    loss_right, _ = _loss(name, logp_right, right)
    loss_left, _ = _loss(name, logp_left, left)
    loss_right.backward()
    loss_left.backward()
    torch.testing.assert_close(loss_left, loss_right, rtol=1e-12, atol=1e-15)
    for i in range(6):
        torch.testing.assert_close(
            logp_left.grad[i][left.mask[i]], logp_right.grad[i][right.mask[i]]
        )


@pytest.mark.parametrize("name", ["grpo", "gspo", "gspo_token", "sspo", "gmpo", "cispo"])
@pytest.mark.parametrize("loss_agg", LOSS_AGG_MODES)
def test_global_denominator_makes_micro_batches_sum_to_the_full_batch(name, loss_agg):
    from megatron_rl.algo import policy_loss_denominator

    batch = random_batch(8, 10, seed=21, drift=0.1)
    options = {"loss_agg": loss_agg}
    if loss_agg == "seq-mean-token-sum-norm":
        options["max_response_len"] = 10
    logp_full = fresh_logp(batch)
    loss_full, _ = _loss(name, logp_full, batch, **options)
    loss_full.backward()

    logp = fresh_logp(batch)
    parts = [slice(0, 3), slice(3, 4), slice(4, 8)]  # uneven micro-batches
    denominator = sum(policy_loss_denominator(batch.mask[p], **options) for p in parts)
    total = 0
    for part in parts:
        loss, metrics = compute_policy_loss(
            name,
            logp[part],
            batch.old_logp[part],
            batch.advantages[part],
            batch.mask[part],
            clip_low=CLIP[name][0],
            clip_high=CLIP[name][1],
            segment_ids=batch.segment_ids[part],
            old_entropy=batch.old_entropy[part],
            loss_denominator=denominator,
            **options,
        )
        assert float(metrics["loss/denominator"]) == float(denominator)
        loss.backward()
        total = total + loss.detach()
    torch.testing.assert_close(total, loss_full.detach(), rtol=1e-12, atol=1e-15)
    torch.testing.assert_close(logp.grad, logp_full.grad, rtol=1e-12, atol=1e-15)


def test_bfloat16_logp_is_computed_in_float32_so_gspo_ranges_still_resolve():
    batch = random_batch(4, 16, seed=14, drift=0.0, dtype=torch.float32)
    logp = batch.logp.detach().to(torch.bfloat16).requires_grad_(True)
    # a tiny drift well below bfloat16's spacing around 1 (2^-7) but above GSPO's 4e-4
    old = (logp.detach().float() - 1e-3).to(torch.float32)
    adv = torch.ones(4)
    loss, metrics = compute_policy_loss(
        "gspo", logp, old, adv, batch.mask, clip_low=3e-4, clip_high=4e-4
    )
    loss.backward()
    assert loss.dtype == torch.float32
    assert logp.grad.dtype == torch.bfloat16
    assert float(metrics["clip_frac/seq"]) == 1.0  # s = e^1e-3 > 1 + 4e-4: every sequence clips


def test_metrics_are_detached_tensors_with_namespaced_keys():
    batch = random_batch(4, 8, seed=15)
    for name in policy_loss_names():
        _, metrics = _loss(name, fresh_logp(batch), batch)
        required = {
            "clip_frac/token",
            "clip_frac/seq",
            "clip_frac/low",
            "clip_frac/high",
            "ratio/mean",
            "ratio/max",
            "ratio/min",
            "log_ratio/abs_max",
            "kl/k3",
            "log_ratio/std",
            "log_ratio/frac_tau1.25",
            "log_ratio/frac_tau2",
            "log_ratio/frac_tau5",
            "loss/denominator",
        }
        assert required <= set(metrics)
        for key, value in metrics.items():
            assert "/" in key
            assert isinstance(value, torch.Tensor) and value.dim() == 0 and not value.requires_grad
        assert float(metrics["ratio/min"]) <= float(metrics["ratio/mean"])
        assert float(metrics["ratio/mean"]) <= float(metrics["ratio/max"])
        assert float(metrics["kl/k3"]) >= 0
        assert 0 <= float(metrics["log_ratio/frac_tau5"]) <= float(metrics["log_ratio/frac_tau2"])
        assert float(metrics["log_ratio/frac_tau2"]) <= float(metrics["log_ratio/frac_tau1.25"])
        assert float(metrics["log_ratio/std"]) >= 0


def test_extreme_token_fraction_counts_ratios_beyond_tau_either_way():
    # p_new / p_old per token: 3 (beyond 2), 1/3 (beyond 2), 6 (beyond 5), 1.5; last token masked.
    log_ratio = torch.tensor([[math.log(3), -math.log(3), math.log(6), math.log(1.5), 9.0]])
    mask = torch.tensor([[True, True, True, True, False]])
    assert float(extreme_token_frac(log_ratio, mask, 2)) == pytest.approx(3 / 4)
    assert float(extreme_token_frac(log_ratio, mask, 5)) == pytest.approx(1 / 4)
    assert float(extreme_token_frac(log_ratio, torch.zeros_like(mask), 2)) == 0.0


def test_log_ratio_std_is_over_response_tokens_only():
    logp = torch.tensor([[0.1, -0.2, 0.4, 5.0], [0.3, 0.0, 0.0, 0.0]])
    old = torch.zeros(2, 4)
    mask = torch.tensor([[True, True, True, False], [True, False, False, False]])
    _, metrics = compute_policy_loss(
        "grpo", logp, old, torch.ones(2), mask, clip_low=0.2, clip_high=0.2
    )
    expected = torch.tensor([0.1, -0.2, 0.4, 0.3]).std(unbiased=False)
    assert float(metrics["log_ratio/std"]) == pytest.approx(float(expected), rel=1e-6)
