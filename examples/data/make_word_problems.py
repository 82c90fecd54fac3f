"""Writes word_problems/{train,eval}.jsonl: grade-school word problems in the style of GSM8K,
written for this project from templates (names, objects and numbers drawn with a fixed seed).

Each line is {"question": ..., "answer": ..., "solution": ...}: the answer is the final number,
the solution works it out in steps and ends with \\boxed{answer}. Run from the repository root:
`python examples/data/make_word_problems.py` (the shipped files are its output).
"""

from __future__ import annotations

import json
import random
from collections.abc import Callable
from pathlib import Path

NAMES = ["Ana", "Bilal", "Chen", "Dana", "Emeka", "Farah", "Goran", "Hina", "Ivo", "Jun", "Kiri"]
ITEMS = ["apples", "marbles", "stickers", "pencils", "shells", "cards", "stamps", "coins"]
INSTRUCTION = " Put the final answer in \\boxed{}."

Problem = tuple[str, list[str], int]  # question, solution steps, answer


def buy_and_give(r: random.Random) -> Problem:
    name, item = r.choice(NAMES), r.choice(ITEMS)
    start, bought, given = r.randint(5, 40), r.randint(2, 30), r.randint(1, 20)
    total = start + bought
    return (
        f"{name} has {start} {item}. {name} buys {bought} more and then gives {given} to a "
        f"friend. How many {item} does {name} have now?",
        [
            f"After buying: {start} + {bought} = {total}.",
            f"After giving: {total} - {given} = {total - given}.",
        ],
        total - given,
    )


def boxes(r: random.Random) -> Problem:
    item = r.choice(ITEMS)
    count, per_box, extra = r.randint(3, 12), r.randint(4, 15), r.randint(2, 9)
    packed = count * per_box
    return (
        f"A shop packs {item} in boxes of {per_box}. It fills {count} boxes and has {extra} "
        f"{item} left over. How many {item} did the shop have?",
        [
            f"In boxes: {count} * {per_box} = {packed}.",
            f"With the rest: {packed} + {extra} = {packed + extra}.",
        ],
        packed + extra,
    )


def share(r: random.Random) -> Problem:
    name, item = r.choice(NAMES), r.choice(ITEMS)
    friends, each = r.randint(2, 9), r.randint(3, 12)
    total = friends * each
    return (
        f"{name} shares {total} {item} equally among {friends} friends. How many {item} does "
        f"each friend get?",
        [f"Each gets {total} / {friends} = {each}."],
        each,
    )


def wages(r: random.Random) -> Problem:
    name = r.choice(NAMES)
    rate, hours, days = r.randint(8, 25), r.randint(2, 8), r.randint(2, 6)
    daily = rate * hours
    return (
        f"{name} earns {rate} dollars an hour and works {hours} hours a day for {days} days. "
        f"How many dollars does {name} earn?",
        [
            f"Per day: {rate} * {hours} = {daily}.",
            f"In {days} days: {daily} * {days} = {daily * days}.",
        ],
        daily * days,
    )


def ages(r: random.Random) -> Problem:
    older, younger = r.sample(NAMES, 2)
    age, gap, years = r.randint(5, 30), r.randint(2, 15), r.randint(1, 10)
    return (
        f"{younger} is {age} years old. {older} is {gap} years older than {younger}. How old "
        f"will {older} be in {years} years?",
        [
            f"{older} is {age} + {gap} = {age + gap} now.",
            f"In {years} years: {age + gap} + {years} = {age + gap + years}.",
        ],
        age + gap + years,
    )


def pages(r: random.Random) -> Problem:
    name = r.choice(NAMES)
    per_day, days, left = r.randint(5, 30), r.randint(2, 9), r.randint(3, 60)
    read = per_day * days
    return (
        f"{name} reads {per_day} pages a day for {days} days and still has {left} pages to go. "
        f"How many pages does the book have?",
        [f"Read: {per_day} * {days} = {read}.", f"Book: {read} + {left} = {read + left}."],
        read + left,
    )


def change(r: random.Random) -> Problem:
    name, item = r.choice(NAMES), r.choice(ITEMS)
    count, price = r.randint(2, 9), r.randint(2, 12)
    cost = count * price
    paid = cost + r.randint(1, 30)
    return (
        f"{name} buys {count} packs of {item} at {price} dollars each and pays with {paid} "
        f"dollars. How much change does {name} get?",
        [f"Cost: {count} * {price} = {cost}.", f"Change: {paid} - {cost} = {paid - cost}."],
        paid - cost,
    )


def rows_of_seats(r: random.Random) -> Problem:
    rows, seats, empty = r.randint(4, 20), r.randint(5, 20), r.randint(1, 30)
    total = rows * seats
    empty = min(empty, total - 1)
    return (
        f"A hall has {rows} rows of {seats} seats. At a concert {empty} seats stay empty. How "
        f"many people sit in the hall?",
        [f"Seats: {rows} * {seats} = {total}.", f"Taken: {total} - {empty} = {total - empty}."],
        total - empty,
    )


TEMPLATES: list[Callable[[random.Random], Problem]] = [
    buy_and_give,
    boxes,
    share,
    wages,
    ages,
    pages,
    change,
    rows_of_seats,
]


def write(path: Path, count: int, rng: random.Random, taken: set[str]) -> None:
    lines = []
    while len(lines) < count:
        question, steps, answer = rng.choice(TEMPLATES)(rng)
        if question in taken:
            continue
        taken.add(question)
        record = {
            "question": question + INSTRUCTION,
            "answer": str(answer),
            "solution": " ".join(steps) + f" The answer is \\boxed{{{answer}}}.",
        }
        lines.append(json.dumps(record))
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")


def main() -> None:
    out = Path(__file__).resolve().parent / "word_problems"
    out.mkdir(exist_ok=True)
    rng, taken = random.Random(2026), set()
    write(out / "train.jsonl", 320, rng, taken)
    write(out / "eval.jsonl", 64, rng, taken)  # disjoint from train: no question twice


if __name__ == "__main__":
    main()
