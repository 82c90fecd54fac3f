"""The rollout engine a recipe asks for (`rollout.backend`), built on rank 0."""

from __future__ import annotations

import sys
from contextlib import ExitStack
from pathlib import Path

from megatron_rl.checkpoint.hf_files import HFCheckpoint
from megatron_rl.config import RolloutConfig, SGLangConfig
from megatron_rl.rollout.engine import RolloutEngine
from megatron_rl.rollout.local import LocalEngine
from megatron_rl.rollout.sglang import (
    LaunchSettings,
    RetryPolicy,
    ServerGroup,
    SGLangEngine,
    make_weight_sync,
)


def launch_settings(
    config: SGLangConfig, hf_path: str, *, routed_experts: bool = False
) -> LaunchSettings:
    """How to start the servers of `config` (rollout.sglang) on the model at `hf_path`."""
    return LaunchSettings(
        model_path=hf_path,
        num_servers=config.num_servers,
        host=config.host,
        base_port=config.base_port,
        tp_size=config.tp_size,
        ep_size=config.ep_size,
        mem_fraction_static=config.mem_fraction_static,
        dtype=config.dtype,
        routed_experts=routed_experts,
        python=config.python or sys.executable,
        extra_args=tuple(config.extra_args),
        env=dict(config.env),
        startup_timeout_s=config.startup_timeout_s,
        request_deadline_s=config.request_deadline_s,
    )


def open_engine(
    rollout: RolloutConfig,
    hf_path: str,
    run_dir: Path,
    stack: ExitStack,
    *,
    routing_shape: tuple[int, int],
    routed_experts: bool,
) -> RolloutEngine:
    """The engine of `rollout.backend` for the Hugging Face model at `hf_path`. Servers it
    starts and resources it holds are released when `stack` closes.

    Args:
        routing_shape: `(layers, topk)` of the model (to decode SGLang's routed experts).
        routed_experts: the run needs the engine's routing (R3).
    """
    if rollout.backend == "local":
        return LocalEngine.from_pretrained(hf_path, max_batch_size=rollout.max_batch_size)
    config = rollout.sglang
    urls, managed = list(config.urls), None
    if not urls:
        settings = launch_settings(config, hf_path, routed_experts=routed_experts)
        managed = stack.enter_context(ServerGroup(settings, run_dir / "sglang"))
        urls = managed.urls
    weight_sync = make_weight_sync(
        config.weight_sync,
        tp_sizes=[config.tp_size] * len(urls),
        directory=Path(config.weight_dir) if config.weight_dir else run_dir / "sglang",
        hf_dir=hf_path,
        master_address=config.master_address,
    )
    checkpoint = HFCheckpoint(hf_path)
    architectures = checkpoint.config.get("architectures") or [None]
    engine = SGLangEngine(
        urls,
        weight_sync,
        routed_experts=routing_shape,
        router_url=config.router_url,
        managed=managed,
        architecture=architectures[0],
        retry=RetryPolicy(deadline_s=config.request_deadline_s),
        tensor_shapes={name: checkpoint.shape(name) for name in checkpoint.names()},
    )
    checkpoint.close()
    stack.callback(engine.close)
    return engine
