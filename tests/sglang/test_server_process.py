"""Server processes: started, waited for, logged and stopped by process group (with a stand-in
launcher, tests/sglang/fake_launcher; the real server's start is covered by the session)."""

from __future__ import annotations

import contextlib
import os
import re
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from megatron_rl.rollout.sglang import ServerGroup, SGLangConfig, SGLangError
from megatron_rl.rollout.sglang.api_key import run_key
from tests.processes import group_gone, live_group_members
from tests.sglang.test_http_errors import ScriptedServer, _closed_port

FAKE = Path(__file__).resolve().parent / "fake_launcher"
REPO = Path(__file__).resolve().parents[2]


def _servers(
    mode: str, port: int, log_dir, *, routed_experts: bool = False, seed: int = 0, **changes
) -> ServerGroup:
    """Servers of the stand-in launcher in `mode`, the first on `port`."""
    defaults = {
        "python": sys.executable,
        "base_port": port,
        "env": {"PYTHONPATH": str(FAKE), "FAKE_SGLANG_MODE": mode},
        "startup_timeout_s": 20.0,
    }
    config = SGLangConfig(**(defaults | changes))
    key = run_key(log_dir)
    return ServerGroup(
        config, "unused", log_dir, api_key=key, seed=seed, routed_experts=routed_experts
    )


def test_servers_start_log_and_stop_with_their_children(tmp_path, monkeypatch):
    for name, value in (("RANK", "1"), ("MASTER_PORT", "29500"), ("TORCHELASTIC_RUN_ID", "x")):
        monkeypatch.setenv(name, value)  # as under torchrun
    port = _closed_port()
    group = _servers("ok", port, tmp_path, num_servers=2, routed_experts=True, seed=7)
    with group:
        assert group.urls == [f"http://127.0.0.1:{port}", f"http://127.0.0.1:{port + 1}"]
        assert all(server.connection.ping() for server in group.servers)
        logs = [server.log_path.read_text() for server in group.servers]
        launchers = [server.process.pid for server in group.servers]
        children = [int(re.search(r"child pid (\d+)", log).group(1)) for log in logs]
        # Each server is a process group of its own, children included.
        assert all(live_group_members(pid) for pid in launchers)
        assert all(os.getpgid(child) == pid for child, pid in zip(children, launchers, strict=True))
        assert "--enable-return-routed-experts" in logs[0] and "--skip-tokenizer-init" in logs[0]
        # the key reached the server (it answers the trainer), but no log and no command line
        key = group.servers[0].api_key.value
        assert "'--api-key', '[redacted]', '--admin-api-key', '[redacted]'" in logs[0]
        assert not any(key in log for log in logs)
        assert all(server.connection.is_ours() for server in group.servers)
        members = [pid for launcher in launchers for pid in live_group_members(launcher)]
        assert len(members) >= 4 * len(launchers)  # supervisor, server, its log's copier, child
        for pid in members:
            assert key.encode() not in Path(f"/proc/{pid}/cmdline").read_bytes()
        assert f"'--port', '{port + 1}'" in logs[1]
        # each server samples from a seed of its own, the run's seed + its index
        assert "'--random-seed', '7'" in logs[0] and "'--random-seed', '8'" in logs[1]
        none = "{'RANK': None, 'MASTER_PORT': None, 'TORCHELASTIC_RUN_ID': None}"
        assert f"launcher variables {none}" in logs[0]  # torchrun's are not passed on
    assert all(group_gone(pid) for pid in launchers)
    assert not any(server.connection.ping() for server in group.servers)


def test_a_server_that_exits_during_start_up_is_reported_with_its_log(tmp_path):
    with pytest.raises(SGLangError, match=r"(?s)exited during start-up \(exit code 3\).*boom"):
        _servers("exit", _closed_port(), tmp_path).start()


def test_a_server_that_never_gets_ready_is_stopped_after_the_deadline(tmp_path):
    group = _servers("hang", _closed_port(), tmp_path, startup_timeout_s=3.0)
    with pytest.raises(SGLangError, match=r"did not answer as this run's server .* within 3 s"):
        group.start()
    launcher = int(re.search(r"=== pid (\d+)", group.servers[0].log_tail()).group(1))
    assert group_gone(launcher)  # the launcher and its child


def test_a_port_that_is_taken_is_not_used():
    taken = ScriptedServer([(200, "{}")])
    try:
        port = int(taken.url.rsplit(":", 1)[1])
        with pytest.raises(SGLangError, match="something already answers on this port"):
            _servers("ok", port, "/tmp").start()
    finally:
        taken.close()


def test_a_server_is_stopped_when_the_process_that_started_it_is_killed(tmp_path):
    owner = subprocess.Popen(
        [sys.executable, "-m", "tests.sglang.server_owner", str(_closed_port()), str(tmp_path)],
        cwd=REPO,
        stdout=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    try:
        launcher = int(owner.stdout.readline())
        assert live_group_members(launcher)
        owner.kill()  # SIGKILL: no clean-up of its own runs
        owner.wait()
        assert group_gone(launcher), "the server outlived the process that started it"
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(owner.pid, signal.SIGKILL)
        owner.wait()
