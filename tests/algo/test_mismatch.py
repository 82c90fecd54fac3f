"""Mismatch corrections (TIS, MIS, IcePop at token, sequence and geometric level) against weights
written here from the formulas, token by token in float64; their effect on the loss and its
gradient; identity when the engine and the trainer agree; their metrics and bad input."""

from __future__ import annotations

import math

import pytest
import torch

from megatron_rl.algo import MismatchCorrection, compute_policy_loss, policy_loss_names
from megatron_rl.algo.mismatch import mismatch_metrics, mismatch_weights
from tests.algo import reference
from tests.algo.batches import fresh_logp, random_batch

CASES = [
    ("tis", "token"),
    ("tis", "sequence"),
    ("tis", "geometric"),
    ("mis", "token"),
    ("mis", "sequence"),
    ("mis", "geometric"),
    ("icepop", "token"),
]
# Bands narrow enough that, at the engine noise below, some tokens and sequences fall outside.
BOUNDS = {"tis": (None, 1.3), "mis": (0.7, 1.4), "icepop": (0.8, 1.25)}


def _engine_logp(batch, noise: float, seed: int = 11):
    """The engine's log-probs: the old ones plus noise on response tokens (NaN on padding)."""
    gen = torch.Generator().manual_seed(seed)
    noisy = batch.old_logp + noise * torch.randn(
        batch.old_logp.shape, generator=gen, dtype=torch.float64
    )
    return torch.where(batch.mask, noisy, torch.full_like(noisy, float("nan")))


def _gspo(batch, **options):
    """GSPO with a wide clip range on `batch`'s current log-probs."""
    return compute_policy_loss(
        "gspo",
        batch.logp,
        batch.old_logp,
        batch.advantages,
        batch.mask,
        clip_low=0.1,
        clip_high=0.1,
        **options,
    )


def reference_weights(old_logp, engine_logp, mask, mode, level, lower, upper):
    """rho = pi_old / pi_engine per token, or the product over the row (sequence), or its
    geometric mean; TIS min(rho, C); MIS and IcePop rho inside [lower, upper], else 0. Returns
    the weights and where they differ from rho."""
    weights = torch.zeros(mask.shape, dtype=torch.float64)
    changed = torch.zeros(mask.shape, dtype=torch.bool)
    for i in range(mask.shape[0]):
        positions = [t for t in range(mask.shape[1]) if bool(mask[i, t])]
        token_rho = {
            t: math.exp(float(old_logp[i, t]) - float(engine_logp[i, t])) for t in positions
        }
        product = math.prod(token_rho.values())
        for t in positions:
            rho = {
                "token": token_rho[t],
                "sequence": product,
                "geometric": product ** (1 / len(positions)),
            }[level]
            if mode == "tis":
                weights[i, t] = min(rho, upper)
                changed[i, t] = rho > upper
            else:
                weights[i, t] = rho if lower <= rho <= upper else 0.0
                changed[i, t] = not lower <= rho <= upper
    return weights, changed


NOISE = {"token": 0.2, "sequence": 0.12, "geometric": 0.5}


@pytest.mark.parametrize(("mode", "level"), CASES)
@pytest.mark.parametrize("name", ["grpo", "gspo"])
def test_corrected_loss_and_gradient_match_float64_reference(name, mode, level):
    batch = random_batch(8, 10, seed=4, drift=0.1)
    engine = _engine_logp(batch, noise=NOISE[level])
    lower, upper = BOUNDS[mode]
    correction = MismatchCorrection.of(mode, level=level, lower=lower, upper=upper)
    clip = (0.1, 0.12) if name == "grpo" else (0.03, 0.04)

    logp = fresh_logp(batch)
    loss, metrics = compute_policy_loss(
        name,
        logp,
        batch.old_logp,
        batch.advantages,
        batch.mask,
        clip_low=clip[0],
        clip_high=clip[1],
        engine_logp=engine,
        mismatch=correction,
        dual_clip=None,
    )
    loss.backward()

    weights, changed = reference_weights(
        batch.old_logp, engine, batch.mask, mode, level, lower, upper
    )
    ref_logp = fresh_logp(batch)
    ref_fn = reference.grpo if name == "grpo" else reference.gspo
    ref = ref_fn(
        ref_logp,
        batch.old_logp,
        batch.advantages,
        batch.mask,
        *clip,
        "seq-mean-token-mean",
        weights=weights,
    )
    ref.backward()
    torch.testing.assert_close(loss, ref, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(logp.grad, ref_logp.grad, rtol=1e-10, atol=1e-12)

    what = "truncated" if mode == "tis" else "masked"
    on_mask = weights[batch.mask]
    share = float(changed[batch.mask].double().mean())
    assert 0 < share < 1  # the correction changed some tokens, not all
    assert float(metrics[f"mismatch/{what}_token_frac"]) == pytest.approx(share)
    rows = changed.any(dim=1).double().sum() / batch.mask.any(dim=1).sum()
    assert float(metrics[f"mismatch/{what}_seq_frac"]) == pytest.approx(float(rows))
    assert float(metrics["mismatch/weight_mean"]) == pytest.approx(float(on_mask.mean()))
    assert float(metrics["mismatch/weight_max"]) == pytest.approx(float(on_mask.max()))


def test_truncation_counts_what_the_cap_cut():
    batch = random_batch(6, 8, seed=2)
    engine = _engine_logp(batch, noise=0.3)
    correction = MismatchCorrection.of("tis", upper=1.2)
    _, metrics = _gspo(
        batch,
        engine_logp=engine,
        mismatch=correction,
    )
    rho = torch.exp(batch.old_logp - engine)[batch.mask]
    assert float(metrics["mismatch/truncated_token_frac"]) == pytest.approx(
        float((rho > 1.2).double().mean())
    )
    assert float(metrics["mismatch/weight_max"]) == pytest.approx(1.2)


@pytest.mark.parametrize(("mode", "level"), CASES)
@pytest.mark.parametrize("name", policy_loss_names())
def test_every_correction_is_the_identity_when_engine_and_trainer_agree(name, mode, level):
    batch = random_batch(6, 9, seed=7, drift=0.1)
    common = {"clip_low": 0.1, "clip_high": 0.1, **batch.kwargs()}
    plain_logp = fresh_logp(batch)
    plain, _ = compute_policy_loss(
        name, plain_logp, batch.old_logp, batch.advantages, batch.mask, **common
    )
    plain.backward()
    logp = fresh_logp(batch)
    corrected, metrics = compute_policy_loss(
        name,
        logp,
        batch.old_logp,
        batch.advantages,
        batch.mask,
        engine_logp=batch.old_logp.clone(),
        mismatch=MismatchCorrection.of(mode, level=level),
        **common,
    )
    corrected.backward()
    assert torch.equal(corrected, plain)
    assert torch.equal(logp.grad, plain_logp.grad)
    assert float(metrics["mismatch/weight_mean"]) == 1.0
    assert float(metrics["mismatch/weight_max"]) == 1.0


def _grpo_gradient(batch, engine, correction):
    """GRPO's loss (clip 0.2) on `batch` with `correction` against `engine`'s log-probs: the
    gradient of the fresh log-probs and the metrics."""
    logp = fresh_logp(batch)
    loss, metrics = compute_policy_loss(
        "grpo",
        logp,
        batch.old_logp,
        batch.advantages,
        batch.mask,
        clip_low=0.2,
        clip_high=0.2,
        engine_logp=engine,
        mismatch=correction,
    )
    loss.backward()
    return logp.grad, metrics


def test_a_masked_token_carries_no_gradient_in_a_token_level_loss():
    batch = random_batch(6, 9, seed=5, drift=0.05)
    first = tuple(batch.mask.nonzero()[0].tolist())
    engine = batch.old_logp.clone()
    engine[first] -= 3.0  # rho = e^3 > 5: outside IcePop's band
    grad, metrics = _grpo_gradient(batch, engine, MismatchCorrection.of("icepop"))
    assert float(grad[first]) == 0.0
    others = batch.mask.clone()
    others[first] = False
    assert bool((grad[others] != 0).all())
    assert float(metrics["mismatch/masked_token_frac"]) == pytest.approx(1 / int(batch.mask.sum()))


def test_sequence_ratios_of_long_rows_do_not_overflow():
    mask = torch.ones(2, 4000, dtype=torch.bool)
    old = torch.zeros(2, 4000, dtype=torch.float64)
    engine = old - 0.5  # the sequence ratio is e^2000
    for mode in ("tis", "mis"):
        corrected = mismatch_weights(
            old, engine, mask, MismatchCorrection.of(mode, level="sequence")
        )
        assert torch.isfinite(corrected.weights).all()
        changed = corrected.masked if mode == "mis" else corrected.truncated
        assert bool(changed.all())
    tis = mismatch_weights(old, engine, mask, MismatchCorrection.of("tis", level="sequence"))
    assert float(tis.weights.max()) == pytest.approx(2.0)


def test_defaults_of_each_mode():
    assert MismatchCorrection.of("tis") == MismatchCorrection("tis", "token", None, 2.0)
    assert MismatchCorrection.of("mis") == MismatchCorrection("mis", "sequence", 0.0, 2.0)
    assert MismatchCorrection.of("icepop") == MismatchCorrection("icepop", "token", 0.5, 5.0)


@pytest.mark.parametrize(
    ("mode", "kwargs", "message"),
    [
        ("bogus", {}, r"mismatch: unknown correction 'bogus'; valid: tis, mis, icepop"),
        ("icepop", {"level": "sequence"}, r"mismatch_level: icepop works at level token"),
        ("tis", {"level": "row"}, r"mismatch_level: tis works at level token or sequence"),
        ("tis", {"upper": 0.9}, r"mismatch_upper: tis's cap C must be >= 1, got 0.9"),
        ("tis", {"lower": 0.5}, r"mismatch_lower: tis has no lower bound"),
        ("mis", {"lower": 1.0}, r"needs 0 <= lower < 1 < upper, got \[1.0, 2.0\]"),
        ("mis", {"upper": 1.0}, r"needs 0 <= lower < 1 < upper, got \[0.0, 1.0\]"),
        ("icepop", {"lower": -0.1}, r"needs 0 <= lower < 1 < upper"),
        ("tis", {"upper": math.inf}, r"mismatch_upper: expected a finite number"),
    ],
)
def test_bad_corrections_are_refused_by_name(mode, kwargs, message):
    with pytest.raises(ValueError, match=message):
        MismatchCorrection.of(mode, **kwargs)


def test_a_correction_without_the_engine_logprobs_is_refused():
    batch = random_batch(4, 6, seed=1)
    with pytest.raises(ValueError, match=r"engine_logp: the mismatch correction 'tis'"):
        _gspo(
            batch,
            mismatch=MismatchCorrection.of("tis"),
        )
    with pytest.raises(ValueError, match=r"mismatch: expected None or a MismatchCorrection"):
        _gspo(
            batch,
            engine_logp=batch.old_logp,
            mismatch="tis",
        )
    engine = batch.old_logp.clone()
    engine[tuple(batch.mask.nonzero()[0].tolist())] = float("inf")
    with pytest.raises(ValueError, match=r"engine_logp: 1 non-finite value"):
        _gspo(
            batch,
            engine_logp=engine,
            mismatch=MismatchCorrection.of("tis"),
        )


TOKEN_LEVEL = [("tis", "token"), ("mis", "token"), ("icepop", "token")]


@pytest.mark.parametrize("name", policy_loss_names())
@pytest.mark.parametrize(("mode", "level"), TOKEN_LEVEL)
def test_a_token_level_correction_scales_each_tokens_gradient_alone(name, mode, level):
    # Token t's gradient with the correction is its weight m_t times its gradient without: a
    # token the correction masks (m_t = 0) gets exactly none, whatever the loss's ratio unit.
    # Sequence-ratio losses used to let it leak through the sequence ratio into every token.
    batch = random_batch(8, 10, seed=4, drift=0.1)
    engine = _engine_logp(batch, noise=0.3)
    lower, upper = BOUNDS[mode]
    correction = MismatchCorrection.of(mode, level=level, lower=lower, upper=upper)
    extra = batch.kwargs() if name == "sspo" else {}

    def gradient(**options):
        logp = fresh_logp(batch)
        loss, _ = compute_policy_loss(
            name,
            logp,
            batch.old_logp,
            batch.advantages,
            batch.mask,
            clip_low=0.3,
            clip_high=0.3,
            **extra,
            **options,
        )
        loss.backward()
        return torch.where(batch.mask, logp.grad, torch.zeros_like(logp.grad))

    plain = gradient()
    corrected = gradient(engine_logp=engine, mismatch=correction)
    weights = mismatch_weights(batch.old_logp, engine, batch.mask, correction).weights
    torch.testing.assert_close(corrected, weights * plain, rtol=1e-12, atol=1e-15)
    if mode != "tis":
        masked = batch.mask & (weights == 0)
        assert bool((masked & (plain != 0)).any())  # those tokens had a gradient to lose
        assert bool((corrected[masked] == 0).all())


def test_tis_masked_by_a_geometric_band_by_hand():
    """Token TIS (cap 2) zeroed on whole rows whose geometric-mean ratio leaves [0.5, 1.5]."""
    correction = MismatchCorrection.of("tis").masked_by("geometric", lower=0.5, upper=1.5)
    mask = torch.tensor([[True, True, True], [True, True, False]])
    engine = torch.zeros(2, 3, dtype=torch.float64)
    # row 0: log rho 1.0, -0.5, -0.2 (mean 0.1: kept); row 1: 0.6, 0.4 (mean 0.5: e^0.5 > 1.5)
    old = torch.tensor([[1.0, -0.5, -0.2], [0.6, 0.4, 9.0]], dtype=torch.float64)
    corrected = mismatch_weights(old, engine, mask, correction)
    expected = torch.tensor(
        [[2.0, math.exp(-0.5), math.exp(-0.2)], [0.0, 0.0, 0.0]], dtype=torch.float64
    )
    torch.testing.assert_close(corrected.weights, expected, rtol=0, atol=1e-15)
    assert corrected.truncated.tolist() == [[True, False, False], [False, False, False]]
    assert corrected.masked.tolist() == [[False, False, False], [True, True, False]]
    metrics = mismatch_metrics(corrected, mask, correction)
    assert float(metrics["mismatch/truncated_token_frac"]) == pytest.approx(1 / 5)
    assert float(metrics["mismatch/masked_token_frac"]) == pytest.approx(2 / 5)
    assert (
        float(metrics["mismatch/masked_seq_frac"])
        == float(metrics["mismatch/truncated_seq_frac"])
        == 0.5
    )
    # without the band it is plain token TIS
    plain = mismatch_weights(old, engine, mask, MismatchCorrection.of("tis"))
    assert float(plain.weights[1, 0]) == pytest.approx(math.exp(0.6))


def test_only_tis_takes_a_mask():
    with pytest.raises(ValueError, match=r"mismatch_mask_level: only tis takes a mask"):
        MismatchCorrection.of("mis").masked_by("geometric")
    with pytest.raises(ValueError, match=r"mismatch_mask_level: mis works at level token"):
        MismatchCorrection.of("tis").masked_by("row")


def test_a_row_the_band_masks_carries_no_gradient_and_the_rest_is_plain_tis():
    batch = random_batch(6, 9, seed=7, drift=0.05)
    engine = batch.old_logp.clone()
    engine[0] -= 3.0  # row 0's geometric ratio e^3 leaves [0, 2]
    combined = MismatchCorrection.of("tis").masked_by("geometric")
    grads = {"combined": _grpo_gradient(batch, engine, combined)[0]}
    grads["tis"], metrics = _grpo_gradient(batch, engine, MismatchCorrection.of("tis"))
    assert bool((grads["combined"][0] == 0).all()) and bool((grads["tis"][0] != 0).any())
    torch.testing.assert_close(grads["combined"][1:], grads["tis"][1:], rtol=0, atol=0)
    rows = int(batch.mask.any(dim=1).sum())
    assert float(metrics["mismatch/truncated_seq_frac"]) == pytest.approx(1 / rows)
