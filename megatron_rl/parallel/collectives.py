"""Answers and errors that every rank of the job must share.

Some things exist once per job, on global rank 0: the rollout engine, the metric sinks, the
choice of a temporary directory. `from_rank0` runs a computation there and hands every rank its
result, or its exception. Other work runs everywhere and may fail on one rank only (a shard that
does not fit, a file one rank cannot read): `raise_together` makes every rank raise the first
failing rank's exception, so that no rank waits in a collective the failing one never reaches.
`any_rank` tells every rank whether some rank said yes, and `host_all_reduce` reduces small host
tensors through whichever device the backend needs. Without a process group, or with one rank,
each simply runs on this process. Only torch is imported here, so that writing a file
(`megatron_rl.files`) does not load megatron-core.
"""

from __future__ import annotations

import pickle
from collections.abc import Callable
from typing import TypeVar

import torch
import torch.distributed as dist

T = TypeVar("T")


def backend() -> str:
    """NCCL when CUDA is available, gloo otherwise."""
    return "nccl" if torch.cuda.is_available() else "gloo"


def host_all_reduce(
    tensor: torch.Tensor,
    op: dist.ReduceOp.RedOpType = dist.ReduceOp.SUM,
    group: dist.ProcessGroup | None = None,
) -> torch.Tensor:
    """The all-reduce of a small host tensor (counters, metric sums), returned on the host.

    It travels through the device the backend takes: NCCL reduces only CUDA tensors, gloo host
    ones.
    """
    device = torch.device("cuda", torch.cuda.current_device()) if backend() == "nccl" else None
    on_device = tensor.to(device) if device is not None else tensor.clone()
    dist.all_reduce(on_device, op=op, group=group)
    return on_device.cpu()


def _world_size() -> int:
    return dist.get_world_size() if dist.is_initialized() else 1


def _shareable(error: Exception) -> Exception:
    """`error` itself when it can travel to the other ranks (pickled), else its text."""
    try:
        pickle.dumps(error)
    except Exception:
        return RuntimeError(f"{type(error).__name__}: {error}")
    return error


def from_rank0(compute: Callable[[], T]) -> T:
    """`compute()` run on global rank 0 only, its result returned on every rank (a collective:
    every rank calls it). An exception on rank 0 is raised on every rank."""
    if _world_size() == 1:
        return compute()
    outcome: list = [None, None]
    if dist.get_rank() == 0:
        try:
            outcome[0] = compute()
        except Exception as error:
            outcome[1] = _shareable(error)
    dist.broadcast_object_list(outcome, src=0)
    if outcome[1] is not None:
        raise outcome[1]
    return outcome[0]


def raise_together(compute: Callable[[], T]) -> T:
    """`compute()` on every rank; if it raised on any rank, every rank raises the exception of
    the lowest such rank (a collective)."""
    if _world_size() == 1:
        return compute()
    result, error = None, None
    try:
        result = compute()
    except Exception as caught:
        error = caught
    errors: list[Exception | None] = [None] * dist.get_world_size()
    dist.all_gather_object(errors, None if error is None else _shareable(error))
    failed = [rank for rank, e in enumerate(errors) if e is not None]
    if failed:
        raise error if failed[0] == dist.get_rank() else errors[failed[0]]
    return result


def any_rank(flag: bool) -> bool:
    """True on every rank when `flag` is true on some rank (a collective)."""
    if _world_size() == 1:
        return flag
    return bool(host_all_reduce(torch.tensor([int(flag)]), op=dist.ReduceOp.MAX))


def union_over_ranks(names: list[str], group: dist.ProcessGroup) -> list[str]:
    """The sorted union of every rank's `names` in `group` (ranks that hold different sets of
    metric keys agree on one before reducing their values)."""
    gathered: list[list[str] | None] = [None] * dist.get_world_size(group)
    dist.all_gather_object(gathered, names, group=group)
    return sorted({name for part in gathered for name in part or []})
