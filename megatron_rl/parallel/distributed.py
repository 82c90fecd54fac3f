"""Start and stop torch.distributed and megatron-core's process groups for a ParallelDims.

The launcher is read from the environment once, into an explicit `LaunchEnv`: torchrun sets
RANK / WORLD_SIZE / LOCAL_RANK / MASTER_ADDR / MASTER_PORT; under `srun` SLURM sets SLURM_PROCID /
SLURM_NTASKS / SLURM_LOCALID, and the rendezvous address comes from MASTER_ADDR / MASTER_PORT (the
sbatch script exports them) or, on one node, defaults to localhost. The backend is NCCL when CUDA
is available and gloo otherwise.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist
from megatron.core import parallel_state
from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed

from megatron_rl.parallel import cpu_compat
from megatron_rl.parallel.collectives import backend
from megatron_rl.parallel.dims import ParallelDims

DEFAULT_PORT = 29500


@dataclass(frozen=True, kw_only=True)
class LaunchEnv:
    """Where this process sits in the job, as its launcher said."""

    rank: int
    world_size: int
    local_rank: int
    master_addr: str
    master_port: int
    launcher: str  # "torchrun", "slurm" or "single"

    @classmethod
    def from_environ(cls, environ: Mapping[str, str] | None = None) -> LaunchEnv:
        env = os.environ if environ is None else environ

        def number(name: str) -> int:
            try:
                return int(env[name])
            except ValueError:
                raise ValueError(f"{name}: expected an int, got {env[name]!r}") from None

        master_addr = env.get("MASTER_ADDR", "127.0.0.1")
        master_port = number("MASTER_PORT") if "MASTER_PORT" in env else DEFAULT_PORT
        if "RANK" in env and "WORLD_SIZE" in env:
            return cls(
                rank=number("RANK"),
                world_size=number("WORLD_SIZE"),
                local_rank=number("LOCAL_RANK") if "LOCAL_RANK" in env else 0,
                master_addr=master_addr,
                master_port=master_port,
                launcher="torchrun",
            )
        if "SLURM_PROCID" in env and "SLURM_NTASKS" in env:
            world_size = number("SLURM_NTASKS")
            nodes = int(env.get("SLURM_NNODES", "1"))
            if world_size > 1 and "MASTER_ADDR" not in env and nodes > 1:
                raise ValueError(
                    "MASTER_ADDR: a multi-node SLURM job must export MASTER_ADDR (the first "
                    "node's address) and MASTER_PORT before srun"
                )
            return cls(
                rank=number("SLURM_PROCID"),
                world_size=world_size,
                local_rank=number("SLURM_LOCALID") if "SLURM_LOCALID" in env else 0,
                master_addr=master_addr,
                master_port=master_port,
                launcher="slurm",
            )
        return cls(
            rank=0,
            world_size=1,
            local_rank=0,
            master_addr=master_addr,
            master_port=master_port,
            launcher="single",
        )


# How long a collective waits for every rank of its group before failing (run.collective_timeout_s).
DEFAULT_COLLECTIVE_TIMEOUT = timedelta(minutes=10)


def init_distributed(
    dims: ParallelDims,
    launch: LaunchEnv,
    *,
    seed: int = 1234,
    timeout: timedelta = DEFAULT_COLLECTIVE_TIMEOUT,
) -> None:
    """Create the default process group and megatron-core's groups for `dims`; seed the RNGs.
    Every group's collectives fail after `timeout` without all of its ranks (a dead node, a cut
    network), the default group's and megatron-core's alike.

    The layout is checked against the launch before anything is created.
    """
    if dims.world_size != launch.world_size:
        raise ValueError(
            f"world_size: the layout is for {dims.world_size} ranks but the launcher "
            f"({launch.launcher}) started {launch.world_size}"
        )
    cpu_compat.apply()
    if torch.cuda.is_available():
        torch.cuda.set_device(launch.local_rank)
    if not dist.is_initialized():
        # One process needs no rendezvous: an in-memory store takes no port and leaves no file.
        rendezvous = (
            {"store": dist.HashStore()}
            if launch.launcher == "single"
            else {"init_method": f"tcp://{launch.master_addr}:{launch.master_port}"}
        )
        dist.init_process_group(
            backend=backend(),
            rank=launch.rank,
            world_size=launch.world_size,
            timeout=timeout,
            **rendezvous,
        )
    set_model_parallel(dims, seed=seed, timeout=timeout)


def set_model_parallel(
    dims: ParallelDims, *, seed: int = 1234, timeout: timedelta = DEFAULT_COLLECTIVE_TIMEOUT
) -> None:
    """(Re)create megatron-core's model-parallel groups for `dims` in the running world, their
    collectives failing after `timeout` (megatron-core's own default is 30 minutes)."""
    if parallel_state.model_parallel_is_initialized():
        parallel_state.destroy_model_parallel()
    parallel_state.initialize_model_parallel(
        tensor_model_parallel_size=dims.tp,
        pipeline_model_parallel_size=dims.pp,
        context_parallel_size=dims.cp,
        expert_model_parallel_size=dims.ep,
        expert_tensor_parallel_size=dims.etp,
        # a float works: megatron-core makes it timedelta(minutes=...)
        distributed_timeout_minutes=timeout.total_seconds() / 60,
    )
    torch.manual_seed(seed)
    model_parallel_cuda_manual_seed(seed)


def shutdown_distributed() -> None:
    """Destroy megatron-core's groups and the default process group, if they exist."""
    if parallel_state.model_parallel_is_initialized():
        parallel_state.destroy_model_parallel()
    if dist.is_initialized():
        dist.destroy_process_group()
