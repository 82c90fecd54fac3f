"""Verifiers registered by name, and the final-answer extraction and normalisation they share.

A verifier is a plain function `(prompt, response, reference) -> float`. The trainer scores a
whole rollout batch through `megatron_rl.rewards.scoring.score_responses`, which runs it in
worker processes that it can kill, so that a verifier that raises, hangs or crashes costs one
sample a 0.0 reward, never the training step. A verifier scored there must be a module-level
function: the workers receive it by reference.
"""

from __future__ import annotations

import re
import string
from collections.abc import Callable

from megatron_rl.rewards.huge_numbers import writes_huge_number

Verifier = Callable[[str, str, str], float]

VERIFIERS: dict[str, Verifier] = {}

_BOXED = "\\boxed{"
_BRACES = re.compile(re.escape(_BOXED) + r"|\{|\}")
_ANSWER_MARKER = "#### "
_STRIPPED_AROUND_ANSWER = string.whitespace + "$"
# Thousands separators are removed only from correctly grouped numbers, so that a tuple such as
# "1,2" is not read as the number 12.
_GROUPED_NUMBER = re.compile(r"[+-]?[0-9]{1,3}(?:,[0-9]{3})+(?:\.[0-9]*)?")
_NUMBER = re.compile(r"(?P<sign>[+-]?)(?=\.?[0-9])(?P<whole>[0-9]*)(?:\.(?P<fraction>[0-9]*))?")


def register_verifier(name: str) -> Callable[[Verifier], Verifier]:
    """Decorator that adds a verifier to `VERIFIERS` under `name` and returns it unchanged."""
    if not isinstance(name, str) or not name:
        raise ValueError(f"name: expected a non-empty string, got {name!r}")
    if name in VERIFIERS:
        raise ValueError(f"name: a verifier named {name!r} is already registered")

    def add(verifier: Verifier) -> Verifier:
        VERIFIERS[name] = verifier
        return verifier

    return add


def verifier_names() -> list[str]:
    """The registered verifier names, sorted."""
    return sorted(VERIFIERS)


def get_verifier(name: str) -> Verifier:
    """The verifier registered as `name`; an unknown name lists the valid ones."""
    if not isinstance(name, str) or name not in VERIFIERS:
        raise ValueError(f"unknown verifier {name!r}; valid: {', '.join(verifier_names())}")
    return VERIFIERS[name]


def extract_final_answer(text: str) -> str | None:
    """The final answer stated in `text`, stripped, or None when it states none.

    The content of the last complete `\\boxed{...}` (nested braces balanced) wins; without one,
    the rest of the line after the last `#### ` marker; without either, None.
    """
    boxed = _last_boxed_content(text)
    if boxed is not None:
        return boxed.strip()
    marker = text.rfind(_ANSWER_MARKER)
    if marker < 0:
        return None
    return text[marker + len(_ANSWER_MARKER) :].split("\n", 1)[0].strip()


def _last_boxed_content(text: str) -> str | None:
    # One pass with a stack of the open braces, each marked with where its box's content starts
    # (None for a brace that opens no box): the answer is the complete box that closes last.
    # That is the rule "the last outermost complete box, an unclosed box transparent (a box
    # nested in it may still count)": a brace closes the nearest brace still open before it,
    # so complete boxes are nested or disjoint and the one closing last lies inside no other
    # complete box (that one would close later) and after every other outermost one; unclosed
    # braces stay on the stack and change no match.
    open_boxes: list[int | None] = []
    last_box: tuple[int, int] | None = None
    for brace in _BRACES.finditer(text):
        if brace.group() != "}":
            open_boxes.append(brace.end() if brace.group() == _BOXED else None)
        elif open_boxes and (content_start := open_boxes.pop()) is not None:
            last_box = (content_start, brace.start())
    return None if last_box is None else text[last_box[0] : last_box[1]]


def normalize_answer(answer: str) -> str:
    """A canonical form of `answer`, so that equal numbers written differently compare equal.

    Whitespace and `$` around the answer are stripped. A number loses its thousands separators,
    a leading `+`, leading zeros and trailing fractional zeros (`1,000.50` -> `1000.5`,
    `1.00` -> `1`, `+5` -> `5`, `-0` -> `0`). Anything else is returned stripped only.
    """
    text = answer.strip(_STRIPPED_AROUND_ANSWER)
    if _GROUPED_NUMBER.fullmatch(text):
        text = text.replace(",", "")
    number = _NUMBER.fullmatch(text)
    if number is None:
        return text
    # Exact string arithmetic: float or Decimal would round long numbers.
    whole = number["whole"].lstrip("0") or "0"
    fraction = (number["fraction"] or "").rstrip("0")
    if whole == "0" and not fraction:
        return "0"
    magnitude = f"{whole}.{fraction}" if fraction else whole
    return f"-{magnitude}" if number["sign"] == "-" else magnitude


# The arithmetic task ends its solution with `#### n`, which the final-answer rule reads.
@register_verifier("arithmetic")
def final_answer_verifier(prompt: str, response: str, reference: str) -> float:
    """1.0 when the response's final answer equals the reference after normalisation, else 0.0.

    The reference may be a bare answer or contain `####` / `\\boxed{}` itself. A response that
    states no final answer scores 0.0.
    """
    answer = extract_final_answer(response)
    if answer is None:
        return 0.0
    expected = extract_final_answer(reference)
    if expected is None:
        expected = reference
    return 1.0 if normalize_answer(answer) == normalize_answer(expected) else 0.0


@register_verifier("math")
def math_verifier(prompt: str, response: str, reference: str) -> float:
    """1.0 when Hugging Face's math-verify finds the response's final answer mathematically
    equal to the reference (`1/2`, `0.5` and `\\frac{1}{2}` agree; so do `2\\sqrt{2}` and
    `\\sqrt{8}`), else 0.0.

    The final answer is the last `\\boxed{}` or `#### ` line (`extract_final_answer`); a
    response with neither is handed to math-verify whole, which extracts what it can. An answer
    (or such a whole response) that writes a number too large to evaluate (`writes_huge_number`:
    `9^{9^{9^{9}}}`, `(10^{6})!`) scores 0.0 before math-verify sees it: sympy would evaluate
    it exactly, for hours, holding the GIL. The reference may be bare or carry `####` /
    `\\boxed{}` itself. A reference math-verify cannot read raises (the sample is counted in
    `reward/failures`), so a bad dataset shows.
    """
    answer = extract_final_answer(response)
    if writes_huge_number(response if answer is None else answer):
        return 0.0
    # Imported here: math-verify pulls sympy and its LaTeX grammar, which only this verifier needs.
    from math_verify import parse, verify

    expected = extract_final_answer(reference)
    # Its own timeouts use signal.alarm, which works on a main thread only and cannot stop C
    # code that holds the GIL anyway; the scoring pool's deadline kills the worker instead.
    gold = parse(f"\\boxed{{{reference if expected is None else expected}}}", parsing_timeout=None)
    if not gold:
        raise ValueError(f"reference {reference!r}: math-verify finds no answer in it")
    target = parse(response if answer is None else f"\\boxed{{{answer}}}", parsing_timeout=None)
    return 1.0 if target and verify(gold, target, timeout_seconds=None) else 0.0
