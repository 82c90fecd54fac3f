"""Generation from a real SGLang server: samples, log-probs that agree with the model's own,
routed experts that are the model's routing, and refusals of what cannot work."""

from __future__ import annotations

import pytest
import torch

from megatron_rl.rollout.engine import SamplingParams
from megatron_rl.rollout.local import LocalEngine
from megatron_rl.rollout.sglang import SGLangEngine, SGLangError
from megatron_rl.rollout.sglang.weight_sync import TensorSync
from tests.sglang.conftest import ROUTING_SHAPE, TINY_MODEL

PROMPTS = [[3, 4, 5, 6, 7, 8, 9], [10, 11, 12], [13, 14]]


@pytest.fixture(scope="module")
def reference():
    """The same checkpoint in transformers, in float32: what the trainer's model computes."""
    return LocalEngine.from_pretrained(TINY_MODEL)


@pytest.fixture
def engine(sglang_servers):
    return SGLangEngine(
        sglang_servers.urls, TensorSync([1]), routed_experts=ROUTING_SHAPE, managed=sglang_servers
    )


@pytest.mark.parametrize("temperature", [1.0, 0.6])
def test_samples_and_logprobs_agree_with_the_model(engine, reference, temperature):
    params = SamplingParams(temperature=temperature, top_p=0.95, max_new_tokens=6)
    groups = engine.generate(PROMPTS, params, n=3, seed=1)
    assert [len(group) for group in groups] == [3, 3, 3]
    for prompt, group in zip(PROMPTS, groups, strict=True):
        for sample in group:
            assert sample.prompt_ids == tuple(prompt)
            if sample.finish_reason == "stop":  # at the model's EOS (1), where SGLang stops
                assert 0 < len(sample.response_ids) <= 6 and sample.response_ids[-1] == 1
            else:
                assert len(sample.response_ids) == 6 and sample.finish_reason == "length"
            # Log-probs of the model's own distribution (temperature 1) whatever the sampling
            # temperature: the server runs with SGLANG_RETURN_ORIGINAL_LOGPROB.
            expected = reference.score([prompt + list(sample.response_ids)])[0][len(prompt) - 1 :]
            assert torch.allclose(sample.logprobs, expected, atol=1e-4), temperature


def test_stop_tokens_end_a_response(engine):
    # 1 is the model's EOS, where SGLang always stops (as the trainer's codec does).
    params = SamplingParams(temperature=1.0, max_new_tokens=24, stop_token_ids=(1, 3, 4, 5, 6))
    samples = [s for group in engine.generate(PROMPTS, params, n=4, seed=2) for s in group]
    stopped = [s for s in samples if s.finish_reason == "stop"]
    assert stopped, "no sample stopped at any of five common tokens"
    assert any(s.response_ids[-1] != 1 for s in stopped), "only EOS stopped a sample"
    for sample in stopped:
        assert sample.response_ids[-1] in params.stop_token_ids
        assert not set(sample.response_ids[:-1]) & set(params.stop_token_ids)


def test_score_is_the_models_log_prob_of_each_token(engine, reference):
    sequence = [3, 4, 5, 6, 7, 8, 9, 10, 11]
    assert torch.allclose(engine.score([sequence])[0], reference.score([sequence])[0], atol=1e-4)


def _router_choices(model: torch.nn.Module, tokens: list[int]) -> torch.Tensor:
    """`[len(tokens), layers, topk]` experts the transformers model routes each token to."""
    choices = []
    routers = [m for m in model.modules() if type(m).__name__.endswith("Router")]
    hooks = [r.register_forward_hook(lambda m, i, out: choices.append(out[-1])) for r in routers]
    try:
        with torch.no_grad():
            model(torch.tensor([tokens]))
    finally:
        for hook in hooks:
            hook.remove()
    return torch.stack(choices, 1)


def test_routed_experts_are_the_models_routing_of_each_token(engine, reference):
    params = SamplingParams(temperature=1.0, max_new_tokens=5)
    samples = [
        s for g in engine.generate(PROMPTS, params, n=2, return_routed_experts=True) for s in g
    ]
    for sample in samples:
        tokens = list(sample.prompt_ids + sample.response_ids)
        # SGLang's layout: every token but the last one (it was never fed back).
        assert sample.routed_experts.shape == (len(tokens) - 1, *ROUTING_SHAPE)
        assert sample.routed_experts.dtype == torch.int32
        expected = _router_choices(reference.model, tokens[:-1])
        same = sample.routed_experts.sort(-1).values == expected.sort(-1).values.to(torch.int32)
        assert same.all(-1).float().mean() >= 0.99  # near-ties may fall the other way


def test_a_server_with_another_architecture_is_refused(sglang_servers):
    with pytest.raises(SGLangError, match=r"serves \['Qwen3MoeForCausalLM'\].*MixtralForCausalLM"):
        SGLangEngine(
            sglang_servers.urls,
            TensorSync([1]),
            api_key=sglang_servers.servers[0].api_key,
            architecture="MixtralForCausalLM",
        )


def test_routed_experts_need_the_models_shape(sglang_servers):
    engine = SGLangEngine(sglang_servers.urls, TensorSync([1]), managed=sglang_servers)
    with pytest.raises(ValueError, match="return_routed_experts"):
        engine.generate(PROMPTS, SamplingParams(max_new_tokens=2), return_routed_experts=True)
