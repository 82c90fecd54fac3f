"""Three ways to put the trainer's weights into SGLang servers.

Each method takes the Hugging Face-named buckets of `Policy.weight_stream()` (on the trainer's
rank 0) and loads them into every server, inside SGLang's weight-update session
(`/begin_weight_update` ... `/end_weight_update`), tagging the servers with the weight version.

- `disk`: the buckets become safetensors shards (+ index, + config.json) in a fresh directory,
  which every server loads with `/update_weights_from_disk`. Works across hosts with a shared
  file system; also the fallback a restarted server starts from.
- `tensor`: each bucket goes to `/update_weights_from_tensor` as torch's shared-memory handles
  (the trainer and servers share the host); a CPU tensor is shared through a file in /dev/shm,
  so the trainer switches torch.multiprocessing to the `file_system` sharing strategy.
- `distributed`: the trainer's rank 0 and every server's ranks form one process group
  (`/init_weights_update_group`, NCCL on GPU, gloo on CPU) and each bucket is broadcast from
  rank 0 while the servers receive it (`/update_weights_from_distributed`).
"""

from __future__ import annotations

import base64
import contextlib
import io
import json
import secrets
import shutil
import socket
import threading
from collections.abc import Callable, Iterable, Sequence
from concurrent.futures import ThreadPoolExecutor
from datetime import timedelta
from multiprocessing.reduction import ForkingPickler
from pathlib import Path
from typing import Any, Protocol

import torch
import torch.distributed as dist
import torch.multiprocessing  # registers tensor reductions with ForkingPickler
from safetensors.torch import save_file
from torch import Tensor

from megatron_rl.files.atomic import staged_directory
from megatron_rl.rollout.engine import WeightBucket
from megatron_rl.rollout.sglang.config import SYNC_METHODS, SyncMethod
from megatron_rl.rollout.sglang.http import ServerConnection, SGLangError
from megatron_rl.rollout.sglang.network import listening_socket


def _checked(answer: Any, where: str) -> Any:
    """SGLang's weight routes answer {"success": bool, "message": str}."""
    if isinstance(answer, dict) and answer.get("success") is False:
        raise SGLangError(f"{where}: {answer.get('message')}")
    return answer


def _each(servers: Sequence[ServerConnection], call: Callable[[ServerConnection], Any]) -> list:
    """`call` on every server at once; the first error is raised after all have finished."""
    with ThreadPoolExecutor(max_workers=len(servers)) as pool:
        futures = [pool.submit(call, server) for server in servers]
        return [future.result() for future in futures]


class WeightSync(Protocol):
    """One way of loading weights into servers (see the module docstring)."""

    def push(
        self, servers: Sequence[ServerConnection], buckets: Iterable[WeightBucket], version: str
    ) -> None:
        """Load every tensor of `buckets` into every server."""
        ...

    def close(self, servers: Sequence[ServerConnection]) -> None:
        """Release what the method holds (files, process groups)."""
        ...


def weight_update_session(servers: Sequence[ServerConnection], load: Callable[[], None]) -> None:
    """Run `load` between `/begin_weight_update` and `/end_weight_update` on every server. A
    failed load still closes the session (so that a later update can open one); the servers
    then hold partly updated weights, which the engine refuses to generate from."""
    _each(servers, lambda s: _checked(s.post("/begin_weight_update", {}), f"{s.url} begin"))
    try:
        load()
    except BaseException:
        with contextlib.suppress(SGLangError):
            _each(servers, lambda s: s.post("/end_weight_update", {}))
        raise
    _each(servers, lambda s: _checked(s.post("/end_weight_update", {}), f"{s.url} end"))


class DiskSync:
    """Write the weights to `directory/weights_v<version>`, then `/update_weights_from_disk`.

    Args:
        directory: where weight directories are written (shared with the servers' hosts).
        hf_dir: the Hugging Face checkpoint the servers were started from; its config.json (and
            generation config) is copied beside the weights, as SGLang's loader expects.
    """

    def __init__(self, directory: str | Path, hf_dir: str | Path) -> None:
        self.directory, self.hf_dir = Path(directory), Path(hf_dir)
        self.latest: Path | None = None

    def push(
        self, servers: Sequence[ServerConnection], buckets: Iterable[WeightBucket], version: str
    ) -> None:
        target = self.directory / f"weights_v{version}"
        self.directory.mkdir(parents=True, exist_ok=True)
        with staged_directory(target, overwrite=True) as staging:
            total, index = 0, {}
            for number, bucket in enumerate(buckets):
                shard = f"model-{number:05d}.safetensors"
                tensors = {name: tensor.detach().cpu().contiguous() for name, tensor in bucket}
                save_file(tensors, str(staging / shard))
                index |= dict.fromkeys(tensors, shard)
                total += sum(t.numel() * t.element_size() for t in tensors.values())
            (staging / "model.safetensors.index.json").write_text(
                json.dumps({"metadata": {"total_size": total}, "weight_map": index}, indent=1)
            )
            for name in ("config.json", "generation_config.json"):
                if (self.hf_dir / name).is_file():
                    shutil.copy2(self.hf_dir / name, staging / name)

        def load() -> None:
            body = {"model_path": str(target.resolve()), "weight_version": version}
            _each(
                servers,
                lambda s: _checked(
                    s.post("/update_weights_from_disk", body), f"{s.url} update_weights_from_disk"
                ),
            )

        weight_update_session(servers, load)
        previous, self.latest = self.latest, target
        if previous is not None and previous != target:
            shutil.rmtree(previous, ignore_errors=True)

    def close(self, servers: Sequence[ServerConnection]) -> None:
        if self.latest is not None:
            shutil.rmtree(self.latest, ignore_errors=True)
            self.latest = None


def serialize_named_tensors(named: list[tuple[str, Tensor]]) -> str:
    """`named` as `/update_weights_from_tensor` takes it: torch's multiprocessing pickle (tensor
    storage travels as shared-memory handles, not bytes), base64-encoded."""
    buffer = io.BytesIO()
    ForkingPickler(buffer).dump(named)
    return base64.b64encode(buffer.getvalue()).decode("ascii")


class TensorSync:
    """Each bucket through `/update_weights_from_tensor` (servers on the trainer's host).

    Args:
        tp_sizes: each server's tensor-parallel size (one serialized copy per TP rank).
    """

    def __init__(self, tp_sizes: Sequence[int]) -> None:
        self.tp_sizes = list(tp_sizes)
        # Handles to CPU tensors must be files other processes can open by name.
        torch.multiprocessing.set_sharing_strategy("file_system")

    def push(
        self, servers: Sequence[ServerConnection], buckets: Iterable[WeightBucket], version: str
    ) -> None:
        def load() -> None:
            for bucket in buckets:
                # Copies: the server reads them after this call returns to the optimizer.
                named = [(name, tensor.detach().clone()) for name, tensor in bucket]
                payload = serialize_named_tensors(named)

                def send(server: ServerConnection, tp_size: int, payload: str = payload) -> Any:
                    body = {
                        "serialized_named_tensors": [payload] * tp_size,
                        "flush_cache": True,
                        "weight_version": version,
                    }
                    where = f"{server.url} update_weights_from_tensor"
                    return _checked(server.post("/update_weights_from_tensor", body), where)

                _each(list(zip(servers, self.tp_sizes, strict=True)), lambda pair: send(*pair))

        weight_update_session(servers, load)

    def close(self, servers: Sequence[ServerConnection]) -> None:
        pass


def open_weight_group(
    backend: str,
    listener: socket.socket,
    world_size: int,
    group_name: str,
    timeout_s: float,
) -> tuple[dist.ProcessGroup, dist.TCPStore]:
    """The trainer's end (rank 0) of the weight-update group SGLang's servers join.

    A group apart from the training job's default group, built the way SGLang builds its end
    (`init_custom_process_group` in sglang/srt/utils/common.py): a TCP store, prefixed with the
    group's name, then torch's process-group helper. Both ends must lay out the store's keys
    alike, hence torch's private helper rather than a public API. The store serves on
    `listener` (a listening socket, handed over: the store closes it), so it listens where the
    caller bound it, at the port the servers were told. Returns the group and its store, which
    must live as long as the group.
    """
    from torch.distributed.distributed_c10d import (
        Backend,
        PrefixStore,
        _new_process_group_helper,
        _world,
    )

    timeout = timedelta(seconds=timeout_s)
    host, port = listener.getsockname()[:2]
    store = dist.TCPStore(
        host, port, world_size, is_master=True, timeout=timeout, master_listen_fd=listener.detach()
    )
    group, _ = _new_process_group_helper(
        world_size,
        0,
        [],
        Backend(backend),
        PrefixStore(group_name, store),
        group_name=group_name,
        backend_options=None,
        timeout=timeout,
    )
    _world.pg_group_ranks[group] = {rank: rank for rank in range(world_size)}
    return group, store


class DistributedSync:
    """Broadcast each bucket from the trainer's rank 0 to every server's ranks.

    torch's stores have no authentication: the group's store listens only on the address the
    servers reach (`master_address`), at a port the system picks, under a group name drawn at
    random per sync (docs/slurm.md, "Trust model").

    Args:
        tp_sizes: each server's tensor-parallel size (its number of ranks in the group).
        master_address: the trainer host's address, as the servers reach it.
        backend: "nccl" (GPU) or "gloo" (CPU).
        timeout_s: how long the group's set-up and each collective may take.
    """

    def __init__(
        self,
        tp_sizes: Sequence[int],
        *,
        master_address: str = "127.0.0.1",
        backend: str | None = None,
        timeout_s: float = 300.0,
    ) -> None:
        self.tp_sizes = list(tp_sizes)
        self.master_address = master_address
        self.backend = backend or ("nccl" if torch.cuda.is_available() else "gloo")
        self.timeout_s = timeout_s
        self.group_name = f"megatron_rl_weights_{secrets.token_hex(8)}"
        self.group: dist.ProcessGroup | None = None
        self._store: dist.TCPStore | None = None

    def _open(self, servers: Sequence[ServerConnection]) -> None:
        listener = listening_socket(self.master_address, given_as="rollout.sglang.master_address")
        port = listener.getsockname()[1]
        world_size = 1 + sum(self.tp_sizes)
        offsets = [1 + sum(self.tp_sizes[:index]) for index in range(len(servers))]
        errors: list[BaseException] = []

        def join(server: ServerConnection, offset: int) -> None:
            body = {
                "master_address": self.master_address,
                "master_port": port,
                "rank_offset": offset,
                "world_size": world_size,
                "group_name": self.group_name,
                "backend": self.backend,
            }
            try:
                _checked(
                    server.post("/init_weights_update_group", body),
                    f"{server.url} init_weights_update_group",
                )
            except BaseException as error:  # reported after the trainer's side gives up
                errors.append(error)

        joins = [
            threading.Thread(target=join, args=(server, offset), daemon=True)
            for server, offset in zip(servers, offsets, strict=True)
        ]
        for thread in joins:
            thread.start()
        opened: list = []

        def open_group() -> None:
            try:
                opened.append(
                    open_weight_group(
                        self.backend,
                        listener,
                        world_size,
                        self.group_name,
                        self.timeout_s,
                    )
                )
            except BaseException as error:
                opened.append(error)

        # The trainer's end waits for every server in a thread of its own, so that a server
        # that fails to join stops the wait at once instead of after the timeout.
        opener = threading.Thread(target=open_group, daemon=True)
        opener.start()
        while opener.is_alive() and not errors:
            opener.join(timeout=0.1)
        if errors:
            raise errors[0]
        if isinstance(opened[0], BaseException):
            raise SGLangError(f"weight-update group at port {port}: {opened[0]}") from opened[0]
        self.group, self._store = opened[0]
        for thread in joins:
            thread.join()
        if errors:
            raise errors[0]

    def push(
        self, servers: Sequence[ServerConnection], buckets: Iterable[WeightBucket], version: str
    ) -> None:
        if self.group is None:
            self._open(servers)
        device = "cuda" if self.backend == "nccl" else "cpu"

        def load() -> None:
            for bucket in buckets:
                tensors = [tensor.detach().to(device).contiguous() for _, tensor in bucket]
                body = {
                    "names": [name for name, _ in bucket],
                    "dtypes": [str(t.dtype).removeprefix("torch.") for t in tensors],
                    "shapes": [list(t.shape) for t in tensors],
                    "group_name": self.group_name,
                    "flush_cache": True,
                    "weight_version": version,
                }
                with ThreadPoolExecutor(max_workers=len(servers)) as pool:
                    answers = [
                        pool.submit(server.post, "/update_weights_from_distributed", body)
                        for server in servers
                    ]
                    # The servers post their receives in the order of `names`.
                    for tensor in tensors:
                        dist.broadcast(tensor, src=0, group=self.group)
                    for server, answer in zip(servers, answers, strict=True):
                        _checked(answer.result(), f"{server.url} update_weights_from_distributed")

        weight_update_session(servers, load)

    def close(self, servers: Sequence[ServerConnection]) -> None:
        if self.group is None:
            return
        for server in servers:
            # A server that is gone has no group left to destroy.
            with contextlib.suppress(SGLangError):
                server.post("/destroy_weights_update_group", {"group_name": self.group_name})
        dist.destroy_process_group(self.group)
        self.group, self._store = None, None


def make_weight_sync(
    method: SyncMethod,
    *,
    tp_sizes: Sequence[int],
    directory: str | Path,
    hf_dir: str | Path,
    master_address: str = "127.0.0.1",
) -> WeightSync:
    """The sync method named `method` (one of SYNC_METHODS)."""
    if method == "disk":
        return DiskSync(directory, hf_dir)
    if method == "tensor":
        return TensorSync(tp_sizes)
    if method == "distributed":
        return DistributedSync(tp_sizes, master_address=master_address)
    raise ValueError(f"weight sync method {method!r}: expected one of {', '.join(SYNC_METHODS)}")
