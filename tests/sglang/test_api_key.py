"""The run's API key (its file, made once whoever comes first) and `launch_with_key.py`, which
hands it to SGLang off the command line and redacts it from everything the server writes. The
real server's refusals are in test_auth.py; these use the stand-in launcher (fake_launcher)."""

from __future__ import annotations

import ast
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from megatron_rl.rollout.sglang import launch_with_key
from megatron_rl.rollout.sglang.api_key import ApiKey, ensure_key_file, read_key, run_key
from megatron_rl.rollout.sglang.servers import KEYED_LAUNCHER

FAKE = Path(__file__).resolve().parent / "fake_launcher"
REPO = Path(__file__).resolve().parents[2]


def test_a_runs_key_is_made_once_readable_by_its_owner_only(tmp_path):
    key = run_key(tmp_path)
    assert key.path == tmp_path / "sglang_api_key"
    assert key.path.stat().st_mode & 0o777 == 0o600
    assert len(key.value) == 64 and int(key.value, 16) >= 0
    assert run_key(tmp_path) == key  # the same key on every later use
    assert key.value not in repr(key) and str(key.path) in repr(key)
    assert key.header == {"Authorization": f"Bearer {key.value}"}
    assert [path.name for path in tmp_path.iterdir()] == ["sglang_api_key"]  # no temporary left


def test_processes_that_make_the_key_at_once_all_read_the_same_one(tmp_path):
    path = tmp_path / "run" / "sglang_api_key"
    code = (
        "import sys; from pathlib import Path\n"
        "from megatron_rl.rollout.sglang.api_key import ensure_key_file\n"
        "print('ready', flush=True); sys.stdin.readline()\n"
        "print(ensure_key_file(Path(sys.argv[1])).read_text().strip())"
    )
    makers = [
        subprocess.Popen(
            [sys.executable, "-c", code, str(path)],
            cwd=REPO,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
        )
        for _ in range(4)
    ]
    assert all(maker.stdout.readline() == "ready\n" for maker in makers)  # imports done
    for maker in makers:  # then all at once
        maker.stdin.write("go\n")
        maker.stdin.flush()
    keys = {maker.communicate(timeout=60)[0].strip() for maker in makers}
    assert len(keys) == 1 and keys == {path.read_text().strip()}


@pytest.mark.parametrize(
    ("content", "mode", "message"),
    [
        ("a" * 64, 0o644, r"readable by others \(mode 644\); `chmod 600"),
        ("short", 0o600, "at least 32 letters and digits"),
        ("a" * 40 + " " + "b" * 40, 0o600, "at least 32 letters and digits"),
    ],
)
def test_a_key_file_that_is_not_private_or_not_a_key_is_refused(tmp_path, content, mode, message):
    path = tmp_path / "key"
    path.write_text(content)
    path.chmod(mode)
    with pytest.raises(ValueError, match=rf"rollout\.sglang\.api_key_file: .*{message}"):
        read_key(path, given_as="rollout.sglang.api_key_file")
    with pytest.raises(ValueError, match=r"rollout\.sglang\.api_key_file: cannot read"):
        read_key(tmp_path / "absent", given_as="rollout.sglang.api_key_file")


def test_the_launcher_imports_only_the_standard_library():
    """SGLang's interpreter runs it by path, without megatron-rl installed."""
    tree = ast.parse(KEYED_LAUNCHER.read_text())
    imported = {
        alias.name.split(".")[0]
        for node in ast.walk(tree)
        if isinstance(node, ast.Import | ast.ImportFrom)
        for alias in (node.names if isinstance(node, ast.Import) else [ast.alias(node.module)])
    }
    assert imported - {"__future__"} <= set(sys.stdlib_module_names), imported


def _launch(key: ApiKey, *args: str, mode: str = "exit") -> subprocess.CompletedProcess:
    command = [sys.executable, str(KEYED_LAUNCHER), str(key.path), "sglang.launch_server", *args]
    env = os.environ | {"PYTHONPATH": str(FAKE), "FAKE_SGLANG_MODE": mode}
    return subprocess.run(command, capture_output=True, text=True, env=env, timeout=60)


def test_the_launcher_passes_the_key_and_redacts_it_from_the_output(tmp_path):
    key = run_key(tmp_path)
    # the stand-in prints its arguments (SGLang logs its settings) and exits with status 3
    result = _launch(key, "--port", "1")
    assert result.returncode == 3, result.stderr
    assert "argv ['--port', '1', '--api-key', '[redacted]', '--admin-api-key', '[redacted]']" in (
        result.stdout
    )
    assert key.value not in result.stdout + result.stderr


def test_the_launcher_refuses_a_key_given_on_the_command_line(tmp_path):
    result = _launch(run_key(tmp_path), "--api-key=mine")
    assert result.returncode == 1
    assert "--api-key=mine given; the run's key" in result.stderr and "argv" not in result.stdout


def test_a_key_written_in_pieces_is_still_redacted():
    secret = b"0123456789abcdef0123456789abcdef"
    source, sink = os.pipe()
    shown, target = os.pipe()
    copier = threading.Thread(target=launch_with_key.copy_redacted, args=({source: target}, secret))
    copier.start()
    for piece in (b"before 0123456789", b"abcdef0123", b"456789abcdef after\n", b"tail 0123"):
        os.write(sink, piece)
        time.sleep(0.05)  # each piece read on its own
    os.close(sink)
    copier.join(timeout=10)
    os.close(target)
    with os.fdopen(shown, "rb") as output:
        assert output.read() == b"before [redacted] after\ntail 0123"


@pytest.mark.parametrize(
    ("data", "kept"), [(b"x\n", 0), (b"x 01", 2), (b"x 0123456789abcdef0123456789abcde", 31)]
)
def test_only_what_may_begin_the_key_waits(data, kept):
    assert launch_with_key.kept_back(data, b"0123456789abcdef0123456789abcdef") == kept


def test_the_key_file_is_created_beside_existing_files(tmp_path):
    (tmp_path / "metrics.jsonl").write_text("{}\n")
    path = ensure_key_file(tmp_path / "sglang_api_key")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["metrics.jsonl", "sglang_api_key"]
    assert read_key(path, given_as="x").path == path
