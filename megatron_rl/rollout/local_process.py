"""The in-process engine's model in a child process of its own (`rollout.local_process`).

The same LocalEngine, spawned into its own interpreter: its generation then shares no GIL with
the trainer's thread (asynchronous rollouts run it beside the training). Requests and answers
go over two pipes, one for the generation (the rollout thread's) and one for everything else
(weight updates, pauses, scores: the trainer's), each served by a thread of the child, so that
a weight update can pause a generation in flight as it does in one process. Tensors travel in
shared memory (torch.multiprocessing's pickling).

The child dies with its parent (Linux's parent-death signal) and leaves the stop signals to it.
"""

from __future__ import annotations

import os
import signal
import threading
from collections.abc import Iterable, Iterator, Sequence
from contextlib import ExitStack, contextmanager, suppress
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any

import torch
import torch.multiprocessing
import transformers

from megatron_rl.process.children import die_with_parent
from megatron_rl.rollout.engine import Sample, SamplingParams, WeightBucket
from megatron_rl.rollout.local import LocalEngine
from megatron_rl.rollout.route_flips import RouteFlips

_END_OF_UPDATE = "end of update"
_CLOSE_WITHIN_S = 30.0


class LocalEngineProcess:
    """A LocalEngine (`LocalEngine.from_pretrained(hf_dir, ...)`) in a spawned child process;
    the RolloutEngine and PausableEngine interfaces, answered by the child."""

    def __init__(
        self,
        hf_dir: str | Path,
        *,
        max_batch_size: int = 256,
        dtype: torch.dtype = torch.float32,
        emulate_fp8: bool = False,
        route_flips: RouteFlips | None = None,
    ) -> None:
        context = torch.multiprocessing.get_context("spawn")
        self._generation, generation_end = context.Pipe()
        self._control, control_end = context.Pipe()
        engine_args = (str(hf_dir), max_batch_size, dtype, emulate_fp8, route_flips)
        self._process = context.Process(
            target=_serve,
            args=(os.getpid(), generation_end, control_end, *engine_args),
            name="local-engine",
            daemon=True,
        )
        self._process.start()
        generation_end.close()
        control_end.close()
        self._version = -1
        self._healthy = True
        self._ask(self._control, "ready")  # the model is loaded

    @property
    def pid(self) -> int:
        """The child's process id."""
        return self._process.pid

    @property
    def weight_version(self) -> int:
        return self._version

    def healthy(self) -> bool:
        return self._healthy and self._process.is_alive()

    def generate(
        self,
        prompts: Sequence[Sequence[int]],
        params: SamplingParams,
        *,
        n: int = 1,
        seed: int = 0,
        return_routed_experts: bool = False,
    ) -> list[list[Sample]]:
        kwargs = {"n": n, "seed": seed, "return_routed_experts": return_routed_experts}
        args = ([list(p) for p in prompts], params)
        return self._ask(self._generation, "generate", args, kwargs)

    def score(self, sequences: Sequence[Sequence[int]]) -> list[torch.Tensor]:
        return self._ask(self._control, "score", ([list(s) for s in sequences],))

    @contextmanager
    def paused(self) -> Iterator[None]:
        """The child's generation held between two of its steps until the block ends."""
        self._ask(self._control, "pause")
        try:
            yield
        finally:
            self._ask(self._control, "resume")

    def update_weights(self, buckets: Iterable[WeightBucket], version: int) -> None:
        """Send every bucket to the child, which copies it in (LocalEngine.update_weights)."""
        self._healthy = False
        self._control.send(("update_weights", (version,), {}))
        for bucket in buckets:
            # Copies: sending moves a tensor's storage to shared memory, and these may be views
            # of the trainer's parameters.
            self._control.send([(name, tensor.detach().clone()) for name, tensor in bucket])
        self._control.send(_END_OF_UPDATE)
        self._answer(self._control)
        self._version = version
        self._healthy = True

    def close(self) -> None:
        """Stop the child: asked to, then by its PID if it has not stopped within 30 s."""
        if self._process.is_alive():
            for connection in (self._generation, self._control):
                with suppress(OSError):  # a pipe the child closed
                    connection.send(None)
            self._process.join(_CLOSE_WITHIN_S)
            if self._process.is_alive():
                self._process.kill()
                self._process.join()
        self._generation.close()
        self._control.close()

    def _ask(
        self, connection: Connection, method: str, args: tuple = (), kwargs: dict | None = None
    ) -> Any:
        connection.send((method, args, kwargs or {}))
        return self._answer(connection)

    def _answer(self, connection: Connection) -> Any:
        try:
            status, value = connection.recv()
        except (EOFError, ConnectionResetError):
            self._process.join(1.0)
            raise RuntimeError(
                f"local engine process {self._process.pid} died (exit code "
                f"{self._process.exitcode}); its samples and weights are lost"
            ) from None
        if status == "error":
            raise value
        return value


def _serve(
    parent_pid: int,
    generation: Connection,
    control: Connection,
    hf_dir: str,
    max_batch_size: int,
    dtype: torch.dtype,
    emulate_fp8: bool,
    route_flips: RouteFlips | None,
) -> None:
    """The child: the engine, the generation pipe served on a thread, the control pipe here."""
    die_with_parent(parent_pid)
    for signum in (signal.SIGINT, signal.SIGTERM):  # the parent stops the run, and this child
        signal.signal(signum, signal.SIG_IGN)
    # No loading bar: its monitor thread (and tqdm's multiprocessing lock) would outlive the
    # serving threads.
    transformers.utils.logging.disable_progress_bar()
    engine = LocalEngine.from_pretrained(
        hf_dir,
        max_batch_size=max_batch_size,
        dtype=dtype,
        emulate_fp8=emulate_fp8,
        route_flips=route_flips,
    )
    generating = threading.Thread(target=_answer_requests, args=(engine, generation))
    generating.start()
    _answer_requests(engine, control)
    generating.join()


def _answer_requests(engine: LocalEngine, connection: Connection) -> None:
    """Answer the requests of `connection` in turn until it closes or sends None."""
    pauses = ExitStack()
    while True:
        try:
            request = connection.recv()
        except EOFError:
            return
        if request is None:
            return
        method, args, kwargs = request
        try:
            answer = ("ok", _call(engine, connection, pauses, method, args, kwargs))
        except Exception as error:  # sent to the caller, which raises it
            answer = ("error", error)
        connection.send(answer)


def _call(
    engine: LocalEngine,
    connection: Connection,
    pauses: ExitStack,
    method: str,
    args: tuple,
    kwargs: dict,
) -> Any:
    if method == "ready":
        return None
    if method == "generate":
        return engine.generate(*args, **kwargs)
    if method == "score":
        return engine.score(*args)
    if method == "pause":
        pauses.enter_context(engine.paused())
        return None
    if method == "resume":
        pauses.close()
        return None
    if method == "update_weights":
        (version,) = args
        buckets = _received_buckets(connection)
        try:
            engine.update_weights(buckets, version)
        finally:
            for _ in buckets:  # what an update that failed did not read, up to its end
                pass
        return None
    raise ValueError(f"local engine process: no request {method!r}")


def _received_buckets(connection: Connection) -> Iterator[WeightBucket]:
    """The buckets of one weight update, as they arrive, up to its end mark."""
    while (bucket := connection.recv()) != _END_OF_UPDATE:
        yield bucket
