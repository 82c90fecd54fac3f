"""The screen that keeps numbers too large to evaluate away from sympy."""

from __future__ import annotations

import time

import pytest

from megatron_rl.rewards.huge_numbers import writes_huge_number


@pytest.mark.parametrize(
    "answer",
    [
        # towers, the first: sympy had not returned after 8 s
        "9^{9^{9^{9}}}",
        "10^{10^{10}}",
        "2^{2^{10}}",  # small, but a tower all the same
        "9^9^9^9",
        "9**9**9**9",
        "9 ** (9 ** 9)",
        "2^{100!}",
        "2^{10}!",
        # long exponents
        "10^{200000}",
        "10^{100\\,000\\,000}",
        "x^{1000000}",
        "2^{-1000000}",
        "123456789^{20000}",
        "2^{1234567890123456789}",
        # factorials
        "(10^{6})!",
        "\\left(10^{6}\\right)!",
        "100000!",
        "100{,}000!",
        "(100000)!",
        "(5!)!",
        "5!!",
        "12345678901234567890!",
    ],
)
def test_huge_numbers_are_caught(answer):
    assert writes_huge_number(answer)


@pytest.mark.parametrize(
    "answer",
    [
        "2^{10}",
        "2^10",
        "2^{2023}",
        "10^{100000}",  # 100001 digits: the limit's edge
        "10^{-3}",
        "x^2 + y^2",
        "e^{i\\pi}",
        "8^{\\frac{1}{3}}",
        "5!",
        "25000!",
        "n!",
        "(n+1)!",
        "\\frac{10!}{2!\\,8!}",
        "\\frac{1}{2}",
        "1\\!000",  # a negative thin space, not a factorial
        "a != b",
        "[0, 1)",
        "x^{",  # truncated
        "",
    ],
)
def test_modest_answers_pass(answer):
    assert not writes_huge_number(answer)


@pytest.mark.timeout(30)
def test_long_answers_cost_linear_time():
    # Many powers and factorials, and deep brackets: each is read once.
    started = time.monotonic()
    assert not writes_huge_number("2^{10} + (3)! + " * 10_000)
    assert not writes_huge_number("(" * 50_000 + "n" + ")" * 50_000 + "!")
    assert writes_huge_number("x^{" * 50_000 + "2" + "}" * 50_000)
    assert time.monotonic() - started < 5.0
