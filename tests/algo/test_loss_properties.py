"""Property tests over random batches: invariances every loss must have."""

from __future__ import annotations

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from megatron_rl.algo import compute_policy_loss, policy_loss_names
from tests.algo.batches import fresh_logp, random_batch

batches = st.builds(
    random_batch,
    batch=st.integers(1, 6),
    seq=st.integers(1, 9),
    seed=st.integers(0, 10_000),
    drift=st.sampled_from([0.0, 0.01, 0.3]),
    padding=st.sampled_from(["left", "right"]),
)


def _loss(name, logp, batch, perm=None):
    take = (lambda x: x) if perm is None else (lambda x: x[perm])
    return compute_policy_loss(
        name,
        take(logp),
        take(batch.old_logp),
        take(batch.advantages),
        take(batch.mask),
        clip_low=0.05,
        clip_high=0.05,
        segment_ids=take(batch.segment_ids),
        old_entropy=take(batch.old_entropy),
    )


@settings(max_examples=40, deadline=None)
@given(batches, st.sampled_from(policy_loss_names()), st.randoms(use_true_random=False))
def test_loss_and_gradient_do_not_depend_on_row_order(batch, name, rnd):
    order = list(range(batch.logp.shape[0]))
    rnd.shuffle(order)
    perm = torch.tensor(order)
    logp_a, logp_b = fresh_logp(batch), fresh_logp(batch)
    loss_a, metrics_a = _loss(name, logp_a, batch)
    loss_b, metrics_b = _loss(name, logp_b, batch, perm)
    loss_a.backward()
    loss_b.backward()
    torch.testing.assert_close(loss_a, loss_b, rtol=1e-12, atol=1e-14)
    torch.testing.assert_close(logp_a.grad, logp_b.grad, rtol=1e-10, atol=1e-14)
    for key in metrics_a:
        torch.testing.assert_close(metrics_a[key], metrics_b[key], rtol=1e-12, atol=1e-14)


@settings(max_examples=40, deadline=None)
@given(batches, st.sampled_from(policy_loss_names()))
def test_no_drift_means_ratio_one_nothing_clipped_and_the_policy_gradient(batch, name):
    batch.old_logp = batch.logp.detach().clone()
    loss, metrics = _loss(name, batch.logp, batch)
    assert float(metrics["clip_frac/token"]) == 0
    assert float(metrics["ratio/min"]) == float(metrics["ratio/max"]) == 1.0
    assert float(metrics["kl/k3"]) == 0
    # at ratio 1 every loss is -mean_i(A_i) over the sequences that have tokens
    has_tokens = batch.mask.any(1)
    expected = -batch.advantages[has_tokens].mean()
    torch.testing.assert_close(loss.detach(), expected, rtol=1e-12, atol=1e-14)
