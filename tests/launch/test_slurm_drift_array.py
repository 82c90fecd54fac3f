"""The drift grid as a SLURM job array, as docs/drift.md runs it on a cluster: `--prepare` once,
examples/slurm/drift_array.sbatch with one array task per run on the three-node test cluster
(tests/launch/slurm_cluster.py), one task requeued while its run is under way, then
`--report-only`. The report is the one the same grid gives run locally: every number of
summary.csv but the times, to the last digit, and every claim's verdict."""

from __future__ import annotations

import csv
import os
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml

from tests.launch.slurm_cluster import SlurmCluster, missing_reason
from tests.trainer.run_cli import RECIPE, REPO, SHORT_RUN, train_environment

pytestmark = [
    pytest.mark.skipif(missing_reason(nodes=3) is not None, reason=str(missing_reason(nodes=3))),
    pytest.mark.timeout(900),
    pytest.mark.extended,  # five short runs of the tiny model, four of them under SLURM
]
ARRAY_SCRIPT = REPO / "examples" / "slurm" / "drift_array.sbatch"
GRID = {
    "seeds": [1, 2],
    "set": dict(item.split("=", 1) for item in SHORT_RUN)
    | {"run.eval_every": 1, "metrics.routing_probe": True},
    "arms": {"grpo_r2": None, "gspo": None},
    "sweeps": [],
}
# the script asks for a GPU cluster's nodes; the test cluster's have CPUs only
CPU_NODES = ("--nodes=1", "--gpus-per-node=0")
# what differs between two runs of the same computation: their times (`seconds*`, the per-step
# means of the phases) and where they ran
TIMES = {"machine", "step_s", "rollout_s", "old_logprob_s", "train_s", "learn_s_per_1k_tokens"}


def _bench(*args: str, env: dict[str, str]) -> subprocess.CompletedProcess:
    command = [sys.executable, "-m", "megatron_rl.cli", "bench", "drift", *args]
    result = subprocess.run(command, env=env, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]
    return result


def _summary(out: Path) -> dict[str, dict[str, str]]:
    rows = csv.DictReader((out / "summary.csv").open())
    return {
        row["run_id"]: {k: v for k, v in row.items() if k not in TIMES and k[:7] != "seconds"}
        for row in rows
    }


def _claims(report: Path) -> list[str]:
    """The verdict lines of report.md (`N. **VERDICT**: ...`, without their evidence)."""
    lines = report.read_text().splitlines()
    return [line.split(":", 1)[0] for line in lines if re.match(r"\d+\. \*\*", line)]


def _outputs(directory: Path) -> str:
    """The array tasks' output files, their last lines."""
    return "\n".join(f"{p.name}: {p.read_text()[-500:]}" for p in sorted(directory.glob("*.out")))


def _array_tasks(cluster: SlurmCluster, job_id: str, tasks: int) -> dict[int, dict[str, str]]:
    return {task: cluster.job(f"{job_id}_{task}") for task in range(tasks)}


def test_the_grid_as_a_job_array_with_a_requeued_task_reports_as_a_local_run(tmp_path):
    grid = tmp_path / "grid.yaml"
    grid.write_text(yaml.safe_dump(GRID))
    # the batch script runs `megatron-rl` from PATH, as a user's environment has it
    bin_dir = Path(sys.executable).parent
    env = train_environment({"PATH": f"{bin_dir}{os.pathsep}{os.environ['PATH']}"})
    local, array = tmp_path / "local", tmp_path / "array"
    common = (str(RECIPE), "--grid", str(grid))  # the tiny grid builds no base model
    _bench(*common, "--out", str(local), "--jobs", "2", env=env)
    listed = _bench(*common, "--out", str(array), "--prepare", env=env).stdout
    assert "4 runs: sbatch --array=0-3" in listed
    cluster = SlurmCluster(tmp_path / "slurm", nodes=3).start()
    try:
        job_id = cluster.sbatch(
            ARRAY_SCRIPT,
            str(RECIPE),
            str(grid),
            str(array),
            cwd=REPO,  # the recipe names its model relative to the repository, as users run it
            env=env,
            options=("--array=0-3", *CPU_NODES, f"--output={tmp_path}/drift-%A-%a.out"),
        )
        # task 1's run under way: its first step logged, then SLURM requeues the task
        requeued = next(
            line.split()[-1] for line in listed.splitlines() if line.strip().startswith("1 ")
        )
        metrics = array / "runs" / requeued / "metrics.jsonl"
        deadline = time.monotonic() + 300
        while not (metrics.exists() and metrics.read_text().count("\n") >= 1):
            tasks = _array_tasks(cluster, job_id, 4)
            running = tasks[1].get("JobState") in ("PENDING", "RUNNING")
            assert running and time.monotonic() < deadline, (tasks[1], _outputs(tmp_path))
            time.sleep(0.5)
        cluster.run("scontrol", "requeue", f"{job_id}_1")
        deadline = time.monotonic() + 600
        while True:
            tasks = _array_tasks(cluster, job_id, 4)
            if all(fields.get("JobState") == "COMPLETED" for fields in tasks.values()):
                break
            failed = [t for t, f in tasks.items() if f.get("JobState") in ("FAILED", "CANCELLED")]
            assert not failed and time.monotonic() < deadline, (tasks, _outputs(tmp_path))
            time.sleep(1)
    finally:
        cluster.stop()
    assert tasks[1]["Restarts"] == "1" and {tasks[t]["Restarts"] for t in (0, 2, 3)} == {"0"}
    # tasks 0-2 started at once, one per node (--exclusive); task 3 on the first node free
    assert tasks[0]["NodeList"] != tasks[2]["NodeList"]
    report = _bench(*common, "--out", str(array), "--report-only", env=env).stdout
    assert report.startswith("wrote ")
    local_rows, array_rows = _summary(local), _summary(array)
    assert list(array_rows) == list(local_rows) and len(local_rows) == 4
    assert all(row["state"] == "done" for row in array_rows.values())
    assert array_rows == local_rows
    assert _claims(array / "report.md") == _claims(local / "report.md")
