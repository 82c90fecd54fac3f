"""`megatron-rl launch slurm` on a real SLURM (tests/launch/slurm_cluster.py): the rendered script
for the tiny recipe at 1 node x 2 ranks (gloo) is submitted with sbatch, receives SLURM's
preemption signal mid-run, checkpoints, requeues itself, resumes and finishes with its export;
its metrics equal, step for step and to the last bit, those of the same recipe run
uninterrupted under `torchrun --nproc_per_node 2`, each step logged once. And a conversion
submitted by `megatron-rl launch slurm-convert` runs on 2 ranks."""

from __future__ import annotations

import json
import re
import time

import pytest

from tests.launch.slurm_cluster import SlurmCluster, missing_reason
from tests.trainer.run_cli import (
    RECIPE,
    REPO,
    RESUMED_RUN,
    SHORT_RUN,
    TINY_MODEL,
    check_repeats,
    read_metrics,
    train_cli,
    train_environment,
)

pytestmark = [
    pytest.mark.skipif(missing_reason() is not None, reason=str(missing_reason())),
    # a job waits for SLURM's requeue (120 s) on top of its runs: more than the default limit
    pytest.mark.timeout(900),
]
ONE_NODE = ["--nodes=1", "--gpus-per-node=2", "--device=cpu"]


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    cluster = SlurmCluster(tmp_path_factory.mktemp("slurm")).start()
    yield cluster
    cluster.stop()


def _launch(cluster: SlurmCluster, run_dir, overrides: list[str]) -> str:
    """Submit a training job through the CLI, as a user does; the job id."""
    return cluster.launch(
        ["slurm", str(RECIPE), *SHORT_RUN, f"run.dir={run_dir}", *overrides, *ONE_NODE],
        cwd=REPO,
        env=train_environment(),
    )


def _logged_steps(metrics) -> set[int]:
    """The steps of the complete lines of a metrics.jsonl being written."""
    if not metrics.exists():
        return set()
    lines = metrics.read_text().split("\n")[:-1]  # the last is empty or still being written
    return {json.loads(line)["step"] for line in lines}


def _wait_for_step(run_dir, step: int, job_id: str, cluster: SlurmCluster) -> None:
    deadline = time.monotonic() + 240
    while time.monotonic() < deadline:
        if step in _logged_steps(run_dir / "metrics.jsonl"):
            return
        state = cluster.job(job_id)["JobState"]
        assert state in ("PENDING", "RUNNING"), cluster.job(job_id)
        time.sleep(0.2)
    raise AssertionError(f"step {step} not logged in 240 s")


# the two-node job of test_slurm_multinode.py runs the same preemption in the default suite,
# with these checks; this one-node case stays for machines without network namespaces
@pytest.mark.extended
def test_a_preempted_job_checkpoints_requeues_resumes_and_repeats_torchrun(tmp_path, cluster):
    reference = tmp_path / "torchrun"
    result = train_cli(reference, RESUMED_RUN, nproc=2)
    assert result.returncode == 0, result.stderr[-3000:]
    whole = read_metrics(reference)

    run_dir = tmp_path / "slurm-run"
    job_id = _launch(cluster, run_dir, [*RESUMED_RUN, "checkpoint.export_hf=true"])
    _wait_for_step(run_dir, 1, job_id, cluster)
    # What `--signal=B:USR1@SECONDS` does at the time limit: USR1 to the batch shell.
    cluster.run("scancel", "--signal=USR1", "--batch", job_id)
    fields = cluster.wait_for_job(
        job_id,
        lambda job: job["JobState"] not in ("PENDING", "RUNNING", "REQUEUED", "COMPLETING"),
        timeout_s=300,
        what="finished",
    )
    log = (run_dir / "slurm" / f"tiny_gspo-{job_id}.out").read_text()
    train_logs = "".join(path.read_text() for path in (run_dir / "slurm").glob("*-train-*.out"))
    assert fields["JobState"] == "COMPLETED", (fields, log, train_logs[-3000:])
    assert fields["Restarts"] == "1" and fields["ExitCode"] == "0:0", fields
    assert "requeueing job" in log and "start 1: training on" in log, log
    # The signal came after step 1 was logged: the run stops after the step it is in (1, while
    # its checkpoint is being written, or 2), and resumes from that step's checkpoint.
    stopped = re.search(
        r"megatron-rl: stopped after step (\d); its checkpoint is (\S+);", train_logs
    )
    assert stopped and stopped[1] in ("1", "2"), train_logs[-3000:]
    assert stopped[2].endswith(f"step_00000{stopped[1]}") and "--resume" in train_logs
    check_repeats(whole, run_dir, resumed_steps=tuple(sorted(whole)))
    assert (run_dir / "export" / "config.json").is_file()
    assert sorted(p.name for p in (run_dir / "checkpoints").iterdir()) == [
        "latest",
        "step_000002",
        "step_000003",
    ]


def test_a_conversion_job_runs_on_two_ranks(tmp_path, cluster):
    out, logs = tmp_path / "tiny-ep2", tmp_path / "logs"
    convert = ["hf-to-mcore", f"--hf={TINY_MODEL}", f"--out={out}", "--ep=2"]
    job_id = cluster.launch(
        ["slurm-convert", *ONE_NODE, f"--log-dir={logs}", "--", *convert],
        cwd=REPO,
        env=train_environment(),
    )
    fields = cluster.wait_for_job(
        job_id,
        lambda job: job["JobState"] not in ("PENDING", "RUNNING", "COMPLETING"),
        timeout_s=180,
        what="finished",
    )
    log = "".join(path.read_text() for path in logs.glob("*.out"))
    assert fields["JobState"] == "COMPLETED" and fields["ExitCode"] == "0:0", (fields, log[-3000:])
    assert f"wrote {out} (Qwen3MoeForCausalLM, world 2" in log
    assert (out / "megatron_rl.json").is_file()
