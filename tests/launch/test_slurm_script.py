"""The batch scripts `megatron-rl launch slurm` renders: shellcheck finds nothing in them at 2, 4
and 16 nodes, with and without rollout nodes; what they ask SLURM for; recipes that cannot run
on the cluster asked for fail before anything is submitted, naming the option and the arithmetic."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from megatron_rl.config import load_config
from megatron_rl.launch.slurm import (
    SlurmJob,
    job_name,
    render_command_script,
    render_train_script,
    time_limit_seconds,
)
from megatron_rl.parallel.dims import ParallelDims
from megatron_rl.trainer.recipe import Recipe
from tests.trainer.run_cli import REPO, TINY_MODEL

QWEN3 = REPO / "examples" / "moe" / "qwen3_30b_a3b_gspo.yaml"
TINY = REPO / "examples" / "moe" / "tiny_gspo.yaml"
LOGS = Path("/shared/runs/x/slurm")


def _job(**options) -> SlurmJob:
    return SlurmJob(python="/shared/venv/bin/python", workdir="/shared/work", **options)


def _render(recipe_path: Path, overrides: list[str], **options) -> str:
    recipe = load_config(Recipe, recipe_path, overrides)
    return render_train_script(recipe_path, overrides, recipe, _job(**options), log_dir=LOGS)


def _shellcheck(script: str, tmp_path: Path) -> str:
    path = tmp_path / "job.sbatch"
    path.write_text(script)
    result = subprocess.run(
        ["shellcheck", "--severity=style", str(path)], capture_output=True, text=True
    )
    return result.stdout + result.stderr


@pytest.mark.skipif(shutil.which("shellcheck") is None, reason="scripts/install_slurm.sh")
@pytest.mark.parametrize("nodes", [2, 4, 16])
@pytest.mark.parametrize("rollout_nodes", [0, 1, 2])
def test_rendered_scripts_pass_shellcheck(tmp_path, nodes, rollout_nodes):
    script = _render(
        QWEN3,
        [],
        nodes=nodes,
        rollout_nodes=rollout_nodes,
        partition="gpu",
        account="rl-team",
        time_limit="04:00:00",
    )
    assert _shellcheck(script, tmp_path) == ""
    assert f"#SBATCH --nodes={nodes + rollout_nodes}\n" in script
    assert (
        "#SBATCH --gpus-per-node=8\n#SBATCH --partition=gpu\n#SBATCH --account=rl-team\n" in script
    )
    assert "#SBATCH --time=04:00:00\n#SBATCH --signal=B:USR1@900\n#SBATCH --requeue\n" in script
    assert f"# Trainer: world {nodes * 8} = tp1 * cp1 * pp2 * dp{nodes * 4}" in script
    assert ("rollout_server route" in script) == (rollout_nodes * 2 > 1)
    assert ("megatron_rl.launch.rollout_server serve" in script) == (rollout_nodes > 0)
    # the servers are trusted once they answer as the run's (its key), not on any /health
    assert ("rollout_server await" in script) == (rollout_nodes > 0)
    assert "curl" not in script and "0.0.0.0" not in script
    # a restart spends the step numbers of every earlier start: the servers', the trainer's and
    # the probe of the trainer nodes after a failed step
    steps_per_start = 3 if rollout_nodes else 2
    assert f"spent < ${{SLURM_RESTART_COUNT:-0}} * {steps_per_start}; spent++" in script
    assert "pkill" not in script and "killall" not in script


def test_the_cpu_script_asks_for_no_gpus_and_passes_the_recipe_as_given():
    script = _render(
        TINY, [f"model.hf_path={TINY_MODEL}", "run.steps=3"], nodes=1, gpus_per_node=2, device="cpu"
    )
    assert "--gpus-per-node" not in script and "#SBATCH --time" not in script
    assert f"train {TINY} model.hf_path={TINY_MODEL} run.steps=3 " in script
    assert "--nproc-per-node 2" in script and "--graceful SIGUSR1 --" in script


def test_values_are_filled_in_once_and_never_read_for_placeholders():
    """An override holding a placeholder stays as written: the workdir (which may hold `$(...)`)
    is written once, quoted, and not again where the override is."""
    override = "run.name=a b@WORKDIR@ @PYTHON@"
    recipe = load_config(Recipe, TINY, [override])
    job = SlurmJob(python="/shared/venv/bin/python", workdir="/w/$(touch /tmp/owned)", nodes=1)
    script = render_train_script(TINY, [override], recipe, job, log_dir=LOGS)
    assert script.count("$(touch /tmp/owned)") == 1
    assert "workdir=${MEGATRON_RL_DIR:-'/w/$(touch /tmp/owned)'}" in script
    assert "'run.name=a b@WORKDIR@ @PYTHON@'" in script
    assert "#SBATCH --job-name=a-b-WORKDIR---PYTHON-\n" in script


@pytest.mark.parametrize(
    ("where", "message"),
    [
        ("recipe", "the recipe's path: .* holds the control character '\\\\n'"),
        ("override", "override: .* holds the control character '\\\\n'"),
        ("workdir", "the working directory: .* holds the control character '\\\\r'"),
    ],
)
def test_control_characters_cannot_reach_a_batch_script(tmp_path, where, message):
    recipe_path, overrides, workdir = TINY, ["run.steps=3"], "/shared/work"
    if where == "recipe":
        recipe_path = tmp_path / "a\ntouch owned\n.yaml"
        recipe_path.write_text(TINY.read_text())
    elif where == "override":
        overrides = ["run.name=x\ntouch owned"]
    else:
        workdir = "/w\r"
    recipe = load_config(Recipe, recipe_path, overrides)
    job = SlurmJob(python="/shared/venv/bin/python", workdir=workdir, nodes=1)
    with pytest.raises(ValueError, match=message):
        render_train_script(recipe_path, overrides, recipe, job, log_dir=LOGS)


def test_a_conversion_jobs_name_and_arguments_are_checked():
    job = _job(nodes=1, device="cpu")
    dims = ParallelDims(world_size=8)
    with pytest.raises(ValueError, match=r"the command's arguments: .* control character"):
        render_command_script(
            ["convert", "hf-to-mcore", "--out", "a\nb"], job, dims=dims, name="x", log_dir=LOGS
        )
    script = render_command_script(
        ["convert", "hf-to-mcore", "--out", "o"], job, dims=dims, name="convert-a b;c", log_dir=LOGS
    )
    assert "#SBATCH --job-name=convert-a-b-c\n" in script
    assert job_name("x\ny") == "x-y"


def test_the_network_interface_is_exported_for_nccl_and_gloo():
    script = _render(TINY, [], nodes=1, device="cpu", network_interface="ib0")
    assert "export NCCL_SOCKET_IFNAME=ib0\nexport GLOO_SOCKET_IFNAME=ib0\n" in script
    assert "\nexport GLOO_SOCKET_IFNAME" not in _render(TINY, [], nodes=1, device="cpu")
    with pytest.raises(ValueError, match="--network-interface: 'ib0; rm' is not an interface"):
        _render(TINY, [], nodes=1, device="cpu", network_interface="ib0; rm")


def test_time_limits():
    assert time_limit_seconds("04:00:00") == 4 * 3600
    assert time_limit_seconds("1-12:30:05") == 36 * 3600 + 30 * 60 + 5
    for bad in ("4h", "04:60:00", "1:2:3"):
        with pytest.raises(ValueError, match="--time: expected"):
            time_limit_seconds(bad)


@pytest.mark.parametrize(
    ("recipe", "overrides", "options", "message"),
    [
        (
            QWEN3,
            [],
            {"nodes": 1, "gpus_per_node": 6},
            r"parallel \(over --nodes 1 x --gpus-per-node 6 = 6 ranks\): .* not a multiple of 16",
        ),
        (
            TINY,
            [f"model.hf_path={TINY_MODEL}", "parallel.ep=3"],
            {"nodes": 1, "gpus_per_node": 3},
            r"num_experts: 8 is not divisible by ep\(3\)",
        ),
        (TINY, [], {"nodes": 1, "rollout_nodes": 1}, "rollout.backend is local"),
        (
            QWEN3,
            ["rollout.sglang.weight_sync=tensor"],
            {"nodes": 2, "rollout_nodes": 1},
            "weight_sync=tensor shares tensors on one host",
        ),
        (
            QWEN3,
            ["rollout.sglang.tp_size=3"],
            {"nodes": 2, "rollout_nodes": 1},
            "tp_size: 3 does not divide --gpus-per-node 8",
        ),
        (
            QWEN3,
            ["rollout.sglang.urls=[http://a:1]"],
            {"nodes": 2, "rollout_nodes": 1},
            "leave those empty",
        ),
        (
            QWEN3,
            ["checkpoint.save_on_signals=[]"],
            {"nodes": 2},
            "checkpoint.save_on_signals: empty",
        ),
        (
            QWEN3,
            [],
            {"nodes": 2, "time_limit": "00:10:00"},
            "--signal-before: 900 s is not less than --time 00:10:00",
        ),
        (
            QWEN3,
            [],
            {"nodes": 2, "partition": "gpu;rm"},
            "--partition: 'gpu;rm' is not a SLURM name",
        ),
    ],
)
def test_a_recipe_that_cannot_run_on_the_cluster_is_refused(recipe, overrides, options, message):
    with pytest.raises(ValueError, match=message):
        _render(recipe, overrides, **options)


def test_the_cli_refuses_before_submitting(tmp_path):
    """A missing model and an earlier run's directory are refused at submission (sbatch is not
    reached: there is none on the path)."""

    def launch(*extra: str, after: tuple[str, ...] = ()) -> subprocess.CompletedProcess:
        return subprocess.run(
            [
                sys.executable,
                "-m",
                "megatron_rl.cli",
                "launch",
                "slurm",
                str(TINY),
                *extra,
                "--nodes=1",
                "--gpus-per-node=2",
                "--device=cpu",
                *after,
            ],
            cwd=tmp_path,
            capture_output=True,
            text=True,
            env={"PATH": "/nonexistent"},
            timeout=120,
        )

    missing = launch("model.hf_path=nowhere")
    assert (
        missing.returncode == 2
        and "model.hf_path " in missing.stderr
        and "nowhere: not a directory" in missing.stderr
    )
    run_dir = tmp_path / "runs" / "tiny_gspo"
    run_dir.mkdir(parents=True)
    (run_dir / "metrics.jsonl").write_text("{}\n")
    earlier = launch(f"model.hf_path={TINY_MODEL}")
    assert earlier.returncode == 2 and "holds an earlier run" in earlier.stderr, earlier.stderr
    no_sbatch = launch(f"model.hf_path={TINY_MODEL}", "--resume")
    assert no_sbatch.returncode == 1 and "sbatch" in no_sbatch.stderr, no_sbatch.stderr
    # overrides written after the options count as well (argparse's intermixed parsing)
    after = launch(after=("--dry-run", f"model.hf_path={TINY_MODEL}", "run.dir=elsewhere"))
    assert after.returncode == 0, after.stderr
    assert f"model.hf_path={TINY_MODEL} run.dir=elsewhere" in after.stdout


@pytest.mark.skipif(shutil.which("shellcheck") is None, reason="scripts/install_slurm.sh")
def test_the_repository_scripts_pass_shellcheck(tmp_path):
    scripts = [*(REPO / "scripts").glob("*.sh"), *(REPO / "examples" / "slurm").glob("*.sbatch")]
    assert len(scripts) > 5
    for script in sorted(scripts):
        assert _shellcheck(script.read_text(), tmp_path) == "", script


def test_the_checkout_and_interpreter_are_named_at_the_top_and_overridable():
    script = _render(TINY, [], nodes=1, device="cpu")
    top = script[: script.index("# ---- Network and NCCL")]
    assert "workdir=${MEGATRON_RL_DIR:-/shared/work}\n" in top
    assert "python=${MEGATRON_RL_PYTHON:-/shared/venv/bin/python}\n" in top
    assert 'cd "$workdir"\n' in script
    lines = [line for line in top.splitlines() if line.startswith(("workdir=", "python="))]
    shell = "\n".join([*lines, 'echo "$workdir $python"'])

    def run(env: dict[str, str]) -> str:
        result = subprocess.run(["bash", "-c", shell], env=env, capture_output=True, text=True)
        return result.stdout.strip()

    assert run({}) == "/shared/work /shared/venv/bin/python"
    moved = {"MEGATRON_RL_DIR": "/other/co", "MEGATRON_RL_PYTHON": "/other/co/.venv/bin/python"}
    assert run(moved) == "/other/co /other/co/.venv/bin/python"
