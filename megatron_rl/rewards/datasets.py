"""Prompt files that users bring: JSON Lines (one problem per line) or parquet (one per row),
checked with exact locations.

Parquet, a binary columnar format, is read with Hugging Face datasets. JSON Lines is read line by
line here rather than by datasets' JSON loader (datasets 5.2), which infers one type per column
(an answer 42 next to 0.5 becomes 42.0, so "42.0") and reports a malformed record as "An error
occurred while generating the dataset" over pyarrow's "row 1" of a block: here each record keeps
its own types and every error names its file and line.
"""

from __future__ import annotations

import json
import math
import tempfile
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


def load_parquet_problems(
    path: str | Path, prompt_key: str = "prompt", answer_key: str = "answer"
) -> list[Problem]:
    """The problems of a parquet file, one per row, read with Hugging Face datasets
    (`load_dataset("parquet", data_files=...)`, in memory, its cache in a directory removed
    afterwards). Columns and values as `load_jsonl_problems`; errors name the file, and the row
    (from 0) and column.

    Raises:
        DatasetError: the file is missing or not parquet, lacks a column, holds no row, or a
            row's prompt or answer is invalid.
    """
    path = Path(path)
    if not path.is_file():
        raise DatasetError(f"{path}: file not found")
    # Imported here: datasets pulls pyarrow and pandas, which only parquet prompt files need.
    import datasets

    datasets.disable_progress_bars()
    datasets.logging.set_verbosity_error()
    with tempfile.TemporaryDirectory(prefix="megatron-rl-datasets-") as cache:
        try:
            table = datasets.load_dataset(
                "parquet", data_files=str(path), split="train", cache_dir=cache, keep_in_memory=True
            )
        except Exception as error:  # pyarrow and datasets raise many kinds
            raise _unreadable_parquet(path, error) from None
        for key in (prompt_key, answer_key):
            if key not in table.column_names:
                present = ", ".join(repr(name) for name in table.column_names) or "none"
                raise DatasetError(f"{path}: no column {key!r}; columns present: {present}")
        prompts, answers = table[prompt_key], table[answer_key]
    if not prompts:
        raise DatasetError(f"{path}: no rows")
    return [
        _problem(
            {prompt_key: prompt, answer_key: answer}, prompt_key, answer_key, f"{path}: row {row}"
        )
        for row, (prompt, answer) in enumerate(zip(prompts, answers, strict=True))
    ]


def _unreadable_parquet(path: Path, error: Exception) -> DatasetError:
    """What went wrong reading `path`: datasets wraps pyarrow's error, which says it; a file
    without rows is one datasets cannot load (datasets 5.2: pyarrow's "BatchSize must be greater
    than 0")."""
    import pyarrow.parquet

    try:
        if pyarrow.parquet.ParquetFile(path).metadata.num_rows == 0:
            return DatasetError(f"{path}: no rows")
    except Exception:  # not parquet at all: the original error says so
        pass
    cause = error.__cause__ or error
    return DatasetError(f"{path}: not readable as parquet ({type(cause).__name__}: {cause})")


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
