"""Where the trainer's per-step metrics go (the recipe's `metrics` section): a JSONL file, a
console progress bar, Weights & Biases.

The trainer builds one flat dict of floats per step (`reward/mean`, `loss/policy`,
`time/rollout_s`, ...) and hands it to a `MetricsLogger`, which fans it out to every sink. Each
sink only needs `log` and `close`, so adding a backend never touches the training loop.

This is the only module that imports `wandb`, and only inside `WandbSink`: wandb is an optional
extra, and importing it costs time and patches the console, which CPU tests and runs that never
track anything should not pay for.
"""

from __future__ import annotations

import json
import math
import os
import time
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from types import TracebackType
from typing import IO, Any, Literal, Protocol

from tqdm import tqdm

from megatron_rl.files.atomic import write_bytes_atomic
from megatron_rl.process.redaction import redacted_config

WandbMode = Literal["auto", "online", "offline", "disabled"]


@dataclass(frozen=True, kw_only=True)
class MetricsConfig:
    """Where per-step metrics go."""

    jsonl: bool = True
    """Append every step's metrics to RUN_DIR/metrics.jsonl."""
    console: bool = True
    """Progress bar with ETA and the headline metrics."""
    wandb: WandbMode = "disabled"
    """wandb logging: auto (online with WANDB_API_KEY, else offline), online, offline, disabled."""
    wandb_project: str = "megatron-rl"
    """wandb project."""
    routing_probe: bool = False
    """Measure what each update does to the routing (the drift harness turns it on): the
    update's last micro-batch is forwarded again after the optimizer step, routing freely and
    with its old routing replayed, for `routing/update_*`, `routing/margin_*` and
    `routing/log_ratio_*_share`; the routers' change per step; and the engine returns its
    routing for `routing/engine_mismatch_*` under every arm (docs/drift.md). Costs two
    forwards of one micro-batch per update."""


class MetricsSink(Protocol):
    """A destination for one flat dict of scalar metrics per training step."""

    def log(self, step: int, metrics: Mapping[str, float]) -> None:
        """Record the metrics of `step`."""
        ...

    def close(self) -> None:
        """Flush and release whatever the sink holds (files, progress bars, runs)."""
        ...


def _json_value(value: float) -> float | int | None:
    """A JSON-safe scalar: NaN and ±inf become None, since strict JSON has no token for them."""
    if isinstance(value, int):
        return value
    # float() also accepts numpy and 0-d torch scalars, which json.dumps would reject.
    number = float(value)
    return number if math.isfinite(number) else None


def _parse_record(path: Path, line_number: int, line: bytes) -> dict[str, Any]:
    """Decode one JSONL line into a record with an integer `step`, or raise ValueError."""
    try:
        record = json.loads(line.decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as error:
        raise ValueError(f"{path}:{line_number}: not a valid JSON line: {error}") from error
    if not isinstance(record, dict) or not isinstance(record.get("step"), int):
        raise ValueError(f"{path}:{line_number}: expected a JSON object with an integer 'step'")
    return record


def _truncate_jsonl(path: Path, resume_step: int) -> None:
    """Rewrite `path` atomically, keeping only the records with `step <= resume_step`."""
    lines = path.read_bytes().split(b"\n")
    # A file written line by line ends with a newline, which leaves one empty piece at the end.
    if lines and not lines[-1]:
        lines.pop()
    kept: list[bytes] = []
    for index, line in enumerate(lines):
        try:
            record = _parse_record(path, index + 1, line)
        except ValueError:
            # The last line may be torn by a killed process; anything earlier is real corruption.
            if index == len(lines) - 1:
                break
            raise
        if record["step"] <= resume_step:
            kept.append(line + b"\n")
    write_bytes_atomic(path, b"".join(kept))


class JsonlSink:
    """Appends `{"step": step, **metrics}` as one JSON line per step, flushed line by line.

    Flushing each line means a killed run keeps every step it completed. With `resume_step`, an
    existing file is first cut back to the steps `<= resume_step`, so steps that ran after the
    checkpoint being resumed are not recorded twice.
    """

    def __init__(self, path: Path, resume_step: int | None = None) -> None:
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        if resume_step is not None and self.path.exists():
            _truncate_jsonl(self.path, resume_step)
        self._file = self.path.open("a", encoding="utf-8")

    def log(self, step: int, metrics: Mapping[str, float]) -> None:
        """Append one line for `step`; non-finite values are written as null."""
        if "step" in metrics:
            raise ValueError("'step' is reserved for the step number in JSONL records")
        record = {"step": step, **{key: _json_value(value) for key, value in metrics.items()}}
        # allow_nan=False turns any non-finite value that slipped through into an error instead
        # of the NaN/Infinity tokens that strict JSON parsers reject.
        self._file.write(json.dumps(record, allow_nan=False) + "\n")
        # flush, not fsync: surviving a killed process is the goal; fsync per step would stall.
        self._file.flush()

    def close(self) -> None:
        """Close the file."""
        self._file.close()


class ConsoleSink:
    """A tqdm progress bar over the run's steps, with ETA and a few chosen metrics as postfix.

    `log(step, ...)` moves the bar to `step`, so `step` counts the steps completed so far.
    """

    def __init__(
        self,
        total_steps: int,
        keys: Sequence[str],
        start_step: int = 0,
        stream: IO[str] | None = None,
    ) -> None:
        self._keys = tuple(keys)
        # initial=start_step keeps a resumed run's ETA based on the steps this process ran.
        self._bar = tqdm(total=total_steps, initial=start_step, unit="step", file=stream)

    def log(self, step: int, metrics: Mapping[str, float]) -> None:
        """Advance the bar to `step` and show the chosen keys present in `metrics`."""
        postfix = {key: f"{metrics[key]:.4g}" for key in self._keys if key in metrics}
        # One redraw per step: the postfix waits for update() instead of drawing on its own.
        self._bar.set_postfix(postfix, refresh=False)
        self._bar.update(max(step - self._bar.n, 0))

    def close(self) -> None:
        """Close the bar, leaving its last state on the stream."""
        self._bar.close()


def resolve_wandb_mode(
    mode: WandbMode, environ: Mapping[str, str]
) -> Literal["online", "offline", "disabled"]:
    """The wandb mode to run in: `auto` is online only where an API key is configured.

    Going offline without a key keeps an unattended job from blocking on wandb's login prompt.
    """
    if mode == "auto":
        return "online" if environ.get("WANDB_API_KEY") else "offline"
    if mode not in ("online", "offline", "disabled"):
        raise ValueError(f"unknown wandb mode {mode!r}; use auto, online, offline or disabled")
    return mode


class WandbSink:
    """Logs each step to a Weights & Biases run; offline runs are written under `directory`."""

    def __init__(
        self,
        project: str,
        run_name: str,
        directory: Path,
        config: Mapping[str, Any],
        mode: WandbMode = "auto",
        resume_id: str | None = None,
    ) -> None:
        try:
            import wandb
        except ImportError as error:
            raise ImportError(
                "WandbSink needs wandb: install it with `pip install -e .[wandb]`, "
                "or turn tracking off with `metrics.wandb=disabled`"
            ) from error
        directory = Path(directory)
        directory.mkdir(parents=True, exist_ok=True)
        # The mode is always passed explicitly so that wandb never decides on its own to prompt
        # for a login or to go online.
        self._run = wandb.init(
            mode=resolve_wandb_mode(mode, os.environ),
            dir=directory,
            project=project,
            name=run_name,
            # The recipe as wandb keeps it, secrets hidden (rollout.sglang.env's tokens, ...).
            config=redacted_config(config),
            id=resume_id,
            resume="allow" if resume_id is not None else None,
        )

    def log(self, step: int, metrics: Mapping[str, float]) -> None:
        """Log `metrics` at the trainer's step, not wandb's own counter, so resumes line up."""
        self._run.log(dict(metrics), step=step)

    def close(self) -> None:
        """Finish the run, which flushes it (and, online, waits for the upload)."""
        self._run.finish()


class MetricsLogger:
    """Fans each step's metrics out to every sink; closing closes them all."""

    def __init__(self, sinks: Sequence[MetricsSink]) -> None:
        self._sinks = tuple(sinks)
        self._closed = False

    def log(self, step: int, metrics: Mapping[str, float]) -> None:
        """Send the metrics of `step` to every sink, in order."""
        if self._closed:
            raise RuntimeError("MetricsLogger.log called after close")
        for sink in self._sinks:
            sink.log(step, metrics)

    def close(self) -> None:
        """Close every sink, even when one fails, then raise the first failure."""
        if self._closed:
            return
        self._closed = True
        first_error: Exception | None = None
        for sink in self._sinks:
            try:
                sink.close()
            except Exception as error:
                # A failing sink must not keep the others (the JSONL file above all) unflushed.
                if first_error is None:
                    first_error = error
        if first_error is not None:
            raise first_error

    def __enter__(self) -> MetricsLogger:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        self.close()


class StepTimer:
    """Where one step's time goes: seconds per named phase (`time/<phase>_s`), the whole step
    (`time/step_s`) and the throughput of trained tokens, from its creation on."""

    def __init__(self) -> None:
        self._started = time.perf_counter()
        self._seconds: dict[str, float] = {}

    @contextmanager
    def phase(self, name: str) -> Iterator[None]:
        """Adds the seconds spent in the block to phase `name`."""
        start = time.perf_counter()
        try:
            yield
        finally:
            self._seconds[name] = self._seconds.get(name, 0.0) + time.perf_counter() - start

    def metrics(self, tokens: int) -> dict[str, float]:
        """The phases so far, the step's total and `tokens` trained per second of it."""
        seconds = time.perf_counter() - self._started
        return {f"time/{name}_s": value for name, value in self._seconds.items()} | {
            "time/step_s": seconds,
            "throughput/response_tokens_per_s": tokens / seconds,
        }
