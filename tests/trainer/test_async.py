"""`megatron-rl train` with asynchronous rollouts (rollout.max_staleness=1) on the shipped tiny
model and the in-process engine: each step trains on the samples of the version before the
previous one, and a run resumed with more steps repeats the uninterrupted one to the last bit
(the rollouts generated ahead ride in the checkpoint)."""

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
