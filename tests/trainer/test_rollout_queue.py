"""The rollout queue: which weight version generates which step's samples, on which thread, and
what a checkpoint keeps of the rollouts generated ahead.

The engine here only holds a weight version (a stand-in: the queue asks nothing else of it and
the generation is the test's own function); the real engines run in tests/trainer/test_async.py.
"""

from __future__ import annotations

import threading
import time
from contextlib import contextmanager

import pytest
import torch

from megatron_rl.rollout.engine import Sample
from megatron_rl.trainer.batches import build_rollout_batch
from megatron_rl.trainer.rank0_engine import Rank0Engine
from megatron_rl.trainer.rollout_queue import RolloutQueue, StepRollouts, generation_version


class _VersionedEngine:
    def __init__(self) -> None:
        self.weight_version = 0


def _batch(step: int, version: int, last_version: int | None = None):
    """Two samples of 1 and 2 tokens by `version`; with another `last_version`, the second
    one's last token by that one (a partial rollout)."""
    partial = last_version is not None and last_version != version
    samples = [
        Sample(
            prompt_ids=(1, 2, step),
            response_ids=(3,) * (row + 1),
            logprobs=torch.full((row + 1,), -0.5),
            finish_reason="stop",
            routed_experts=torch.zeros(3 + row, 2, 2, dtype=torch.int32),
            weight_version=version,
            token_versions=(version, last_version) if row and partial else None,
        )
        for row in range(2)
    ]
    return build_rollout_batch(
        samples, torch.tensor([1.0, 0.0]), group_size=2, pad_id=0, newline_token_ids=[9]
    )


def _run(max_staleness: int, steps: int, on_generate=None) -> list[tuple[int, int, int]]:
    """A loop's use of the queue for `steps` steps: take, (train), sync the next version,
    generate ahead. Returns (step, version, thread id) of each generation."""
    engine = _VersionedEngine()
    generated = []

    def generate(engine, step):
        generated.append((step, engine.weight_version, threading.get_ident()))
        if on_generate is not None:
            on_generate(step)
        return _batch(step, engine.weight_version), {"reward/mean": float(step)}

    queue = RolloutQueue(Rank0Engine(engine), generate, max_staleness=max_staleness)
    queue.generate_ahead(0)
    for step in range(1, steps + 1):
        taken = queue.take(step)
        assert (taken.step, taken.version) == (step, generation_version(step, max_staleness))
        assert taken.metrics["staleness/max"] == min(step - 1, max_staleness)
        assert taken.metrics["time/generate_s"] >= 0
        queue.engine.run(lambda e, step=step: setattr(e, "weight_version", step))  # the sync
        if step < steps:
            queue.generate_ahead(step)
    queue.engine.close()
    return generated


@pytest.mark.parametrize("max_staleness", [0, 1, 2])
def test_each_step_is_generated_by_the_version_its_staleness_allows(max_staleness):
    generated = _run(max_staleness, steps=6)
    # lock-step: each step when it is taken; else up to max_staleness steps ahead, and the last
    # ones beyond the run's end (a resumed, longer run takes them)
    assert [step for step, _, _ in generated] == list(range(1, 7 + max_staleness))
    for step, version, _ in generated:
        assert version == max(0, step - 1 - max_staleness)
    background = {thread for _, _, thread in generated} != {threading.get_ident()}
    assert background == (max_staleness > 0)


def test_the_next_generation_runs_while_the_trainer_trains_and_the_sync_waits_for_it():
    trained, finished = threading.Event(), []

    def on_generate(step):
        if step == 2:  # generated ahead: runs while step 1 trains
            assert trained.wait(timeout=30), "step 2 was not generated while step 1 trained"
            time.sleep(0.2)
            finished.append(step)

    engine = _VersionedEngine()
    queue = RolloutQueue(
        Rank0Engine(engine),
        lambda e, step: (on_generate(step), (_batch(step, e.weight_version), {}))[1],
        max_staleness=1,
    )
    queue.generate_ahead(0)
    queue.take(1)
    trained.set()  # step 1 "trains" here, while step 2 is generated
    # the weight sync waits for the generation that uses the weights it replaces
    assert queue.engine.run(lambda e: list(finished)) == [2]
    queue.engine.close()


class _PausableEngine(_VersionedEngine):
    def __init__(self) -> None:
        super().__init__()
        self.pauses = 0

    @contextmanager
    def paused(self):
        self.pauses += 1
        yield

    def update_weights(self, buckets, version: int) -> None:
        list(buckets)
        self.weight_version = version


def test_with_partial_rollouts_the_sync_pauses_the_generation_in_flight():
    in_flight, synced = threading.Event(), threading.Event()

    def generate(engine, step):
        first = engine.weight_version
        if step == 2:  # generated ahead; the sync of version 1 lands in the middle
            in_flight.set()
            assert synced.wait(timeout=30), "the sync waited for the generation in flight"
        return _batch(step, first, engine.weight_version), {}

    engine = _PausableEngine()
    queue = RolloutQueue(Rank0Engine(engine, partial_rollouts=True), generate, max_staleness=1)
    queue.generate_ahead(0)
    queue.take(1)
    assert in_flight.wait(timeout=30)
    metrics = queue.engine.update_weights([[("w", torch.zeros(4))]], 1)
    synced.set()
    assert (engine.pauses, engine.weight_version) == (1, 1)
    assert metrics["sync/paused_generation"] == 1.0 and metrics["sync/bytes"] == 16
    queue.generate_ahead(1)
    taken = queue.take(2)
    # samples from version 0 at the start (1 behind), their last tokens from version 1 (0
    # behind): one sample of two has two versions, one token of three is fresh
    assert taken.version == 0 and taken.metrics["staleness/max"] == 1
    assert taken.metrics["rollout/partial_frac"] == 0.5
    assert taken.metrics["staleness/token_mean"] == pytest.approx(2 / 3)
    assert [s.response_versions() for s in taken.batch.samples] == [[0], [0, 1]]
    third = queue.take(3)
    assert third.version == 1 and third.metrics["rollout/partial_frac"] == 0.0
    queue.engine.close()


def test_partial_rollouts_need_an_engine_that_can_pause():
    with pytest.raises(ValueError, match=r"rollout\.partial_rollouts: the _VersionedEngine engine"):
        Rank0Engine(_VersionedEngine(), partial_rollouts=True)


def test_an_error_in_a_generation_ahead_reaches_the_step_that_takes_it():
    def generate(engine, step):
        if step == 2:
            raise RuntimeError("engine lost")
        return _batch(step, engine.weight_version), {}

    queue = RolloutQueue(Rank0Engine(_VersionedEngine()), generate, max_staleness=1)
    queue.generate_ahead(0)
    queue.take(1)
    with pytest.raises(RuntimeError, match="engine lost"):
        queue.take(2)
    queue.engine.close()


def test_the_rollouts_generated_ahead_survive_a_checkpoint(tmp_path):
    engine = _VersionedEngine()
    queue = RolloutQueue(
        Rank0Engine(engine),
        lambda e, step: (_batch(step, e.weight_version), {"reward/mean": 0.5}),
        max_staleness=2,
    )
    queue.generate_ahead(0)
    queue.take(1)
    path = tmp_path / "rollouts.pt"
    torch.save(queue.ahead(), path)
    queue.engine.close()
    resumed = RolloutQueue(Rank0Engine(_VersionedEngine()), None, max_staleness=2)
    resumed.restore(tmp_path, 2, lambda: torch.load(path, weights_only=True))
    for step in (2, 3):
        again = resumed.take(step)
        expected = StepRollouts(step, 0, _batch(step, 0), {"reward/mean": 0.5})
        assert (again.step, again.version) == (step, 0)
        assert again.metrics["reward/mean"] == 0.5
        assert again.metrics["staleness/mean"] == again.metrics["staleness/max"] == step - 1
        for name in ("tokens", "loss_mask", "engine_logp", "segment_ids", "rewards"):
            assert torch.equal(getattr(again.batch, name), getattr(expected.batch, name)), name
        for kept, made in zip(again.batch.samples, expected.batch.samples, strict=True):
            assert kept.prompt_ids == made.prompt_ids and kept.weight_version == 0
            assert torch.equal(kept.routed_experts, made.routed_experts)
    with pytest.raises(ValueError, match=r"saved with rollout.max_staleness=1, resumed with 2"):
        resumed.restore(tmp_path, 1, list)


def test_rollouts_saved_with_their_advantages_still_load():
    # checkpoints taken before the learner computed the advantages hold them in the batch
    state = StepRollouts(2, 0, _batch(2, 0), {}).state()
    state["batch"]["advantages"] = torch.tensor([1.0, -1.0])
    restored = StepRollouts.from_state(state)
    assert torch.equal(restored.batch.rewards, torch.tensor([1.0, 0.0]))
