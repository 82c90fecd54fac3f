"""The built-in verifiable task: multi-step integer addition and subtraction, one step per line.

The text format is exact, since it is the whole alphabet a small model has to learn: only the
characters `0123456789+-=#`, space and newline appear. For the prompt `"12+7-5+30\\n"`:

    solution:  "12+7=19\\n19-5=14\\n14+30=44\\n#### 44\\n"
    reference: "44"

Operands are non-negative integers written without leading zeros, and every running total stays
non-negative, so no negative number appears anywhere. `solve` is the one source of the solution
text; the generator and the tests both go through it.
"""

from __future__ import annotations

import math
import random
import re
import zlib
from dataclasses import dataclass, field
from typing import Literal

Split = Literal["train", "eval"]

SPLITS: tuple[Split, ...] = ("train", "eval")

_OPERAND = r"(?:0|[1-9][0-9]*)"
_PROMPT = re.compile(rf"{_OPERAND}(?:[+-]{_OPERAND})+\n")

# Drawing this many times in a row (scaled by how rare the split is) without a new problem of the
# requested split has probability about e**-50 while most of the split is still undrawn; when it
# happens the split is all but exhausted, so repeats are allowed from then on.
_FRUITLESS_DRAWS_PER_HIT = 50


@dataclass(frozen=True)
class Problem:
    """One prompt with its ideal response (empty when unknown) and the reference final answer."""

    prompt: str
    solution: str
    reference: str
    origin: str = field(default="", compare=False)
    """Where it comes from (`FILE:LINE` for a prompt file's), for error messages; not part of
    what the problem is."""


def solve(prompt: str) -> Problem:
    """The problem for an arithmetic prompt such as `"12+7-5\\n"`, with its step-by-step solution.

    Raises:
        ValueError: the prompt is not non-negative integers (no leading zeros) joined by `+` or
            `-` and ending with one newline, or a running total goes negative.
    """
    if not isinstance(prompt, str) or not _PROMPT.fullmatch(prompt):
        raise ValueError(
            "prompt: expected non-negative integers without leading zeros joined by '+' or '-' "
            f"and ending with one newline, e.g. '12+7-5\\n'; got {prompt!r}"
        )
    first, *operations = re.split(r"([+-])", prompt[:-1])
    total = int(first)
    lines = []
    for operator, operand_text in zip(operations[::2], operations[1::2], strict=True):
        operand = int(operand_text)
        new_total = total + operand if operator == "+" else total - operand
        if new_total < 0:
            raise ValueError(
                f"prompt: the running total goes negative at {total}{operator}{operand} in "
                f"{prompt!r}; the task has no negative numbers"
            )
        lines.append(f"{total}{operator}{operand}={new_total}\n")
        total = new_total
    lines.append(f"#### {total}\n")
    return Problem(prompt=prompt, solution="".join(lines), reference=str(total))


@dataclass(frozen=True)
class ArithmeticTask:
    """Generator of random `+`/`-` problems, split into train and eval by a hash of the prompt."""

    min_operands: int = 3
    """Fewest operands in an expression; at least 2 (one step)."""
    max_operands: int = 4
    """Most operands in an expression; at least `min_operands`."""
    max_operand: int = 30
    """Operands are drawn from [0, max_operand]; at least 1."""
    eval_fraction: float = 0.25
    """Share of all possible prompts that belongs to the eval split; strictly between 0 and 1."""

    def __post_init__(self) -> None:
        _check_int("min_operands", self.min_operands, 2, "2 (one step)")
        _check_int(
            "max_operands",
            self.max_operands,
            self.min_operands,
            f"min_operands={self.min_operands}",
        )
        _check_int("max_operand", self.max_operand, 1, "1")
        fraction = self.eval_fraction
        if (
            isinstance(fraction, bool)
            or not isinstance(fraction, int | float)
            or not 0 < fraction < 1
        ):
            raise ValueError(
                f"eval_fraction: expected a number strictly between 0 and 1, got {fraction!r}"
            )

    def split_of(self, prompt: str) -> Split:
        """The split `prompt` belongs to; fixed by its text, so the splits never share a prompt."""
        # crc32, not hash(): str hashes are salted per process, and splits must be stable.
        return "eval" if zlib.crc32(prompt.encode()) < self.eval_fraction * 2**32 else "train"

    def problems(self, split: Split, count: int, seed: int) -> list[Problem]:
        """`count` problems of `split`, the same for the same task, split, count and seed.

        Expressions are drawn at random and kept when they belong to `split`. A prompt is not
        repeated until the split looks exhausted (a long run of draws yields nothing new).

        Raises:
            ValueError: a bad argument, or the task has no prompt at all in `split`.
        """
        if split not in SPLITS:
            raise ValueError(f"split: expected one of {', '.join(SPLITS)}, got {split!r}")
        if isinstance(count, bool) or not isinstance(count, int) or count < 0:
            raise ValueError(f"count: expected an int >= 0, got {count!r}")
        if isinstance(seed, bool) or not isinstance(seed, int):
            raise ValueError(f"seed: expected an int, got {seed!r}")
        rng = random.Random(seed)
        split_share = self.eval_fraction if split == "eval" else 1 - self.eval_fraction
        max_fruitless_draws = math.ceil(_FRUITLESS_DRAWS_PER_HIT / split_share)
        problems: list[Problem] = []
        seen: set[str] = set()
        fruitless_draws = 0
        allow_repeats = False
        while len(problems) < count:
            prompt = self._draw_prompt(rng)
            if self.split_of(prompt) == split and (allow_repeats or prompt not in seen):
                seen.add(prompt)
                problems.append(solve(prompt))
                fruitless_draws = 0
                continue
            fruitless_draws += 1
            if fruitless_draws >= max_fruitless_draws:
                if not seen:
                    raise ValueError(
                        f"split: no {split} prompt found in {fruitless_draws} draws; the task "
                        f"is too small to have one: raise max_operand or max_operands"
                    )
                allow_repeats = True
        return problems

    def _draw_prompt(self, rng: random.Random) -> str:
        """A random prompt whose running totals are all non-negative."""
        operand_count = rng.randint(self.min_operands, self.max_operands)
        total = rng.randint(0, self.max_operand)
        terms = [str(total)]
        for _ in range(operand_count - 1):
            if rng.random() < 0.5:
                operand = rng.randint(0, self.max_operand)
                total += operand
                terms.append(f"+{operand}")
            else:
                # Never more than the running total, which therefore stays non-negative.
                operand = rng.randint(0, min(total, self.max_operand))
                total -= operand
                terms.append(f"-{operand}")
        return "".join(terms) + "\n"


def _check_int(field: str, value: object, minimum: int, minimum_text: str) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ValueError(f"{field}: expected an int >= {minimum_text}, got {value!r}")
