"""`megatron-rl bench drift`: GRPO + routing replay against GSPO without it (and the other
losses) over a grid of arms x sweep points x seeds, with the literature's claims checked.

grid.py plans the runs from a recipe and a grid file; base_models.py builds models of other
shapes; runner.py runs them (resumable, in parallel; stopped at a collapse where the grid asks);
run_files.py reads a run's files, from its folder or the archive a finished grid is packed into;
collapse.py finds a run's collapse events and what moved before them; summary.py turns each
run's metrics into a row; claims/ checks the claims on the rows (stability.py, uncertainty.py and
survival.py decide with what confidence); plots.py draws the figures; report.py writes
summary.csv, the plots and report.md. docs/drift.md says how to read and run it.
"""

from __future__ import annotations

from pathlib import Path

from megatron_rl.bench.drift.grid import DEFAULT_GRID, QUICK_GRID, DriftGrid, GridSource, load_grid
from megatron_rl.bench.drift.run_files import pack_runs
from megatron_rl.bench.drift.runner import check_results_dir, prepare_grid, run_grid

__all__ = [
    "DEFAULT_GRID",
    "QUICK_GRID",
    "pack_drift_benchmark",
    "prepare_drift_benchmark",
    "report_drift_benchmark",
    "run_drift_benchmark",
]


def run_drift_benchmark(
    recipe: str,
    grid_file: GridSource,
    out: Path,
    *,
    jobs: int,
    models_dir: Path,
    rerun_crashed: bool = False,
    overrides: list[str] = (),
    only: int | None = None,
) -> Path | None:
    """Run the grid's runs that have not ended, then write the report; returns report.md.
    With `only`, run just that run (a job array's task) and write no report."""
    grid = load_grid(recipe, grid_file, list(overrides))
    print(f"drift grid: {len(grid.runs)} runs into {out}", flush=True)
    run_grid(grid, out, jobs=jobs, models_dir=models_dir, rerun_crashed=rerun_crashed, only=only)
    return None if only is not None else _write_report(grid, out)


def prepare_drift_benchmark(
    recipe: str, grid_file: GridSource, out: Path, *, models_dir: Path, overrides: list[str] = ()
) -> list[str]:
    """Claim `out` and build the base models, for a job array of the grid's runs; the run ids
    (array task i runs run i)."""
    grid = load_grid(recipe, grid_file, list(overrides))
    return prepare_grid(grid, out, models_dir=models_dir)


def report_drift_benchmark(
    recipe: str, grid_file: GridSource, out: Path, overrides: list[str] = ()
) -> Path:
    """Write the report of the runs in `out` that have ended; returns report.md."""
    return _write_report(load_grid(recipe, grid_file, list(overrides)), out)


def pack_drift_benchmark(
    recipe: str, grid_file: GridSource, out: Path, overrides: list[str] = ()
) -> tuple[Path, Path]:
    """Pack the ended runs of the grid in `out` into its runs archive (run_files.py), then write
    the report from it; returns the archive's and report.md's paths."""
    grid = load_grid(recipe, grid_file, list(overrides))
    check_results_dir(out, grid)  # this grid's results, not yet packed
    archive = pack_runs(out, [run.run_id for run in grid.runs])
    return archive, _write_report(grid, out)


def _write_report(grid: DriftGrid, out: Path) -> Path:
    from megatron_rl.bench.drift.report import write_report  # matplotlib: only when reporting

    return write_report(grid, out)
