"""What every benchmark shares: the machine it ran on, peak memory, and its JSON + markdown."""

from __future__ import annotations

import json
import os
import platform
import random
import statistics
from collections.abc import Callable
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import torch

from megatron_rl.files.atomic import write_text_atomic


def resident_kib(field: str = "VmRSS") -> int:
    """This process's resident memory (`VmRSS`) or its high-water mark (`VmHWM`), in KiB."""
    with open("/proc/self/status") as status:
        for line in status:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    raise RuntimeError(f"/proc/self/status has no {field}")


def reset_peak() -> None:
    """Linux: writing 5 to clear_refs resets VmHWM to the current resident size."""
    with open("/proc/self/clear_refs", "w") as clear_refs:
        clear_refs.write("5")


def allocation_peak(run: Callable[[], object]) -> tuple[int, int]:
    """Bytes allocated by torch during `run()`, counted allocation by allocation (the profiler's
    memory events; deterministic, unlike resident memory): (peak above the start, net at end)."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        run()
    events = [e for e in prof.profiler.kineto_results.events() if e.name() == "[memory]"]
    current = peak = 0
    for event in sorted(events, key=lambda e: e.start_ns()):
        current += event.nbytes()
        peak = max(peak, current)
    return peak, current


def median_interval(
    values: list[float], level: float = 0.95, resamples: int = 2000, seed: int = 0
) -> tuple[float, float]:
    """A bootstrap interval for the median of `values`: the central `level` share of the
    medians of `resamples` samples drawn with replacement (seeded, so reports reproduce)."""
    draw = random.Random(seed)
    medians = sorted(
        statistics.median(draw.choices(values, k=len(values))) for _ in range(resamples)
    )
    tail = round((1 - level) / 2 * resamples)
    return medians[tail], medians[resamples - 1 - tail]


def cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as cpuinfo:
            for line in cpuinfo:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.machine()


def machine() -> dict[str, Any]:
    """The machine and the time of a run, for the report."""
    return {
        "cpu": cpu_model(),
        "cores": os.cpu_count(),
        "torch": torch.__version__,
        "threads": torch.get_num_threads(),
    }


def now() -> str:
    return datetime.now(UTC).strftime("%Y-%m-%d %H:%M UTC")


def write_report(
    report: dict, out_dir: Path, stem: str, markdown: Callable[[dict], str]
) -> tuple[Path, Path]:
    """`<stem>.json` and `<stem>.md` in `out_dir`, each written atomically."""
    json_path = write_text_atomic(out_dir / f"{stem}.json", json.dumps(report, indent=2))
    md_path = write_text_atomic(out_dir / f"{stem}.md", markdown(report) + "\n")
    return json_path, md_path
