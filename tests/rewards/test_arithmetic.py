"""The built-in arithmetic task: exact text format, generator invariants, splits, verifier."""

from __future__ import annotations

import itertools
import re

import pytest

from megatron_rl.rewards import ArithmeticTask, Problem, get_verifier, solve

ALPHABET = set("0123456789+-=# \n")
STEP = re.compile(r"([0-9]+)([+-])([0-9]+)=([0-9]+)\n")


def test_solution_format_is_exact():
    assert solve("12+7-5+30\n") == Problem(
        prompt="12+7-5+30\n",
        solution="12+7=19\n19-5=14\n14+30=44\n#### 44\n",
        reference="44",
    )


def test_a_total_may_reach_zero():
    assert solve("3-3+0\n").solution == "3-3=0\n0+0=0\n#### 0\n"


@pytest.mark.parametrize(
    ("prompt", "message"),
    [
        ("12+7", "expected non-negative integers"),
        ("12+7\n\n", "expected non-negative integers"),
        ("12\n", "expected non-negative integers"),
        ("12++7\n", "expected non-negative integers"),
        ("-3+4\n", "expected non-negative integers"),
        ("012+3\n", "expected non-negative integers"),
        ("1*2\n", "expected non-negative integers"),
        ("1 + 2\n", "expected non-negative integers"),
        ("", "expected non-negative integers"),
        ("4-5+9\n", "running total goes negative at 4-5"),
    ],
)
def test_solve_rejects_malformed_prompts(prompt, message):
    with pytest.raises(ValueError, match=message):
        solve(prompt)


def _check_problem(problem: Problem, task: ArithmeticTask) -> None:
    """Checks one generated problem against the format, independently of `solve`."""
    assert set(problem.prompt + problem.solution) <= ALPHABET
    operands = [int(text) for text in re.split(r"[+-]", problem.prompt[:-1])]
    assert task.min_operands <= len(operands) <= task.max_operands
    assert all(0 <= operand <= task.max_operand for operand in operands)
    *steps, answer_line = problem.solution.splitlines(keepends=True)
    assert len(steps) == len(operands) - 1
    total = operands[0]
    for step in steps:
        left, operator, right, result = STEP.fullmatch(step).groups()
        assert int(left) == total
        total = total + int(right) if operator == "+" else total - int(right)
        assert int(result) == total >= 0
    assert answer_line == f"#### {total}\n"
    assert problem.reference == str(total)


@pytest.mark.parametrize("split", ["train", "eval"])
def test_generated_problems_follow_the_format(split):
    task = ArithmeticTask(min_operands=2, max_operands=5, max_operand=12)
    problems = task.problems(split, 500, seed=3)
    assert len(problems) == 500
    for problem in problems:
        _check_problem(problem, task)
        assert solve(problem.prompt) == problem
        assert task.split_of(problem.prompt) == split
    counts = {len(re.split(r"[+-]", problem.prompt)) for problem in problems}
    assert counts == {2, 3, 4, 5}


def test_large_space_has_no_repeats():
    prompts = [problem.prompt for problem in ArithmeticTask().problems("train", 1000, seed=0)]
    assert len(set(prompts)) == len(prompts)


def test_train_and_eval_are_disjoint():
    task = ArithmeticTask(min_operands=2, max_operands=3, max_operand=5)
    train = {problem.prompt for problem in task.problems("train", 3000, seed=1)}
    evaluation = {problem.prompt for problem in task.problems("eval", 3000, seed=1)}
    assert train and evaluation
    assert not train & evaluation


def test_eval_fraction_sets_the_share_of_eval_prompts():
    task = ArithmeticTask(eval_fraction=0.25)
    prompts = [f"{left}+{right}\n" for left in range(64) for right in range(64)]
    share = sum(task.split_of(prompt) == "eval" for prompt in prompts) / len(prompts)
    assert 0.21 < share < 0.29


def test_reproducible_under_a_seed_and_different_under_another():
    task = ArithmeticTask()
    first = task.problems("eval", 50, seed=7)
    assert task.problems("eval", 50, seed=7) == first
    assert task.problems("eval", 50, seed=8) != first


def test_exhausted_split_repeats_and_an_empty_split_is_an_error():
    task = ArithmeticTask(min_operands=2, max_operands=2, max_operand=1)
    every_prompt = set()
    for left, operator, right in itertools.product("01", "+-", "01"):
        if operator == "+" or left >= right:
            every_prompt.add(f"{left}{operator}{right}\n")
    for split in ("train", "eval"):
        members = {prompt for prompt in every_prompt if task.split_of(prompt) == split}
        if members:
            problems = task.problems(split, 40, seed=0)
            assert len(problems) == 40
            assert {problem.prompt for problem in problems} == members
        else:
            with pytest.raises(ValueError, match=f"no {split} prompt found"):
                task.problems(split, 1, seed=0)


@pytest.mark.parametrize(
    ("fields", "message"),
    [
        ({"min_operands": 1}, "min_operands: expected an int >= 2"),
        ({"min_operands": 2.0}, "min_operands: expected an int"),
        ({"max_operands": 2}, "max_operands: expected an int >= min_operands=3"),
        ({"max_operand": 0}, "max_operand: expected an int >= 1"),
        ({"max_operand": True}, "max_operand: expected an int"),
        ({"eval_fraction": 0.0}, "eval_fraction: expected a number strictly between 0 and 1"),
        ({"eval_fraction": 1}, "eval_fraction: expected a number strictly between 0 and 1"),
        ({"eval_fraction": "0.2"}, "eval_fraction: expected a number"),
    ],
)
def test_bad_fields_are_named(fields, message):
    with pytest.raises(ValueError, match=message):
        ArithmeticTask(**fields)


@pytest.mark.parametrize(
    ("arguments", "message"),
    [
        ({"split": "test"}, "split: expected one of train, eval"),
        ({"count": -1}, "count: expected an int >= 0"),
        ({"seed": "7"}, "seed: expected an int"),
    ],
)
def test_bad_problem_arguments_are_named(arguments, message):
    with pytest.raises(ValueError, match=message):
        ArithmeticTask().problems(**({"split": "train", "count": 1, "seed": 0} | arguments))


def test_arithmetic_verifier_scores_the_solution_and_not_a_wrong_answer():
    verifier = get_verifier("arithmetic")
    problem = solve("12+7-5+30\n")
    assert verifier(problem.prompt, problem.solution, problem.reference) == 1.0
    wrong = problem.solution.replace("#### 44", "#### 45")
    assert verifier(problem.prompt, wrong, problem.reference) == 0.0
    unfinished = problem.solution.replace("#### 44\n", "")
    assert verifier(problem.prompt, unfinished, problem.reference) == 0.0
