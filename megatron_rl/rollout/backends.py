"""The rollout engine a recipe asks for (`rollout.backend`), built on rank 0."""

from __future__ import annotations

import time
from contextlib import ExitStack
from pathlib import Path

import torch

from megatron_rl.files.hf_checkpoint import HFCheckpoint
from megatron_rl.rollout.config import RolloutConfig
from megatron_rl.rollout.engine import RolloutEngine
from megatron_rl.rollout.local import LocalEngine
from megatron_rl.rollout.local_process import LocalEngineProcess
from megatron_rl.rollout.route_flips import RouteFlips
from megatron_rl.rollout.sglang import (
    RetryPolicy,
    ServerGroup,
    SGLangConfig,
    SGLangEngine,
    make_weight_sync,
)
from megatron_rl.rollout.sglang.api_key import ApiKey, read_key, run_key
from megatron_rl.rollout.sglang.http import IDENTITY_PATH, ROUTER_IDENTITY_PATH, ServerConnection

# How long a server the recipe names gets to answer as the run's.
REACHABLE_WITHIN_S = 10.0


def open_engine(
    rollout: RolloutConfig,
    hf_path: str,
    run_dir: Path,
    stack: ExitStack,
    *,
    routing_shape: tuple[int, int],
    routed_experts: bool,
    seed: int,
) -> RolloutEngine:
    """The engine of `rollout.backend` for the Hugging Face model at `hf_path`. Servers it
    starts and resources it holds are released when `stack` closes.

    Args:
        routing_shape: `(layers, topk)` of the model (to decode SGLang's routed experts).
        routed_experts: the run needs the engine's routing (R3).
        seed: the run's seed; the servers it starts sample from it.
    """
    if rollout.backend == "local":
        # float8_emulated: float32 weights and matmuls, operands rounded to e4m3.
        emulate_fp8 = rollout.engine_dtype == "float8_emulated"
        engine_options = {
            "max_batch_size": rollout.max_batch_size,
            "dtype": torch.float32 if emulate_fp8 else getattr(torch, rollout.engine_dtype),
            "emulate_fp8": emulate_fp8,
            "route_flips": None
            if rollout.flip_routes == 0
            else RouteFlips(rollout.flip_routes, rollout.flip_routes_at, seed),
        }
        if not rollout.local_process:
            return LocalEngine.from_pretrained(hf_path, **engine_options)
        engine = LocalEngineProcess(hf_path, **engine_options)
        stack.callback(engine.close)
        return engine
    config = rollout.sglang
    api_key = run_api_key(config, run_dir)
    urls, managed = list(config.urls), None
    for url in urls:
        check_answers(url, "rollout.sglang.urls", api_key)
    if config.router_url:
        check_answers(
            config.router_url, "rollout.sglang.router_url", api_key, path=ROUTER_IDENTITY_PATH
        )
    if not urls:
        servers = ServerGroup(
            config,
            hf_path,
            run_dir / "sglang",
            api_key=api_key,
            seed=seed,
            routed_experts=routed_experts,
        )
        managed = stack.enter_context(servers)
        urls = managed.urls
    weight_sync = make_weight_sync(
        config.weight_sync,
        tp_sizes=[config.tp_size] * len(urls),
        directory=Path(config.weight_dir) if config.weight_dir else run_dir / "sglang",
        hf_dir=hf_path,
        master_address=config.master_address,
    )
    checkpoint = HFCheckpoint(hf_path, given_as="model.hf_path")
    architectures = checkpoint.config.get("architectures") or [None]
    engine = SGLangEngine(
        urls,
        weight_sync,
        routed_experts=routing_shape,
        router_url=config.router_url,
        managed=managed,
        api_key=api_key,
        architecture=architectures[0],
        retry=RetryPolicy(deadline_s=config.request_deadline_s),
        tensor_shapes={name: checkpoint.shape(name) for name in checkpoint.names()},
    )
    checkpoint.close()
    stack.callback(engine.close)
    return engine


def run_api_key(config: SGLangConfig, run_dir: Path) -> ApiKey:
    """The key of the run's servers: rollout.sglang.api_key_file's, or the run's own (made on
    first use)."""
    if config.api_key_file:
        return read_key(config.api_key_file, given_as="rollout.sglang.api_key_file")
    return run_key(run_dir)


def check_answers(
    url: str,
    name: str,
    api_key: ApiKey,
    *,
    path: str = IDENTITY_PATH,
    within_s: float = REACHABLE_WITHIN_S,
) -> None:
    """Refuse a server the recipe names (`name`) that does not answer as one started with
    `api_key` (GET `path` refused without it, answered with it) within `within_s`, before the
    run sends it anything else."""
    connection = ServerConnection(url, api_key=api_key)
    deadline = time.monotonic() + within_s
    attempts = 0
    while True:
        attempts += 1
        if connection.is_ours(path, timeout_s=min(5.0, within_s)):
            return
        if time.monotonic() + 1.0 > deadline:
            raise ValueError(
                f"{name}: {url} does not answer as a server started with the key of "
                f"{api_key.path} (GET {path}: 401 without the key, 200 with it; "
                f"{attempts} attempts in {within_s:g} s): start that server with that key "
                "(docs/sglang.md), or leave rollout.sglang.urls empty to have the trainer "
                "start its own"
            )
        time.sleep(1.0)
