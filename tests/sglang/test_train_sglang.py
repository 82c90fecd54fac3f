"""`megatron-rl train` with SGLang rollouts: the CPU example recipe as shipped (the trainer
starts and stops its own server), and the session's server used as an external one (the SLURM
case) with each weight-sync method, R3 on SGLang's routed experts and engine log-probs."""

from __future__ import annotations

import contextlib
import json
import math
import os
import re
import signal
import subprocess
import time

import pytest

from tests.processes import group_gone
from tests.sglang.conftest import REPO
from tests.trainer.run_cli import (
    SGLANG_RECIPE,
    finished_run_metrics,
    train_cli,
    train_command,
    train_environment,
)


def assert_secret_nowhere(secret: str, run_dir, result) -> None:
    """`secret` is in none of the run's files but its key file, nor in its output."""
    assert len(secret) >= 32
    for path in run_dir.rglob("*"):
        if path.is_file() and path.name != "sglang_api_key":
            assert secret.encode() not in path.read_bytes(), path
    assert secret not in result.stdout + result.stderr


def _check(result, run_dir) -> dict[int, dict[str, float]]:
    metrics = finished_run_metrics(result, run_dir)
    for step in (1, 2):
        record = metrics[step]
        assert math.isfinite(record["loss/policy"]) and record["steps/skipped"] == 0
        # The server computes in float32 like the trainer: the same log-probs, to float noise.
        assert record["mismatch/k3"] < 1e-6
        assert record["mismatch/abs_max"] < 1e-3
        assert record["mismatch/frac_tau2"] == 0
        # The probe after the step's sync: the server serves the trainer's new weights.
        assert record["sync/probe_mean_abs_diff"] < 1e-4
        assert record["sync/bytes"] > 5e6  # the whole tiny model (5.6 MB of float32)
    assert 0 <= metrics[2]["eval/accuracy"] <= 1
    return metrics


# Each run may take its 600 s (train_cli's timeout) beyond the default limit.
@pytest.mark.timeout(900)
@pytest.mark.parametrize(
    ("method", "overrides"),
    [
        ("tensor", ["algo.loss=grpo", "algo.routing_replay=r3"]),
        # The two-rank example below trains over distributed sync, and tests/sglang/
        # test_weight_sync.py checks each method's weights: these runs are extended.
        pytest.param("distributed", ["algo.mismatch=bypass"], marks=pytest.mark.extended),
        pytest.param("disk", ["algo.loss=sspo"], marks=pytest.mark.extended),
    ],
    ids=["r3_tensor", "engine_logprobs_distributed", "sspo_disk"],
)
def test_training_on_an_external_server(sglang_servers, base_weights, tmp_path, method, overrides):
    url = sglang_servers.urls[0]
    key = sglang_servers.servers[0].api_key
    common = [
        "rollout.backend=sglang",
        f"rollout.sglang.urls=[{json.dumps(url)}]",
        f"rollout.sglang.api_key_file={key.path}",
        f"rollout.sglang.weight_sync={method}",
        "rollout.probe_tolerance=1e-3",
    ]
    result = train_cli(tmp_path, common + overrides, timeout=600)
    metrics = _check(result, tmp_path)
    server = sglang_servers.servers[0].connection
    assert server.get("/model_info")["weight_version"] == "2"
    assert not (tmp_path / "sglang" / "sglang_0.log").exists()  # nothing was started
    assert not (tmp_path / "sglang_api_key").exists()  # the servers' key was the one named
    assert_secret_nowhere(key.value, tmp_path, result)
    if "algo.routing_replay=r3" in overrides:
        # SGLang's routed experts, placed on the training tokens and replayed.
        assert metrics[1]["routing/record_bytes"] > 0
        assert 0 <= metrics[2]["routing/drift_token_layer"] <= 1


# Extended: test_server_process.py checks that a server ends with the process that started it,
# tests/trainer/test_stop.py the trainer's SIGTERM.
@pytest.mark.extended
def test_sigterm_stops_the_servers_the_run_started(tmp_path):
    command = train_command(tmp_path, ["run.steps=50"], 1, False, recipe=SGLANG_RECIPE)
    run = subprocess.Popen(
        command,
        cwd=REPO,
        env=train_environment(),
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        start_new_session=True,
    )
    log, metrics = tmp_path / "sglang" / "sglang_0.log", tmp_path / "metrics.jsonl"
    try:
        deadline = time.monotonic() + 400
        while not (metrics.is_file() and metrics.read_text().strip()):  # step 0 was evaluated
            assert run.poll() is None and time.monotonic() < deadline, "the run did not start"
            time.sleep(0.5)
        server = int(re.search(r"=== pid (\d+)", log.read_text()).group(1))
        os.kill(server, 0)  # running
        run.send_signal(signal.SIGTERM)  # the trainer alone, not its process group
        assert run.wait(timeout=60) == 128 + signal.SIGTERM
        assert group_gone(server)  # the server's whole process group
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(run.pid, signal.SIGKILL)
        run.wait()


@pytest.mark.timeout(900)
def test_the_cpu_example_recipe_on_two_ranks_starts_a_server_of_its_own(two_rank_sglang_run):
    """Experts split over the two ranks, weights over a process group (the run is shared with
    tests/launch, which compares a two-node job with it)."""
    # The server is started by rank 0 under torchrun: it must not inherit torchrun's variables
    # (it would try to join the trainer's job and hang).
    result, run_dir = two_rank_sglang_run()
    _check(result, run_dir)
    log = (run_dir / "sglang" / "sglang_0.log").read_text()
    # the run's own key, which only its owner reads, in no log, metric or output of the run
    key = run_dir / "sglang_api_key"
    assert key.stat().st_mode & 0o777 == 0o600
    assert_secret_nowhere(key.read_text().strip(), run_dir, result)
    assert "'api_key': '[redacted]'" in log  # SGLang logs its settings, its key redacted
    assert "--port 30100" in log and "--dtype float32" in log  # the recipe's server
    assert "--enable-return-routed-experts" not in log  # only R3 needs the routing
    assert "Uvicorn running" in log
