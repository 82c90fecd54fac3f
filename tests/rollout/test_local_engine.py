"""The in-process engine on a tiny random Qwen3-MoE: cached generation equals a full forward,
seeds, stop tokens, routed experts in SGLang's layout, weight updates by checkpoint name, and a
generation paused for a weight update (partial rollouts)."""

from __future__ import annotations

import threading
import time
from contextlib import contextmanager

import pytest
import torch
from transformers import DynamicCache

from megatron_rl.rollout import local
from megatron_rl.rollout.engine import SamplingParams
from megatron_rl.rollout.kv_cache import PreallocatedLayer
from megatron_rl.rollout.local import LocalEngine, WeightUpdateError
from tests.checkpoint.tiny_hf import save_tiny
from tests.rollout.version_marks import logprobs_by_mark

PROMPTS = [[5, 6, 7], [8, 9, 10, 11, 12], [13]]


@pytest.fixture(scope="module")
def engine(tmp_path_factory) -> LocalEngine:
    return LocalEngine.from_pretrained(save_tiny("qwen3_moe", tmp_path_factory.mktemp("hf")))


def _full_forward_logprobs(engine: LocalEngine, sample) -> torch.Tensor:
    ids = torch.tensor(sample.prompt_ids + sample.response_ids)[None]
    with torch.no_grad():
        logp = engine.model(ids).logits.float().log_softmax(-1)[0]
    start = len(sample.prompt_ids)
    return logp[start - 1 : -1].gather(1, ids[0, start:, None])[:, 0]


def test_cached_batched_generation_matches_a_full_forward(engine):
    params = SamplingParams(max_new_tokens=10)
    groups = engine.generate(PROMPTS, params, n=2, seed=3)
    assert [len(g) for g in groups] == [2, 2, 2]
    for prompt, group in zip(PROMPTS, groups, strict=True):
        for sample in group:
            assert sample.prompt_ids == tuple(prompt)
            assert len(sample.response_ids) == 10 and sample.finish_reason == "length"
            # Left-padded, KV-cached, batched log-probs equal one unpadded forward.
            torch.testing.assert_close(
                sample.logprobs, _full_forward_logprobs(engine, sample), atol=1e-5, rtol=0
            )


def test_seed_reproduces_and_changes_samples(engine):
    params = SamplingParams(max_new_tokens=8)
    first = engine.generate(PROMPTS, params, n=4, seed=11)
    again = engine.generate(PROMPTS, params, n=4, seed=11)
    other = engine.generate(PROMPTS, params, n=4, seed=12)

    def ids(groups):
        return [s.response_ids for g in groups for s in g]

    assert ids(first) == ids(again)
    assert ids(first) != ids(other)


def test_greedy_and_stop_tokens(engine):
    greedy = engine.generate(PROMPTS, SamplingParams(temperature=0, max_new_tokens=6), n=2)
    for group in greedy:
        assert group[0].response_ids == group[1].response_ids
    stop = greedy[1][0].response_ids[2]
    params = SamplingParams(temperature=0, max_new_tokens=6, stop_token_ids=(stop,))
    (sample,) = engine.generate([PROMPTS[1]], params)[0]
    assert sample.finish_reason == "stop"
    assert sample.response_ids[-1] == stop and stop not in sample.response_ids[:-1]


def test_routed_experts_and_weights_in_sglang_layout(engine):
    # Stop tokens end rows at different steps: a row that ends leaves the batch, and the rows
    # that go on keep their own routing, gate weights, tokens and log-probs.
    first = engine.generate(PROMPTS, SamplingParams(max_new_tokens=8), n=3, seed=1)
    stops = tuple({group[1].response_ids[2] for group in first})
    params = SamplingParams(max_new_tokens=8, stop_token_ids=stops)
    groups = engine.generate(PROMPTS, params, n=3, seed=1, return_routed_experts=True)
    samples = [sample for group in groups for sample in group]
    assert len({len(sample.response_ids) for sample in samples}) > 2
    recorded, weights = [], []

    def record(module, inputs, output):
        recorded.append(output[-1])
        weights.append(output[1])

    hooks = [r.register_forward_hook(record) for r in engine._routers]
    try:
        for sample in samples:
            torch.testing.assert_close(
                sample.logprobs, _full_forward_logprobs(engine, sample), atol=1e-5, rtol=0
            )
            recorded.clear()
            weights.clear()
            with torch.no_grad():
                engine.model(torch.tensor(sample.prompt_ids + sample.response_ids)[None])
            full = torch.stack(recorded, 1)  # [tokens, layers, topk]
            assert sample.routed_experts.dtype == torch.int32
            # One row per token that went through the model: all but the last.
            torch.testing.assert_close(sample.routed_experts, full[:-1].to(torch.int32))
            assert sample.routed_weights.dtype == torch.float32
            # the gate weights of the same experts, in the same order (normalised over the top-k)
            torch.testing.assert_close(
                sample.routed_weights, torch.stack(weights, 1)[:-1], atol=1e-5, rtol=0
            )
            torch.testing.assert_close(
                sample.routed_weights.sum(-1), torch.ones(sample.routed_weights.shape[:2])
            )
    finally:
        for hook in hooks:
            hook.remove()


@pytest.mark.parametrize("family", ["qwen3_moe", "deepseek_v3", "glm4_moe"])
def test_weight_update_by_checkpoint_name(tmp_path, family):
    """Every checkpoint tensor lands, DeepSeek-V3's and GLM-4.5's router bias (a buffer) too."""
    engine = LocalEngine.from_pretrained(save_tiny(family, tmp_path / "a", seed=0))
    donor = LocalEngine.from_pretrained(save_tiny(family, tmp_path / "b", seed=1))
    from safetensors.torch import load_file

    tensors = load_file(tmp_path / "b" / "model.safetensors")
    assert any(".experts.0.gate_proj" in name for name in tensors)  # per-expert names
    params = SamplingParams(temperature=0, max_new_tokens=6)
    before = engine.generate(PROMPTS, params)
    engine.update_weights([list(tensors.items())], version=7)
    assert engine.weight_version == 7
    for name, param in donor.model.state_dict().items():
        torch.testing.assert_close(engine.model.state_dict()[name], param, atol=0, rtol=0)
    after = engine.generate(PROMPTS, params)
    assert [g[0].response_ids for g in after] == [
        g[0].response_ids for g in donor.generate(PROMPTS, params)
    ]
    assert [g[0].response_ids for g in after] != [g[0].response_ids for g in before]


def test_routing_records_cover_the_moe_layers_only(tmp_path):
    """transformers' DeepSeek-V3 has routers in its MoE layers only (layer 0 is dense): the
    records have one column per MoE layer (the trainer maps them by their width)."""
    engine = LocalEngine.from_pretrained(save_tiny("deepseek_v3", tmp_path / "hf"))
    params = SamplingParams(max_new_tokens=4)
    (group,) = engine.generate(PROMPTS[:1], params, return_routed_experts=True)
    assert tuple(group[0].routed_experts.shape) == (len(PROMPTS[0]) + 4 - 1, 3, 4)
    assert group[0].routed_weights.shape == group[0].routed_experts.shape


def test_weight_update_errors(tmp_path):
    engine = LocalEngine.from_pretrained(save_tiny("qwen3_moe", tmp_path / "a"))
    from safetensors.torch import load_file

    tensors = load_file(tmp_path / "a" / "model.safetensors")
    with pytest.raises(WeightUpdateError, match="no such tensor"):
        engine.update_weights([[("model.layers.0.mlp.nonsense.weight", torch.zeros(2))]], 1)
    name = "model.layers.0.mlp.experts.1.up_proj.weight"
    with pytest.raises(WeightUpdateError, match=r"shape \[3\], the engine expects"):
        engine.update_weights([[(name, torch.zeros(3))]], 1)
    partial = [(n, t) for n, t in tensors.items() if "layers.1." not in n]
    with pytest.raises(WeightUpdateError, match="never came"):
        engine.update_weights([partial], 2)
    assert not engine.healthy()
    with pytest.raises(RuntimeError, match="did not complete"):
        engine.generate(PROMPTS, SamplingParams(max_new_tokens=2))
    engine.update_weights([list(tensors.items())], 3)
    assert engine.healthy() and engine.weight_version == 3


def test_bad_requests(engine):
    with pytest.raises(ValueError, match=r"prompts\[1\]: empty prompt"):
        engine.generate([[1], []], SamplingParams())
    with pytest.raises(ValueError, match="top_p"):
        SamplingParams(top_p=0)
    with pytest.raises(ValueError, match="max_new_tokens"):
        SamplingParams(max_new_tokens=0)


def test_a_bfloat16_engine_differs_from_float32_by_its_precision_alone(tmp_path):
    # The production gap between engine and trainer is precision and kernels: a bfloat16 engine
    # on the same weights gives nearby, not equal, log-probs (float32 out of upcast logits).
    hf_dir = save_tiny("qwen3_moe", tmp_path)
    exact = LocalEngine.from_pretrained(hf_dir)
    low = LocalEngine.from_pretrained(hf_dir, dtype=torch.bfloat16)
    assert {p.dtype for p in low.model.parameters()} == {torch.bfloat16}
    sequences = [[5, 6, 7, 8, 9, 10, 11, 12], [13, 14, 15, 16, 17, 18]]
    pairs = zip(low.score(sequences), exact.score(sequences), strict=True)
    gaps = torch.cat([a - b for a, b in pairs])
    assert all(s.dtype == torch.float32 for s in low.score(sequences))
    assert 1e-5 < float(gaps.abs().mean()) < 0.1
    # synced weights are cast to the engine's dtype
    names = low._names.targets
    name = next(iter(names))
    param, index = names[name]
    update = torch.full(tuple(index.shape), 0.25)
    low.update_weights([[(n, update if n == name else _current(low, n)) for n in names]], 1)
    assert param.dtype == torch.bfloat16
    assert torch.equal(param.view(-1)[index.reshape(-1)].float(), update.reshape(-1))


def _current(engine: LocalEngine, name: str) -> torch.Tensor:
    param, index = engine._names.targets[name]
    return param.detach().view(-1)[index.reshape(-1)].view(index.shape).clone()


@contextmanager
def _weights_change_after(engine: LocalEngine, steps: int, buckets, version: int):
    """Within it, at the engine's `steps`-th model step, a weight update to `version` starts on
    another thread (through `paused()`, as the trainer's sync does), and the step ends only once
    that pause waits: the update lands between steps `steps` and `steps + 1`, and no later."""
    calls = [0]

    def update() -> None:
        with engine.paused():
            engine.update_weights(buckets, version)

    updater = threading.Thread(target=update)

    def hook(module, inputs, output) -> None:
        calls[0] += 1
        if calls[0] == steps:
            updater.start()
            deadline = time.monotonic() + 30
            while not engine.pause_pending:
                assert time.monotonic() < deadline, "the weight update never asked to pause"
                time.sleep(0.001)

    handle = engine.model.register_forward_hook(hook)
    try:
        yield
    finally:
        handle.remove()
        if updater.ident is not None:
            updater.join()


def test_a_generation_paused_for_new_weights_marks_each_tokens_version(tmp_path):
    # Partial rollouts: the weights change after the 4th model step (token 3); tokens 0..3 come
    # from version 0 and the rest from version 1, with the prefix recomputed under it, so that
    # each token's log-prob is exactly its own version's.
    engine = LocalEngine.from_pretrained(save_tiny("qwen3_moe", tmp_path / "a", seed=0))
    old = LocalEngine.from_pretrained(tmp_path / "a")
    new = LocalEngine.from_pretrained(save_tiny("qwen3_moe", tmp_path / "b", seed=1))
    from safetensors.torch import load_file

    engine.update_weights([list(load_file(tmp_path / "a" / "model.safetensors").items())], 0)
    buckets = [list(load_file(tmp_path / "b" / "model.safetensors").items())]
    with _weights_change_after(engine, 4, buckets, version=1):
        groups = engine.generate(PROMPTS, SamplingParams(max_new_tokens=9), n=2, seed=5)
    assert engine.weight_version == 1
    for sample in (s for group in groups for s in group):
        assert sample.weight_version == 0
        assert sample.token_versions == (0,) * 4 + (1,) * 5
        assert sample.response_versions() == list(sample.token_versions)
        expected = logprobs_by_mark(sample, {0: old, 1: new})
        torch.testing.assert_close(sample.logprobs, expected, atol=1e-5, rtol=0)
    # A generation the weights did not change under carries no marks.
    (after,) = engine.generate([PROMPTS[0]], SamplingParams(max_new_tokens=3))[0]
    assert (after.weight_version, after.token_versions) == (1, None)
    assert after.response_versions() == [1, 1, 1]


def test_routing_is_not_recorded_across_a_weight_change(tmp_path):
    engine = LocalEngine.from_pretrained(save_tiny("qwen3_moe", tmp_path / "a"))
    from safetensors.torch import load_file

    buckets = [list(load_file(tmp_path / "a" / "model.safetensors").items())]
    with (
        _weights_change_after(engine, 2, buckets, version=1),
        pytest.raises(RuntimeError, match="partial rollouts cannot record routing"),
    ):
        engine.generate(PROMPTS, SamplingParams(max_new_tokens=4), return_routed_experts=True)


@pytest.mark.timeout(120)
@pytest.mark.parametrize("family", ["qwen3_moe", "mixtral", "deepseek_v3", "glm4_moe"])
def test_the_preallocated_cache_generates_what_transformers_growing_cache_does(
    tmp_path, monkeypatch, family
):
    # Rows end at different steps (they leave the batch and the buffers), and DeepSeek-V3's
    # keys and values differ in width.
    engine = LocalEngine.from_pretrained(save_tiny(family, tmp_path))
    first = engine.generate(PROMPTS, SamplingParams(max_new_tokens=8), n=3, seed=1)
    stops = tuple({group[1].response_ids[2] for group in first})
    params = SamplingParams(max_new_tokens=8, stop_token_ids=stops)
    preallocated = [s for group in engine.generate(PROMPTS, params, n=3, seed=1) for s in group]
    assert len({len(sample.response_ids) for sample in preallocated}) > 2
    monkeypatch.setattr(
        local, "preallocated_cache", lambda config, capacity: DynamicCache(config=config)
    )
    growing = [s for group in engine.generate(PROMPTS, params, n=3, seed=1) for s in group]
    for ours, theirs in zip(preallocated, growing, strict=True):
        assert ours.response_ids == theirs.response_ids
        torch.testing.assert_close(ours.logprobs, theirs.logprobs, atol=1e-6, rtol=0)


def test_the_preallocated_cache_refuses_more_positions_than_it_holds():
    layer = PreallocatedLayer(capacity=4)
    keys = torch.zeros(2, 1, 3, 8)
    layer.update(keys, keys)
    with pytest.raises(ValueError, match="KV cache: 6 positions exceed the 4 preallocated"):
        layer.update(keys, keys)
