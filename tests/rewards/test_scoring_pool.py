"""The scoring pool: each verifier call in a worker process, killed at its deadline and replaced,
limited in memory, while the process that owns the pool keeps running."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from megatron_rl.rewards import RewardScores, ScoringPool, get_verifier, score_responses
from tests.processes import is_running, still_running
from tests.rewards.conftest import DEADLINE_S
from tests.rewards.misbehaving import ALLOCATED_MB, HANG_S, math_verify_unscreened, misbehave

REPO = Path(__file__).resolve().parents[2]
# The answers: sympy had not returned after 8 s, still ran after 6 s, took 4.9 s.
RUNAWAY_ANSWERS = ["\\boxed{9^{9^{9^{9}}}}", "\\boxed{10^{10^{10}}}", "\\boxed{(10^{6})!}"]
# Slack for a worker's replacement and the scheduling of a busy 2-core machine: far below what
# an unkilled call would take (minutes to hours).
SLACK_S = 2.0
TICK_S = 0.01


def _score_while_ticking(
    pool: ScoringPool, verifier, responses: list[str]
) -> tuple[RewardScores, float, float]:
    """Score `responses` (reference "1") on a thread while this, the main thread, ticks every
    TICK_S; returns the scores, the seconds they took, and the longest the main thread went
    without a tick."""
    done: dict[str, object] = {}

    def score() -> None:
        started = time.monotonic()
        n = len(responses)
        done["scores"] = score_responses(verifier, ["?"] * n, responses, ["1"] * n, pool)
        done["elapsed"] = time.monotonic() - started

    thread = threading.Thread(target=score, name="scoring")
    thread.start()
    last_tick, longest_gap = time.monotonic(), 0.0
    while thread.is_alive():
        time.sleep(TICK_S)
        now = time.monotonic()
        longest_gap, last_tick = max(longest_gap, now - last_tick), now
    thread.join()
    return done["scores"], done["elapsed"], longest_gap


@pytest.mark.timeout(60)
@pytest.mark.parametrize("response", RUNAWAY_ANSWERS)
def test_runaway_math_answers_score_zero_within_their_deadline(scoring_pool, response):
    scores, elapsed, longest_gap = _score_while_ticking(
        scoring_pool, get_verifier("math"), [response]
    )
    # Screened out: no evaluation, so no timeout (the thread-based scoring timed out on (10^6)!
    # after 2 s and never returned on the towers).
    assert scores == RewardScores(rewards=[0.0], failures=0, timeouts=0)
    assert elapsed < DEADLINE_S + SLACK_S
    assert longest_gap < DEADLINE_S / 2  # the main thread was never held up


@pytest.mark.timeout(60)
@pytest.mark.parametrize("response", RUNAWAY_ANSWERS)
def test_sympy_on_a_runaway_answer_is_killed_at_the_deadline(scoring_pool, response):
    # The screen bypassed: math-verify and sympy evaluate the answer until the worker is killed
    # (or, for (10^6)! on a fast machine, finish first and find it wrong).
    scores, elapsed, longest_gap = _score_while_ticking(
        scoring_pool, math_verify_unscreened, [response]
    )
    assert scores.rewards == [0.0] and scores.failures == 0
    if response == RUNAWAY_ANSWERS[0]:
        assert scores.timeouts == 1  # hours of work
    assert elapsed < DEADLINE_S + SLACK_S
    assert longest_gap < DEADLINE_S / 2


@pytest.mark.timeout(60)
def test_a_verifier_stuck_in_c_is_killed_and_its_worker_replaced(scoring_pool):
    before = scoring_pool.pids
    # Both workers hang, holding their GIL; the "ok" samples wait for their replacements.
    responses = ["hang in C", "hang in C", "ok", "ok"]
    scores, elapsed, longest_gap = _score_while_ticking(scoring_pool, misbehave, responses)
    assert scores == RewardScores(rewards=[0.0, 0.0, 1.0, 1.0], failures=0, timeouts=2)
    assert DEADLINE_S <= elapsed < DEADLINE_S + 2 * SLACK_S
    assert longest_gap < DEADLINE_S / 2
    assert still_running(before, timeout_s=5.0) == []  # killed
    assert set(scoring_pool.pids).isdisjoint(before)
    # The next batch scores on the replacements as on any worker.
    again = score_responses(misbehave, ["?"] * 3, ["ok", "wrong", "ok"], ["1"] * 3, scoring_pool)
    assert again == RewardScores(rewards=[1.0, 0.0, 1.0], failures=0, timeouts=0)


@pytest.mark.timeout(60)
@pytest.mark.parametrize("workers", [1, 2])
def test_hung_verifiers_time_out_without_holding_up_the_others(workers):
    responses = ["sleep", "ok", "sleep", "ok", "sleep", "ok", "ok"]
    with ScoringPool(workers=workers, timeout_s=0.5, memory_limit_mb=2048) as pool:
        started = time.monotonic()
        scores = score_responses(
            misbehave, ["p"] * len(responses), responses, ["r"] * len(responses), pool
        )
        elapsed = time.monotonic() - started
    assert scores == RewardScores(
        rewards=[0.0, 1.0, 0.0, 1.0, 0.0, 1.0, 1.0], failures=0, timeouts=3
    )
    # Three 0.5 s deadlines and three replacements, one after another at worst: a liveness
    # bound, far below the hang.
    assert elapsed < HANG_S / 4


@pytest.mark.timeout(60)
def test_a_worker_that_dies_fails_its_sample_and_is_replaced(scoring_pool):
    before = scoring_pool.pids
    scores = score_responses(misbehave, ["?"] * 3, ["die", "ok", "ok"], ["1"] * 3, scoring_pool)
    assert scores == RewardScores(rewards=[0.0, 1.0, 1.0], failures=1, timeouts=0)
    gone = set(before) - set(scoring_pool.pids)
    assert len(gone) == 1 and not is_running(gone.pop())
    assert all(is_running(pid) for pid in scoring_pool.pids)


@pytest.mark.timeout(60)
def test_a_worker_over_its_memory_limit_fails_its_sample_and_is_replaced():
    assert misbehave("?", "allocate", "1") == 1.0  # this process may allocate it
    with ScoringPool(workers=1, timeout_s=30.0, memory_limit_mb=ALLOCATED_MB // 2) as pool:
        responses = ["pid", "allocate", "pid"]
        scores = score_responses(misbehave, ["?"] * 3, responses, ["1"] * 3, pool)
        first, replacement = int(scores.rewards[0]), int(scores.rewards[2])
        assert scores.rewards[1] == 0.0
        assert (scores.failures, scores.timeouts) == (1, 0)
        assert replacement != first and not is_running(first)
        assert pool.pids == [replacement]


@pytest.mark.timeout(60)
def test_a_request_to_save_sent_to_the_trainers_group_leaves_the_workers_alone():
    """SLURM's SIGUSR1 (or Ctrl-C) reaches the trainer's whole process group; it is the
    trainer's to answer. Sent at once, while the workers are still starting, and again once
    they run, it ends none of them."""
    with ScoringPool(workers=2, timeout_s=10.0, memory_limit_mb=1024) as pool:
        pids = pool.pids
        for signum in (signal.SIGUSR1, signal.SIGINT, signal.SIGUSR1):
            for pid in pids:
                os.kill(pid, signum)
            scores = score_responses(misbehave, ["?"] * 2, ["ok"] * 2, ["1"] * 2, pool)
            assert scores == RewardScores(rewards=[1.0, 1.0], failures=0, timeouts=0)
        assert pool.pids == pids


@pytest.mark.timeout(60)
def test_the_workers_end_when_their_trainer_is_killed_though_a_fork_holds_their_pipes():
    """A trainer killed with SIGKILL leaves no worker behind, even while a process it forked
    (a checkpoint writer) still holds the pool's ends of the workers' pipes."""
    owner = subprocess.Popen(
        [sys.executable, "-m", "tests.rewards.pool_owner", "orphan"],
        cwd=REPO,
        stdout=subprocess.PIPE,
    )
    workers, forked = [], None
    try:
        *workers, forked = (int(pid) for pid in owner.stdout.readline().split())
        assert len(workers) == 2 and all(is_running(pid) for pid in workers)
        owner.kill()
        owner.wait()
        assert is_running(forked)
        assert still_running(workers, timeout_s=5.0) == []
    finally:
        for pid in [owner.pid, *workers, *([forked] if forked else [])]:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        owner.wait()


@pytest.mark.timeout(60)
def test_the_first_pool_of_a_process_starts_its_workers_ignoring_the_owners_signals():
    """A fresh process's first pool: with multiprocessing's 'spawn' the first worker's start
    also started its resource tracker, which unblocked SIGINT and SIGTERM, and a Ctrl-C to the
    trainer's group during that worker's imports ended it ("Exception ignored ...
    KeyboardInterrupt" in CI)."""
    result = subprocess.run(
        [sys.executable, "-m", "tests.rewards.pool_owner", "signalled"],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=50,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    assert "KeyboardInterrupt" not in result.stderr, result.stderr[-3000:]
    expected = RewardScores(rewards=[1.0, 1.0], failures=0, timeouts=0)
    assert result.stdout.split("\n")[0] == f"{expected} True False"


@pytest.mark.timeout(60)
def test_close_kills_the_workers():
    pool = ScoringPool(workers=2, timeout_s=1.0, memory_limit_mb=256)
    pids = pool.pids
    assert all(is_running(pid) for pid in pids)
    pool.close()
    assert still_running(pids, timeout_s=5.0) == []
    pool.close()  # again: nothing to do
    with pytest.raises(RuntimeError, match="the scoring pool is closed"):
        pool.score(misbehave, [("?", "ok", "1")])


def test_a_verifier_the_workers_cannot_import_is_refused(scoring_pool):
    def local(prompt: str, response: str, reference: str) -> float:
        return 1.0

    for verifier in (local, lambda prompt, response, reference: 1.0):
        with pytest.raises(ValueError, match="cannot be sent to a scoring worker process"):
            score_responses(verifier, ["?"], ["ok"], ["1"], scoring_pool)
    # The pool is unharmed.
    assert score_responses(misbehave, ["?"], ["ok"], ["1"], scoring_pool).rewards == [1.0]


@pytest.mark.timeout(60)
def test_a_verifier_of_the_script_run_as_main_is_refused_with_the_reason(tmp_path):
    """The workers import nothing of the trainer's main script, so they cannot find a verifier
    defined there: the first batch says so instead of scoring zeros."""
    script = tmp_path / "train_my_way.py"
    script.write_text(
        "from megatron_rl.rewards import ScoringPool, score_responses\n"
        "def mine(prompt, response, reference):\n"
        "    return 1.0\n"
        "if __name__ == '__main__':\n"
        "    with ScoringPool(workers=1, timeout_s=5.0, memory_limit_mb=512) as pool:\n"
        "        score_responses(mine, ['?'], ['ok'], ['1'], pool)\n"
    )
    result = subprocess.run(
        [sys.executable, str(script)], cwd=REPO, capture_output=True, text=True, timeout=50
    )
    assert result.returncode == 1
    assert "verifier mine: cannot be sent to a scoring worker process" in result.stderr
    assert "not of the script run as __main__" in result.stderr
