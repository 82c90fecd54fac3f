"""Verifiers registered by name, final-answer extraction, and failure-tolerant batch scoring.

A verifier is a plain function `(prompt, response, reference) -> float`. The trainer scores a whole
rollout batch through `score_responses`, which turns a verifier that raises, returns garbage or
hangs into a 0.0 reward and a count, so one bad sample never stops a training step. Nothing here
logs: the caller reports the counts.
"""

from __future__ import annotations

import math
import numbers
import re
import string
import time
from collections.abc import Callable, Sequence
from concurrent.futures import FIRST_COMPLETED, Future, ThreadPoolExecutor, wait
from dataclasses import dataclass

from megatron_rl.rewards.huge_numbers import writes_huge_number

Verifier = Callable[[str, str, str], float]

VERIFIERS: dict[str, Verifier] = {}

DEFAULT_CONCURRENCY = 8

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
    # Its own timeouts use signal.alarm, which only the main thread may; score_responses
    # runs verifiers on worker threads and enforces the deadline itself.
    gold = parse(f"\\boxed{{{reference if expected is None else expected}}}", parsing_timeout=None)
    if not gold:
        raise ValueError(f"reference {reference!r}: math-verify finds no answer in it")
    target = parse(response if answer is None else f"\\boxed{{{answer}}}", parsing_timeout=None)
    return 1.0 if target and verify(gold, target, timeout_seconds=None) else 0.0


@dataclass(frozen=True)
class RewardScores:
    """The rewards of a batch and how many samples got 0.0 because their verifier misbehaved."""

    rewards: list[float]
    """One reward per sample, in input order."""
    failures: int
    """Samples whose verifier raised or returned a non-numeric or non-finite value."""
    timeouts: int
    """Samples whose verifier did not return within the timeout."""


def score_responses(
    verifier: Verifier,
    prompts: Sequence[str],
    responses: Sequence[str],
    references: Sequence[str],
    timeout_s: float | None,
    *,
    concurrency: int = DEFAULT_CONCURRENCY,
) -> RewardScores:
    """Score every sample with `verifier`; misbehaviour costs that sample a 0.0, never an exception.

    A verifier that raises, or returns a non-numeric or non-finite value, scores 0.0 and counts
    as a failure. With a positive finite `timeout_s`, verifiers run on worker threads, at most
    `concurrency` at a time, and each sample gets `timeout_s` wall-clock seconds from its own
    start; one that overruns scores 0.0 and counts as a timeout. A Python thread cannot be killed,
    so an overrunning call keeps running in the background until it returns, and a call that never
    returns keeps the interpreter from exiting (concurrent.futures joins its threads at exit). A
    verifier stuck in C code that holds the GIL cannot be timed out by threads at all. With
    `timeout_s` None, zero, negative or infinite, verifiers run one by one in the calling thread.

    Raises:
        ValueError: the three sequences differ in length, `timeout_s` is NaN, or `concurrency`
            is not a positive int.
    """
    lengths = {"prompts": len(prompts), "responses": len(responses), "references": len(references)}
    if len(set(lengths.values())) > 1:
        counts = ", ".join(f"{name}={length}" for name, length in lengths.items())
        raise ValueError(f"prompts, responses and references must have equal lengths; got {counts}")
    if timeout_s is not None and math.isnan(timeout_s):
        raise ValueError("timeout_s: expected seconds (or None for no timeout), got nan")
    if isinstance(concurrency, bool) or not isinstance(concurrency, int) or concurrency < 1:
        raise ValueError(f"concurrency: expected an int >= 1, got {concurrency!r}")
    samples = list(zip(prompts, responses, references, strict=True))
    if timeout_s is None or timeout_s <= 0 or math.isinf(timeout_s) or not samples:
        outcomes = [_score_one(verifier, *sample) for sample in samples]
        return _collect(outcomes, timeouts=0)
    return _score_with_deadlines(verifier, samples, timeout_s, concurrency)


def _score_one(verifier: Verifier, prompt: str, response: str, reference: str) -> float | None:
    """The sample's reward, or None when the verifier failed."""
    try:
        value = verifier(prompt, response, reference)
        reward = float(value) if isinstance(value, numbers.Real) else math.nan
    except Exception:
        # A verifier bug or a malformed response must cost one sample, not the training step.
        return None
    return reward if math.isfinite(reward) else None


def _collect(outcomes: list[float | None], timeouts: int) -> RewardScores:
    """RewardScores from per-sample outcomes, where None means failed or timed out."""
    rewards = [0.0 if outcome is None else outcome for outcome in outcomes]
    failures = sum(outcome is None for outcome in outcomes) - timeouts
    return RewardScores(rewards=rewards, failures=failures, timeouts=timeouts)


def _score_with_deadlines(
    verifier: Verifier,
    samples: list[tuple[str, str, str]],
    timeout_s: float,
    concurrency: int,
) -> RewardScores:
    """Run verifiers on threads, at most `concurrency` live at once, each with its own deadline.

    Samples are submitted by this loop, not queued in the executor, and the executor may grow to
    one thread per sample: a submitted call therefore starts at once (an idle thread is reused, or
    a new one replaces a hung one), so its deadline is measured from its start, and a hung call,
    once abandoned, stops counting against the concurrency and never delays the samples after it.
    """
    outcomes: list[float | None] = [None] * len(samples)
    timeouts = 0
    running: dict[Future[float | None], tuple[int, float]] = {}  # -> (sample index, deadline)
    next_sample = 0
    executor = ThreadPoolExecutor(max_workers=len(samples), thread_name_prefix="verifier")
    try:
        while next_sample < len(samples) or running:
            while next_sample < len(samples) and len(running) < concurrency:
                future = executor.submit(_score_one, verifier, *samples[next_sample])
                running[future] = (next_sample, time.monotonic() + timeout_s)
                next_sample += 1
            earliest_deadline = min(deadline for _, deadline in running.values())
            done, _ = wait(
                running,
                timeout=max(0.0, earliest_deadline - time.monotonic()),
                return_when=FIRST_COMPLETED,
            )
            for future in done:
                index, _ = running.pop(future)
                outcomes[index] = future.result()
            now = time.monotonic()
            for future, (_, deadline) in list(running.items()):
                # A call that finished just now is collected on the next pass, not timed out.
                if now >= deadline and not future.done():
                    del running[future]
                    timeouts += 1
    finally:
        # Abandoned calls keep their threads; waiting for them would defeat the timeout.
        executor.shutdown(wait=False, cancel_futures=True)
    return _collect(outcomes, timeouts)
