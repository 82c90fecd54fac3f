"""A run's files, from its folder `runs/RUN_ID/` or, once the grid is finished and packed, from
one archive: `runs.tar.xz` in the results directory holds each run's `metrics.jsonl`,
`status.json`, `recipe.yaml` and `train.log`, compressed about tenfold, in place of `runs/`. The
report reads either (`run_file`, `run_metrics`); a packed grid is complete, so nothing runs into
it again.

Files are read as bytes, decoded, with no newline translation: a train.log holds the carriage
returns of progress bars. The archive is read into memory member by member (none is extracted to
disk, so no name in it can write outside the results directory), once per archive file and
modification time.
"""

from __future__ import annotations

import functools
import json
import shutil
import tarfile
from pathlib import Path
from typing import Any

RUNS_ARCHIVE = "runs.tar.xz"
RUN_FILES = ("metrics.jsonl", "status.json", "recipe.yaml", "train.log")


class ArchiveError(ValueError):
    """A results directory that cannot be packed, or an archive that cannot be read."""


def is_packed(out: Path) -> bool:
    return (out / RUNS_ARCHIVE).is_file()


def run_file(out: Path, run_id: str, name: str) -> str | None:
    """The text of run `run_id`'s file `name` in results directory `out` (from `runs/`, else
    from the archive), or None when the run has none."""
    path = out / "runs" / run_id / name
    if path.is_file():
        return path.read_bytes().decode()
    archive = out / RUNS_ARCHIVE
    if not archive.is_file():
        return None
    return _members(archive, archive.stat().st_mtime_ns).get(f"{run_id}/{name}")


def run_metrics(out: Path, run_id: str) -> list[dict[str, Any]]:
    """The records of the run's metrics.jsonl, [] before it has any (a torn last line, from a
    run killed or still writing, is left out)."""
    text = run_file(out, run_id, "metrics.jsonl")
    records = []
    for line in (text or "").splitlines():
        try:
            records.append(json.loads(line))
        except json.JSONDecodeError:
            break
    return records


def pack_runs(out: Path, run_ids: list[str]) -> Path:
    """Pack the files of `run_ids` (every run of the grid, each ended: a status.json) from
    `out/runs/` into `out/runs.tar.xz`, check that it reads back the same, then remove
    `out/runs/`. The archive is written under a temporary name and renamed when whole."""
    runs = out / "runs"
    missing = [run_id for run_id in run_ids if not (runs / run_id / "status.json").is_file()]
    if missing:
        raise ArchiveError(
            f"--pack: {len(missing)} runs of the grid have not ended in {runs} "
            f"(first: {missing[0]}); run them first (a packed grid runs nothing more)"
        )
    archive, partial = out / RUNS_ARCHIVE, out / f".{RUNS_ARCHIVE}.partial"
    packed: dict[str, str] = {}
    with tarfile.open(partial, "w:xz") as tar:
        for run_id in run_ids:
            for name in RUN_FILES:
                path = runs / run_id / name
                if path.is_file():
                    tar.add(path, arcname=f"{run_id}/{name}")
                    packed[f"{run_id}/{name}"] = path.read_bytes().decode()
    if _members(partial, partial.stat().st_mtime_ns) != packed:
        partial.unlink()
        raise ArchiveError(f"--pack: {partial} did not read back as written; {runs} kept")
    partial.rename(archive)
    shutil.rmtree(runs)
    return archive


@functools.lru_cache(maxsize=2)
def _members(archive: Path, modified_ns: int) -> dict[str, str]:
    """Every regular file of `archive` by its name, as text (`modified_ns`: the cache's key)."""
    try:
        with tarfile.open(archive, "r:xz") as tar:
            return {
                member.name: tar.extractfile(member).read().decode()
                for member in tar.getmembers()
                if member.isfile()
            }
    except (tarfile.TarError, EOFError, UnicodeDecodeError) as error:
        raise ArchiveError(f"{archive}: not a readable runs archive ({error})") from None
