"""Running a drift grid: one `megatron-rl train` process per run, up to `jobs` at once.

The results directory holds `grid.json` (what the grid and recipe were: another grid is refused)
and `runs/RUN_ID/` per run: `recipe.yaml` (the run's whole recipe), `metrics.jsonl`,
`train.log` and, when the process has ended, `status.json` (done or crashed, with the error).
A run with a status is not run again, except a crashed one with `rerun_crashed`; a run that was
interrupted (no status) starts afresh. `models.json` holds the weights' digest of each base model
the runs used: a results directory resumed with another build of a model (rebuilt on another
machine, say) is refused, since its runs would start from two different models. Every process is
started in its own session and stopped by its PID (its process group) if the grid is
interrupted.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any

import yaml

from megatron_rl.bench.drift import base_models
from megatron_rl.bench.drift.collapse import collapse_events
from megatron_rl.bench.drift.grid import DriftGrid, GridError, PlannedRun, recipe_for
from megatron_rl.bench.drift.run_files import RUNS_ARCHIVE, is_packed, run_file, run_metrics
from megatron_rl.bench.report import cpu_model
from megatron_rl.files.atomic import write_text_atomic
from megatron_rl.process import children

DONE, CRASHED = "done", "crashed"


def run_dir(out: Path, run: PlannedRun) -> Path:
    return out / "runs" / run.run_id


def read_status(out: Path, run: PlannedRun) -> dict[str, Any] | None:
    """The run's `status.json` (from `runs/`, or the packed grid's archive), or None while it
    has not ended."""
    text = run_file(out, run.run_id, "status.json")
    return None if text is None else json.loads(text)


def check_results_dir(out: Path, grid: DriftGrid) -> None:
    """Claim `out` for `grid`, or refuse it if it holds another grid's results or is packed
    (complete: nothing more runs into it)."""
    if is_packed(out):
        raise GridError(
            f"--out {out}: its runs are packed into {RUNS_ARCHIVE}, so the grid is complete; "
            "--report-only reads it"
        )
    path, identity = out / "grid.json", grid.identity()
    if path.is_file():
        held = json.loads(path.read_text())
        difference = _first_difference(held, identity)
        if difference is not None:
            raise GridError(
                f"--out {out}: holds the results of another grid or recipe ({difference}); "
                "choose another --out, or remove it to start over"
            )
        return
    if out.exists() and any(out.iterdir()):
        raise GridError(f"--out {out}: not empty and not a drift results directory (no grid.json)")
    out.mkdir(parents=True, exist_ok=True)
    write_text_atomic(path, json.dumps(identity, indent=1, sort_keys=True) + "\n")


def check_model_build(out: Path, model: Path) -> None:
    """Record the weights' digest of base model `model` in `out`'s models.json, or refuse a
    build other than the one recorded."""
    path = out / "models.json"
    recorded = json.loads(path.read_text()) if path.is_file() else {}
    digest = base_models.weights_digest(model)
    held = recorded.get(model.name)
    if held is None:
        write_text_atomic(path, json.dumps(recorded | {model.name: digest}, indent=1) + "\n")
    elif held != digest:
        raise GridError(
            f"--models-dir: {model} is another build of {model.name} than the one the runs in "
            f"{out} used (weights sha256 {digest[:12]}, recorded {held[:12]} in {path}); restore "
            "that build, or choose another --out to start over"
        )


# How often a run the grid stops at its first collapse has its metrics read while it runs.
WATCH_EVERY_S = 5.0


@dataclass(frozen=True)
class _Ending:
    """How a task's process ended: its return code, its seconds, its log's error line, and why
    the runner stopped it ("" when it ended by itself)."""

    code: int
    seconds: float
    error: str = ""
    stopped: str = ""

    @property
    def ok(self) -> bool:
        """It finished, or was stopped where the grid asks (a collapse: the run's result)."""
        return self.code == 0 or bool(self.stopped)


def _never() -> str:
    return ""


@dataclass
class _Task:
    """A process to run: a base-model build or a training run."""

    name: str
    command: list[str]
    log: Path
    is_build: bool
    needs: str | None  # the build it waits for
    prepare: Callable[[], None]
    finish: Callable[[_Ending], None]
    stop_now: Callable[[], str] = _never  # while it runs: why to stop it now ("": go on)


def run_grid(
    grid: DriftGrid,
    out: Path,
    *,
    jobs: int,
    models_dir: Path,
    rerun_crashed: bool = False,
    only: int | None = None,
    progress: Callable[[str], None] = print,
) -> None:
    """Run every run of `grid` that has not ended yet (and crashed ones with `rerun_crashed`);
    with `only`, just run number `only` (a task of a job array), whose base model must have
    been built (`prepare_grid`)."""
    check_results_dir(out, grid)
    runs = grid.runs if only is None else [_run_number(grid, only, models_dir)]
    pending = []
    for run in runs:
        status = read_status(out, run)
        if status is None or (rerun_crashed and status["state"] == CRASHED):
            pending.append(run)
    skipped = len(runs) - len(pending)
    if skipped:
        progress(f"{skipped} of {len(runs)} runs already ended; running {len(pending)}")
    failed_builds: dict[str, str] = {}
    tasks = _build_tasks(pending, models_dir, failed_builds)
    tasks += [_run_task(grid, out, run, models_dir, failed_builds) for run in pending]
    _Scheduler(tasks, jobs, threads=grid.threads, progress=progress).run(total_runs=len(pending))


def prepare_grid(
    grid: DriftGrid, out: Path, *, models_dir: Path, progress: Callable[[str], None] = print
) -> list[str]:
    """Claim `out` for `grid` and build the base models its runs need, so that the runs can
    then be started one by one, at once (a job array: `run_grid(..., only=i)`); the run ids,
    in run-number order."""
    check_results_dir(out, grid)
    failed: dict[str, str] = {}
    tasks = _build_tasks(grid.runs, models_dir, failed)
    _Scheduler(tasks, 1, threads=grid.threads, progress=progress).run(total_runs=0)
    if failed:
        raise GridError(f"base models not built: {failed}")
    return [run.run_id for run in grid.runs]


def _run_number(grid: DriftGrid, number: int, models_dir: Path) -> PlannedRun:
    if not 0 <= number < len(grid.runs):
        raise GridError(
            f"--run-index: {number} is not a run of this grid (0 .. {len(grid.runs) - 1})"
        )
    run = grid.runs[number]
    if run.shape is not None and not base_models.is_built(models_dir, run.shape):
        raise GridError(
            f"--run-index {number} ({run.run_id}): its base model "
            f"{base_models.shape_name(run.shape)} is not in {models_dir}; run --prepare first"
        )
    return run


def _build_tasks(runs: list[PlannedRun], models_dir: Path, failed: dict[str, str]) -> list[_Task]:
    shapes = {base_models.shape_name(r.shape): r.shape for r in runs if r.shape is not None}
    tasks = []
    for name, shape in shapes.items():
        if base_models.is_built(models_dir, shape):
            continue
        models_dir.mkdir(parents=True, exist_ok=True)

        def finish(ending: _Ending, name: str = name) -> None:
            if not ending.ok:
                failed[name] = f"building base model {name} failed ({ending.error})"

        tasks.append(
            _Task(
                name=f"build {name}",
                command=base_models.build_command(models_dir, shape),
                log=models_dir / f"{name}.log",
                is_build=True,
                needs=None,
                prepare=lambda: None,
                finish=finish,
            )
        )
    return tasks


def _run_task(
    grid: DriftGrid, out: Path, run: PlannedRun, models_dir: Path, failed: dict[str, str]
) -> _Task:
    directory = run_dir(out, run)
    recipe_path = directory / "recipe.yaml"
    build = None if run.shape is None else base_models.shape_name(run.shape)
    # $NAME in the launcher (e.g. the head node of a SLURM allocation) is the environment's
    launcher = [os.path.expandvars(part) for part in grid.launcher] or [sys.executable]

    def prepare() -> None:
        if build in failed:
            raise _NotStarted(failed[build])
        model = None if run.shape is None else base_models.model_path(models_dir, run.shape)
        if model is not None:
            check_model_build(out, model)
        shutil.rmtree(directory, ignore_errors=True)  # an interrupted attempt starts afresh
        directory.mkdir(parents=True)
        recipe = run.recipe if model is None else recipe_for(grid, run, model)
        tree = json.loads(json.dumps(dataclasses.asdict(recipe)))  # enums as their values
        tree["run"]["dir"] = str(directory)
        write_text_atomic(recipe_path, yaml.safe_dump(tree, sort_keys=False))

    def finish(ending: _Ending) -> None:
        # The report reads the metrics; checkpoints a grid asks for (checkpoint.save_every;
        # ~17 MB each on the tiny model) are not needed, and a grid holds a hundred runs.
        shutil.rmtree(directory / "checkpoints", ignore_errors=True)
        directory.mkdir(parents=True, exist_ok=True)  # a run that never started has none yet
        status = {
            "state": DONE if ending.ok else CRASHED,
            "returncode": ending.code,
            "seconds": round(ending.seconds, 1),
            "error": "" if ending.ok else ending.error,
            "stopped": ending.stopped,
            # a grid resumed elsewhere mixes machines: the time claims say so (claims/)
            "machine": cpu_model(),
        }
        write_text_atomic(directory / "status.json", json.dumps(status, indent=1) + "\n")

    return _Task(
        name=run.run_id,
        command=[*launcher, "-m", "megatron_rl.cli", "train", str(recipe_path)],
        log=directory / "train.log",
        is_build=False,
        needs=None if build is None else f"build {build}",
        prepare=prepare,
        finish=finish,
        stop_now=(lambda: _first_collapse(out, run)) if grid.stop_at_collapse else _never,
    )


def _first_collapse(out: Path, run: PlannedRun) -> str:
    """Why to stop `run` now: its first collapse event so far ("" while none)."""
    events = collapse_events(run_metrics(out, run.run_id), finished=False)
    if not events:
        return ""
    step, kind = events[0]
    return f"collapse at step {step} ({kind})"


class _NotStarted(RuntimeError):
    """A task that cannot start (its base model failed to build)."""


class _Scheduler:
    """Up to `jobs` processes at once, each in its own session, one progress line per ending."""

    def __init__(
        self, tasks: list[_Task], jobs: int, *, threads: int, progress: Callable[[str], None]
    ) -> None:
        self.waiting, self.jobs, self.progress = list(tasks), jobs, progress
        self.running: list[tuple[_Task, subprocess.Popen, IO[bytes], float]] = []
        self.unfinished_builds = {task.name for task in tasks if task.is_build}
        self.env = os.environ | {
            "OMP_NUM_THREADS": str(threads),
            "MKL_NUM_THREADS": str(threads),
            "PYTHONUNBUFFERED": "1",
        }
        self.finished_runs, self.run_seconds = 0, 0.0
        self.stopping: dict[int, str] = {}  # pid -> why the runner stopped it
        self.watched_at = 0.0

    def run(self, *, total_runs: int) -> None:
        self.total_runs = total_runs
        try:
            while self.waiting or self.running:
                self._start_ready()
                self._watch()
                self._reap()
                time.sleep(0.2)
        finally:
            self._stop_all()

    def _start_ready(self) -> None:
        for task in list(self.waiting):
            if len(self.running) >= self.jobs:
                return
            if task.needs in self.unfinished_builds:
                continue
            self.waiting.remove(task)
            try:
                task.prepare()
            except _NotStarted as error:
                ending = _Ending(1, 0.0, str(error))
                task.finish(ending)
                self._report(task, ending)
                continue
            log = task.log.open("wb")
            process = subprocess.Popen(
                task.command,
                stdout=log,
                stderr=subprocess.STDOUT,
                env=self.env,
                start_new_session=True,
            )
            children.started_group(process.pid)
            self.running.append((task, process, log, time.monotonic()))

    def _watch(self) -> None:
        """Every WATCH_EVERY_S, stop each running task that says why it should stop now (its
        process group: SIGTERM, which the trainer obeys at once)."""
        if time.monotonic() - self.watched_at < WATCH_EVERY_S:
            return
        self.watched_at = time.monotonic()
        for task, process, _, _ in self.running:
            if process.pid in self.stopping:
                continue
            reason = task.stop_now()
            if reason:
                self.stopping[process.pid] = reason
                _signal_group(process, signal.SIGTERM)

    def _reap(self) -> None:
        for entry in list(self.running):
            task, process, log, began = entry
            code = process.poll()
            if code is None:
                continue
            self.running.remove(entry)
            children.stopped_group(process.pid)
            log.close()
            stopped = self.stopping.pop(process.pid, "")
            error = "" if code == 0 or stopped else _error_line(task.log)
            ending = _Ending(code, time.monotonic() - began, error, stopped)
            task.finish(ending)
            self.unfinished_builds.discard(task.name)
            self._report(task, ending)

    def _report(self, task: _Task, ending: _Ending) -> None:
        seconds = ending.seconds
        if task.is_build:
            state = "built" if ending.ok else f"FAILED: {ending.error}"
            self.progress(f"{task.name}: {state} in {seconds:.0f} s")
            return
        self.finished_runs += 1
        self.run_seconds += seconds
        left = self.total_runs - self.finished_runs
        # runs still to go at the mean time of the runs so far, `jobs` at a time
        eta = self.run_seconds / self.finished_runs * left / self.jobs
        state = DONE if ending.code == 0 else f"CRASHED ({ending.error})"
        if ending.stopped:
            state = f"stopped: {ending.stopped}"
        self.progress(
            f"[{self.finished_runs}/{self.total_runs}] {task.name}: {state} in {seconds:.0f} s; "
            f"ETA {_duration(eta)}"
        )

    def _stop_all(self) -> None:
        """Stop whatever still runs (the grid was interrupted): SIGTERM to each process group
        we started, SIGKILL after 20 s."""
        for _, process, _, _ in self.running:
            _signal_group(process, signal.SIGTERM)
        deadline = time.monotonic() + 20
        for _, process, log, _ in self.running:
            try:
                process.wait(timeout=max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                _signal_group(process, signal.SIGKILL)
                process.wait()
            children.stopped_group(process.pid)
            log.close()
        self.running.clear()


def _signal_group(process: subprocess.Popen, signum: int) -> None:
    with contextlib.suppress(ProcessLookupError):
        os.killpg(process.pid, signum)  # the session we started it in: its pid is the group's


def _error_line(log: Path) -> str:
    """The most telling line of a failed run's log: its last error message."""
    lines = [line.strip() for line in log.read_text(errors="replace").splitlines() if line.strip()]
    for line in reversed(lines):
        if "Error" in line or line.startswith("megatron-rl:"):
            return line[:500]
    return lines[-1][:500] if lines else "no output"


def _duration(seconds: float) -> str:
    minutes, seconds = divmod(int(seconds), 60)
    return f"{minutes} min {seconds:02d} s" if minutes else f"{seconds} s"


def _first_difference(held: Any, wanted: Any, path: str = "") -> str | None:
    """Where two JSON trees first differ, as `key: held vs wanted`."""
    if isinstance(held, dict) and isinstance(wanted, dict):
        for key in sorted(set(held) | set(wanted)):
            where = f"{path}.{key}" if path else key
            if key not in held or key not in wanted:
                return f"{where}: only in {'the results' if key in held else 'this grid'}"
            found = _first_difference(held[key], wanted[key], where)
            if found is not None:
                return found
        return None
    if held != wanted:
        if isinstance(held, str) and "\n" in held:
            return f"{path}: the file's text differs"
        return f"{path}: {held!r} in the results vs {wanted!r} now"
    return None
