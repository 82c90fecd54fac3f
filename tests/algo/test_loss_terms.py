"""The terms around the clipped surrogate: PPO dual-clip for negative advantages, the log-ratio
clamp that keeps exp() finite, and the entropy bonus; each against a float64 reference."""

from __future__ import annotations

import math

import pytest
import torch

from megatron_rl.algo import (
    LOG_RATIO_CLAMP,
    compute_policy_loss,
    get_policy_loss,
    policy_loss_names,
)
from megatron_rl.algo.ratios import ratio_from_log
from tests.algo import reference
from tests.algo.batches import fresh_logp, random_batch

REFERENCE = {"grpo": reference.grpo, "gspo": reference.gspo}
CLIP = {"grpo": (0.2, 0.27), "gspo": (0.03, 0.04)}


def _loss(name, logp, batch, **options):
    return compute_policy_loss(
        name,
        logp,
        batch.old_logp,
        batch.advantages,
        batch.mask,
        clip_low=CLIP[name][0],
        clip_high=CLIP[name][1],
        **options,
    )


@pytest.mark.parametrize("name", ["grpo", "gspo"])
def test_dual_clip_matches_float64_reference(name):
    # ratios far from 1, so that negative-advantage units beyond c = 3 exist
    batch = random_batch(
        12, 8, seed=6 if name == "grpo" else 9, drift=1.5 if name == "grpo" else 2.5
    )
    logp = fresh_logp(batch)
    loss, metrics = _loss(name, logp, batch, dual_clip=3.0)
    loss.backward()
    ref_logp = fresh_logp(batch)
    ref = REFERENCE[name](
        ref_logp,
        batch.old_logp,
        batch.advantages,
        batch.mask,
        *CLIP[name],
        "seq-mean-token-mean",
        dual_clip=3.0,
    )
    ref.backward()
    torch.testing.assert_close(loss, ref, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(logp.grad, ref_logp.grad, rtol=1e-10, atol=1e-12)
    assert 0 < float(metrics["clip_frac/dual"]) < 1

    plain_logp = fresh_logp(batch)
    plain, plain_metrics = _loss(name, plain_logp, batch, dual_clip=None)
    assert float(plain.detach()) != float(loss.detach())  # the bound changed something
    assert "clip_frac/dual" in plain_metrics and float(plain_metrics["clip_frac/dual"]) == 0.0


def test_every_loss_with_dual_clip_bounds_at_three_by_default():
    with_option = [n for n in policy_loss_names() if "dual_clip" in get_policy_loss(n).options]
    assert with_option == ["grpo", "gspo", "gspo_token", "sspo", "gmpo"]
    for name in with_option:
        assert get_policy_loss(name).options["dual_clip"] == 3.0
    batch = random_batch(12, 8, seed=6, drift=1.5)
    default, _ = _loss("grpo", batch.logp, batch)
    explicit, _ = _loss("grpo", batch.logp, batch, dual_clip=3.0)
    off, _ = _loss("grpo", batch.logp, batch, dual_clip=None)
    assert torch.equal(default, explicit)
    assert not torch.equal(default, off)


def _one_token(log_ratio: float, advantage: float):
    logp = torch.tensor([[log_ratio - 1.0]], dtype=torch.float64, requires_grad=True)
    old = torch.tensor([[-1.0]], dtype=torch.float64)
    return logp, old, torch.tensor([advantage], dtype=torch.float64), torch.ones(1, 1, dtype=bool)


@pytest.mark.parametrize("name", ["grpo", "gspo", "gspo_token", "sspo", "gmpo", "cispo"])
def test_an_extreme_negative_advantage_token_has_a_bounded_loss_and_gradient(name):
    # verl's cross-check: at log-ratio 25 an unbounded GRPO token gradient is ~1e10
    logp, old, adv, mask = _one_token(25.0, -1.0)
    options = {"segment_ids": torch.zeros(1, 1, dtype=torch.long)} if name == "sspo" else {}
    if name == "sspo":
        options["sspo_entropy_coef"] = 0.0
    loss, _ = compute_policy_loss(
        name, logp, old, adv, mask, clip_low=0.2, clip_high=0.2, **options
    )
    loss.backward()
    assert math.isfinite(float(loss.detach())) and math.isfinite(float(logp.grad))
    assert abs(float(logp.grad)) <= math.exp(LOG_RATIO_CLAMP)
    assert float(loss.detach()) <= math.exp(LOG_RATIO_CLAMP)
    if "dual_clip" in get_policy_loss(name).options:
        logp.grad = None
        bounded, metrics = compute_policy_loss(
            name, logp, old, adv, mask, clip_low=0.2, clip_high=0.2, dual_clip=3.0, **options
        )
        bounded.backward()
        assert float(bounded.detach()) == pytest.approx(3.0)  # -(c * A)
        assert float(logp.grad) == 0.0
        assert float(metrics["clip_frac/dual"]) == 1.0


def test_the_clamp_changes_nothing_inside_it():
    # at log-ratio 19 (inside the clamp) the unbounded loss and gradient are exactly the formula's
    logp, old, adv, mask = _one_token(19.0, -1.0)
    loss, _ = compute_policy_loss(
        "grpo", logp, old, adv, mask, clip_low=0.2, clip_high=0.2, dual_clip=None
    )
    loss.backward()
    ref_logp = logp.detach().clone().requires_grad_(True)
    ref = reference.grpo(ref_logp, old, adv, mask, 0.2, 0.2, "seq-mean-token-mean")
    ref.backward()
    assert float(loss.detach()) == float(ref.detach()) == pytest.approx(math.exp(19.0))
    assert float(logp.grad) == float(ref_logp.grad)
    log_ratios = torch.linspace(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP, 1001, dtype=torch.float64)
    assert torch.equal(ratio_from_log(log_ratios), torch.exp(log_ratios))
    assert float(ratio_from_log(torch.tensor(100.0))) == pytest.approx(math.exp(LOG_RATIO_CLAMP))


@pytest.mark.parametrize("value", [1.0, 0.5, -3.0, math.inf, True, "3"])
def test_a_dual_clip_of_one_or_less_is_refused(value):
    batch = random_batch(4, 6, seed=1)
    with pytest.raises(
        ValueError, match=r"dual_clip: expected None \(off\) or a finite number > 1"
    ):
        _loss("grpo", batch.logp, batch, dual_clip=value)


def test_cispo_has_no_dual_clip_its_weight_is_already_bounded():
    batch = random_batch(4, 6, seed=1)
    with pytest.raises(ValueError, match=r"unknown option\(s\) dual_clip for policy loss 'cispo'"):
        compute_policy_loss(
            "cispo",
            batch.logp,
            batch.old_logp,
            batch.advantages,
            batch.mask,
            clip_low=1.0,
            clip_high=0.28,
            dual_clip=3.0,
        )


@pytest.mark.parametrize("loss_agg", ["seq-mean-token-mean", "token-mean", "seq-mean-token-sum"])
def test_entropy_bonus_adds_the_aggregated_entropy_and_its_gradient(loss_agg):
    batch = random_batch(6, 9, seed=8, drift=0.1)
    gen = torch.Generator().manual_seed(3)
    entropy = torch.rand(batch.mask.shape, generator=gen, dtype=torch.float64) * 2
    # padding holds NaN, as the other inputs' padding does
    entropy = torch.where(batch.mask, entropy, float("nan")).requires_grad_()
    coef = 0.01
    logp = fresh_logp(batch)
    loss, metrics = _loss(
        "gspo", logp, batch, loss_agg=loss_agg, entropy=entropy, entropy_coef=coef
    )
    loss.backward()
    plain_logp = fresh_logp(batch)
    plain, _ = _loss("gspo", plain_logp, batch, loss_agg=loss_agg)
    plain.backward()
    # the bonus, token by token: rows of entropies aggregated like the objective
    bonus_ref_entropy = entropy.detach().clone().requires_grad_()
    rows = [
        [bonus_ref_entropy[i, t] for t in range(batch.mask.shape[1]) if batch.mask[i, t]]
        for i in range(batch.mask.shape[0])
        if batch.mask[i].any()
    ]
    bonus = -reference._aggregate(rows, loss_agg, None) * coef
    bonus.backward()
    torch.testing.assert_close(loss, plain - bonus, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(logp.grad, plain_logp.grad, rtol=1e-12, atol=1e-14)
    torch.testing.assert_close(entropy.grad, -bonus_ref_entropy.grad, rtol=1e-12, atol=1e-14)
    assert float(metrics["loss/entropy_bonus"]) == pytest.approx(float(bonus.detach()))
    assert float(entropy.grad[~batch.mask].abs().sum()) == 0.0
    assert torch.isfinite(loss.detach())


def test_an_entropy_bonus_needs_the_entropy():
    batch = random_batch(4, 6, seed=1)
    with pytest.raises(ValueError, match=r"entropy: entropy_coef > 0 adds an entropy bonus"):
        _loss("gspo", batch.logp, batch, entropy_coef=0.01)
    with pytest.raises(ValueError, match=r"entropy_coef: expected a finite, non-negative number"):
        _loss("gspo", batch.logp, batch, entropy=batch.old_entropy, entropy_coef=-0.1)


def _reference_kl(logp, ref_logp, i, t, estimator):
    x = ref_logp[i, t] - logp[i, t]
    if estimator == "k1":
        return -x
    if estimator == "k2":
        return x * x / 2
    return torch.exp(x) - 1 - x


@pytest.mark.parametrize("estimator", ["k1", "k2", "k3"])
@pytest.mark.parametrize("loss_agg", ["seq-mean-token-mean", "token-mean"])
def test_kl_penalty_matches_float64_reference(estimator, loss_agg):
    batch = random_batch(6, 9, seed=9, drift=0.1)
    gen = torch.Generator().manual_seed(4)
    ref_logp = batch.old_logp + 0.3 * torch.randn(
        batch.mask.shape, generator=gen, dtype=torch.float64
    )
    coef = 0.05
    logp = fresh_logp(batch)
    loss, metrics = _loss(
        "gspo",
        logp,
        batch,
        loss_agg=loss_agg,
        ref_logp=ref_logp,
        kl_coef=coef,
        kl_estimator=estimator,
    )
    loss.backward()
    ref_policy_logp = fresh_logp(batch)
    plain, _ = _loss("gspo", ref_policy_logp, batch, loss_agg=loss_agg)
    rows = [
        [
            _reference_kl(ref_policy_logp, ref_logp, i, t, estimator)
            for t in range(batch.mask.shape[1])
            if batch.mask[i, t]
        ]
        for i in range(batch.mask.shape[0])
        if batch.mask[i].any()
    ]
    kl = -reference._aggregate(rows, loss_agg, None)
    (plain + coef * kl).backward()
    torch.testing.assert_close(loss, plain + coef * kl, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(logp.grad, ref_policy_logp.grad, rtol=1e-10, atol=1e-13)
    assert float(metrics["kl/ref"]) == pytest.approx(float(kl.detach()))
    assert float(metrics["loss/kl_penalty"]) == pytest.approx(coef * float(kl.detach()))


def test_kl_penalty_needs_the_reference_and_a_known_estimator():
    batch = random_batch(4, 6, seed=1)
    with pytest.raises(ValueError, match=r"ref_logp: kl_coef > 0 penalises the KL"):
        _loss("gspo", batch.logp, batch, kl_coef=0.1)
    with pytest.raises(ValueError, match=r"kl_estimator: unknown estimator 'k4'; valid: k1, k2"):
        _loss("gspo", batch.logp, batch, ref_logp=batch.old_logp, kl_coef=0.1, kl_estimator="k4")
    with pytest.raises(ValueError, match=r"kl_coef: expected a finite, non-negative number"):
        _loss("gspo", batch.logp, batch, ref_logp=batch.old_logp, kl_coef=-1.0)


def test_the_penalty_and_bonus_metrics_use_the_batchs_own_denominator():
    # a trainer passes a global denominator (megatron-core divides by it later); the metrics
    # must still read as this batch's aggregated KL and bonus
    batch = random_batch(6, 9, seed=2, drift=0.1)
    entropy = torch.where(batch.mask, 0.5, float("nan")).to(torch.float64)
    terms = {"ref_logp": batch.old_logp, "kl_coef": 0.1, "entropy": entropy, "entropy_coef": 0.1}
    _, own = _loss("gspo", fresh_logp(batch), batch, **terms)
    _, global_d = _loss("gspo", fresh_logp(batch), batch, loss_denominator=1, **terms)
    for key in ("kl/ref", "loss/kl_penalty", "loss/entropy_bonus"):
        assert float(global_d[key]) == pytest.approx(float(own[key])), key
    assert float(own["loss/entropy_bonus"]) == pytest.approx(0.05)


@pytest.mark.parametrize("name", ["grpo", "gspo", "gspo_token", "sspo", "gmpo"])
def test_by_default_a_row_with_a_negative_advantage_and_log_ratio_20_gets_no_gradient(name):
    # Without the bound its gradient is of order e^20 (4.9e8) per token.
    old = torch.full((2, 6), -2.0, dtype=torch.float64)
    logp = (old + torch.tensor([[20.0], [0.01]], dtype=torch.float64)).requires_grad_(True)
    mask = torch.ones(2, 6, dtype=torch.bool)
    advantages = torch.tensor([-1.0, -1.0], dtype=torch.float64)
    options = {"segment_ids": torch.zeros(2, 6, dtype=torch.long), "old_entropy": 0 * old}
    options = options if name == "sspo" else {}
    loss, metrics = compute_policy_loss(
        name, logp, old, advantages, mask, clip_low=0.2, clip_high=0.2, **options
    )
    loss.backward()
    assert torch.equal(logp.grad[0], torch.zeros(6, dtype=torch.float64))
    assert bool((logp.grad[1] != 0).all())  # the row inside the bound still learns
    assert float(metrics["clip_frac/dual"]) == pytest.approx(0.5)
    unbounded = logp.detach().clone().requires_grad_(True)
    loss, _ = compute_policy_loss(
        name,
        unbounded,
        old,
        advantages,
        mask,
        clip_low=0.2,
        clip_high=0.2,
        dual_clip=None,
        **options,
    )
    loss.backward()
    assert float(unbounded.grad[0].abs().max()) > 1e6


@pytest.mark.parametrize("name", policy_loss_names())
def test_with_default_options_every_tokens_gradient_is_bounded(name):
    # Ratios from e^-12 to e^12: for A > 0 an unclipped unit's ratio is at most the upper clip
    # bound, for A < 0 at most the dual-clip c = 3; so |d loss / d logp_t| <= 3 |A_i| w_t / D
    # with the aggregation's weight w_t / D = 1 / (|y_i| * sequences) (seq-mean-token-mean).
    batch = random_batch(16, 10, seed=12, drift=4.0)
    extra = batch.kwargs() if name == "sspo" else {}
    logp = fresh_logp(batch)
    loss, _ = compute_policy_loss(
        name,
        logp,
        batch.old_logp,
        batch.advantages,
        batch.mask,
        clip_low=0.2,
        clip_high=0.2,
        **extra,
    )
    loss.backward()
    lengths = batch.mask.sum(dim=1, keepdim=True).double()
    bound = 3 * batch.advantages.abs()[:, None] / (lengths * batch.mask.any(dim=1).sum())
    grad = torch.where(batch.mask, logp.grad, torch.zeros_like(logp.grad))
    assert bool((grad.abs() <= bound * (1 + 1e-12)).all())
    assert float(grad.abs().max()) > 0
