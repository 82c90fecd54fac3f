"""The SGLang rollout engine: the RolloutEngine interface over one or more SGLang servers.

Prompts are split into contiguous shares, one per server (data-parallel rollout), sent at once
and answered in order. Behind an sglang-router each sample is a request of its own, all sent at
once: the router places each request on a server whole (one request with every prompt would
keep one server busy and the others idle), and takes one set of sampling parameters per request
(each sample keeps its own seed). Weight updates always go to every server directly (a router
does not forward them).

A server that dies is noticed at once (its process is gone) when this engine manages it. It is
started again from the latest weights on disk when the disk method keeps some; otherwise its
weights would be the base model's, so the engine stops with an error instead of rolling out
from stale weights.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from typing import Any

from torch import Tensor

from megatron_rl.rollout.engine import (
    Sample,
    SamplingParams,
    WeightBucket,
    check_generate_request,
)
from megatron_rl.rollout.sglang.api_key import ApiKey
from megatron_rl.rollout.sglang.http import RetryPolicy, ServerConnection, ServerDied, SGLangError
from megatron_rl.rollout.sglang.responses import parse_prompt_logprobs, parse_samples
from megatron_rl.rollout.sglang.servers import ServerGroup
from megatron_rl.rollout.sglang.weight_sync import DiskSync, WeightSync

# Requests a router is sent at once per server behind it (one per sample): enough for a
# server's running batch, bounded so that a large step does not start a thread per sample.
ROUTER_REQUESTS_PER_SERVER = 256


class SGLangEngine:
    """Rollouts from SGLang servers (see the module docstring).

    Args:
        urls: the servers' base URLs (`http://host:port`), one per SGLang server.
        weight_sync: how weights reach the servers (megatron_rl.rollout.sglang.weight_sync).
        routed_experts: `(layers, topk)` of the model, needed to decode routed experts (R3).
        router_url: an sglang-router in front of `urls`, used for generation only.
        managed: the ServerGroup that started `urls`, to restart a server that died (its
            connections carry its API key).
        api_key: the key every request to servers the engine does not manage, and to the
            router, carries (megatron_rl.rollout.sglang.api_key); None: no key.
        architecture: the model's Hugging Face architecture; a server serving another one is
            refused before any weight is sent.
        retry: retries of servers the engine does not manage (managed ones bring their own).
        tensor_shapes: name -> shape of every tensor of the served checkpoint. Each weight update
            is checked against it before a tensor is sent: SGLang 0.5.23 silently ignores a name
            it does not know and its scheduler dies on a wrong shape.
    """

    def __init__(
        self,
        urls: Sequence[str],
        weight_sync: WeightSync,
        *,
        routed_experts: tuple[int, int] | None = None,
        router_url: str | None = None,
        managed: ServerGroup | None = None,
        api_key: ApiKey | None = None,
        architecture: str | None = None,
        retry: RetryPolicy | None = None,
        tensor_shapes: dict[str, tuple[int, ...]] | None = None,
    ) -> None:
        if not urls:
            raise ValueError("urls: at least one SGLang server is needed")
        self.managed = managed
        if managed is not None:
            if list(urls) != managed.urls:
                raise ValueError(f"urls: {list(urls)} are not the managed servers' {managed.urls}")
            self.servers = [server.connection for server in managed.servers]
        else:
            self.servers = [ServerConnection(url, retry, api_key=api_key) for url in urls]
        self.router = ServerConnection(router_url, retry, api_key=api_key) if router_url else None
        self.weight_sync = weight_sync
        self.routed_experts = routed_experts
        self.tensor_shapes = tensor_shapes
        self._version = -1
        self._healthy = True
        if architecture is not None:
            self._check_architecture(architecture)

    def _check_architecture(self, architecture: str) -> None:
        for server in self.servers:
            served = server.get("/model_info").get("architectures") or []
            if architecture not in served:
                raise SGLangError(
                    f"SGLang server {server.url} serves {served or 'an unknown architecture'}, "
                    f"the trainer's model is {architecture}; weights cannot be synced into it"
                )

    @property
    def weight_version(self) -> int:
        return self._version

    def healthy(self) -> bool:
        return self._healthy and all(server.ping() for server in self.servers)

    def generate(
        self,
        prompts: Sequence[Sequence[int]],
        params: SamplingParams,
        *,
        n: int = 1,
        seed: int = 0,
        return_routed_experts: bool = False,
    ) -> list[list[Sample]]:
        """`n` samples per prompt. Each sample carries a sampling seed of its own, from `seed`
        (SGLang honours it under --enable-deterministic-inference; otherwise the server's own
        --random-seed and its batching decide: docs/sglang.md). Besides
        `params.stop_token_ids`, SGLang stops at the model's own EOS tokens (its config), which
        the trainer's codec counts among its stop tokens anyway."""
        check_generate_request(prompts, n)
        if return_routed_experts and self.routed_experts is None:
            raise ValueError(
                "return_routed_experts: the engine was built without the model's (layers, topk)"
            )
        self._require_healthy()
        if not prompts:
            return []
        seeds = [[_sample_seed(seed, i * n + j) for j in range(n)] for i in range(len(prompts))]
        if self.router is None:  # one request per server: its share of the prompts
            shares = _split(len(prompts), len(self.servers))
            requests = [
                (server, share, [each for i in share for each in seeds[i]])
                for server, share in zip(self.servers, shares, strict=True)
                if share
            ]
        else:
            # The router takes one sampling_params object per request: a request per sample,
            # each with its seed, all at once for the router to spread over the servers.
            requests = [(self.router, [i], [one]) for i, group in enumerate(seeds) for one in group]
        in_flight = min(len(requests), ROUTER_REQUESTS_PER_SERVER * len(self.servers))
        with ThreadPoolExecutor(max_workers=in_flight) as pool:
            futures = [
                pool.submit(
                    self._generate_on,
                    target,
                    [prompts[i] for i in share],
                    params,
                    sample_seeds,
                    return_routed_experts,
                )
                for target, share, sample_seeds in requests
            ]
            results = [future.result() for future in futures]
        if self.router is None:
            return [group for result in results for group in result]
        samples = [result[0][0] for result in results]
        return [samples[i * n : (i + 1) * n] for i in range(len(prompts))]

    def _generate_on(
        self,
        server: ServerConnection,
        prompts: list[Sequence[int]],
        params: SamplingParams,
        sample_seeds: list[int],
        return_routed_experts: bool,
    ) -> list[list[Sample]]:
        """`len(sample_seeds) // len(prompts)` samples of each prompt, sample k of the request
        seeded `sample_seeds[k]` (prompt-major)."""
        n = len(sample_seeds) // len(prompts)
        sampling: dict[str, Any] = {
            "temperature": params.temperature,
            "top_p": params.top_p,
            "max_new_tokens": params.max_new_tokens,
        }
        if params.stop_token_ids:
            sampling["stop_token_ids"] = list(params.stop_token_ids)
        # Each sample an item of its own (prompt-major, as SGLang answers `n`): SGLang gives the
        # n copies of an item asked for `n` samples the item's one seed, and where it honours
        # seeds a group's samples would all be the same.
        items = [sampling | {"sampling_seed": seed} for seed in sample_seeds]
        body = {
            "input_ids": [list(prompt) for prompt in prompts for _ in range(n)],
            # one object for one item: the router (a request per sample) takes no list
            "sampling_params": items[0] if len(items) == 1 else items,
            "return_logprob": True,
            "return_routed_experts": return_routed_experts,
        }
        answer = self._post(server, "/generate", body)
        return parse_samples(
            answer,
            prompts,
            n,
            where=f"SGLang server {server.url}, POST /generate",
            routed_experts=self.routed_experts if return_routed_experts else None,
            weight_version=self._version,
        )

    @contextmanager
    def paused(self) -> Iterator[None]:
        """Every server's generation paused (`/pause_generation`, mode "retract": the requests in
        flight go back to the waiting queue and their prefix is recomputed on continue, under
        the weights then served), continued on exit (`/continue_generation`). Each answer marks
        which tokens which version generated (`meta_info.weight_versions`)."""
        for server in self.servers:
            self._post(server, "/pause_generation", {"mode": "retract"})
        try:
            yield
        finally:
            for server in self.servers:
                self._post(server, "/continue_generation", {})

    def score(self, sequences: Sequence[Sequence[int]]) -> list[Tensor]:
        """Per sequence, `[len - 1]` log-probs of its tokens 1.. under the engine's weights
        (the first server's; all servers hold the same weights)."""
        self._require_healthy()
        body = {
            "input_ids": [list(sequence) for sequence in sequences],
            "sampling_params": {"max_new_tokens": 1, "temperature": 0.0},
            "return_logprob": True,
            "logprob_start_len": 0,
        }
        server = self.servers[0]
        answer = self._post(server, "/generate", body)
        return parse_prompt_logprobs(
            answer, sequences, where=f"SGLang server {server.url}, POST /generate (score)"
        )

    def update_weights(self, buckets: Iterable[WeightBucket], version: int) -> None:
        """Load `buckets` into every server; the engine refuses to generate until it is done."""
        self._healthy = False
        checked = buckets if self.tensor_shapes is None else self._checked(buckets, version)
        self.weight_sync.push(self.servers, checked, str(version))
        for server in self.servers:
            served = server.get("/model_info").get("weight_version")
            if served != str(version):
                raise SGLangError(
                    f"SGLang server {server.url}: weight version {served!r} after the update to "
                    f"version {version}"
                )
        self._version = version
        self._healthy = True

    def _checked(self, buckets: Iterable[WeightBucket], version: int) -> Iterable[WeightBucket]:
        """`buckets`, each checked against `tensor_shapes` before it is handed on; the stream's
        manifest, when it has one, is checked as a whole before anything is sent."""
        servers = ", ".join(server.url for server in self.servers)
        where = f"weight update {version} to SGLang server(s) {servers}"
        manifest = getattr(buckets, "manifest", None)
        if manifest is not None:
            for name, shape, _ in manifest:
                self._check_tensor(name, tuple(shape), where)
            self._check_complete({name for name, _, _ in manifest}, where)
        seen: set[str] = set()
        for bucket in buckets:
            for name, tensor in bucket:
                self._check_tensor(name, tuple(tensor.shape), where)
                seen.add(name)
            yield bucket
        self._check_complete(seen, where)

    def _check_tensor(self, name: str, shape: tuple[int, ...], where: str) -> None:
        if name not in self.tensor_shapes:
            raise SGLangError(f"{where}: weight {name!r}: the served model has no such tensor")
        if shape != self.tensor_shapes[name]:
            raise SGLangError(
                f"{where}: weight {name!r} has shape {list(shape)}, the served model's is "
                f"{list(self.tensor_shapes[name])}"
            )

    def _check_complete(self, names: set[str], where: str) -> None:
        missing = sorted(set(self.tensor_shapes) - names)
        if missing:
            raise SGLangError(
                f"{where}: {len(missing)} tensor(s) of the served model are not in the update, "
                f"e.g. {missing[:3]}"
            )

    def close(self) -> None:
        """Release the sync method's resources (the servers themselves belong to their owner)."""
        self.weight_sync.close(self.servers)

    def _require_healthy(self) -> None:
        if not self._healthy:
            raise SGLangError(
                f"SGLang engine: the weight update to version {self._version + 1} did not "
                "complete; refusing to generate from partly updated weights"
            )

    def _post(self, server: ServerConnection, path: str, body: dict[str, Any]) -> Any:
        try:
            return server.post(path, body)
        except ServerDied:
            if self.managed is None or server not in self.servers:
                raise
        return self._recover(self.servers.index(server), server, path, body)

    def _recover(self, index: int, server: ServerConnection, path: str, body: dict) -> Any:
        """Server `index` died: start it again from the latest weights on disk, if any."""
        managed = self.managed.servers[index]
        code = managed.process.returncode if managed.process is not None else None
        latest = self.weight_sync.latest if isinstance(self.weight_sync, DiskSync) else None
        if latest is None and self._version >= 0:
            raise SGLangError(
                f"SGLang server {server.url} died (exit code {code}; log {managed.log_path}). "
                f"A restarted server would serve the base weights, not version {self._version}; "
                "resume the run from its last checkpoint (megatron-rl train ... --resume), or "
                "use rollout.sglang.weight_sync=disk, from which a server can be restarted"
            )
        self.managed.restart(index, None if latest is None else str(latest))
        if self._version >= 0:
            served = server.get("/model_info").get("weight_version")
            # A server started from a weight directory reports "default": tag it.
            if served != str(self._version):
                server.post("/update_weight_version", {"new_version": str(self._version)})
        return server.post(path, body)


def _sample_seed(seed: int, index: int) -> int:
    """The sampling seed of sample `index` of a request seeded `seed`: distinct for 2**32
    samples per request, and between requests whose seeds differ (SGLang takes int64)."""
    return ((seed << 32) + index) % 2**63


def _split(count: int, parts: int) -> list[list[int]]:
    """`range(count)` in `parts` contiguous shares whose sizes differ by at most one."""
    base, extra = divmod(count, parts)
    shares, start = [], 0
    for part in range(parts):
        size = base + (part < extra)
        shares.append(list(range(start, start + size)))
        start += size
    return shares
