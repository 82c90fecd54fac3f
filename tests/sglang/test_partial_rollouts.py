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


def _generate_across_an_update(engine, buckets, old: int, new: int, delay_s: float):
    """Samples of a generation under version `old`, paused `delay_s` after its request went out
    to load version `new`, then continued."""
    engine.update_weights(buckets[old % 2], old)
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
    try:
        # counted from the request, not the thread's start, which a loaded machine may delay
        assert posted.wait(timeout=60)
        time.sleep(delay_s)
        with engine.paused():
            engine.update_weights(buckets[new % 2], new)
    finally:
        generation.join()
        engine._post = post
    return [sample for group in answers["groups"] for sample in group]


def test_a_generation_paused_for_a_weight_update_marks_each_tokens_version(
    sglang_servers, base_weights, tmp_path
):
    sync = make_weight_sync("tensor", tp_sizes=[1], directory=tmp_path, hf_dir=TINY_MODEL)
    engine = SGLangEngine(
        sglang_servers.urls, sync, managed=sglang_servers, tensor_shapes=tiny_tensor_shapes()
    )
    # Even versions serve one set of weights, odd ones the other.
    buckets = [_perturbed_buckets(21), _perturbed_buckets(22)]
    reference_engines = [LocalEngine.from_pretrained(TINY_MODEL) for _ in buckets]
    for parity, reference in enumerate(reference_engines):
        reference.update_weights(buckets[parity], parity)
    # Where the pause lands depends on the machine's speed: before the server took the request
    # (every token under the new version) or after the generation finished (every token under
    # the old one). Each attempt is checked whole; one must land inside the generation, and the
    # next attempt pauses later or sooner according to where the last one landed.
    delay_s, partial, landed = 0.1, [], []
    try:
        for attempt in range(4):
            old, new = 2 * attempt, 2 * attempt + 1
            samples = _generate_across_an_update(engine, buckets, old, new, delay_s)
            references = {old: reference_engines[0], new: reference_engines[1]}
            for sample in samples:
                versions = sample.response_versions()
                assert sample.weight_version == versions[0]
                assert versions == sorted(versions) and set(versions) <= {old, new}
                # SGLang recomputes the prefix under the new weights (retract): each token's
                # log-prob is exactly its version's
                expected = logprobs_by_mark(sample, references)
                torch.testing.assert_close(sample.logprobs, expected, atol=1e-4, rtol=0)
            partial = [sample for sample in samples if sample.token_versions is not None]
            for sample in partial:
                assert sample.response_versions()[0] == old
                assert sample.response_versions()[-1] == new
            if partial:
                break
            before = all(sample.weight_version == new for sample in samples)
            landed.append(f"{delay_s:.3f} s: {'before' if before else 'after'}")
            delay_s = delay_s * 4 if before else delay_s / 4
    finally:
        engine.close()
    assert partial, f"no update landed inside the generation (pause after {', '.join(landed)})"
