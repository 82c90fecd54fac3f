"""The rollout engine a recipe asks for (`rollout.backend`), built on rank 0."""

from __future__ import annotations

from contextlib import ExitStack
from pathlib import Path

from megatron_rl.files.hf_checkpoint import HFCheckpoint
from megatron_rl.rollout.config import RolloutConfig
from megatron_rl.rollout.engine import RolloutEngine
from megatron_rl.rollout.local import LocalEngine
from megatron_rl.rollout.sglang import RetryPolicy, ServerGroup, SGLangEngine, make_weight_sync


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
        servers = ServerGroup(config, hf_path, run_dir / "sglang", routed_experts=routed_experts)
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
        architecture=architectures[0],
        retry=RetryPolicy(deadline_s=config.request_deadline_s),
        tensor_shapes={name: checkpoint.shape(name) for name in checkpoint.names()},
    )
    checkpoint.close()
    stack.callback(engine.close)
    return engine
