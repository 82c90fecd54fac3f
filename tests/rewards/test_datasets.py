"""Loading JSON Lines prompt files: good records, and errors that name the file and the line."""

from __future__ import annotations

import re

import pytest

from megatron_rl.rewards import DatasetError, Problem, load_jsonl_problems


def _write(tmp_path, text: str):
    path = tmp_path / "prompts.jsonl"
    path.write_text(text, encoding="utf-8")
    return path


def test_loads_records_skipping_blank_lines(tmp_path):
    path = _write(
        tmp_path,
        '{"prompt": "What is 6*7?", "answer": 42, "source": "quiz"}\n'
        "\n"
        '{"prompt": "Half of 1?", "answer": 0.5}\n'
        "   \n"
        '{"prompt": "Capital of France?", "answer": "Paris"}',
    )
    problems = load_jsonl_problems(path)
    assert problems == [
        Problem(prompt="What is 6*7?", solution="", reference="42"),
        Problem(prompt="Half of 1?", solution="", reference="0.5"),
        Problem(prompt="Capital of France?", solution="", reference="Paris"),
    ]
    # each knows its line, for the errors that come later (a prompt the tokenizer cannot encode)
    assert [problem.origin for problem in problems] == [f"{path}:1", f"{path}:3", f"{path}:5"]


def test_custom_keys_and_a_string_path(tmp_path):
    path = _write(tmp_path, '{"question": "1+1?", "solution": "2"}\n')
    problems = load_jsonl_problems(str(path), prompt_key="question", answer_key="solution")
    assert problems == [Problem(prompt="1+1?", solution="", reference="2")]


@pytest.mark.parametrize(
    ("text", "line", "message"),
    [
        ('{"prompt": "a", "answer": "1"}\n{"prompt": "b", "answer": \n', 2, "not valid JSON"),
        ('\n\n["prompt", "answer"]\n', 3, "expected a JSON object, got list"),
        ('{"prompt": "a", "answer": "1"}\n"text"\n', 2, "expected a JSON object, got str"),
        (
            '{"question": "a", "answer": "1"}\n',
            1,
            "missing key 'prompt'; keys present: 'question', 'answer'",
        ),
        ('{"prompt": "a"}\n', 1, "missing key 'answer'; keys present: 'prompt'"),
        ("{}\n", 1, "missing key 'prompt'; keys present: none"),
        ('{"prompt": "", "answer": "1"}\n', 1, "'prompt': expected a non-empty string"),
        ('{"prompt": 3, "answer": "1"}\n', 1, "'prompt': expected a non-empty string"),
        ('{"prompt": "a", "answer": null}\n', 1, "'answer': expected a non-empty string or a"),
        ('{"prompt": "a", "answer": true}\n', 1, "'answer': expected a non-empty string or a"),
        ('{"prompt": "a", "answer": [1]}\n', 1, "'answer': expected a non-empty string or a"),
        ('{"prompt": "a", "answer": NaN}\n', 1, "'answer': expected a non-empty string or a"),
        ('{"prompt": "a", "answer": " "}\n', 1, "'answer': expected a non-empty string or a"),
    ],
)
def test_bad_lines_name_the_file_and_line(tmp_path, text, line, message):
    path = _write(tmp_path, text)
    with pytest.raises(DatasetError, match=re.escape(f"{path}:{line}: ") + ".*" + message):
        load_jsonl_problems(path)


def test_bad_utf8_names_the_line(tmp_path):
    path = tmp_path / "prompts.jsonl"
    path.write_bytes(b'{"prompt": "a", "answer": "1"}\n{"prompt": "\xff", "answer": "1"}\n')
    with pytest.raises(DatasetError, match=re.escape(f"{path}:2: expected UTF-8")):
        load_jsonl_problems(path)


def test_missing_file_is_named(tmp_path):
    path = tmp_path / "absent.jsonl"
    with pytest.raises(DatasetError, match=re.escape(f"{path}: file not found")):
        load_jsonl_problems(path)


@pytest.mark.parametrize("text", ["", "\n  \n\n"])
def test_file_without_records_is_named(tmp_path, text):
    path = _write(tmp_path, text)
    with pytest.raises(DatasetError, match=re.escape(f"{path}: no records")):
        load_jsonl_problems(path)


def test_dataset_error_is_a_value_error():
    assert issubclass(DatasetError, ValueError)
