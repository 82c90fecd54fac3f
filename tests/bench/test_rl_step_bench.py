"""`megatron-rl bench step` on its lock-step arm for a few steps (the full run, TRL and SGLang
arms included, is in docs/benchmarks/rl_step.md): the figures it reports are the run's own."""

from __future__ import annotations

import pytest

from megatron_rl.bench import rl_step


@pytest.mark.extended  # a reduced run of every arm: over a minute
def test_the_step_benchmark_reports_each_arm_beside_the_compute_floor(tmp_path):
    arms = ("megatron-rl lock-step", "megatron-rl token budget")
    spec = rl_step.RLStepBenchSpec(steps=3, warmup=0, arms=arms)
    report = rl_step.run_benchmark(spec, tmp_path)
    result, budget = (report["arms"][arm] for arm in arms)
    # rows of like length share a micro-batch cut to their width
    assert 0 <= budget["padding_frac"] < result["padding_frac"] < 1
    assert result["step_s_min"] <= result["step_s_median"] <= result["step_s_max"]
    # 16 prompts x 8 samples of at most 32 tokens
    assert 16 * 8 <= result["tokens_per_step"] <= 16 * 8 * 32
    assert result["tokens_per_s"] == pytest.approx(
        result["tokens_per_step"] / result["step_s_median"], rel=0.2
    )
    phases = result["phases"]
    assert phases["old_logprob"] == 0  # one update per batch: no separate forward
    assert 0 < phases["rollout"] + phases["train"] < result["step_s_max"]
    assert result["peak_rss_mib"] > 100
    floor = report["floor"]
    assert 0 < floor["floor_s"] < result["step_s_min"]
    assert floor["floor_s"] == floor["step_flops"] / floor["matmul_peak_flops"]
    markdown = rl_step.format_markdown(report)
    assert "| megatron-rl lock-step |" in markdown and "Compute floor" in markdown
    assert list(tmp_path.iterdir()) == []  # the scratch space is removed


def test_the_step_benchmark_refuses_an_unknown_arm_or_too_few_steps():
    with pytest.raises(ValueError, match=r"arms: unknown \['verl'\]; valid: megatron-rl lock"):
        rl_step.RLStepBenchSpec(arms=("verl",))
    with pytest.raises(ValueError, match=r"warmup: expected 0 <= warmup < steps - 2"):
        rl_step.RLStepBenchSpec(steps=3, warmup=1)
