"""`megatron-rl train` with asynchronous rollouts (rollout.max_staleness=1) on the shipped tiny
model and the in-process engine: each step trains on the samples of the version before the
previous one, and a run resumed with more steps repeats the uninterrupted one to the last bit
(the rollouts generated ahead ride in the checkpoint); the engine in a child process gives the
same run; with partial rollouts, the lag's bounds."""

from __future__ import annotations

import math

import pytest

from megatron_rl.trainer.checkpoints import ROLLOUTS_AHEAD
from tests.trainer.run_cli import RESUMED_RUN, check_repeats, read_metrics, train_cli

ONE_STEP_OFF = ["rollout.max_staleness=1"]


@pytest.fixture(scope="module")
def whole_run(tmp_path_factory) -> dict[int, dict[str, float]]:
    run_dir = tmp_path_factory.mktemp("whole")
    result = train_cli(run_dir, [*RESUMED_RUN, *ONE_STEP_OFF])
    assert result.returncode == 0, result.stderr[-3000:]
    return read_metrics(run_dir)


def test_each_step_trains_on_samples_one_version_behind(whole_run):
    # step 1 on the starting weights' samples; step s >= 2 on version s - 2's
    assert [whole_run[step]["staleness/max"] for step in (1, 2, 3)] == [0, 1, 1]
    for step in (1, 2, 3):
        record = whole_run[step]
        assert record["staleness/mean"] == record["staleness/max"]
        assert math.isfinite(record["loss/policy"]) and record["steps/skipped"] == 0
        assert record["time/generate_s"] > 0 and record["time/rollout_s"] >= 0
        # the old policy is the trainer's recomputation: the engine's version lags behind it
        assert record["mismatch/k3"] >= 0
    assert whole_run[1]["mismatch/k3"] < 1e-8  # same weights at step 1
    assert whole_run[3]["mismatch/k3"] > 1e-8


def test_a_run_resumed_with_more_steps_repeats_the_longer_run(tmp_path, whole_run):
    short = train_cli(tmp_path, [*RESUMED_RUN, *ONE_STEP_OFF, "run.steps=1"])
    assert short.returncode == 0, short.stderr[-3000:]
    # step 2's rollouts were generated ahead, by the starting weights, and saved
    assert (tmp_path / "checkpoints" / "step_000001" / ROLLOUTS_AHEAD).is_file()
    resumed = train_cli(tmp_path, [*RESUMED_RUN, *ONE_STEP_OFF], resume=True)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    check_repeats(whole_run, tmp_path, (2, 3))


def test_the_engine_in_a_process_of_its_own_gives_the_same_run(tmp_path, whole_run):
    result = train_cli(tmp_path, [*RESUMED_RUN, *ONE_STEP_OFF, "rollout.local_process=true"])
    assert result.returncode == 0, result.stderr[-3000:]
    check_repeats(whole_run, tmp_path, (1, 2, 3))


def test_with_partial_rollouts_each_token_lags_at_most_as_far_as_its_sample(tmp_path):
    # Where the sync lands in the generation in flight depends on timing: the bounds hold
    # whatever it is (the marks themselves: tests/rollout, tests/sglang).
    overrides = [*ONE_STEP_OFF, "rollout.partial_rollouts=true", "run.steps=3", "run.eval_every=3"]
    result = train_cli(tmp_path, overrides)
    assert result.returncode == 0, result.stderr[-3000:]
    run = read_metrics(tmp_path)
    assert run[1]["staleness/max"] == run[1]["staleness/token_mean"] == 0
    for step in (2, 3):
        record = run[step]
        assert 0 <= record["staleness/token_mean"] <= record["staleness/mean"] <= 1
        assert 0 <= record["rollout/partial_frac"] <= 1
        assert record["sync/paused_generation"] in (0.0, 1.0)
        assert math.isfinite(record["loss/policy"]) and record["steps/skipped"] == 0
