"""What a run directory holds besides the checkpoints' contents (checkpoints.py): which
checkpoints are complete, whether an earlier run is there, pruning, and what interrupted saves
left. Only the standard library: the CLI checks a directory before it imports megatron-core.

    RUN_DIR/metrics.jsonl, warnings.log, checkpoints/, export/, ...
    RUN_DIR/checkpoints/step_000020/    a complete checkpoint (it exists only once complete)
    RUN_DIR/checkpoints/latest          the name of the one a resume takes
"""

from __future__ import annotations

import os
import re
import shutil
from pathlib import Path

LATEST = "latest"
_STEP_NAME = re.compile(r"step_(\d+)")
# What cut saves and removals leave: staging, half-removed checkpoints, `latest`'s temporary files.
LEFTOVERS = (".step_*.partial", ".step_*.removing", ".step_*.old-*", f".{LATEST}.*.tmp")


def complete_checkpoints(directory: Path) -> list[Path]:
    """The complete checkpoints (`step_N` with its trainer.json) under `directory`, oldest
    first by step."""
    found = [
        (int(match[1]), path)
        for path in directory.glob("step_*")
        if (match := _STEP_NAME.fullmatch(path.name)) and (path / "trainer.json").is_file()
    ]
    return [path for _, path in sorted(found)]


def refuse_earlier_run(run_dir: Path) -> None:
    """Refuse `run_dir` to a fresh run when it holds an earlier one: any complete checkpoint
    (with `latest` or without), or a metrics.jsonl (a run that saved no checkpoint)."""
    found = complete_checkpoints(run_dir / "checkpoints")
    earlier = f"checkpoints up to {found[-1].name}" if found else None
    if earlier is None and (run_dir / "metrics.jsonl").is_file():
        earlier = "metrics.jsonl, no checkpoint"
    if earlier is not None:
        raise ValueError(
            f"run.dir {run_dir}: holds an earlier run ({earlier}); pass --resume to continue "
            "it (from step 0 when it saved no checkpoint), or choose another run.dir"
        )


def prune(directory: Path, *, keep: int, newest: Path) -> None:
    """Keep `newest` (the one just written, which `latest` names) and the `keep - 1` highest
    steps of the others. Each one removed is renamed `.step_N.removing` first: a kill leaves
    either the whole checkpoint or a hidden folder (a LEFTOVER), never half of one."""
    others = [path for path in complete_checkpoints(directory) if path != newest]
    for old in others[: max(0, len(others) - (keep - 1))]:
        removing = directory / f".{old.name}.removing"
        os.replace(old, removing)
        shutil.rmtree(removing)


def clear_leftovers(directory: Path) -> list[Path]:
    """Remove what saves and removals cut short left under `directory` (LEFTOVERS); returns
    what was removed."""
    removed = [path for pattern in LEFTOVERS for path in sorted(directory.glob(pattern))]
    for path in removed:
        if path.is_dir():
            shutil.rmtree(path)
        else:
            path.unlink()
    return removed
