"""The SGLang rollout backend: HTTP client, server processes, weight sync (see docs/sglang.md)."""

from megatron_rl.rollout.sglang.config import SYNC_METHODS, SGLangConfig, SyncMethod
from megatron_rl.rollout.sglang.engine import SGLangEngine
from megatron_rl.rollout.sglang.http import RetryPolicy, ServerConnection, ServerDied, SGLangError
from megatron_rl.rollout.sglang.servers import ServerGroup
from megatron_rl.rollout.sglang.weight_sync import make_weight_sync

__all__ = [
    "SYNC_METHODS",
    "RetryPolicy",
    "SGLangConfig",
    "SGLangEngine",
    "SGLangError",
    "ServerConnection",
    "ServerDied",
    "ServerGroup",
    "SyncMethod",
    "make_weight_sync",
]
