"""Partial rollouts on a real SGLang server: a generation paused for a weight update
(`SGLangEngine.paused`, SGLang's retract mode) goes on under the new weights, and the server's
marks say which tokens which version generated; each token's log-prob is its own version's."""

from __future__ import annotations

import threading
import time

import torch

from megatron_rl.rollout.engine import SamplingParams
from megatron_rl.rollout.local import LocalEngine
from megatron_rl.rollout.sglang import SGLangEngine, make_weight_sync
from tests.rollout.version_marks import logprobs_by_mark
from tests.sglang.conftest import TINY_MODEL, tiny_tensor_shapes
from tests.sglang.test_weight_sync import _perturbed_buckets

PROMPTS = [[3, 4, 5, 6, 7, 8, 9], [10, 11, 12], [13, 14]]


def test_a_generation_paused_for_a_weight_update_marks_each_tokens_version(
    sglang_servers, base_weights, tmp_path
):
    sync = make_weight_sync("tensor", tp_sizes=[1], directory=tmp_path, hf_dir=TINY_MODEL)
    engine = SGLangEngine(
        sglang_servers.urls, sync, managed=sglang_servers, tensor_shapes=tiny_tensor_shapes()
    )
    weights = {0: _perturbed_buckets(21), 1: _perturbed_buckets(22)}
    references = {version: LocalEngine.from_pretrained(TINY_MODEL) for version in weights}
    for version, buckets in weights.items():
        references[version].update_weights(buckets, version)
    try:
        engine.update_weights(weights[0], 0)
        posted = threading.Event()  # the generation's request is on its way to the server
        post = engine._post

        def post_and_tell(server, path, body):
            if path == "/generate":
                posted.set()
            return post(server, path, body)

        engine._post = post_and_tell
        answers = {}
        generation = threading.Thread(
            target=lambda: answers.update(
                groups=engine.generate(PROMPTS, SamplingParams(max_new_tokens=100), n=16, seed=4)
            )
        )
        generation.start()
        # into the generation (48 samples of up to 100 tokens take longer): counted from the
        # request, not the thread's start, which a loaded machine may delay past a fixed sleep
        assert posted.wait(timeout=60)
        time.sleep(0.1)
        with engine.paused():
            engine.update_weights(weights[1], 1)
        generation.join()
    finally:
        engine.close()
    samples = [sample for group in answers["groups"] for sample in group]
    partial = [sample for sample in samples if sample.token_versions is not None]
    assert partial, "the weight update landed after every generation had finished"
    for sample in samples:
        versions = sample.response_versions()
        assert sample.weight_version == versions[0]
        assert versions == sorted(versions) and set(versions) <= {0, 1}
        # SGLang recomputes the prefix under the new weights (retract): each token's log-prob
        # is exactly its version's
        expected = logprobs_by_mark(sample, references)
        torch.testing.assert_close(sample.logprobs, expected, atol=1e-4, rtol=0)
    for sample in partial:
        assert sample.response_versions()[0] == 0 and sample.response_versions()[-1] == 1
