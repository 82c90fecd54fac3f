"""Bad input to compute_policy_loss: a ValueError that names the argument and what was expected."""

from __future__ import annotations

import pytest
import torch

from megatron_rl.algo import (
    LossOptions,
    PolicyLossSpec,
    compute_policy_loss,
    policy_loss,
    policy_loss_denominator,
)
from tests.algo.batches import random_batch

B, T = 3, 5


def _good():
    return {
        "name": "gspo",
        "logp": -torch.rand(B, T),
        "old_logp": -torch.rand(B, T),
        "advantages": torch.randn(B),
        "mask": torch.ones(B, T, dtype=torch.bool),
        "clip_low": 3e-4,
        "clip_high": 4e-4,
    }


def _call(**changes):
    args = _good() | changes
    name = args.pop("name")
    return compute_policy_loss(
        name,
        args.pop("logp"),
        args.pop("old_logp"),
        args.pop("advantages"),
        args.pop("mask"),
        **args,
    )


def _with_nan(shape, where=(1, 2)):
    tensor = -torch.rand(*shape)
    tensor[where] = float("nan")
    return tensor


SSPO = {"name": "sspo", "segment_ids": torch.zeros(B, T, dtype=torch.long)}

CASES = {
    "unknown name lists valid names": (
        {"name": "ppo"},
        r"name: unknown policy loss 'ppo'; valid names: grpo, gspo, gspo_token, sspo, gmpo, cispo",
    ),
    "logp 1-D": ({"logp": torch.zeros(T)}, r"logp: expected shape \[B, T\]"),
    "logp integer": ({"logp": torch.zeros(B, T, dtype=torch.long)}, "logp: expected a floating"),
    "logp not a tensor": ({"logp": [[0.0] * T] * B}, "logp: expected a floating-point tensor"),
    "old_logp shape": ({"old_logp": torch.zeros(B, T + 1)}, r"old_logp: expected shape"),
    "old_logp shape broadcastable": ({"old_logp": torch.zeros(1, T)}, r"old_logp: expected shape"),
    "advantages shape": ({"advantages": torch.zeros(B + 1)}, r"advantages: expected shape \[B\]"),
    "advantages broadcastable": ({"advantages": torch.zeros(1)}, r"advantages: expected shape"),
    "advantages 3-D": ({"advantages": torch.zeros(B, T, 1)}, r"advantages: expected shape"),
    "advantages integer": (
        {"advantages": torch.zeros(B, dtype=torch.long)},
        "advantages: expected a floating",
    ),
    "mask float": ({"mask": torch.ones(B, T)}, "mask: expected a bool tensor"),
    "mask shape": ({"mask": torch.ones(B, 1, dtype=torch.bool)}, r"mask: expected shape"),
    "mask empty": ({"mask": torch.zeros(B, T, dtype=torch.bool)}, "mask: has no true entry"),
    "nan logp": ({"logp": _with_nan((B, T))}, r"logp: 1 non-finite value.*index \[1, 2\]"),
    "inf old_logp": (
        {"old_logp": torch.full((B, T), -float("inf"))},
        "old_logp: 15 non-finite",
    ),
    "nan advantage": ({"advantages": torch.tensor([0.0, float("nan"), 1.0])}, "advantages: 1 non"),
    "negative clip_low": ({"clip_low": -0.1}, "clip_low: expected a finite, non-negative"),
    "negative clip_high": ({"clip_high": -1e-4}, "clip_high: expected a finite, non-negative"),
    "inf clip_high": ({"clip_high": float("inf")}, "clip_high: expected a finite"),
    "string clip": ({"clip_low": "0.2"}, "clip_low: expected a non-negative number"),
    "unknown option": ({"loss_aggr": "token-mean"}, "unknown option.*loss_aggr.*valid options"),
    "sspo option on gspo": ({"sspo_lower": "fixed"}, "unknown option.*sspo_lower"),
    "unknown loss_agg": ({"loss_agg": "mean"}, "loss_agg: unknown mode 'mean'; valid modes"),
    "dr grpo without max len": (
        {"loss_agg": "seq-mean-token-sum-norm"},
        "max_response_len: loss_agg='seq-mean-token-sum-norm'",
    ),
    "dr grpo max len too short": (
        {"loss_agg": "seq-mean-token-sum-norm", "max_response_len": T - 1},
        "max_response_len: 4 is shorter than the longest response",
    ),
    "max len without dr grpo": ({"max_response_len": 8}, "max_response_len: only used by"),
    "bad denominator": ({"loss_denominator": 0}, "loss_denominator: expected a positive number"),
    "denominator shape": (
        {"loss_denominator": torch.ones(2)},
        "loss_denominator: expected a number or 1-element tensor",
    ),
    "sspo without segments": ({"name": "sspo"}, "segment_ids: policy loss 'sspo' needs"),
    "sspo without entropy": (SSPO, "old_entropy: entropy-adaptive sspo"),
    "sspo float segments": (
        SSPO | {"segment_ids": torch.zeros(B, T), "sspo_entropy_coef": 0.0},
        "segment_ids: expected an integer",
    ),
    "sspo segment out of range": (
        SSPO | {"segment_ids": torch.full((B, T), T), "sspo_entropy_coef": 0.0},
        r"segment_ids: on response tokens ids must lie in \[0, T\)",
    ),
    "sspo bad lower": (
        SSPO | {"old_entropy": torch.rand(B, T), "sspo_lower": "min"},
        "sspo_lower: unknown mode 'min'; valid modes: entropy, fixed",
    ),
    "sspo negative coef": (
        SSPO | {"old_entropy": torch.rand(B, T), "sspo_entropy_coef": -1.0},
        "sspo_entropy_coef: expected a finite, non-negative",
    ),
    "sspo entropy shape": (
        SSPO | {"old_entropy": torch.rand(B)},
        r"old_entropy: expected shape \[B, T\]",
    ),
    "sspo negative entropy": (
        SSPO | {"old_entropy": -torch.rand(B, T)},
        "old_entropy: token entropy must be >= 0",
    ),
    "sspo nan entropy": (
        SSPO | {"old_entropy": _with_nan((B, T))},
        "old_entropy: 1 non-finite",
    ),
}


@pytest.mark.parametrize("case", list(CASES))
def test_bad_input_raises_a_clear_value_error(case):
    changes, message = CASES[case]
    with pytest.raises(ValueError, match=message):
        _call(**changes)


def test_nan_in_padding_is_fine_and_check_finite_can_be_skipped():
    mask = torch.ones(B, T, dtype=torch.bool)
    mask[:, -1] = False
    logp = _with_nan((B, T), where=(0, T - 1)).requires_grad_(True)
    loss, _ = _call(logp=logp, mask=mask)
    loss.backward()
    assert torch.isfinite(loss) and torch.isfinite(logp.grad).all()
    loss, _ = _call(logp=_with_nan((B, T)), check_finite=False)
    assert torch.isnan(loss)  # unchecked, a NaN on a response token propagates


def test_denominator_helper_rejects_bad_mask():
    with pytest.raises(ValueError, match="mask: expected a bool tensor"):
        policy_loss_denominator(torch.ones(B, T))
    assert float(policy_loss_denominator(torch.ones(B, T, dtype=torch.bool))) == B
    assert (
        float(policy_loss_denominator(torch.ones(B, T, dtype=torch.bool), loss_agg="token-mean"))
        == B * T
    )


def test_a_spec_is_checked_once_and_carries_typed_options():
    spec = PolicyLossSpec.of("sspo", clip_low=0.1, clip_high=0.1, sspo_lower="fixed")
    assert isinstance(spec.options, LossOptions)
    assert spec.options.sspo_lower == "fixed" and spec.options.dual_clip == 3.0
    with pytest.raises(ValueError, match=r"unknown option\(s\) sspo_lower for policy loss 'gspo'"):
        PolicyLossSpec.of("gspo", clip_low=0.1, clip_high=0.1, sspo_lower="fixed")
    with pytest.raises(ValueError, match="kl_estimator: unknown"):
        PolicyLossSpec.of("gspo", clip_low=0.1, clip_high=0.1, kl_estimator="k9")
    with pytest.raises(TypeError):  # no spec without its checked options
        PolicyLossSpec("gspo", 0.1, 0.1)  # type: ignore[call-arg]
    batch = random_batch(4, 6, seed=1)
    from_spec, _ = policy_loss(
        spec, batch.logp, batch.old_logp, batch.advantages, batch.mask, **batch.kwargs()
    )
    in_one_call, _ = compute_policy_loss(
        "sspo",
        batch.logp,
        batch.old_logp,
        batch.advantages,
        batch.mask,
        clip_low=0.1,
        clip_high=0.1,
        sspo_lower="fixed",
        **batch.kwargs(),
    )
    assert torch.equal(from_spec, in_one_call)
