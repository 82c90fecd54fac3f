"""The shipped word problems: the generator's output, disjoint splits, answers the math verifier
accepts in the solutions, and the recipe that trains on them reads them."""

from __future__ import annotations

import importlib.util
from pathlib import Path

from megatron_rl.config import load_config
from megatron_rl.rewards import get_verifier, load_jsonl_problems, problem_source
from megatron_rl.trainer.recipe import Recipe

REPO = Path(__file__).resolve().parents[2]
DATA = REPO / "examples" / "data"


def test_the_shipped_files_are_the_generators_output(tmp_path, monkeypatch):
    spec = importlib.util.spec_from_file_location("make", DATA / "make_word_problems.py")
    make = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(make)
    monkeypatch.setattr(make, "__file__", str(tmp_path / "make_word_problems.py"))
    make.main()
    for split in ("train", "eval"):
        shipped = (DATA / "word_problems" / f"{split}.jsonl").read_bytes()
        assert (tmp_path / "word_problems" / f"{split}.jsonl").read_bytes() == shipped, split


def test_splits_are_disjoint_and_each_solution_earns_its_reward():
    math = get_verifier("math")
    splits = {
        split: load_jsonl_problems(
            DATA / "word_problems" / f"{split}.jsonl", prompt_key="question", answer_key="solution"
        )
        for split in ("train", "eval")
    }
    answers = {
        split: load_jsonl_problems(DATA / "word_problems" / f"{split}.jsonl", "question", "answer")
        for split in splits
    }
    assert (len(splits["train"]), len(splits["eval"])) == (320, 64)
    assert not {p.prompt for p in splits["train"]} & {p.prompt for p in splits["eval"]}
    for split, problems in splits.items():
        for worked, answer in zip(problems, answers[split], strict=True):
            assert "\\boxed{}" in worked.prompt
            assert math(worked.prompt, worked.reference, answer.reference) == 1.0, worked.origin
            wrong = str(int(answer.reference) + 1)
            assert math(worked.prompt, worked.reference, wrong) == 0.0, worked.origin


def test_the_recipe_on_them_loads_its_data(monkeypatch):
    monkeypatch.chdir(REPO)  # its paths are relative to the repository root
    recipe = load_config(Recipe, REPO / "examples" / "moe" / "qwen3_30b_a3b_word_problems.yaml")
    assert recipe.data.chat_template and recipe.algo.correction() is not None
    problems = problem_source(recipe.data, per_step=recipe.rollout.prompts_per_step, seed=1)
    assert len(problems.train_batch(1)) == 32 and len(problems.eval_problems) == 64
