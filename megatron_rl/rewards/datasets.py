"""Prompt files that users bring: JSON Lines, one problem per line, checked with exact locations."""

from __future__ import annotations

import json
import math
from pathlib import Path

from megatron_rl.rewards.arithmetic import Problem


class DatasetError(ValueError):
    """A prompt file is missing or malformed; the message names the file and, if any, the line."""


def load_jsonl_problems(
    path: str | Path, prompt_key: str = "prompt", answer_key: str = "answer"
) -> list[Problem]:
    """The problems of a JSON Lines file, one JSON object per line; blank lines are skipped.

    Each object needs `prompt_key`, a non-empty string, and `answer_key`, a non-empty string or a
    finite number (converted with `str`, so the integer 42 becomes `"42"`). Other keys are
    ignored. The problems have no ideal solution (`solution == ""`).

    Raises:
        DatasetError: the file is missing or unreadable, holds no record, or a line is not a JSON
            object with a valid prompt and answer; the message gives the file and line number.
    """
    path = Path(path)
    try:
        data = path.read_bytes()
    except FileNotFoundError:
        raise DatasetError(f"{path}: file not found") from None
    except OSError as error:
        raise DatasetError(f"{path}: cannot read the file ({error.strerror})") from None
    problems = []
    for line_number, raw_line in enumerate(data.split(b"\n"), start=1):
        if raw_line.strip():
            where = f"{path}:{line_number}"
            record = _parse_record(raw_line, where)
            problems.append(_problem(record, prompt_key, answer_key, where))
    if not problems:
        raise DatasetError(f"{path}: no records (the file is empty or has only blank lines)")
    return problems


def _parse_record(raw_line: bytes, where: str) -> dict[str, object]:
    try:
        record = json.loads(raw_line.decode("utf-8"))
    except UnicodeDecodeError:
        raise DatasetError(f"{where}: expected UTF-8 text") from None
    except json.JSONDecodeError as error:
        raise DatasetError(
            f"{where}: not valid JSON ({error.msg} at column {error.colno}); "
            "expected one JSON object per line"
        ) from None
    except ValueError as error:
        # The json module's own limits, such as its cap on the digits of an integer.
        raise DatasetError(f"{where}: not valid JSON ({error})") from None
    if not isinstance(record, dict):
        raise DatasetError(f"{where}: expected a JSON object, got {type(record).__name__}")
    return record


def _problem(record: dict[str, object], prompt_key: str, answer_key: str, where: str) -> Problem:
    for key in (prompt_key, answer_key):
        if key not in record:
            present = ", ".join(repr(name) for name in record) or "none"
            raise DatasetError(f"{where}: missing key {key!r}; keys present: {present}")
    prompt = record[prompt_key]
    if not isinstance(prompt, str) or not prompt.strip():
        raise DatasetError(f"{where}: {prompt_key!r}: expected a non-empty string, got {prompt!r}")
    reference = _answer_text(record[answer_key], answer_key, where)
    return Problem(prompt=prompt, solution="", reference=reference, origin=where)


def _answer_text(answer: object, answer_key: str, where: str) -> str:
    # bool is an int subclass, but `true` is no answer; NaN and Infinity pass the json module, but
    # no response can match them.
    is_number = not isinstance(answer, bool) and (
        isinstance(answer, int) or (isinstance(answer, float) and math.isfinite(answer))
    )
    if is_number or (isinstance(answer, str) and answer.strip()):
        return str(answer)
    raise DatasetError(
        f"{where}: {answer_key!r}: expected a non-empty string or a finite number, got {answer!r}"
    )
