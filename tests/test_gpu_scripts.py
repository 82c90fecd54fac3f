"""scripts/gpu_check.sh and gpu_bench.sh put the wheels they carry first on PYTHONPATH from a
fresh directory of their own, removed on exit, never a fixed path in /tmp (whoever made that
first would decide what Python imports). Run in a copy of the repository with stand-ins for
python3 and nvidia-smi that record how they were called."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
SCRIPTS = ("gpu_check.sh", "gpu_bench.sh")


@pytest.fixture
def repo_copy(tmp_path):
    """The two scripts in a repository of their own with a wheel in .whl/, and a PATH whose
    python3 and nvidia-smi record their calls in `calls.jsonl`."""
    repo = tmp_path / "repo"
    (repo / "scripts").mkdir(parents=True)
    for name in SCRIPTS:
        shutil.copy(REPO / "scripts" / name, repo / "scripts" / name)
    (repo / ".whl").mkdir()
    (repo / ".whl" / "megatron_core-0-py3-none-any.whl").write_bytes(b"")
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    # each call's arguments, whether each is a directory, and PYTHONPATH: a JSON line in CALLS
    record = (
        "#!/bin/sh\n"
        f"exec {shutil.which('python3') or '/usr/bin/python3'} -c 'import json, os, sys; "
        'print(json.dumps({"argv": sys.argv[1:], "pythonpath": os.environ.get("PYTHONPATH", ""), '
        '"exists": [os.path.isdir(a) for a in sys.argv[1:]]}))\' "$@" >> "$CALLS"\n'
    )
    for name in ("python3", "nvidia-smi"):
        (bin_dir / name).write_text(record)
        (bin_dir / name).chmod(0o755)
    return repo, bin_dir, tmp_path / "calls.jsonl"


def _run(repo_copy, script: str) -> list[dict]:
    repo, bin_dir, calls = repo_copy
    env = dict(os.environ, PATH=f"{bin_dir}:{os.environ['PATH']}", CALLS=str(calls))
    env["OUT"] = str(repo.parent / "out")  # gpu_check.sh's is there already
    (repo.parent / "out").mkdir(exist_ok=True)
    env.pop("PYTHONPATH", None)
    done = subprocess.run(
        ["bash", str(repo / "scripts" / script)], env=env, capture_output=True, text=True
    )
    assert done.returncode == 0, done.stderr
    return [json.loads(line) for line in calls.read_text().splitlines()]


_PIP_INSTALL = ["-m", "pip", "install"]


def _site(calls: list[dict]) -> str:
    """Where the wheels were installed, checked to be a directory by then."""
    (install,) = [call for call in calls if call["argv"][:3] == _PIP_INSTALL]
    at = install["argv"].index("--target") + 1
    assert install["exists"][at]
    return install["argv"][at]


@pytest.mark.parametrize("script", SCRIPTS)
def test_the_wheels_come_first_from_a_fresh_directory_removed_on_exit(repo_copy, script):
    calls = _run(repo_copy, script)
    site = _site(calls)
    assert not site.startswith("/tmp/site")
    assert not Path(site).exists()  # removed on exit
    repo, _, recorded = repo_copy
    # pytest, and gpu_bench.sh's benchmarks
    runs = [
        call for call in calls if call["argv"][:1] == ["-m"] and call["argv"][:3] != _PIP_INSTALL
    ]
    assert len(runs) == (1 if script == "gpu_check.sh" else 6)
    for call in runs:
        assert call["pythonpath"] == f"{site}:{repo}", call["argv"]
    recorded.unlink()
    assert _site(_run(repo_copy, script)) != site  # a second run, a directory of its own


@pytest.mark.skipif(shutil.which("shellcheck") is None, reason="shellcheck is not installed")
def test_the_scripts_pass_shellcheck():
    done = subprocess.run(
        ["shellcheck", *(str(REPO / "scripts" / name) for name in SCRIPTS)],
        capture_output=True,
        text=True,
    )
    assert done.returncode == 0, done.stdout
