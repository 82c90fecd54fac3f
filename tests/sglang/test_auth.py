"""The real SGLang server takes orders only from holders of the run's key: without it, or with
another, its weight updates, logging, aborts, memory release and generation are refused (401);
the key is on no process's command line and in no log of the server."""

from __future__ import annotations

from pathlib import Path

import pytest
import requests

from tests.processes import live_group_members

REFUSED = [
    ("POST", "/update_weights_from_disk", {"model_path": "/tmp", "weight_version": "x"}),
    ("POST", "/update_weights_from_tensor", {"serialized_named_tensors": []}),
    ("POST", "/init_weights_update_group", {"master_address": "127.0.0.1", "master_port": 1}),
    ("POST", "/configure_logging", {"log_requests": True, "crash_dump_folder": "/tmp/x"}),
    ("POST", "/abort_request", {"rid": "", "abort_all": True}),
    ("POST", "/release_memory_occupation", {}),
    ("POST", "/generate", {"input_ids": [3, 4], "sampling_params": {"max_new_tokens": 1}}),
    ("GET", "/server_info", None),  # it lists the server's settings, its keys included
]


@pytest.mark.parametrize(("method", "path", "body"), REFUSED, ids=[r[1] for r in REFUSED])
@pytest.mark.parametrize("credential", ["none", "another key"])
def test_requests_without_the_runs_key_are_refused(sglang_servers, method, path, body, credential):
    url = sglang_servers.urls[0]
    headers = {} if credential == "none" else {"Authorization": "Bearer " + "0" * 64}
    answer = requests.request(method, url + path, json=body, headers=headers, timeout=30)
    assert answer.status_code == 401, (answer.status_code, answer.text[:200])


def test_the_runs_own_requests_are_answered(sglang_servers):
    connection = sglang_servers.servers[0].connection
    assert connection.is_ours()
    assert connection.get("/model_info")["architectures"] == ["Qwen3MoeForCausalLM"]
    answer = connection.post(
        "/generate", {"input_ids": [3, 4], "sampling_params": {"max_new_tokens": 1}}
    )
    assert len(answer["output_ids"]) == 1


def test_the_key_is_on_no_command_line_and_in_no_log(sglang_servers):
    server = sglang_servers.servers[0]
    key = server.api_key.value
    members = live_group_members(server.process.pid)
    # the supervisor, the launcher (the server's main process), its log's copier, SGLang's
    # scheduler and detokenizer
    assert len(members) >= 5, members
    for pid in members:
        assert key.encode() not in Path(f"/proc/{pid}/cmdline").read_bytes(), pid
    log = server.log_path.read_text()
    assert "'api_key': '[redacted]'" in log and "'admin_api_key': '[redacted]'" in log
    assert key not in log
