"""What a finished run prints last: how far it went, how long it took, how its held-out accuracy
moved, and where its metrics, checkpoints, export and warnings are."""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path

from megatron_rl.trainer.recipe import Recipe
from megatron_rl.trainer.run_dir import complete_checkpoints

ACCURACY = "eval/accuracy"
# The last evaluations shown one by one: a single last figure hides how much they swing.
LAST_EVALUATIONS = 3


@dataclass(frozen=True)
class RunSummary:
    """A finished run, from its run directory. `accuracy` holds `(step, held-out accuracy)` of
    every evaluation metrics.jsonl records, in step order (the run's earlier parts too, when it
    was resumed)."""

    steps: int
    wall_seconds: float  # this process's, from its start
    accuracy: list[tuple[int, float]]
    metrics: Path | None
    checkpoint: Path | None
    export: Path | None
    warnings: int  # this rank's known warnings written to `warnings_log`
    warnings_log: Path

    def lines(self) -> list[str]:
        minutes, seconds = divmod(round(self.wall_seconds), 60)
        lines = [f"run finished: {self.steps} steps in {minutes} min {seconds:02d} s"]
        lines += self._accuracy_lines()
        lines.append(f"  metrics:    {self.metrics or 'not written (metrics.jsonl: false)'}")
        lines.append(f"  checkpoint: {self.checkpoint or 'none (checkpoint.save_last: false)'}")
        lines.append(f"  export:     {self.export or 'none (checkpoint.export_hf: false)'}")
        lines.append(f"  warnings:   {self.warnings} known ones in {self.warnings_log}")
        return lines

    def _accuracy_lines(self) -> list[str]:
        if not self.accuracy:
            return ["  held-out accuracy: not evaluated"]
        (first_step, first), (last_step, last) = self.accuracy[0], self.accuracy[-1]
        best_step, best = max(self.accuracy, key=lambda item: (item[1], -item[0]))
        line = (
            f"  held-out accuracy: {first:.3f} at step {first_step}, best {best:.3f} at step "
            f"{best_step}, last {last:.3f} at step {last_step}"
        )
        recent = self.accuracy[-LAST_EVALUATIONS:]
        if len(recent) > 1:
            shown = ", ".join(f"{value:.3f} (step {step})" for step, value in recent)
            line += f"\n  the last {len(recent)} evaluations: {shown}"
        return [line]


def summarize_run(recipe: Recipe, wall_seconds: float, warnings: int) -> RunSummary:
    """The summary of the finished run of `recipe`, read from its run directory."""
    run_dir = Path(recipe.run.dir)
    metrics = run_dir / "metrics.jsonl"
    checkpoints = complete_checkpoints(run_dir / "checkpoints")
    export = run_dir / "export"
    return RunSummary(
        steps=recipe.run.steps,
        wall_seconds=wall_seconds,
        accuracy=_accuracy(metrics) if metrics.is_file() else [],
        metrics=metrics if recipe.metrics.jsonl and metrics.is_file() else None,
        checkpoint=checkpoints[-1] if checkpoints else None,
        export=export if recipe.checkpoint.export_hf and export.is_dir() else None,
        warnings=warnings,
        warnings_log=run_dir / "warnings.log",
    )


def _accuracy(metrics: Path) -> list[tuple[int, float]]:
    """`(step, held-out accuracy)` of each finite evaluation in `metrics` (JSON Lines), by step."""
    by_step: dict[int, float] = {}
    for line in metrics.read_text().splitlines():
        record = json.loads(line)
        value = record.get(ACCURACY)
        if isinstance(value, int | float) and math.isfinite(value):
            by_step[int(record["step"])] = float(value)
    return sorted(by_step.items())
