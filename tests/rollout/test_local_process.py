"""The local engine in a child process of its own (rollout.local_process): the child's answers
are the in-process engine's, weight updates land (or fail, and the next one lands), a weight
update pauses a generation in flight, and a child that dies is reported."""

from __future__ import annotations

import os
import signal
import threading
import time

import pytest
import torch
from safetensors.torch import load_file

from megatron_rl.rollout.engine import SamplingParams
from megatron_rl.rollout.local import LocalEngine, WeightUpdateError
from megatron_rl.rollout.local_process import LocalEngineProcess
from tests.checkpoint.tiny_hf import save_tiny
from tests.rollout.version_marks import logprobs_by_mark

PROMPTS = [[5, 6, 7], [8, 9, 10, 11, 12], [13]]


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    """Two tiny random Qwen3-MoE checkpoints (other seeds): their directories and tensors."""
    root = tmp_path_factory.mktemp("hf")
    dirs = [save_tiny("qwen3_moe", root / name, seed=seed) for name, seed in (("a", 0), ("b", 1))]
    return [(path, list(load_file(path / "model.safetensors").items())) for path in dirs]


@pytest.fixture
def child(checkpoints):
    engine = LocalEngineProcess(checkpoints[0][0])
    yield engine
    engine.close()


def test_the_child_answers_as_the_in_process_engine_does(child, checkpoints):
    here = LocalEngine.from_pretrained(checkpoints[0][0])
    params = SamplingParams(max_new_tokens=8, stop_token_ids=(3,))
    for version, (_, tensors) in enumerate(reversed(checkpoints)):
        there = child.generate(PROMPTS, params, n=2, seed=4)
        ours = here.generate(PROMPTS, params, n=2, seed=4)
        pairs = zip((s for g in there for s in g), (s for g in ours for s in g), strict=True)
        for theirs, mine in pairs:
            assert theirs.response_ids == mine.response_ids
            torch.testing.assert_close(theirs.logprobs, mine.logprobs, atol=1e-6, rtol=0)
        torch.testing.assert_close(child.score(PROMPTS), here.score(PROMPTS), atol=1e-6, rtol=0)
        child.update_weights([tensors[:9], tensors[9:]], version)
        here.update_weights([tensors], version)
        assert child.weight_version == version and child.healthy()


def test_a_failed_update_is_raised_and_the_next_one_lands(child, checkpoints):
    tensors = checkpoints[1][1]
    with pytest.raises(WeightUpdateError, match=r"'model\.nonsense': the engine's model has no"):
        child.update_weights([[("model.nonsense", torch.zeros(2))], tensors], 1)
    assert not child.healthy()
    with pytest.raises(RuntimeError, match="a weight update did not complete"):
        child.generate(PROMPTS, SamplingParams(max_new_tokens=2))
    child.update_weights([tensors], 2)  # the failed update's buckets did not stay in the pipe
    assert child.healthy() and child.weight_version == 2
    reference = LocalEngine.from_pretrained(checkpoints[1][0])
    torch.testing.assert_close(child.score(PROMPTS), reference.score(PROMPTS), atol=1e-6, rtol=0)


def test_a_weight_update_pauses_the_childs_generation_in_flight(child, checkpoints):
    # Where the pause lands depends on timing; whatever it is, each token's log-prob is the
    # one of the version it is marked with (the marks themselves: test_local_engine.py).
    child.update_weights([checkpoints[0][1]], 0)
    answers = {}
    generation = threading.Thread(
        target=lambda: answers.update(
            groups=child.generate(PROMPTS * 8, SamplingParams(max_new_tokens=40), n=4, seed=1)
        )
    )
    generation.start()
    time.sleep(0.05)
    with child.paused():
        child.update_weights([checkpoints[1][1]], 1)
    generation.join()
    references = dict(enumerate(LocalEngine.from_pretrained(path) for path, _ in checkpoints))
    swapped = {0: references[1], 1: references[0]}
    for sample in (sample for group in answers["groups"] for sample in group):
        versions = sample.response_versions()
        assert versions == sorted(versions) and set(versions) <= {0, 1}
        expected = logprobs_by_mark(sample, references)
        # Decoding rows in a batch whose make-up depends on where the pause landed, against a
        # rescoring of the sequence alone: float32 sums in other orders, up to about 1e-5 apart
        # (1.3e-5 seen); the other version's log-probs are orders of magnitude further.
        torch.testing.assert_close(sample.logprobs, expected, atol=1e-4, rtol=0)
        assert (logprobs_by_mark(sample, swapped) - expected).abs().max() > 1e-2


def test_a_child_that_dies_is_reported_and_close_stops_one_that_lives(checkpoints):
    dying, living = LocalEngineProcess(checkpoints[0][0]), LocalEngineProcess(checkpoints[0][0])
    os.kill(dying.pid, signal.SIGKILL)
    with pytest.raises(RuntimeError, match=rf"local engine process {dying.pid} died \(exit code"):
        dying.generate(PROMPTS, SamplingParams(max_new_tokens=2))
    assert not dying.healthy()
    dying.close()
    living.close()
    with pytest.raises(ProcessLookupError):
        os.kill(living.pid, 0)
