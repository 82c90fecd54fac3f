"""The recipe's `rollout.sglang` section: the SGLang servers and how weights reach them."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

from megatron_rl.config import ConfigError, check_positive
from megatron_rl.rollout.sglang.http import RetryPolicy

SyncMethod = Literal["disk", "tensor", "distributed"]
SYNC_METHODS: tuple[SyncMethod, ...] = ("disk", "tensor", "distributed")


@dataclass(frozen=True, kw_only=True)
class SGLangConfig:
    """SGLang servers (rollout.backend=sglang); docs/sglang.md."""

    urls: list[str] = field(default_factory=list)
    """Servers someone else started (e.g. a SLURM job step), as http://host:port; empty: the
    trainer starts num_servers servers itself and stops them at the end."""
    router_url: str | None = None
    """An sglang-router in front of the servers, used for generation (weights go to urls)."""
    api_key_file: str = ""
    """A file (mode 0600) holding the API key that the servers of `urls` and `router_url` take;
    empty: the run's own key, RUN_DIR/sglang_api_key, made by the trainer (or the SLURM job)
    and given to the servers it starts (docs/sglang.md, "Who can drive the servers")."""
    num_servers: int = 1
    """Servers the trainer starts (data-parallel rollout)."""
    host: str = "127.0.0.1"
    """Address the started servers listen on."""
    base_port: int = 30000
    """Port of the first started server; server i listens on base_port + i."""
    tp_size: int = 1
    """Tensor-parallel size of each server."""
    ep_size: int = 1
    """Expert-parallel size of each server."""
    mem_fraction_static: float = 0.8
    """SGLang's --mem-fraction-static (weights + KV cache share of device memory)."""
    dtype: str = "auto"
    """SGLang's --dtype (auto takes the checkpoint's)."""
    python: str = ""
    """Interpreter that runs sglang.launch_server; empty: the trainer's own."""
    extra_args: list[str] = field(default_factory=list)
    """More sglang.launch_server arguments, e.g. ["--device", "cpu"]."""
    env: dict[str, str] = field(default_factory=dict)
    """Environment variables added for the started servers only."""
    startup_timeout_s: float = 300.0
    """Longest wait for a started server to answer /health."""
    request_deadline_s: float = RetryPolicy.deadline_s
    """How long a request that fails transiently (503, refused, timeout) is retried."""
    weight_sync: SyncMethod = "tensor"
    """disk (/update_weights_from_disk), tensor (same host, shared memory) or distributed
    (a process group with the servers: NCCL on GPU, gloo on CPU)."""
    weight_dir: str = ""
    """Where weight_sync=disk writes (must be visible to the servers); empty: RUN_DIR/sglang."""
    master_address: str = "127.0.0.1"
    """The trainer's address as the servers reach it (weight_sync=distributed)."""

    def validate(self) -> None:
        check_positive(
            "rollout.sglang",
            self,
            "num_servers",
            "tp_size",
            "ep_size",
            "mem_fraction_static",
            "startup_timeout_s",
            "request_deadline_s",
        )
        for url in self.urls + ([self.router_url] if self.router_url else []):
            if not url.startswith(("http://", "https://")):
                raise ConfigError(f"rollout.sglang.urls: {url!r} is not http://host:port")
