"""JSON over HTTP to one SGLang server, with retries for what is transient and clear errors for
what is not.

Transient (retried with exponential backoff until the deadline): connection refused or reset
(a server still starting or restarting), timeouts, 502/503/504. A 4xx is the request's fault and
is never retried: its message is shown. Any other failure, and a deadline passed, raise
`SGLangError` naming the server, the request and the last response.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import requests

from megatron_rl.rollout.sglang.api_key import ApiKey

TRANSIENT_STATUS = frozenset({502, 503, 504})
# A route an SGLang server with an API key answers only to requests carrying it (the keyless
# /health and /ready answer anyone); sglang-router's is /workers.
IDENTITY_PATH = "/model_info"
ROUTER_IDENTITY_PATH = "/workers"


class SGLangError(RuntimeError):
    """An SGLang server failed a request, or answered one in a way that cannot be used."""


class ServerDied(SGLangError):
    """The server's process (started by this trainer) is gone."""


@dataclass(frozen=True, kw_only=True)
class RetryPolicy:
    """How long to keep trying a request that fails transiently."""

    deadline_s: float = 120.0
    """Give up this many seconds after the first attempt."""
    timeout_s: float = 600.0
    """One attempt's read timeout (a large batch or weight update can take minutes)."""
    first_backoff_s: float = 0.2
    """Wait after the first failure; doubles after each further one."""
    max_backoff_s: float = 5.0
    """The longest wait between two attempts."""


def _shorten(text: str, limit: int = 500) -> str:
    return text if len(text) <= limit else text[:limit] + f"... ({len(text)} chars)"


class ServerConnection:
    """Requests to one server at `url` (e.g. `http://127.0.0.1:30000`), each carrying `api_key`
    (the run's: megatron_rl.rollout.sglang.api_key) when given.

    `alive`, when the trainer started the server, says whether its process still runs: a
    connection error from a dead server is then reported at once instead of retried.
    """

    def __init__(
        self,
        url: str,
        retry: RetryPolicy | None = None,
        *,
        api_key: ApiKey | None = None,
        alive: Callable[[], bool] | None = None,
    ) -> None:
        if not url.startswith(("http://", "https://")):
            raise ValueError(f"server url {url!r}: expected http://HOST:PORT or https://HOST:PORT")
        self.url = url.rstrip("/")
        self.retry = retry or RetryPolicy()
        self.alive = alive
        self.api_key = api_key
        self._session = requests.Session()
        if api_key is not None:
            self._session.headers.update(api_key.header)

    def __repr__(self) -> str:
        return f"ServerConnection({self.url})"

    def post(self, path: str, body: dict[str, Any], *, retry: RetryPolicy | None = None) -> Any:
        """POST `body` as JSON to `path`; returns the decoded JSON answer."""
        return self._request("POST", path, body, retry or self.retry)

    def get(self, path: str, *, retry: RetryPolicy | None = None) -> Any:
        """GET `path`; returns the decoded JSON answer."""
        return self._request("GET", path, None, retry or self.retry)

    def ping(self, path: str = "/health", timeout_s: float = 5.0) -> bool:
        """One attempt, no retries: does the server answer `path` with 200? (SGLang answers
        /health to anyone: this says something listens, not whose it is; see `is_ours`.)"""
        try:
            return self._session.get(self.url + path, timeout=timeout_s).status_code == 200
        except requests.RequestException:
            return False

    def is_ours(self, path: str = IDENTITY_PATH, timeout_s: float = 5.0) -> bool:
        """One attempt each: does the server refuse `path` without a key (401) and answer it
        with this connection's key (200)? A server started with another key, or none, or
        something else on the port, does not; it is asked without the key first, so that one
        that takes requests from anyone is never sent the key."""
        if self.api_key is None:
            raise ValueError(f"{self.url}: without an API key there is no identity to check")
        try:
            anonymous = requests.get(self.url + path, timeout=timeout_s)
            if anonymous.status_code != 401:
                return False
            return self._session.get(self.url + path, timeout=timeout_s).status_code == 200
        except requests.RequestException:
            return False

    def _request(self, method: str, path: str, body: Any, retry: RetryPolicy) -> Any:
        where = f"SGLang server {self.url}, {method} {path}"
        give_up_at = time.monotonic() + retry.deadline_s
        backoff, attempts, last = retry.first_backoff_s, 0, "no response"
        while True:
            attempts += 1
            try:
                response = self._session.request(
                    method, self.url + path, json=body, timeout=(10.0, retry.timeout_s)
                )
            except (requests.ConnectionError, requests.Timeout) as error:
                last = f"{type(error).__name__}: {_shorten(str(error), 200)}"
                if self.alive is not None and not self.alive():
                    raise ServerDied(f"{where}: the server's process has exited ({last})") from None
            else:
                if response.status_code == 200:
                    return _decode(response, where)
                last = f"HTTP {response.status_code}: {_shorten(response.text)}"
                if response.status_code not in TRANSIENT_STATUS:
                    raise SGLangError(f"{where}: the server refused the request ({last})")
            if time.monotonic() + backoff > give_up_at:
                raise SGLangError(
                    f"{where}: no usable answer within {retry.deadline_s:g} s "
                    f"({attempts} attempt(s)); last response: {last}"
                )
            time.sleep(backoff)
            backoff = min(backoff * 2, retry.max_backoff_s)


def _decode(response: requests.Response, where: str) -> Any:
    try:
        return response.json()
    except (json.JSONDecodeError, ValueError):
        raise SGLangError(f"{where}: the answer is not JSON: {_shorten(response.text)!r}") from None
