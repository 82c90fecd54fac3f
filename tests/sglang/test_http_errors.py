"""The client's retries and errors against servers that misbehave.

A real SGLang server does not return malformed answers on demand, so these tests use a small
HTTP server in a thread that answers as scripted (a test double of a broken SGLang server);
the client code under test is the real one.
"""

from __future__ import annotations

import base64
import json
import socket
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import numpy as np
import pytest
import torch

from megatron_rl.rollout.backends import check_answers
from megatron_rl.rollout.engine import SamplingParams
from megatron_rl.rollout.sglang import RetryPolicy, ServerConnection, SGLangEngine, SGLangError
from megatron_rl.rollout.sglang.api_key import run_key
from megatron_rl.rollout.sglang.weight_sync import TensorSync

QUICK = RetryPolicy(deadline_s=1.5, timeout_s=0.5, first_backoff_s=0.05, max_backoff_s=0.2)


class ScriptedServer:
    """Answers each POST with the next (status, body) of `script` (the last one repeats), and
    every GET with 200 and an empty JSON object (healthy, nothing to report)."""

    def __init__(self, script: list[tuple[int, str]], port: int = 0) -> None:
        self.script, self.requests, self.headers = list(script), [], []
        owner = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:
                length = int(self.headers.get("Content-Length", 0))
                owner.requests.append((self.path, json.loads(self.rfile.read(length) or b"{}")))
                status, body = owner.script.pop(0) if len(owner.script) > 1 else owner.script[0]
                self.send_response(status)
                self.send_header("Content-Type", "application/json")
                self.end_headers()
                self.wfile.write(body.encode())

            def do_GET(self) -> None:
                owner.headers.append(dict(self.headers))
                self.send_response(200)
                self.send_header("Content-Type", "application/json")
                self.end_headers()
                self.wfile.write(b"{}")

            def log_message(self, *args) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", port), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


@pytest.fixture
def scripted():
    servers = []

    def make(script):
        servers.append(ScriptedServer(script))
        return servers[-1]

    yield make
    for server in servers:
        server.close()


def _closed_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def _sample(output_ids, logprobs, prompt_tokens=2, finish="length") -> dict:
    return {
        "output_ids": output_ids,
        "meta_info": {
            "output_token_logprobs": logprobs,
            "finish_reason": {"type": finish},
            "prompt_tokens": prompt_tokens,
        },
    }


def _engine(url: str) -> SGLangEngine:
    return SGLangEngine([url], TensorSync([1]), routed_experts=(4, 2), retry=QUICK)


def test_a_url_that_never_answers_fails_after_the_deadline_naming_it():
    url = f"http://127.0.0.1:{_closed_port()}"
    with pytest.raises(SGLangError, match=r"127\.0\.0\.1.*POST /generate.*within 1\.5 s.*Connect"):
        ServerConnection(url, QUICK).post("/generate", {})


@pytest.mark.parametrize("listening", ["nothing", "a server that takes no key"])
def test_a_server_the_recipe_names_that_does_not_answer_as_the_runs_is_refused_at_once(
    scripted, tmp_path, listening
):
    """Nothing on the port, or a server that answers requests without the run's key (another
    run's, or one anyone may drive): refused before the run sends it anything, its key
    included."""
    if listening == "nothing":
        url = f"http://127.0.0.1:{_closed_port()}"
    else:
        server = scripted([(200, "{}")])
        url = server.url
    started = time.monotonic()
    with pytest.raises(ValueError, match=r"rollout\.sglang\.urls: .* does not answer as a server"):
        check_answers(url, "rollout.sglang.urls", run_key(tmp_path), within_s=2.0)
    assert time.monotonic() - started < 10
    if listening != "nothing":
        assert all("Authorization" not in headers for headers in server.headers)


def test_a_server_that_accepts_but_never_replies_times_out():
    with socket.socket() as silent:
        silent.bind(("127.0.0.1", 0))
        silent.listen()
        url = f"http://127.0.0.1:{silent.getsockname()[1]}"
        with pytest.raises(SGLangError, match=r"within 1\.5 s.*(Timeout|timed out)"):
            ServerConnection(url, QUICK).post("/generate", {})


def test_503_is_retried_until_it_succeeds(scripted):
    server = scripted([(503, "loading"), (503, "loading"), (200, '{"ok": 1}')])
    assert ServerConnection(server.url, QUICK).post("/x", {"a": 1}) == {"ok": 1}
    assert len(server.requests) == 3


def test_400_is_not_retried_and_its_message_is_shown(scripted):
    server = scripted([(400, '{"error": "unknown sampling param bogus"}')])
    with pytest.raises(SGLangError, match=r"refused the request \(HTTP 400.*bogus"):
        ServerConnection(server.url, QUICK).post("/generate", {})
    assert len(server.requests) == 1


def test_malformed_json_names_server_and_request(scripted):
    server = scripted([(200, "<html>oops")])
    with pytest.raises(SGLangError, match=rf"{server.url}, POST /generate: the answer is not JSON"):
        _engine(server.url).generate([[1, 2]], SamplingParams(max_new_tokens=2))


@pytest.mark.parametrize(
    ("answer", "message"),
    [
        (_sample([5, 6], [[-0.1, 5, None]]), r"output_token_logprobs has 1 entries for 2"),
        (_sample([5, 6], [[-0.1, 5, None], [-0.2, 7, None]]), r"\[1\] .* output token 6"),
        (_sample([5], [[-0.1, 5, None]], prompt_tokens=3), r"prompt_tokens = 3, the prompt has 2"),
        (_sample([5], [[-0.1, 5, None]], finish="abort"), r"finish_reason .*abort"),
        ({"output_ids": [5]}, r"no field 'meta_info.output_token_logprobs'"),
        ([_sample([5], [[-0.1, 5, None]])] * 2, r"2 sample\(s\) in the answer, expected 1"),
    ],
    ids=["short_logprobs", "wrong_token", "wrong_prompt", "aborted", "no_logprobs", "too_many"],
)
def test_a_wrong_generate_answer_is_a_clear_error(scripted, answer, message):
    server = scripted([(200, json.dumps(answer))])
    with pytest.raises(SGLangError, match=message) as error:
        _engine(server.url).generate([[1, 2]], SamplingParams(max_new_tokens=2))
    assert f"{server.url}, POST /generate" in str(error.value)


def _versioned(spans) -> dict:
    answer = _sample([5, 6], [[-0.1, 5, None], [-0.2, 6, None]])
    answer["meta_info"]["weight_versions"] = spans
    return answer


@pytest.mark.parametrize(
    ("spans", "message"),
    [
        ([{"version": "3", "start": 0, "end": 1}], r"covers 1 of the 2 output tokens"),
        (
            [{"version": "3", "start": 0, "end": 1}, {"version": "4", "start": 0, "end": 2}],
            r"weight_versions = .*expected contiguous spans from token 0 to 2",
        ),
        (
            [{"version": "3", "start": 0, "end": 1}, {"version": "base", "start": 1, "end": 2}],
            r"names version 'base'",
        ),
    ],
    ids=["short", "overlapping", "not_a_number"],
)
def test_wrong_weight_version_marks_are_a_clear_error(scripted, spans, message):
    server = scripted([(200, json.dumps(_versioned(spans)))])
    with pytest.raises(SGLangError, match=message):
        _engine(server.url).generate([[1, 2]], SamplingParams(max_new_tokens=2))


def test_weight_version_marks_become_each_tokens_version(scripted):
    two = [{"version": "3", "start": 0, "end": 1}, {"version": "4", "start": 1, "end": 2}]
    one = [{"version": "4", "start": 0, "end": 2}]
    # the weights the server started with go by another name: the engine's version (-1 here)
    started = [{"version": "default", "start": 0, "end": 1}, {"version": "0", "start": 1, "end": 2}]
    answers = [two, one, started, [{"version": "default", "start": 0, "end": 2}]]
    server = scripted([(200, json.dumps(_versioned(spans))) for spans in answers])
    engine = _engine(server.url)
    got = [engine.generate([[1, 2]], SamplingParams(max_new_tokens=2))[0][0] for _ in answers]
    assert [(s.weight_version, s.token_versions) for s in got] == [
        (3, (3, 4)),
        (4, None),
        (-1, (-1, 0)),
        (-1, None),
    ]


def test_routed_experts_of_the_wrong_size_are_refused(scripted):
    answer = _sample([5, 6], [[-0.1, 5, None], [-0.2, 6, None]])
    # 3 positions x 4 layers x top-2 expected; 2 positions sent.
    answer["meta_info"]["routed_experts"] = base64.b64encode(
        np.zeros((2, 4, 2), dtype=np.int32).tobytes()
    ).decode()
    server = scripted([(200, json.dumps(answer))])
    with pytest.raises(SGLangError, match=r"routed_experts holds 16 int32 values, expected 3 pos"):
        _engine(server.url).generate(
            [[1, 2]], SamplingParams(max_new_tokens=2), return_routed_experts=True
        )


def test_a_failed_weight_update_is_reported_and_blocks_generation(scripted):
    server = scripted([(200, '{"success": true, "message": ""}'), (400, '{"success": false}')])
    engine = _engine(server.url)
    with pytest.raises(SGLangError, match=r"update_weights_from_tensor"):
        engine.update_weights([[("w", torch.zeros(2))]], version=1)
    with pytest.raises(SGLangError, match=r"did not complete; refusing to generate"):
        engine.generate([[1, 2]], SamplingParams(max_new_tokens=2))


def test_a_server_that_comes_up_late_is_waited_for():
    port = _closed_port()
    late: list[ScriptedServer] = []

    def start_late() -> None:
        time.sleep(0.4)
        late.append(ScriptedServer([(200, '{"ok": 2}')], port=port))

    threading.Thread(target=start_late).start()
    try:
        assert ServerConnection(f"http://127.0.0.1:{port}", QUICK).post("/x", {}) == {"ok": 2}
    finally:
        for server in late:
            server.close()


def _answers(prompts: list[list[int]], n: int) -> str:
    """A well-formed /generate answer: response [prompt[0], 9] for every sample."""
    items = [
        _sample([p[0], 9], [[-0.5, p[0], None], [-0.25, 9, None]], prompt_tokens=len(p))
        for p in prompts
        for _ in range(n)
    ]
    return json.dumps(items)


def test_prompts_are_split_over_servers_and_answers_kept_in_order(scripted):
    prompts = [[10 + i] * (1 + i % 3) for i in range(5)]
    first = scripted([(200, _answers(prompts[:3], 2))])
    second = scripted([(200, _answers(prompts[3:], 2))])
    engine = SGLangEngine([first.url, second.url], TensorSync([1, 1]), retry=QUICK)
    groups = engine.generate(prompts, SamplingParams(max_new_tokens=2), n=2, seed=7)
    assert [group[0].prompt_ids for group in groups] == [tuple(p) for p in prompts]
    assert all(group[1].response_ids == (group[1].prompt_ids[0], 9) for group in groups)
    (path, body_1), (_, body_2) = first.requests[0], second.requests[0]
    # each sample an item of its own, prompt-major
    assert path == "/generate" and body_1["input_ids"] == [p for p in prompts[:3] for _ in "ab"]
    assert body_2["input_ids"] == [p for p in prompts[3:] for _ in "ab"]
    assert body_1["return_logprob"] is True
    # a sampling seed per sample, none shared (SGLang would give n copies of an item one seed)
    params = body_1["sampling_params"] + body_2["sampling_params"]
    assert len({item["sampling_seed"] for item in params}) == len(prompts) * 2
    assert all("n" not in item and item["max_new_tokens"] == 2 for item in params)
    # and the next request's seeds are new ones
    third = scripted([(200, _answers(prompts, 2))])
    SGLangEngine([third.url], TensorSync([1]), retry=QUICK).generate(
        prompts, SamplingParams(max_new_tokens=2), n=2, seed=8
    )
    later = {item["sampling_seed"] for item in third.requests[0][1]["sampling_params"]}
    assert not later & {item["sampling_seed"] for item in params}


def test_with_a_router_generation_goes_through_it_and_weights_to_every_server(scripted):
    prompts = [[3, 4], [5, 6]]  # of one length: either answer fits either request
    router = scripted([(200, _answers(prompts[:1], 1))] * 4)
    ok = '{"success": true, "message": ""}'
    workers = [scripted([(200, ok)]) for _ in range(2)]
    engine = SGLangEngine(
        [w.url for w in workers], TensorSync([1, 1]), router_url=router.url, retry=QUICK
    )
    groups = engine.generate(prompts, SamplingParams(max_new_tokens=2), n=2)
    assert [[sample.prompt_ids for sample in group] for group in groups] == [
        [tuple(p)] * 2 for p in prompts
    ]
    # a request per sample, at once: the router places each on a server whole; one object of
    # sampling parameters each (the router takes no list), each with a seed of its own
    assert [path for path, _ in router.requests] == ["/generate"] * 4
    bodies = [body for _, body in router.requests]
    assert sorted(body["input_ids"] for body in bodies) == [[p] for p in prompts for _ in "ab"]
    assert all(isinstance(body["sampling_params"], dict) for body in bodies)
    assert len({body["sampling_params"]["sampling_seed"] for body in bodies}) == 4
    assert not any(path == "/generate" for w in workers for path, _ in w.requests)
    with pytest.raises(SGLangError, match="weight version"):  # the stand-ins report none
        engine.update_weights([[("w", torch.zeros(2))]], version=3)
    for worker in workers:
        paths = [path for path, _ in worker.requests]
        assert paths == [
            "/begin_weight_update",
            "/update_weights_from_tensor",
            "/end_weight_update",
        ]
