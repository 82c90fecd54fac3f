"""What a finished run prints last (trainer/run_summary.py); the real run's lines are checked
end to end in tests/trainer/test_train.py."""

from __future__ import annotations

import json

from megatron_rl.config import load_config
from megatron_rl.trainer.recipe import Recipe
from megatron_rl.trainer.run_summary import RunSummary, summarize_run


def _recipe(run_dir, *overrides):
    return load_config(Recipe, None, [f"run.dir={run_dir}", "run.steps=300", *overrides])


def test_the_summary_reads_every_evaluation_and_shows_how_the_last_ones_swing(tmp_path):
    evaluations = {0: 0.539, 100: 0.81, 200: 0.848, 250: 0.79, 275: 0.68, 300: 0.848}
    records = [{"step": step, "eval/accuracy": value} for step, value in evaluations.items()]
    records.insert(2, {"step": 150, "loss/policy": 0.1})  # a step without an evaluation
    records.append({"step": 301, "eval/accuracy": None})  # a non-finite one, logged as null
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    (tmp_path / "checkpoints" / "step_000300").mkdir(parents=True)
    (tmp_path / "checkpoints" / "step_000300" / "trainer.json").write_text("{}")
    (tmp_path / "export").mkdir()
    summary = summarize_run(_recipe(tmp_path), wall_seconds=296.4, warnings=7)
    assert summary.accuracy == sorted(evaluations.items())
    text = "\n".join(summary.lines())
    assert text.splitlines()[0] == "run finished: 300 steps in 4 min 56 s"
    # the best is the earliest of equal ones
    assert "0.539 at step 0, best 0.848 at step 200, last 0.848 at step 300" in text
    assert "the last 3 evaluations: 0.790 (step 250), 0.680 (step 275), 0.848 (step 300)" in text
    assert f"checkpoint: {tmp_path / 'checkpoints' / 'step_000300'}" in text
    assert f"export:     {tmp_path / 'export'}" in text
    assert f"metrics:    {tmp_path / 'metrics.jsonl'}" in text
    assert f"7 known ones in {tmp_path / 'warnings.log'}" in text


def test_a_run_that_kept_nothing_says_so_and_why(tmp_path):
    recipe = _recipe(
        tmp_path, "metrics.jsonl=false", "checkpoint.save_last=false", "checkpoint.export_hf=false"
    )
    summary = summarize_run(recipe, wall_seconds=5, warnings=0)
    assert summary == RunSummary(300, 5, [], None, None, None, 0, tmp_path / "warnings.log")
    text = "\n".join(summary.lines())
    assert "held-out accuracy: not evaluated" in text
    assert "none (checkpoint.save_last: false)" in text
    assert "not written (metrics.jsonl: false)" in text
    assert "none (checkpoint.export_hf: false)" in text
