"""Answers that write a number too large to evaluate: `9^{9^{9^{9}}}`, `10^{10^{10}}`, `(10^{6})!`.

math-verify hands such an answer to sympy, which evaluates the number exactly when it compares
it: in C code that holds the GIL, for minutes or hours, with memory growing all the while. The
`math` verifier scores these answers 0.0 before math-verify sees them (`writes_huge_number`).
The scoring pool's deadline stops whatever this screen misses, at the cost of a worker process;
the screen keeps those kills rare, and costs one pass over the answer.

The rules read the answer's text, not its value, and are deliberately coarse: a correct answer
is a number of modest size written plainly (`2^{2023}`, `5!`, `n!`), and an answer that merely
could be huge is rejected rather than evaluated.
"""

from __future__ import annotations

import math
import re

MAX_DIGITS = 100_000
"""The most decimal digits an answer's number may have (sympy handles such an integer in
milliseconds; `10^{6}` digits take it seconds, and the growth is worse than linear)."""

_MAX_EXACT_DIGITS = 15  # longer integer literals are huge whatever follows; shorter fit a float
# A power: LaTeX's `^` and the `**` that math-verify reads in plain-text answers.
_POWER = re.compile(r"\^|\*\*")
# Factorials: a run of `!` (`5!!` is read as (5!)!), but not LaTeX's negative space `\!`, nor `!=`.
_FACTORIALS = re.compile(r"(?<!\\)!+(?!=)")
# An exponent written without a group: one signed atom (`2^10`, `x^-3`, `e^\pi`).
_ATOM = re.compile(r"[+-]?\s*(?:\\[A-Za-z]+|[0-9.]+|[A-Za-z])")
_INTEGER = re.compile(r"[0-9]+")
# An integer literal, digit groups and all, at the end of a text: `100{,}000`, `100\\,000`.
_TRAILING_LITERAL = re.compile(r"[0-9](?:[0-9,]|\\[,;: ]|\{,\})*$")
_LITERAL_WINDOW = 64
# What may split one number into digit groups: spaces, commas, LaTeX's small spaces. They are
# removed before the literals of an exponent are read: `10^{100\,000}` reads as 10^100000 (an
# over-estimate only ever rejects more).
_DIGIT_SEPARATORS = re.compile(r"\\[,;:! ]|\{,\}|[\s,]")
_CLOSER_OF = {"{": "}", "(": ")", "[": "]"}
_BRACKETS = re.compile(r"[{}()\[\]]")


def writes_huge_number(answer: str) -> bool:
    """Whether `answer` writes a number that may have more than MAX_DIGITS digits. That is:

    - a power whose exponent contains a power or a factorial, or that a power or a factorial
      follows at once: a tower (`10^{10^{10}}`, `9^{9^{9^{9}}}`, `9**9**9`, `2^{100!}`,
      `2^{10}!`), however small (`2^{2^{10}}` is rejected: write `2^{1024}`);
    - a power whose exponent's largest integer literal E makes it longer than MAX_DIGITS
      digits: E * log10(base), the base read as 10 unless it is a larger integer literal
      (`10^{200000}`, `x^{1000000}`, `123456789^{20000}`; `2^{2023}` passes);
    - a factorial of an expression containing a power or a factorial (`(10^{6})!`, `(5!)!`,
      `5!!`), or of an integer whose factorial is longer than MAX_DIGITS digits (`100000!`;
      `5!` and `n!` pass).

    `^` and `**` both write powers. Linear in the length of `answer`: the brackets are matched
    in one pass, and the exponents and operands read are disjoint, except where the first
    nested one already decides.
    """
    partner = _bracket_partners(answer)
    return any(_huge_power(answer, power, partner) for power in _POWER.finditer(answer)) or any(
        _huge_factorial(answer, factorials, partner) for factorials in _FACTORIALS.finditer(answer)
    )


def _huge_power(answer: str, power: re.Match[str], partner: dict[int, int]) -> bool:
    """Whether the power whose operator `power` matched may be huge."""
    start, end, after = _exponent_span(answer, power.end(), partner)
    if _POWER.search(answer, start, end) or _FACTORIALS.search(answer, start, end):
        return True
    after = _skip_spaces(answer, after)
    if _POWER.match(answer, after) or _FACTORIALS.match(answer, after):
        return True
    exponent = _largest_integer(answer[start:end])
    return exponent * _base_log10(answer, power.start()) > MAX_DIGITS


def _huge_factorial(answer: str, factorials: re.Match[str], partner: dict[int, int]) -> bool:
    """Whether the factorial(s) that `factorials` matched may be huge."""
    if len(factorials.group()) > 1:
        return True  # a factorial of a factorial
    last = factorials.start() - 1
    while last >= 0 and answer[last].isspace():
        last -= 1
    if last < 0:
        return False
    if answer[last] in _CLOSER_OF.values():
        if last not in partner:
            return False  # an unmatched bracket: no operand that math-verify could evaluate
        start, end = partner[last] + 1, last
        if _POWER.search(answer, start, end) or _FACTORIALS.search(answer, start, end):
            return True
        operand = _DIGIT_SEPARATORS.sub("", answer[start:end]).strip("{}()[]")
        if not operand.isdigit():
            return False  # symbolic: `(n+1)!`
    elif answer[last].isdigit():
        # A literal is read from a bounded window, so that many factorials cost linear time; a
        # literal longer than the window is huge anyway.
        window = answer[max(0, last + 1 - _LITERAL_WINDOW) : last + 1]
        operand = _DIGIT_SEPARATORS.sub("", _TRAILING_LITERAL.search(window).group())
    else:
        return False  # `n!`, `\alpha!`
    if len(operand) > _MAX_EXACT_DIGITS:
        return True
    return math.lgamma(int(operand) + 1) / math.log(10) > MAX_DIGITS


def _bracket_partners(text: str) -> dict[int, int]:
    """The index of each matched bracket's partner, both ways, each kind matched on its own: an
    interval such as `[0, 1)` leaves its two brackets unmatched rather than mismatched."""
    partner: dict[int, int] = {}
    open_at: dict[str, list[int]] = {closer: [] for closer in _CLOSER_OF.values()}
    for bracket in _BRACKETS.finditer(text):
        position, character = bracket.start(), bracket.group()
        if character in _CLOSER_OF:
            open_at[_CLOSER_OF[character]].append(position)
        elif open_at[character]:
            opened = open_at[character].pop()
            partner[opened], partner[position] = position, opened
    return partner


def _exponent_span(
    answer: str, after_operator: int, partner: dict[int, int]
) -> tuple[int, int, int]:
    """Where the exponent of the power whose operator ends at `after_operator` starts and ends,
    and where the text after it starts: the inside of the bracket group that follows (an
    unmatched bracket runs to the end), or one atom."""
    start = _skip_spaces(answer, after_operator)
    if start < len(answer) and answer[start] in _CLOSER_OF:
        if start not in partner:
            return start + 1, len(answer), len(answer)
        return start + 1, partner[start], partner[start] + 1
    atom = _ATOM.match(answer, start)
    end = start if atom is None else atom.end()
    return start, end, end


def _largest_integer(text: str) -> float:
    """The largest integer literal in `text` (inf past _MAX_EXACT_DIGITS digits), 0 if none."""
    literals = _INTEGER.findall(_DIGIT_SEPARATORS.sub("", text))
    longest = max(literals, key=len, default="0")
    return math.inf if len(longest) > _MAX_EXACT_DIGITS else max(map(int, literals), default=0)


def _base_log10(answer: str, operator: int) -> float:
    """log10 of the power's base, ending just before `operator`, when it is an integer literal
    of 10 or more; 1 (as if the base were 10) for any other base: a symbol, a group, a decimal,
    a smaller integer."""
    end = operator
    while end > 0 and answer[end - 1].isspace():
        end -= 1
    start = end
    while start > 0 and answer[start - 1].isdigit():
        start -= 1
    if start == end:
        return 1.0
    if end - start > _MAX_EXACT_DIGITS:
        return float(end - start)
    return max(1.0, math.log10(max(int(answer[start:end]), 1)))


def _skip_spaces(text: str, position: int) -> int:
    while position < len(text) and text[position].isspace():
        position += 1
    return position
